"""python -m ttt_lm.convert: ttt-lm-pytorch's TTTForCausalLM format ↔ our export directory.

The ttt-lm-pytorch side is written here without the converter: its tensor names are listed from
``ttt.py`` (TTTForCausalLM → TTTModel → Block → TTTLinear / TTTMLP, SwiGluMLP, Conv, RMSNorm) and
the state dict is built from our model by the inverse renaming, with a config.json as
``TTTConfig.to_json_string`` writes one. Logits are compared for exact equality: the weights go
through unchanged (float32 → float32), so any difference is a wrong tensor."""
import json
import os
import re

import pytest
import torch

from ttt_lm import convert
from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.registry import builtin_kinds, kinds_with, mixer_class
from ttt_lm.train.export import load_pretrained

#: the converter's kinds, TTT's (the kinds of its config section), by their inner model ("linear", "mlp")
TTT_KINDS = {mixer_class(k).kind: k for k in kinds_with(lambda c: c.config_section == "ttt", builtin_kinds())}


def official_keys(n_layers, kind, share_qk, use_gate, pre_conv, tied):
    """Every tensor of ttt-lm-pytorch's TTTForCausalLM state dict for such a config (persistent
    parameters only: token_idx and the rotary inv_freq are non-persistent buffers there)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(n_layers):
        b = f"model.layers.{i}."
        s = b + "seq_modeling_block."
        keys += [s + n for n in ("learnable_token_idx", "q_proj.weight", "v_proj.weight", "o_proj.weight",
                                 "learnable_ttt_lr_weight", "learnable_ttt_lr_bias", "ttt_norm_weight",
                                 "ttt_norm_bias", "post_norm.weight", "post_norm.bias", "W1", "b1")]
        keys += [s + "k_proj.weight"] if not share_qk else [s + n for n in ("conv_q.weight", "conv_q.bias",
                                                                             "conv_k.weight", "conv_k.bias")]
        keys += [s + "g_proj.weight"] if use_gate else []
        keys += [s + "W2", s + "b2"] if kind == "mlp" else []
        keys += [b + "mlp.gate_proj.weight", b + "mlp.up_proj.weight", b + "mlp.down_proj.weight",
                 b + "seq_norm.weight", b + "ffn_norm.weight"]
        keys += [b + "conv.norm.weight", b + "conv.conv.weight", b + "conv.conv.bias"] if pre_conv else []
    return sorted(keys)


def to_official(sd, tied):
    """Our state dict renamed to ttt-lm-pytorch's, written out rule by rule (the test's own
    inverse of the converter's table)."""
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight" and tied:
            continue
        parts = k.split(".")
        if parts[0] == "embed":
            n = "model.embed_tokens." + ".".join(parts[1:])
        elif parts[0] == "norm":
            n = "model.norm." + ".".join(parts[1:])
        elif parts[0] == "lm_head":
            n = k
        else:
            i, sub, rest = parts[1], parts[2], ".".join(parts[3:])
            sub = {"mixer": "seq_modeling_block", "mixer_norm": "seq_norm", "mlp_norm": "ffn_norm", "mlp": "mlp",
                   "pre_conv_norm": "conv.norm", "pre_conv": "conv"}[sub]
            n = f"model.layers.{i}.{sub}.{rest}"
        out[n] = v.clone()
    return out


VARIANTS = {
    "linear": dict(kind="linear", share_qk=False, use_gate=False, pre_conv=False, tied=True),
    "linear_mamba_backbone": dict(kind="linear", share_qk=True, use_gate=True, pre_conv=True, tied=False),
    "mlp": dict(kind="mlp", share_qk=False, use_gate=True, pre_conv=True, tied=True),
}


def _model(v) -> LM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_seq_len=64,
                      layer_pattern=[TTT_KINDS[v["kind"]]],
                      tie_embeddings=v["tied"], norm_eps=1e-5, init="ttt")
    # the converter's subject is this section: each field below is a key of ttt-lm-pytorch's
    # TTTConfig, set away from its default so that a converter that drops or swaps one fails
    cfg.ttt.mini_batch_size = 4
    cfg.ttt.base_lr = 0.5
    cfg.ttt.share_qk, cfg.ttt.use_gate, cfg.ttt.pre_conv = v["share_qk"], v["use_gate"], v["pre_conv"]
    cfg.ttt.conv_width = 3
    cfg.ttt.rope_theta = 5000.0
    m = LM(cfg).eval()
    with torch.no_grad():   # every parameter away from its init, so no swap goes unseen
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _write_official(m: LM, v, d, fmt="safetensors"):
    sd = to_official(m.state_dict(), v["tied"])
    os.makedirs(d, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, os.path.join(d, "model.safetensors"))
    else:
        torch.save(sd, os.path.join(d, "pytorch_model.bin"))
    c, t = m.cfg, m.cfg.ttt
    hf = {"architectures": ["TTTForCausalLM"], "model_type": "ttt", "vocab_size": c.vocab_size,
          "hidden_size": c.d_model, "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers,
          "num_attention_heads": c.n_heads, "hidden_act": "silu", "max_position_embeddings": c.max_seq_len,
          "initializer_range": 0.02, "rms_norm_eps": c.norm_eps, "use_cache": False, "pad_token_id": None,
          "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": c.tie_embeddings,
          "rope_theta": t.rope_theta, "use_gate": t.use_gate, "share_qk": t.share_qk,
          "ttt_layer_type": v["kind"], "ttt_base_lr": t.base_lr, "mini_batch_size": t.mini_batch_size,
          "pre_conv": t.pre_conv, "conv_kernel": t.conv_width, "scan_checkpoint_group_size": 0,
          "torch_dtype": "float32", "transformers_version": "4.41.0"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f)
    return sd


@pytest.mark.parametrize("name", list(VARIANTS))
def test_from_ttt_then_back_is_exact(name, tmp_path):
    """A TTTForCausalLM directory → ours gives identical logits (and decode logits); ours →
    TTTForCausalLM gives exactly the official key set and tensors; converting that back again
    gives identical logits."""
    v = VARIANTS[name]
    m = _model(v)
    official = _write_official(m, v, str(tmp_path / "hf"))
    assert sorted(official) == official_keys(2, v["kind"], v["share_qk"], v["use_gate"], v["pre_conv"], v["tied"])
    assert convert.main(["from-ttt", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    got = load_pretrained(str(tmp_path / "ours"))
    assert got.cfg.ttt.base_lr == 0.5 and got.cfg.norm_eps == 1e-5 and got.cfg.ttt.conv_width == 3
    ids = torch.randint(0, 97, (2, 11))   # 11: not a multiple of the mini-batch size 4
    with torch.no_grad():
        ref = m(ids).logits
        assert torch.equal(got(ids).logits, ref)
        st = got.init_states(2)
        lg, st = got.step(ids[:, 0], st)
        torch.testing.assert_close(lg, ref[:, 0], atol=1e-5, rtol=0)   # decode form: fp32 rounding

    assert convert.main(["to-ttt", str(tmp_path / "ours"), str(tmp_path / "hf2")]) == 0
    from safetensors.torch import load_file
    back = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(back) == sorted(official)
    for k in official:
        assert torch.equal(back[k], official[k]), k
    hf2 = json.load(open(tmp_path / "hf2" / "config.json"))
    hf1 = json.load(open(tmp_path / "hf" / "config.json"))
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "ttt_layer_type", "ttt_base_lr", "mini_batch_size", "use_gate", "share_qk", "pre_conv",
              "conv_kernel", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert hf2[k] == hf1[k], k
    assert convert.main(["from-ttt", str(tmp_path / "hf2"), str(tmp_path / "ours2")]) == 0
    with torch.no_grad():
        assert torch.equal(load_pretrained(str(tmp_path / "ours2"))(ids).logits, ref)


def test_bin_format_and_tied_head_present(tmp_path):
    """pytorch_model.bin is read too, with a tied lm_head.weight listed (torch.save keeps it)."""
    v = VARIANTS["linear"]
    m = _model(v)
    sd = _write_official(m, v, str(tmp_path / "hf"), fmt="bin")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    torch.save(sd, tmp_path / "hf" / "pytorch_model.bin")
    convert.from_ttt(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(load_pretrained(str(tmp_path / "ours"))(ids).logits, m(ids).logits)


def test_bad_input_is_named(tmp_path):
    v = VARIANTS["mlp"]
    m = _model(v)
    d = str(tmp_path / "hf")
    sd = _write_official(m, v, d, fmt="bin")
    # a missing tensor and an unknown one
    bad = dict(sd)
    del bad["model.layers.1.seq_modeling_block.W2"]
    bad["model.layers.0.extra.weight"] = torch.zeros(1)
    torch.save(bad, os.path.join(d, "pytorch_model.bin"))
    with pytest.raises(convert.ConversionError, match="no mapping for tensor 'model.layers.0.extra.weight'"):
        convert.from_ttt(d, str(tmp_path / "o"))
    del bad["model.layers.0.extra.weight"]
    torch.save(bad, os.path.join(d, "pytorch_model.bin"))
    with pytest.raises(convert.ConversionError, match=r"missing \['model.layers.1.seq_modeling_block.W2'\]"):
        convert.from_ttt(d, str(tmp_path / "o"))
    # a shape that does not fit the config
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(40, 32)
    torch.save(bad, os.path.join(d, "pytorch_model.bin"))
    with pytest.raises(convert.ConversionError, match=r"model.layers.0.mlp.up_proj.weight: \(40, 32\) \(expected \(48, 32\)\)"):
        convert.from_ttt(d, str(tmp_path / "o"))
    # settings the LM cannot express
    hf = json.load(open(os.path.join(d, "config.json")))
    json.dump({**hf, "hidden_act": "gelu"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(convert.ConversionError, match="hidden_act='gelu'"):
        convert.from_ttt(d, str(tmp_path / "o"))
    assert convert.main(["from-ttt", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 2


def test_to_ttt_refuses_models_it_cannot_express(tmp_path):
    from ttt_lm.train.export import CONFIG, WEIGHTS
    from ttt_lm.config import ExperimentConfig, save_config
    cfg = ExperimentConfig()
    other = kinds_with(lambda c: c.config_section != "ttt", builtin_kinds())[0]   # a kind ttt-lm-pytorch lacks
    pattern = [TTT_KINDS["linear"], other]
    cfg.model = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, layer_pattern=pattern)
    d = tmp_path / "ours"
    d.mkdir()
    torch.save(LM(cfg.model).state_dict(), d / WEIGHTS)
    save_config(cfg, str(d / CONFIG))
    with pytest.raises(convert.ConversionError,
                       match=rf"every layer to be {TTT_KINDS['linear']} .* got {re.escape(str(sorted(pattern)))}"):
        convert.to_ttt(str(d), str(tmp_path / "hf"))
