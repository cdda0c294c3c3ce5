"""python -m ttt_lm.convert from-e2e: the official TTT-E2E code's parameter tree → E2ELM.

The official side is written here without the converter, from the official code
(github test-time-training/e2e, ``ttt/model/transformer.py`` and ``attention.py``): ``official_tree``
lays a model's weights out as ``MetaModel.weights()`` does (the L blocks stacked by ``jax.vmap`` in
``h.blocks``, the S prime MLPs and their norms in ``h.prime_storage``, ``NormalLinear`` weights
``[in, out]``, no ``lm_head`` when tied), and ``official_logits`` runs that tree as the official
forward does on one chunk (numpy, float64: ``x @ W``, the complex interleaved RoPE of
``apply_rotary_emb``, qk-norm, pre and post norms, the prime MLP before the static one, the window
mask), so a wrong name, a missing transpose or a swapped W1/W3 fails against the official math, not
only against the inverse of the converter.

Tolerances: the import is float32 → float32, so the imported model's logits equal the original's
exactly; against the float64 numpy forward of the float32 weights, 2e-5 (float32 rounding over three
blocks; a swapped or untransposed tensor moves the logits by ~1e-2 or more).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ttt_lm import convert
from ttt_lm.artifacts import load_pretrained
from ttt_lm.config import load_config

V, D, L, H, F, S, W, B = 64, 32, 3, 4, 48, 2, 6, 4
SHAPE = [f"model.vocab_size={V}", f"model.d_model={D}", f"model.n_layers={L}", f"model.n_heads={H}",
         f"model.d_ff={F}", "model.ttt_e2e.enabled=true", f"model.ttt_e2e.suffix_len={S}",
         f"model.ttt_e2e.window={W}", f"model.ttt_e2e.inner_batch={B}", "model.max_seq_len=64", "data.seq_len=16"]


def tiny(tied=True, seed=0, extra=()):
    from ttt_lm.model import LM
    cfg = load_config(None, [*SHAPE, f"model.tie_embeddings={str(tied).lower()}", *extra])
    torch.manual_seed(seed)
    m = LM(cfg.model)
    with torch.no_grad():   # norms away from 1, so a norm mapped to the wrong place shows
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return cfg, m.eval()


def official_tree(m, tied=True, s=S):
    """{path: array} of the official MetaModel.weights() for our model ``m``, from the official
    module layout (names of transformer.py / attention.py; NormalLinear weights [in, out])."""
    P = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    lin = lambda k: P[k].T                                    # nn.Linear [out, in] → NormalLinear [in, out]
    stack = lambda f, idx: np.stack([f(i) for i in idx])
    t = {"language_model.model.wte.weight": P["embed.weight"], "language_model.model.ln_f.weight": P["norm.weight"]}
    if not tied:
        t["language_model.lm_head.weight"] = lin("lm_head.weight")
    blocks = "language_model.model.h.blocks."
    for norm in ("seq_norm", "seq_post_norm", "ffn_norm", "ffn_post_norm"):
        t[blocks + norm + ".weight"] = stack(lambda i: P[f"layers.{i}.{norm}.weight"], range(L))
    for w in ("wq", "wk", "wv", "wo"):
        t[blocks + f"seq_modeling_block.{w}.weight"] = stack(lambda i: lin(f"layers.{i}.attn.{w}.weight"), range(L))
    for n in ("q_norm", "k_norm"):
        t[blocks + f"seq_modeling_block.{n}.weight"] = stack(lambda i: P[f"layers.{i}.attn.{n}.weight"], range(L))
    # SwiGLUMLP: w1 gated by silu, w3 the linear branch, w2 down
    for w, ours in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        t[blocks + f"feed_forward.{w}.weight"] = stack(lambda i: lin(f"layers.{i}.mlp.{ours}.weight"), range(L))
    prime = "language_model.model.h.prime_storage."
    suffix = range(L - s, L)
    if not s:          # the baselines (suffix_len 0, config.prime false): no prime_storage
        return {k: np.ascontiguousarray(v) for k, v in t.items()}
    for w in ("w1", "w3", "w2"):
        t[prime + f"feed_forward_prime.{w}.weight"] = stack(lambda i: P[f"layers.{i}.prime.{w}"].T, suffix)
    t[prime + "ffn_prime_norm.weight"] = stack(lambda i: P[f"layers.{i}.prime_norm.weight"], suffix)
    t[prime + "ffn_prime_post_norm.weight"] = stack(lambda i: P[f"layers.{i}.prime_post_norm.weight"], suffix)
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def official_logits(t, ids, theta=500000.0, eps=1e-6, tied=True):
    """The official forward of one chunk (T ≤ inner batch: the TTT blocks run with W^(0)), float64."""
    g = lambda k: t[k].astype(np.float64)
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    silu = lambda x: x / (1 + np.exp(-x))
    T, hd = len(ids), D // H
    freqs = 1.0 / theta ** (np.arange(0, hd, 2)[: hd // 2] / hd)
    cis = np.exp(1j * np.outer(np.arange(T), freqs))          # precompute_freqs_cis
    def rope(x):                                              # apply_rotary_emb: pairs (x[2i], x[2i+1]) as complex
        c = (x[..., 0::2] + 1j * x[..., 1::2]) * cis[:, None, :]
        return np.stack((c.real, c.imag), -1).reshape(x.shape)
    i = np.arange(T)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] < i[None, :] + W)
    blk = "language_model.model.h.blocks."
    pr = "language_model.model.h.prime_storage."
    h = g("language_model.model.wte.weight")[ids]
    for l in range(L):
        b = lambda n: g(blk + n)[l]
        x = rms(h, b("seq_norm.weight"))
        q, k, v = (x @ b(f"seq_modeling_block.{w}.weight") for w in ("wq", "wk", "wv"))
        q, k, v = (a.reshape(T, H, hd) for a in (q, k, v))
        q, k = rms(q, b("seq_modeling_block.q_norm.weight")), rms(k, b("seq_modeling_block.k_norm.weight"))
        q, k = rope(q), rope(k)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(T, D) @ b("seq_modeling_block.wo.weight")
        h = h + rms(o, b("seq_post_norm.weight"))
        if l >= L - S:
            j = l - (L - S)
            pp = lambda n: g(pr + n)[j]
            x = rms(h, pp("ffn_prime_norm.weight"))
            y = (silu(x @ pp("feed_forward_prime.w1.weight")) * (x @ pp("feed_forward_prime.w3.weight"))) \
                @ pp("feed_forward_prime.w2.weight")
            h = h + rms(y, pp("ffn_prime_post_norm.weight"))
        x = rms(h, b("ffn_norm.weight"))
        y = (silu(x @ b("feed_forward.w1.weight")) * (x @ b("feed_forward.w3.weight"))) @ b("feed_forward.w2.weight")
        h = h + rms(y, b("ffn_post_norm.weight"))
    h = rms(h, g("language_model.model.ln_f.weight"))
    head = g("language_model.model.wte.weight").T if tied else g("language_model.lm_head.weight")
    return h @ head


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


@pytest.mark.parametrize("tied", [True, False])
def test_official_tree_imports_with_the_official_forwards_logits(tied):
    cfg, m = tiny(tied)
    t = official_tree(m, tied)
    new = load_config(None, [*SHAPE, f"model.tie_embeddings={str(tied).lower()}"]).model
    from ttt_lm.model import LM
    got = LM(new)
    got.load_state_dict(convert.state_dict_from_e2e(t, new), strict=True)
    got.eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(got, ids), _logits(m, ids))        # four chunks: every inner step too
    one = ids[0, :B]
    ref = official_logits(t, one.numpy(), tied=tied)
    out = _logits(got, one[None])[0].double().numpy()
    assert np.abs(out - ref).max() < 2e-5, np.abs(out - ref).max()
    # the official forward is sensitive to the layout: W1 and W3 of one prime MLP swapped is far off
    bad = dict(t)
    k1, k3 = (f"language_model.model.h.prime_storage.feed_forward_prime.{w}.weight" for w in ("w1", "w3"))
    bad[k1], bad[k3] = t[k3], t[k1]
    assert np.abs(official_logits(bad, one.numpy(), tied=tied) - ref).max() > 1e-3


def test_a_baseline_tree_without_prime_storage_imports():
    """The official baselines (prime false, suffix_len 0) have no h.prime_storage: suffix_len 0 is read."""
    cfg, m = tiny(extra=["model.ttt_e2e.suffix_len=0"])
    t = official_tree(m, s=0)
    got = load_config(None, [*SHAPE, "model.ttt_e2e.suffix_len=0"]).model
    assert convert.e2e_shape_of(t)["suffix_len"] == 0
    from ttt_lm.model import LM
    lm = LM(got)
    lm.load_state_dict(convert.state_dict_from_e2e(t, got), strict=True)
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(lm.eval(), ids), _logits(m, ids))
    with pytest.raises(convert.ConversionError, match=r"model.ttt_e2e.suffix_len=2 \(the tensors: 0\)"):
        convert.e2e_config(t, None, [f"model.ttt_e2e.window={W}", f"model.ttt_e2e.inner_batch={B}",
                                     "data.seq_len=16", "model.ttt_e2e.suffix_len=2"])


def test_the_cli_reads_npz_and_safetensors_and_infers_or_checks_the_config(tmp_path):
    from safetensors.numpy import save_file
    cfg, m = tiny()
    t = official_tree(m)
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(2))
    want = _logits(m, ids)
    # keystr of attribute paths (".a.b"), plus a state index's initial value, which is dropped
    npz = tmp_path / "e2e.npz"
    np.savez(npz, **{"." + k: v for k, v in t.items()},
             **{".language_model.model.h.blocks.seq_modeling_block.kv_cache_index.init[0]": np.zeros((L, W, D), np.float32)})
    # without --config: the shape from the tensors, the window and inner batch as overrides
    assert convert.main(["from-e2e", str(npz), str(tmp_path / "a"), f"model.ttt_e2e.window={W}",
                         f"model.ttt_e2e.inner_batch={B}", "data.seq_len=16"]) == 0
    a = load_pretrained(str(tmp_path / "a"))
    assert type(a).__name__ == "E2ELM" and a.cfg.ttt_e2e.suffix_len == S and a.cfg.n_heads == H
    assert a.cfg.ttt_e2e.rope_theta == 500000.0 and a.cfg.max_seq_len == 8192    # the released settings
    assert torch.equal(_logits(a, ids), want)
    # orbax's nested-dict spelling in a safetensors file, checked against a preset
    st = tmp_path / "e2e.safetensors"
    save_file({"".join(f"['{p}']" for p in k.split(".")): v for k, v in t.items()}, str(st))
    preset = tmp_path / "preset.yaml"
    preset.write_text("model:\n" + "".join(f"  {o.split('=')[0][6:]}: {o.split('=')[1]}\n" for o in SHAPE
                                           if o.startswith("model.") and "ttt_e2e" not in o)
                      + f"  ttt_e2e:\n    enabled: true\n    suffix_len: {S}\n    window: {W}\n    inner_batch: {B}\n"
                      + "data:\n  seq_len: 16\n")
    assert convert.main(["from-e2e", str(st), str(tmp_path / "b"), "--config", str(preset)]) == 0
    assert torch.equal(_logits(load_pretrained(str(tmp_path / "b")), ids), want)
    # a preset that disagrees with the tensors is refused, naming the field and both values
    with pytest.raises(convert.ConversionError, match=r"model.d_ff=40 \(the tensors: 48\)"):
        convert.from_e2e(str(st), str(tmp_path / "c"), str(preset), ["model.d_ff=40"])
    with pytest.raises(convert.ConversionError, match=r"model.ttt_e2e.suffix_len=1 \(the tensors: 2\)"):
        convert.from_e2e(str(st), str(tmp_path / "c"), str(preset), ["model.ttt_e2e.suffix_len=1"])
    with pytest.raises(convert.ConversionError, match=r"model.tie_embeddings=False \(the tensors: True\)"):
        convert.from_e2e(str(st), str(tmp_path / "c"), str(preset), ["model.tie_embeddings=false"])


def test_missing_extra_and_misshapen_tensors_are_refused_naming_the_path(tmp_path):
    cfg, m = tiny()
    t = official_tree(m)
    mc = cfg.model
    p_w2 = "language_model.model.h.prime_storage.feed_forward_prime.w2.weight"
    gone = {k: v for k, v in t.items() if k != p_w2}
    with pytest.raises(convert.ConversionError, match=r"missing \['" + p_w2.replace(".", r"\.")):
        convert.state_dict_from_e2e(gone, mc)
    extra = dict(t, **{"language_model.model.h.blocks.seq_modeling_block.bq.weight": np.zeros((L, D), np.float32)})
    with pytest.raises(convert.ConversionError, match=r"unexpected \['language_model\.model\.h\.blocks\.seq_modeling_block\.bq\.weight'\]"):
        convert.state_dict_from_e2e(extra, mc)
    head = dict(t, **{"language_model.lm_head.weight": np.zeros((D, V), np.float32)})
    with pytest.raises(convert.ConversionError, match=r"unexpected \['language_model\.lm_head\.weight'\]"):
        convert.state_dict_from_e2e(head, mc)                     # an untied head in a tied model
    k1 = "language_model.model.h.blocks.feed_forward.w1.weight"   # left in nn.Linear's [out, in]
    wrong = dict(t, **{k1: np.ascontiguousarray(t[k1].transpose(0, 2, 1))})
    with pytest.raises(convert.ConversionError, match=re.escape(f"{k1}: ({L}, {F}, {D}) (expected ({L}, {D}, {F}))")):
        convert.state_dict_from_e2e(wrong, mc)
    short = dict(t, **{"language_model.model.h.prime_storage.ffn_prime_norm.weight": t[
        "language_model.model.h.prime_storage.ffn_prime_norm.weight"][:1]})
    with pytest.raises(convert.ConversionError, match=r"ffn_prime_norm\.weight: \(1, 32\) \(expected \(2, 32\)\)"):
        convert.state_dict_from_e2e(short, mc)
    twice = dict(t, **{"['language_model']['model']['ln_f']['weight']": t["language_model.model.ln_f.weight"]})
    with pytest.raises(convert.ConversionError, match=r"'language_model\.model\.ln_f\.weight' appears twice"):
        convert.state_dict_from_e2e(twice, mc)
    ints = tmp_path / "ints.npz"
    np.savez(ints, **{k: (v * 0).astype(np.int32) if "wte" in k else v for k, v in t.items()})
    with pytest.raises(convert.ConversionError, match=r"'language_model\.model\.wte\.weight' has dtype int32"):
        convert.from_e2e(str(ints), str(tmp_path / "x"))
    not_e2e = {k: v for k, v in t.items() if "blocks" not in k}
    with pytest.raises(convert.ConversionError, match=r"not a TTT-E2E parameter tree"):
        convert.e2e_config(not_e2e)
    assert convert.main(["from-e2e", str(tmp_path / "none.npz"), str(tmp_path / "y")]) == 2



#: the official configs/model/*.yaml and experiment/*/pretrain-*-e2e.yaml: (L, D, heads, F_E2E, S)
OFFICIAL_SIZES = {"125m": (12, 768, 12, 1664, 3), "350m": (24, 1024, 16, 2304, 6),
                  "760m": (24, 1536, 16, 3328, 6), "1b": (24, 2048, 32, 4352, 6)}


@pytest.mark.parametrize("size", sorted(OFFICIAL_SIZES))
def test_the_released_sizes_import_into_their_presets(size):
    """A tree of the official shapes (meta tensors: shapes only) against configs/ttt_e2e_<size>.yaml."""
    nl, d, nh, f, s = OFFICIAL_SIZES[size]
    v, hd = 128256, d // nh
    e = lambda *shape: torch.empty(shape, device="meta")
    blk, pr = "language_model.model.h.blocks.", "language_model.model.h.prime_storage."
    t = {"language_model.model.wte.weight": e(v, d), "language_model.model.ln_f.weight": e(d)}
    t.update({blk + n + ".weight": e(nl, d) for n in ("seq_norm", "seq_post_norm", "ffn_norm", "ffn_post_norm")})
    t.update({blk + f"seq_modeling_block.{w}.weight": e(nl, d, d) for w in ("wq", "wk", "wv", "wo")})
    t.update({blk + f"seq_modeling_block.{n}.weight": e(nl, hd) for n in ("q_norm", "k_norm")})
    t.update({blk + "feed_forward.w1.weight": e(nl, d, f), blk + "feed_forward.w3.weight": e(nl, d, f),
              blk + "feed_forward.w2.weight": e(nl, f, d)})
    t.update({pr + "feed_forward_prime.w1.weight": e(s, d, f), pr + "feed_forward_prime.w3.weight": e(s, d, f),
              pr + "feed_forward_prime.w2.weight": e(s, f, d), pr + "ffn_prime_norm.weight": e(s, d),
              pr + "ffn_prime_post_norm.weight": e(s, d)})
    cfg = convert.e2e_config(t, f"configs/ttt_e2e_{size}.yaml")
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.ff, cfg.model.ttt_e2e.suffix_len) \
        == (nl, d, nh, f, s)
    with torch.device("meta"):
        sd = convert.state_dict_from_e2e(t, cfg.model)
    assert sd["layers.0.attn.wq.weight"].shape == (d, d) and sd[f"layers.{nl - 1}.prime.w2"].shape == (d, f)
    assert len(sd) == 3 + nl * 13 + s * 5       # embed, norm, tied head; 13 per block; 5 per TTT block
