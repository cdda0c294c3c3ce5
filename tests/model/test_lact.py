"""The ``lact`` mixer: its three forms, streaming, packed documents, config checks, FLOPs."""
import dataclasses

import pytest
import torch

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.flops import flops_per_token, matmul_params
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers import build_mixer
from ttt_lm.model.mixers.lact import LaCT

BASE = {"chunk_size": 4, "window": 3, "num_heads": 2, "muon_dtype": "state"}
CASES = [
    dict(BASE),                                                   # momentum, full-rank initial weights
    dict(BASE, low_rank=3, use_muon=True),                        # the preset's low rank, Muon
    dict(BASE, use_momentum=False, prenorm=True, inter_multi=1.5),  # d_h ≠ head width
    dict(BASE, chunk_size=64, window=64, num_heads=1),            # one chunk: no write at all
]
IDS = ["momentum", "lowrank_muon", "prenorm_wide", "one_chunk"]


@pytest.mark.parametrize("kw", CASES, ids=IDS)
@pytest.mark.parametrize("T", [1, 9, 12])
def test_chunked_matches_reference(kw, T):
    m, _ = make_mixer("lact", lact=kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_decode_and_segments(kw):
    """step() token by token, the chunk written when the token after it arrives, and two segments
    with the state passed, equal one pass (float64)."""
    m, _ = make_mixer("lact", lact=kw)
    check_decode(m, 13)


@pytest.mark.parametrize("kw", CASES[:2], ids=IDS[:2])
def test_causal(kw):
    m, _ = make_mixer("lact", lact=kw)
    check_causal(m, 12)


def test_gradcheck():
    m, _ = make_mixer("lact", d_model=16, lact=dict(BASE, chunk_size=3, low_rank=2))
    check_gradcheck(m, T=7)


def test_fast_path_matters_and_chunks_write():
    """Both paths reach the output, and a write changes what later chunks read: with the
    learning-rate projection pushed to ~0 the later tokens' outputs change, the first chunk's not."""
    m, _ = make_mixer("lact", lact=dict(BASE, chunk_size=4))
    x = torch.randn(1, 12, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        y, _ = m(x)
        m.lr_proj.bias.fill_(-60.0)      # softplus(−60 + …) ≈ 0: no update
        y0, _ = m(x)
    torch.testing.assert_close(y[:, :4], y0[:, :4], atol=1e-12, rtol=0)
    assert (y[:, 4:] - y0[:, 4:]).abs().max() > 1e-4


def test_state_holds_the_open_chunk_and_window():
    m, _ = make_mixer("lact", lact=dict(BASE, chunk_size=4, window=3))
    x = torch.randn(2, 10, m.d_model, dtype=torch.float64)
    _, st = m(x, output_state=True)
    assert st.pos == 10 and st.fk.shape[2] == 2 and st.k.shape[2] == 2   # 10 = 2·4 + 2; w − 1 = 2
    _, st = m(x[:, :8], output_state=True)
    assert st.fk.shape[2] == 4            # a full chunk stays open until the next token


def test_packed_documents_start_from_the_initial_weights():
    """With reset_at_doc_boundaries, a packed row equals its documents run one by one."""
    cfg = dataclasses.replace(tiny_cfg("lact", lact=dict(BASE)), n_layers=2, reset_at_doc_boundaries=True)
    torch.manual_seed(0)
    lm = LM(cfg).double().eval()
    ids = torch.randint(0, 64, (1, 15))
    pos = torch.tensor([list(range(9)) + list(range(6))])
    with torch.no_grad():
        packed = lm(ids, position_ids=pos).logits
        a = lm(ids[:, :9]).logits
        b = lm(ids[:, 9:]).logits
    torch.testing.assert_close(packed, torch.cat([a, b], 1), atol=1e-10, rtol=0)


def test_bad_config_names_the_key():
    """Ranges of one field are checked with the config (LaCTConfig), what depends on the model's
    widths when the layer is built."""
    for kw, key in [(dict(chunk_size=0), "model.lact.chunk_size"), (dict(window=-1), "model.lact.window"),
                    (dict(muon_dtype="fp8"), "model.lact.muon_dtype"), (dict(low_rank=-2), "model.lact.low_rank"),
                    (dict(base_lr=0.0), "model.lact.base_lr")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            tiny_cfg("lact", lact=dict(BASE, **kw))
    cfg = tiny_cfg("lact", lact=dict(BASE, num_heads=3))
    with pytest.raises(ValueError, match=r"model\.lact\.num_heads"):
        build_mixer("lact", cfg, 0)


def test_no_triton_kernel_is_refused_loudly():
    m, _ = make_mixer("lact", lact=dict(BASE))
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match="kernels.lact has only"):
        m(torch.zeros(1, 4, m.d_model, dtype=torch.float64))
    m.kernel_backend = "auto"
    assert m.resolve_backend("cuda") == "torch"


def test_init_follows_the_official_code():
    cfg = tiny_cfg("lact", d_model=64, lact=dict(BASE, low_rank=4, num_heads=2))
    torch.manual_seed(0)
    m = LaCT(cfg, 0)
    w0, w1, w2 = m.fast_weights()
    e = 32
    eye = torch.eye(e)
    # W_left W_right + 0.5·I: the identity part is there, the rest is small
    assert ((w0 - 0.5 * eye).abs().max()) < 0.5
    torch.testing.assert_close(m.w0.left.std().item(), 0.5 / 4 ** 0.5, rtol=0.15, atol=0)
    torch.testing.assert_close(m.w0.right.std().item(), 0.5 / e ** 0.5, rtol=0.15, atol=0)
    torch.testing.assert_close(w1.std().item(), 1 / e ** 0.5, rtol=0.1, atol=0)
    assert torch.equal(m.qk_scale, torch.ones(64, 2)) and torch.equal(m.qk_offset, torch.zeros(64, 2))


def test_flops_count_the_fast_weight_products():
    """FLOPs per token: the fast-weight products (query apply for every token, the write for the
    tokens of written chunks), Muon, the window's attention; the initial fast weights are not
    counted again from their shapes."""
    cfg = tiny_cfg("lact", d_model=64, n_heads=4, lact=dict(BASE, chunk_size=16, window=8, num_heads=2,
                                                              low_rank=4))
    f = LaCT.flops_per_token(cfg, 64)
    e = dh = 32
    seen = (8 * 9 / 2 + (64 - 8) * 8) / 64
    want = 4 * 4 * 16 * seen + 2 * e * dh * (6 + 12 * 48 / 64)
    assert f == pytest.approx(want)
    cfg.lact.use_muon = True
    fm = LaCT.flops_per_token(cfg, 64)
    assert fm - f == pytest.approx(2 * 3 * 5 * (4 * 32 ** 3 + 2 * 32 ** 3) * 3 / 64)
    assert LaCT.flops_per_token(cfg, 16) == pytest.approx(4 * 4 * 16 * (8 * 9 / 2 + 8 * 8) / 16 + 2 * e * dh * 6)
    # N_matmul: the low-rank factors, w1 and the per-channel scales are left out
    m = LM(cfg)
    lact = m.layers[0].mixer
    dense = sum(p.numel() for n, p in m.named_parameters() if p.ndim >= 2 and n != "embed.weight"
                and not any(s in n for s in ("w0.", "w2.", "w1", "qk_scale", "qk_offset")))
    assert matmul_params(cfg) == dense + (m.lm_head.weight.numel() if cfg.tie_embeddings else 0)
    assert flops_per_token(cfg, 64)["forward"] == pytest.approx(2 * matmul_params(cfg) + fm)
    assert lact.w1._flops_not_per_token


def test_rope_tables_are_built_in_the_accumulation_dtype(monkeypatch):
    """A float64 layer is float64 throughout: its RoPE tables too (float32 tables moved a float64
    layer with Muon by ~1e-6 relative in its gradients, Newton-Schulz amplifying their rounding).
    The oracle is the same layer with every table forced to float64: equal to 1e-13 in output and
    gradients (only the order of float64 operations may differ). bfloat16 inputs keep float32
    tables (their accumulation dtype)."""
    import ttt_lm.model.mixers.lact as lact_mod
    real, seen = lact_mod.rope_cos_sin, []

    def recording(*a, **k):
        cos, sin = real(*a, **k)
        seen.append(cos.dtype)
        return cos, sin

    def float64_tables(*a, **k):
        return real(*a, **dict(k, dtype=torch.float64))

    m, _ = make_mixer("lact", lact=dict(BASE, low_rank=3, use_muon=True))
    torch.manual_seed(3)
    x = torch.randn(2, 13, m.d_model, dtype=torch.float64)
    R = torch.randn(2, 13, m.d_model, dtype=torch.float64)

    def run():
        xx = x.clone().requires_grad_(True)
        y, _ = m(xx)
        return [y] + list(torch.autograd.grad((y * R).sum(), [xx] + list(m.parameters())))

    monkeypatch.setattr(lact_mod, "rope_cos_sin", recording)
    got = run()
    assert seen and set(seen) == {torch.float64}, seen
    monkeypatch.setattr(lact_mod, "rope_cos_sin", float64_tables)
    want = run()
    for i, (a, b) in enumerate(zip(got, want)):
        assert _rel(a, b) <= 1e-13, (i, _rel(a, b))
    seen.clear()
    monkeypatch.setattr(lact_mod, "rope_cos_sin", recording)
    with torch.no_grad():
        m16 = m.to(torch.bfloat16)
        y16, _ = m16(x.to(torch.bfloat16))
    assert seen and set(seen) == {torch.float32} and torch.isfinite(y16).all(), seen


# ---- the official layer's numbers -----------------------------------------------------------------

LAYER_GOLDEN = __import__("pathlib").Path(__file__).parent / "data" / "lact_layer_golden.pt"
#: official parameter name → ours
RENAME = {"w0.w_left": "w0.left", "w0.w_right": "w0.right", "w2.w_left": "w2.left", "w2.w_right": "w2.right",
          "momentum_proj.0.weight": "momentum_proj.weight", "momentum_proj.0.bias": "momentum_proj.bias",
          "ttt_scale_proj.weight": "scale_proj.weight", "ttt_scale_proj.bias": "scale_proj.bias"}


def _rel(a, b):
    return float((a.detach() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_matches_the_official_layer(impl):
    """The mixer with the official layer's parameters gives its output and gradients.

    ``data/lact_layer_golden.pt``: the official ``LaCTSWIGLULayer`` (a1600012888/LaCT at 1f84d47,
    ``lact_llm/lact_model/layer_lact_swiglu.py``) run on CPU in float64 with TORCHDYNAMO_DISABLE=1
    and CPU stand-ins for the CUDA-only pieces it imports (flash-linear-attention's RMSNorm, eps
    1e-5, and non-interleaved RotaryEmbedding; flash_attn_func as a masked softmax with window
    (w − 1, 0)): d_model 64, 4 attention heads, 2 fast-weight heads, window 6, chunk 8, T = 29,
    B = 2, random parameters (lr bias ≈ 5, so that updates matter); case 1 low rank 4 with
    momentum, case 2 full rank with Muon, once with its Newton–Schulz steps in float64
    (``Tensor.bfloat16`` made the identity) and once in bfloat16 as shipped. Loss Σ o ⊙ R.

    Tolerances: the official layer rounds the learning rates and the momentum to float32 whatever
    the model's dtype (``.float()``), this mixer keeps float64: 1e-6 relative (measured ≤ 3e-7),
    3e-5 with Muon, whose Newton–Schulz steps amplify that rounding (measured 7.9e-6).
    Newton–Schulz in bfloat16: the output to 5e-2 (measured 1.4e-4); its gradients are not
    compared: Muon's output does not depend on the update's scale, so the learning rates'
    gradients through it are rounding noise of bfloat16 (they differ by tens of percent)."""
    g = torch.load(LAYER_GOLDEN, weights_only=False)
    for c in g["cases"]:
        for ns, res in c["results"].items():
            cfg = tiny_cfg("lact", d_model=g["hidden_size"], n_heads=g["num_attn_heads"],
                           lact=dict(num_heads=g["num_lact_heads"], window=g["window_size"],
                                     chunk_size=g["lact_chunk_size"], low_rank=max(0, c["w0_w2_low_rank"]),
                                     use_momentum=c["use_momentum"], use_muon=c["use_muon"],
                                     muon_dtype="bfloat16" if ns == "bf16" else "state",
                                     rope_theta=g["rope_theta"]))
            m = LaCT(cfg, 0).double()
            m.load_state_dict({RENAME.get(n, n): p for n, p in c["params"].items()}, strict=True)
            m.impl = impl
            x = c["x"].clone().requires_grad_(True)
            y, _ = m(x)
            if ns == "bf16" and c["use_muon"]:
                assert _rel(y, res["o"]) <= 5e-2
                continue
            tol = 3e-5 if c["use_muon"] else 1e-6
            assert _rel(y, res["o"]) <= tol
            names = [n for n, _ in m.named_parameters()]
            grads = torch.autograd.grad((y * c["R"]).sum(), [x] + [p for _, p in m.named_parameters()])
            assert _rel(grads[0], res["grad_x"]) <= tol
            back = {v: k for k, v in RENAME.items()}
            assert {back.get(n, n) for n in names} == set(res["grads"])
            for n, gr in zip(names, grads[1:]):
                assert _rel(gr, res["grads"][back.get(n, n)]) <= tol, (n, _rel(gr, res["grads"][back.get(n, n)]))


def test_bf16_autocast_keeps_float32_fast_weights():
    """Under bfloat16 autocast (as the trainer runs on a GPU) the fast weights stay float32 and
    the output is close to the float32 run (bfloat16 products: 5e-2 relative)."""
    m, _ = make_mixer("lact", dtype=torch.float32, lact=dict(BASE, low_rank=2))
    x = torch.randn(2, 13, m.d_model)
    with torch.no_grad():
        y32, _ = m(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y16, st = m(x, output_state=True)
        y_step, st2 = m.step(x[:, :1], st)
    assert st.w0.dtype == torch.float32 and st2.w1.dtype == torch.float32
    assert float((y16.float() - y32).abs().max() / y32.abs().max()) <= 5e-2
    assert torch.isfinite(y_step).all()
