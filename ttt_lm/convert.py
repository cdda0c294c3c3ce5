r"""Convert between ttt-lm-pytorch's ``TTTForCausalLM`` (a Hugging Face directory: ``config.json``
and ``model.safetensors`` or ``pytorch_model.bin``) and this project's export directory
(``model.pt`` + ``config.yaml``, what ``python -m ttt_lm.train.export`` writes and
``ttt_lm.artifacts.load_pretrained`` / ``train.init_from`` read):

    python -m ttt_lm.convert from-ttt path/to/hf_ttt_model out/ttt_125m     # theirs → ours
    python -m ttt_lm.convert to-ttt out/ttt_125m path/to/hf_dir               # ours → theirs

and between this project's export directory and its own Hugging Face folder (``ttt_lm.hf``:
``config.json`` with model_type ``ttt_lm``, ``model.safetensors``, the modeling code), bit-identical
both ways:

    python -m ttt_lm.convert to-hf out/tiny out/tiny-hf        # ours → transformers
    python -m ttt_lm.convert from-hf out/tiny-hf out/tiny2     # transformers → ours (init_from, evals)

The TTT layers' parameters already carry ttt-lm-pytorch's names and shapes (see
``ttt_lm/model/mixers/ttt.py``); the rest is renamed (``i`` is the layer index):

    model.embed_tokens.weight                    embed.weight
    model.layers.i.seq_modeling_block.<name>     layers.i.mixer.<name>
    model.layers.i.seq_norm.weight               layers.i.mixer_norm.weight
    model.layers.i.ffn_norm.weight               layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight  layers.i.mlp.{gate,up,down}_proj.weight
    model.layers.i.conv.norm.weight              layers.i.pre_conv_norm.weight       (pre_conv)
    model.layers.i.conv.conv.{weight,bias}       layers.i.pre_conv.conv.{weight,bias} (pre_conv)
    model.norm.weight                            norm.weight
    lm_head.weight                               lm_head.weight (left out when tied, as
                                                 save_pretrained does; read if present)

and ``config.json`` maps onto ``model``: hidden_size → d_model, intermediate_size → d_ff,
num_hidden_layers → n_layers, num_attention_heads → n_heads, ttt_layer_type → layer_pattern
[ttt_linear | ttt_mlp], mini_batch_size, ttt_base_lr → ttt.base_lr (1.0 when absent, their
default for both layer types), use_gate, share_qk, pre_conv, conv_kernel → ttt.conv_width,
rope_theta, rms_norm_eps → norm_eps, tie_word_embeddings, vocab_size, max_position_embeddings
→ max_seq_len, initializer_range → init_std (and init = ttt). Settings this LM cannot express
(an activation other than SiLU, pretraining_tp > 1) stop the conversion with a message, as do
missing, unknown or misshapen tensors, naming them. The non-persistent buffers ``token_idx`` and
``rotary_emb.inv_freq`` are recomputed, so they are dropped if a file has them. ``to-ttt``
needs a pure TTT-Linear or TTT-MLP model with their block (SwiGLU MLP, head_dim = d_model /
n_heads, 4× inner MLP).

TTT-E2E checkpoints of the official JAX code (github test-time-training/e2e; equinox modules saved
by orbax, the released ones in gs://ttt-e2e-checkpoints) are read from a flat export of their
``model_weights`` tree, since this project does not depend on JAX or orbax. In the official
environment (``uv run python``), one line writes it:

    import numpy as np, jax, orbax.checkpoint as ocp; np.savez("e2e.npz", **{jax.tree_util.keystr(k): np.asarray(v, np.float32) for k, v in jax.tree_util.tree_flatten_with_path(ocp.StandardCheckpointer().restore("CKPT/STEP/model_weights"))[0]})

and then

    python -m ttt_lm.convert from-e2e e2e.npz out/e2e_125m [--config configs/ttt_e2e_125m.yaml]
        [--tokenizer tokenizer.json] [key=value ...]

writes an export directory of :class:`ttt_lm.model.e2e.E2ELM` (``.safetensors`` files with the
same names are read too). Names are the tree's paths, dots between attributes (``keystr``'s
``.a.b``, orbax's nested dicts ``['a']['b']`` and ``a/b`` are read alike). The official tree
stacks the L blocks on a leading axis (``h.blocks``, built by ``jax.vmap``, applied by
``lax.scan``) and keeps the S prime MLPs and their norms in a separate stack (``h.prime_storage``,
index j is block L − S + j); its linears are ``[in, out]`` (``y = x @ W``) and are transposed into
``nn.Linear``'s ``[out, in]``; RMSNorm weights (``weight``, no bias), the qk-norms (one
``[head_dim]`` weight per layer), the embedding ``[V, D]`` and the interleaved RoPE (computed, no
tensor) go through as they are:

    language_model.model.wte.weight                          embed.weight (and the tied head)
    language_model.model.ln_f.weight                         norm.weight
    language_model.lm_head.weight [D, V]                     lm_head.weight (ᵀ; untied only)
    language_model.model.h.blocks.<p>[i]                     layers.i.<q>, for <p> → <q>:
        seq_norm.weight, seq_post_norm.weight, ffn_norm.weight, ffn_post_norm.weight   (same)
        seq_modeling_block.{wq,wk,wv,wo}.weight              attn.{wq,wk,wv,wo}.weight (ᵀ)
        seq_modeling_block.{q_norm,k_norm}.weight            attn.{q_norm,k_norm}.weight
        feed_forward.{w1,w3,w2}.weight                       mlp.{gate,up,down}_proj.weight (ᵀ)
    language_model.model.h.prime_storage.<p>[j]              layers.(L−S+j).<q>:
        feed_forward_prime.{w1,w3,w2}.weight                 prime.{w1,w3,w2} (ᵀ)
        ffn_prime_norm.weight, ffn_prime_post_norm.weight    prime_norm.weight, prime_post_norm.weight

The shape (V, D, L, heads = D / head_dim, F, S, tied or not) is read from the tensors. Without
``--config`` the other settings are the released runs' (window 8192, inner batch 1024, θ 5e5,
inner lr 1, clip 1, ε 1e-6, 8K context; ``key=value`` overrides change them, e.g.
``model.max_seq_len=131072``); with ``--config`` a preset (its overrides applied) is checked against
the tensors, every differing field named. The window and the choice of sliding-window or full
attention (the official baselines) are not in the weights: pass the matching preset
(``ttt_e2e_fa_*`` for a full-attention baseline). Every tensor of the tree must be used and every
tensor of the model filled: a missing, unknown or misshapen path stops the conversion, naming the
path (the initial values of the official state indices, ``step_index``, ``kv_cache_index`` and
``chunk_index``, are not parameters and are dropped if an export has them).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, Optional, Sequence, Tuple

import torch

from ttt_lm.config import ExperimentConfig
from ttt_lm.model.config import ModelConfig
from ttt_lm.artifacts import CONFIG, WEIGHTS, load_pretrained, save_export

HF_CONFIG = "config.json"
HF_SAFETENSORS = "model.safetensors"
HF_BIN = "pytorch_model.bin"

#: (ttt-lm-pytorch prefix, ours), {i} standing for a layer index; tried in order, and since
#: every prefix ends at a dot, none is a prefix of another's key
_PREFIXES = [
    ("model.embed_tokens.", "embed."),
    ("model.layers.{i}.seq_modeling_block.", "layers.{i}.mixer."),
    ("model.layers.{i}.seq_norm.", "layers.{i}.mixer_norm."),
    ("model.layers.{i}.ffn_norm.", "layers.{i}.mlp_norm."),
    ("model.layers.{i}.mlp.", "layers.{i}.mlp."),
    ("model.layers.{i}.conv.norm.", "layers.{i}.pre_conv_norm."),
    ("model.layers.{i}.conv.conv.", "layers.{i}.pre_conv.conv."),
    ("model.norm.", "norm."),
    ("lm_head.", "lm_head."),
]


def _rule(src: str, dst: str):
    return re.escape(src).replace(re.escape("{i}"), r"(\d+)"), dst.replace("{i}", r"\1")


_RENAMES = [_rule(a, b) for a, b in _PREFIXES]
_INVERSE = [_rule(b, a) for a, b in _PREFIXES]

#: non-persistent buffers of ttt-lm-pytorch that some files may still hold
_BUFFERS = re.compile(r".*\.(token_idx|rotary_emb\.inv_freq)$")


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the problem."""


def _rename(key: str, table) -> str:
    for pat, rep in table:
        new, n = re.subn("^" + pat, rep, key)
        if n:
            return new
    raise ConversionError(f"no mapping for tensor {key!r}")


def ttt_to_ours_key(key: str) -> str:
    return _rename(key, _RENAMES)


def ours_to_ttt_key(key: str) -> str:
    return _rename(key, _INVERSE)


# ---- configs --------------------------------------------------------------------------------

def model_config_from_hf(hf: dict) -> ModelConfig:
    """Our ModelConfig from a ttt-lm-pytorch ``TTTConfig`` dict (config.json)."""
    if hf.get("model_type", "ttt") != "ttt":
        raise ConversionError(f"{HF_CONFIG}: model_type is {hf['model_type']!r}, not 'ttt' (ttt-lm-pytorch's TTTConfig)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{HF_CONFIG}: hidden_act={hf['hidden_act']!r}; the SwiGLU MLP here uses silu only")
    if hf.get("pretraining_tp", 1) != 1:
        raise ConversionError(f"{HF_CONFIG}: pretraining_tp={hf['pretraining_tp']} is not supported (1 only)")
    kind = hf.get("ttt_layer_type", "linear")
    if kind not in ("linear", "mlp"):
        raise ConversionError(f"{HF_CONFIG}: ttt_layer_type={kind!r}, expected 'linear' or 'mlp'")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise ConversionError(f"{HF_CONFIG}: missing {missing}")
    cfg = ModelConfig(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), d_ff=int(hf["intermediate_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=int(hf["num_attention_heads"]),
        layer_pattern=["ttt_linear" if kind == "linear" else "ttt_mlp"], mlp_act="silu",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)), init_std=float(hf.get("initializer_range", 0.02)),
        init="ttt")
    t = cfg.ttt
    t.mini_batch_size = int(hf.get("mini_batch_size", 16))
    t.base_lr = float(hf.get("ttt_base_lr", 1.0))
    t.use_gate = bool(hf.get("use_gate", False))
    t.share_qk = bool(hf.get("share_qk", False))
    t.pre_conv = bool(hf.get("pre_conv", False))
    t.conv_width = int(hf.get("conv_kernel", 4))
    t.rope_theta = float(hf.get("rope_theta", 10000.0))
    t.mlp_expansion = 4
    return cfg.validate()


def hf_config_from(cfg: ModelConfig) -> dict:
    """ttt-lm-pytorch's config.json for a pure TTT-Linear / TTT-MLP model."""
    kinds = set(cfg.layer_kinds())
    if kinds not in ({"ttt_linear"}, {"ttt_mlp"}):
        raise ConversionError(f"to-ttt needs every layer to be ttt_linear or every layer ttt_mlp, got {sorted(kinds)}")
    problems = []
    if cfg.mlp_act != "silu" or cfg.ff == 0:
        problems.append(f"a SwiGLU MLP in every block (model.mlp_act={cfg.mlp_act}, d_ff={cfg.ff})")
    if cfg.hd * cfg.n_heads != cfg.d_model:
        problems.append(f"head_dim = d_model / n_heads (head_dim={cfg.hd}, d_model={cfg.d_model}, n_heads={cfg.n_heads})")
    if kinds == {"ttt_mlp"} and cfg.ttt.mlp_expansion != 4:
        problems.append(f"model.ttt.mlp_expansion=4 (got {cfg.ttt.mlp_expansion})")
    if problems:
        raise ConversionError("ttt-lm-pytorch's TTTForCausalLM cannot express this model; it needs " + "; ".join(problems))
    kind = "linear" if kinds == {"ttt_linear"} else "mlp"
    base_lr = cfg.ttt.base_lr if cfg.ttt.base_lr is not None else (1.0 if kind == "linear" else 0.1)
    return {
        "architectures": ["TTTForCausalLM"], "model_type": "ttt",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "use_cache": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.ttt.rope_theta,
        "use_gate": cfg.ttt.use_gate, "share_qk": cfg.ttt.share_qk, "ttt_layer_type": kind,
        "ttt_base_lr": base_lr, "mini_batch_size": cfg.ttt.mini_batch_size, "pre_conv": cfg.ttt.pre_conv,
        "conv_kernel": cfg.ttt.conv_width, "bos_token_id": 1, "eos_token_id": 2,
    }


# ---- state dicts ----------------------------------------------------------------------------

def state_dict_from_ttt(sd: Dict[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Our LM's state dict from a TTTForCausalLM one; checks names and shapes against the LM
    that ``cfg`` builds."""
    from ttt_lm.model import LM
    want = LM(cfg).state_dict()
    out = {}
    for k, v in sd.items():
        if _BUFFERS.match(k):
            continue
        out[ttt_to_ours_key(k)] = v
    if cfg.tie_embeddings and "lm_head.weight" in out:
        if not torch.equal(out["lm_head.weight"], out["embed.weight"]):
            raise ConversionError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out.get("embed.weight")
    unknown = sorted(set(out) - set(want))
    missing = sorted(set(want) - set(k for k, v in out.items() if v is not None))
    if unknown or missing:
        raise ConversionError(f"the checkpoint does not match its {HF_CONFIG}: missing "
                              f"{[ours_to_ttt_key(k) for k in missing]}, unexpected {[ours_to_ttt_key(k) for k in unknown]}")
    bad = [f"{ours_to_ttt_key(k)}: {tuple(out[k].shape)} (expected {tuple(want[k].shape)})"
           for k in want if tuple(out[k].shape) != tuple(want[k].shape)]
    if bad:
        raise ConversionError("tensor shapes do not match the config: " + "; ".join(bad))
    return out


def state_dict_to_ttt(sd: Dict[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """TTTForCausalLM's state dict from ours (lm_head.weight left out when tied)."""
    out = {}
    for k, v in sd.items():
        if cfg.tie_embeddings and k == "lm_head.weight":
            continue
        out[ours_to_ttt_key(k)] = v.detach().clone().contiguous()
    return out


# ---- files ----------------------------------------------------------------------------------

def read_ttt_dir(src: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(config.json, the state dict) of a ttt-lm-pytorch / Hugging Face directory."""
    cpath = os.path.join(src, HF_CONFIG)
    if not os.path.isfile(cpath):
        raise ConversionError(f"{src}: no {HF_CONFIG} (a ttt-lm-pytorch TTTForCausalLM directory has one)")
    with open(cpath) as f:
        hf = json.load(f)
    st, binp = os.path.join(src, HF_SAFETENSORS), os.path.join(src, HF_BIN)
    if os.path.isfile(st):
        from safetensors.torch import load_file
        sd = load_file(st)
    elif os.path.isfile(binp):
        sd = torch.load(binp, map_location="cpu", weights_only=True)
    else:
        raise ConversionError(f"{src}: no {HF_SAFETENSORS} or {HF_BIN} (sharded checkpoints are not read)")
    return hf, sd


def from_ttt(src: str, out_dir: str) -> str:
    """ttt-lm-pytorch directory → our export directory (model.pt, config.yaml)."""
    hf, sd = read_ttt_dir(src)
    mcfg = model_config_from_hf(hf)
    ours = state_dict_from_ttt(sd, mcfg)
    from ttt_lm.model import LM
    model = LM(mcfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in ours.items()})
    exp = ExperimentConfig()
    exp.model = mcfg
    return save_export(model, exp, out_dir)


def to_ttt(src: str, out_dir: str, fmt: str = "safetensors") -> str:
    """Our export directory → a ttt-lm-pytorch directory (config.json and model.safetensors, or
    pytorch_model.bin with ``fmt="bin"``)."""
    model = load_pretrained(src)
    hf = hf_config_from(model.cfg)
    sd = state_dict_to_ttt(model.state_dict(), model.cfg)
    os.makedirs(out_dir, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, os.path.join(out_dir, HF_SAFETENSORS), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(sd, os.path.join(out_dir, HF_BIN))
    else:
        raise ConversionError(f"--format must be safetensors or bin, got {fmt!r}")
    with open(os.path.join(out_dir, HF_CONFIG), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    return out_dir


# ---- TTT-E2E: the official JAX code's parameter tree ----------------------------------------

E2E_TOP = "language_model."
E2E_BLOCKS = "language_model.model.h.blocks."
E2E_PRIME = "language_model.model.h.prime_storage."
#: (official path under h.blocks., our name under layers.i., transposed)
E2E_BLOCK_MAP = [
    ("seq_norm.weight", "seq_norm.weight", False),
    ("seq_post_norm.weight", "seq_post_norm.weight", False),
    ("seq_modeling_block.wq.weight", "attn.wq.weight", True),
    ("seq_modeling_block.wk.weight", "attn.wk.weight", True),
    ("seq_modeling_block.wv.weight", "attn.wv.weight", True),
    ("seq_modeling_block.wo.weight", "attn.wo.weight", True),
    ("seq_modeling_block.q_norm.weight", "attn.q_norm.weight", False),
    ("seq_modeling_block.k_norm.weight", "attn.k_norm.weight", False),
    ("ffn_norm.weight", "ffn_norm.weight", False),
    ("ffn_post_norm.weight", "ffn_post_norm.weight", False),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight", True),
    ("feed_forward.w3.weight", "mlp.up_proj.weight", True),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", True),
]
#: (official path under h.prime_storage., our name under layers.(L−S+j)., transposed)
E2E_PRIME_MAP = [
    ("feed_forward_prime.w1.weight", "prime.w1", True),
    ("feed_forward_prime.w3.weight", "prime.w3", True),
    ("feed_forward_prime.w2.weight", "prime.w2", True),
    ("ffn_prime_norm.weight", "prime_norm.weight", False),
    ("ffn_prime_post_norm.weight", "prime_post_norm.weight", False),
]
E2E_WTE = "language_model.model.wte.weight"
E2E_LN_F = "language_model.model.ln_f.weight"
E2E_HEAD = "language_model.lm_head.weight"
#: the official modules' state indices (nn.StateIndex initial values: caches, counters), not parameters
_E2E_STATE = re.compile(r"(^|\.)(step_index|kv_cache_index|chunk_index)(\.|$)")
#: the released runs' settings that the weights do not carry (configs/arch/ttt_e2e.yaml)
E2E_RELEASED = ["model.ttt_e2e.window=8192", "model.ttt_e2e.inner_batch=1024", "model.ttt_e2e.rope_theta=500000.0",
                "model.ttt_e2e.inner_lr=1.0", "model.ttt_e2e.inner_clip=1.0", "model.norm_eps=1e-6",
                "model.max_seq_len=8192", "data.seq_len=8192"]


def e2e_official_name(key: str) -> str:
    """A path of the official tree in dotted form: ``.a.b`` (keystr of attributes), ``['a']['b']``
    (nested dicts), ``a/b`` and ``a.b`` all give ``a.b``."""
    k = re.sub(r"\['([^']*)'\]", r".\1", key)
    k = re.sub(r"\[(\d+)\]", r".\1", k).replace("/", ".")
    return k.strip(".")


def _e2e_flat(tree: Dict[str, "object"]) -> Dict[str, torch.Tensor]:
    """{dotted official path: tensor}, the state indices dropped; two spellings of one path refused."""
    import numpy as np
    out: Dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        name = e2e_official_name(k)
        if _E2E_STATE.search(name):
            continue
        if name in out:
            raise ConversionError(f"official tensor {name!r} appears twice (as {k!r} and another spelling)")
        out[name] = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
    return out


def e2e_shape_of(tree: Dict[str, torch.Tensor]) -> dict:
    """The model shape the official tensors carry: vocab_size, d_model, n_layers, n_heads, d_ff,
    suffix_len, tie_embeddings."""
    tree = _e2e_flat(tree)
    need = [E2E_WTE, E2E_BLOCKS + "feed_forward.w1.weight", E2E_BLOCKS + "seq_modeling_block.q_norm.weight"]
    missing = [k for k in need if k not in tree]
    if missing:
        raise ConversionError(f"not a TTT-E2E parameter tree of the official code: missing {missing}")
    wte, w1, qn = (tree[k] for k in need)
    if wte.dim() != 2 or w1.dim() != 3 or qn.dim() != 2:
        raise ConversionError(f"{E2E_WTE} must be [V, D], {need[1]} [L, D, F] and {need[2]} [L, head_dim]; got "
                              f"{tuple(wte.shape)}, {tuple(w1.shape)}, {tuple(qn.shape)}")
    V, D = wte.shape
    L, _, F_ = w1.shape
    hd = qn.shape[1]
    if hd == 0 or D % hd:
        raise ConversionError(f"{need[2]}: head_dim {hd} does not divide d_model {D} ({E2E_WTE} {tuple(wte.shape)})")
    pw1 = E2E_PRIME + "feed_forward_prime.w1.weight"
    S = int(tree[pw1].shape[0]) if pw1 in tree and tree[pw1].dim() >= 1 else 0
    return {"vocab_size": int(V), "d_model": int(D), "n_layers": int(L), "n_heads": int(D // hd), "d_ff": int(F_),
            "suffix_len": S, "tie_embeddings": E2E_HEAD not in tree}


def e2e_config(tree: Dict[str, torch.Tensor], preset: Optional[str] = None, overrides: Sequence[str] = ()):
    """The ExperimentConfig to import ``tree`` into: ``preset`` (a YAML) checked against the
    tensors' shape, or the shape read from them with the released runs' other settings."""
    from ttt_lm.config import ConfigError, load_config
    tree = _e2e_flat(tree)
    shape = e2e_shape_of(tree)
    inferred = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                for k, v in shape.items() if k != "suffix_len"]
    inferred += ["model.ttt_e2e.enabled=true", f"model.ttt_e2e.suffix_len={shape['suffix_len']}"]
    try:
        cfg = load_config(preset, list(overrides)) if preset else load_config(None, [*E2E_RELEASED, *inferred,
                                                                                     *overrides])
    except ConfigError as e:
        raise ConversionError(str(e)) from e
    m = cfg.model
    if not m.ttt_e2e.enabled:
        raise ConversionError(f"{preset or 'the config'}: model.ttt_e2e.enabled is false; the official tree is a "
                              "TTT-E2E model (use a ttt_e2e preset)")
    have = {"vocab_size": m.vocab_size, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "d_ff": m.ff, "suffix_len": m.ttt_e2e.suffix_len, "tie_embeddings": m.tie_embeddings}
    bad = [f"model.{'ttt_e2e.' if k == 'suffix_len' else ''}{k}={have[k]} (the tensors: {shape[k]})"
           for k in shape if have[k] != shape[k]]
    if bad:
        raise ConversionError(f"{preset or 'the config'} does not match the official tensors: " + "; ".join(bad))
    return cfg


def state_dict_from_e2e(tree: Dict[str, "object"], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """E2ELM's state dict (for ``cfg``) from the official flat tree {path: array}: every official
    tensor used, every model tensor filled, shapes checked; a problem names the official path."""
    from ttt_lm.model import LM
    flat = _e2e_flat(tree)
    L, S = cfg.n_layers, cfg.ttt_e2e.suffix_len
    with torch.device("meta"):        # the names and shapes only: no memory for a 1B model's weights
        want = LM(cfg).state_dict()
    plan = []            # (official path, stack size or None, [(our name, transposed)])
    plan.append((E2E_WTE, None, [("embed.weight", False)]))
    plan.append((E2E_LN_F, None, [("norm.weight", False)]))
    if not cfg.tie_embeddings:
        plan.append((E2E_HEAD, None, [("lm_head.weight", True)]))
    for src, dst, t in E2E_BLOCK_MAP:
        plan.append((E2E_BLOCKS + src, L, [(f"layers.{i}.{dst}", t) for i in range(L)]))
    if S:
        for src, dst, t in E2E_PRIME_MAP:
            plan.append((E2E_PRIME + src, S, [(f"layers.{L - S + j}.{dst}", t) for j in range(S)]))
    expected = {p for p, _, _ in plan}
    unknown = sorted(set(flat) - expected)
    missing = sorted(expected - set(flat))
    if unknown or missing:
        raise ConversionError(f"the official tree does not match the model (n_layers={L}, suffix_len={S}, "
                              f"tie_embeddings={cfg.tie_embeddings}): missing {missing}, unexpected {unknown}")
    out: Dict[str, torch.Tensor] = {}
    bad = []
    for path, n, targets in plan:
        x = flat[path]
        one = want[targets[0][0]].shape
        exp = tuple(one)[::-1] if targets[0][1] else tuple(one)
        exp = exp if n is None else (n, *exp)
        if tuple(x.shape) != exp:
            bad.append(f"{path}: {tuple(x.shape)} (expected {exp})")
            continue
        for j, (name, t) in enumerate(targets):
            v = x if n is None else x[j]
            out[name] = (v.t() if t else v).to(torch.float32).contiguous()
    if bad:
        raise ConversionError("official tensor shapes do not match the config: " + "; ".join(bad))
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    left = sorted(set(want) - set(out))
    if left:   # the plan must cover the model: a model tensor it does not name is a converter bug
        raise ConversionError(f"the model's tensors {left} have no official source")
    return out


def read_e2e_tree(src: str) -> Dict[str, torch.Tensor]:
    """{official path: tensor} from a flat ``.npz`` or ``.safetensors`` export of the tree."""
    if not os.path.isfile(src):
        raise ConversionError(f"{src}: no such file (an .npz or .safetensors export of the official "
                              "model_weights tree; see python -m ttt_lm.convert --help)")
    if src.endswith(".safetensors"):
        from safetensors.torch import load_file
        return dict(load_file(src))
    if src.endswith(".npz"):
        import numpy as np
        with np.load(src, allow_pickle=False) as z:
            out = {}
            for k in z.files:
                a = z[k]
                if a.dtype.kind != "f":
                    raise ConversionError(f"{src}: {k!r} has dtype {a.dtype} (export float arrays: np.asarray(v, np.float32))")
                out[k] = torch.from_numpy(np.ascontiguousarray(a))
            return out
    raise ConversionError(f"{src}: expected an .npz or .safetensors file")


def from_e2e(src: str, out_dir: str, preset: Optional[str] = None, overrides: Sequence[str] = (),
             tokenizer: Optional[str] = None) -> str:
    """An official TTT-E2E tree (flat .npz / .safetensors export) → our export directory."""
    tree = _e2e_flat(read_e2e_tree(src))
    cfg = e2e_config(tree, preset, overrides)
    sd = state_dict_from_e2e(tree, cfg.model)
    from ttt_lm.model import LM
    model = LM(cfg.model)
    model.load_state_dict(sd, strict=True)
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise ConversionError(f"--tokenizer {tokenizer}: no such file")
    return save_export(model, cfg, out_dir, tokenizer)


def _tokenizer_in(d: str):
    """The tokenizer file a folder holds (Hugging Face ``tokenizer.json`` first), or None."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


def from_hf(src: str, out_dir: str) -> str:
    """A ttt-lm Hugging Face folder (``export --format hf``, ``to-hf``, or one saved with
    transformers' ``save_pretrained`` after fine-tuning there) → an export directory, with the
    folder's tokenizer; the weights are bit-identical."""
    from ttt_lm.hf import HFError, load_hf
    try:
        lm = load_hf(src)
    except HFError as e:
        raise ConversionError(str(e)) from e
    exp = ExperimentConfig()
    exp.model = lm.cfg
    return save_export(lm, exp, out_dir, _tokenizer_in(src))


def to_hf(src: str, out_dir: str) -> str:
    """An export directory → a ttt-lm Hugging Face folder (safetensors + config.json + modeling
    code), with the export's tokenizer."""
    from ttt_lm.hf import HFError, save_hf
    if not os.path.isfile(os.path.join(src, CONFIG)) or not os.path.isfile(os.path.join(src, WEIGHTS)):
        raise ConversionError(f"{src} is not an export directory: it needs {WEIGHTS} and {CONFIG}")
    try:
        return save_hf(load_pretrained(src), out_dir, _tokenizer_in(src))
    except HFError as e:
        raise ConversionError(str(e)) from e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.convert", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a1 = sub.add_parser("from-ttt", help="ttt-lm-pytorch TTTForCausalLM directory -> export directory")
    a1.add_argument("src")
    a1.add_argument("out_dir")
    a2 = sub.add_parser("to-ttt", help="export directory -> ttt-lm-pytorch TTTForCausalLM directory")
    a2.add_argument("src")
    a2.add_argument("out_dir")
    a2.add_argument("--format", default="safetensors", choices=["safetensors", "bin"])
    a3 = sub.add_parser("from-hf", help="ttt-lm Hugging Face folder (export --format hf) -> export directory")
    a3.add_argument("src")
    a3.add_argument("out_dir")
    a4 = sub.add_parser("to-hf", help="export directory -> ttt-lm Hugging Face folder")
    a4.add_argument("src")
    a4.add_argument("out_dir")
    a5 = sub.add_parser("from-e2e", help="official TTT-E2E parameter tree (flat .npz/.safetensors export) -> export directory")
    a5.add_argument("src")
    a5.add_argument("out_dir")
    a5.add_argument("--config", default=None, help="a ttt_e2e preset to check the tensors against")
    a5.add_argument("--tokenizer", default=None, help="a tokenizer file to copy into the export")
    a5.add_argument("overrides", nargs="*", help="key=value config overrides")
    a = ap.parse_args(argv)
    try:
        if a.cmd in ("from-hf", "to-hf"):
            out = (from_hf if a.cmd == "from-hf" else to_hf)(a.src, a.out_dir)
            print(f"converted {a.src} -> {os.path.abspath(out)} ({', '.join(sorted(os.listdir(out)))})")
        elif a.cmd == "from-e2e":
            out = from_e2e(a.src, a.out_dir, a.config, a.overrides, a.tokenizer)
            print(f"converted {a.src} -> {os.path.abspath(out)} ({WEIGHTS}, {CONFIG})")
        elif a.cmd == "from-ttt":
            out = from_ttt(a.src, a.out_dir)
            print(f"converted {a.src} -> {os.path.abspath(out)} ({WEIGHTS}, {CONFIG})")
        else:
            out = to_ttt(a.src, a.out_dir, a.format)
            print(f"converted {a.src} -> {os.path.abspath(out)} ({HF_CONFIG}, "
                  f"{HF_SAFETENSORS if a.format == 'safetensors' else HF_BIN})")
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
