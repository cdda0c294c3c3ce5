"""Kimi Delta Attention: its three forms held equal, the layer as flash-linear-attention computes
it (low-rank gates, per-channel decay, sigmoid output gate), its init and head widths, and an LM
that decodes as it trains."""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels.kda import kda_reference
from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers.kda import A_INIT_MAX, A_INIT_MIN, KDAConfig, KimiDeltaAttention, head_dims
from ttt_lm.model.mixers.gated_deltanet import DT_MAX, DT_MIN

CASES = [
    {"kda": {"chunk_size": 4}},                                                # conv, 2 heads of 16
    {"kda": {"chunk_size": 3, "num_heads": 4, "head_dim": 8, "expand_v": 1.5, "gate_rank": 5,
             "allow_neg_eigval": True, "conv_bias": True}},
    {"kda": {"use_short_conv": False, "chunk_size": 64, "output_gate_bias": False}},   # one chunk, no conv
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("T", [1, 7, 9])
def test_chunked_matches_reference(kw, T):
    m, _ = make_mixer("kda", **kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kw", CASES)
def test_decode_and_segments(kw):
    m, _ = make_mixer("kda", **kw)
    check_decode(m, 11)


@pytest.mark.parametrize("kw", CASES)
def test_causal(kw):
    m, _ = make_mixer("kda", **kw)
    check_causal(m, 12)


@pytest.mark.parametrize("kw", CASES[:2])
def test_gradcheck(kw):
    m, _ = make_mixer("kda", d_model=16, **kw)
    check_gradcheck(m)


@pytest.mark.parametrize("kw", CASES[:2])
def test_layer_is_the_official_computation(kw):
    """The mixer's output equals the layer written out from flash-linear-attention's operations
    (separate short convs with SiLU, l2-normalized q and k, q scaled by d_k^−1/2, the gate
    −exp(A_log)·softplus(f_proj(x) + dt_bias) per channel from the two-factor f_proj, β = σ(b_proj x)
    (twice that with allow_neg_eigval), per-head RMSNorm times σ(g_proj(x)) from the two-factor
    g_proj with its bias, o_proj) around the sequential KDA; float64, 1e-10."""
    m, cfg = make_mixer("kda", **kw)
    c = cfg.kda
    with torch.no_grad():
        if m.g_b_proj.bias is not None:
            m.g_b_proj.bias.normal_()   # zero at init: give it a value that shows
        if m.q_conv is not None and m.q_conv.conv.bias is not None:
            for conv in (m.q_conv, m.k_conv, m.v_conv):
                conv.conv.bias.normal_()
    torch.manual_seed(5)
    B, T, H, dk, dv = 2, 9, m.n_heads, m.dk, m.dv
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)

    def conv(cv, z):   # causal depthwise conv, zero history, then SiLU
        if cv is None:
            return F.silu(z)
        w = cv.conv.weight                                                 # [C, 1, width]
        zp = F.pad(z.transpose(1, 2), (w.shape[-1] - 1, 0))
        return F.silu(F.conv1d(zp, w, cv.conv.bias, groups=w.shape[0]).transpose(1, 2))

    def heads(z, d):
        return z.reshape(B, T, -1, d).transpose(1, 2)

    q = heads(conv(m.q_conv, x @ m.q_proj.weight.T), dk)
    k = heads(conv(m.k_conv, x @ m.k_proj.weight.T), dk)
    v = heads(conv(m.v_conv, x @ m.v_proj.weight.T), dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = (x @ m.f_a_proj.weight.T @ m.f_b_proj.weight.T).view(B, T, H, dk)
    g = (-m.A_log.exp().view(H, 1) * F.softplus(f + m.dt_bias.view(H, dk))).transpose(1, 2)
    beta = torch.sigmoid(x @ m.b_proj.weight.T).transpose(1, 2) * (2.0 if c.allow_neg_eigval else 1.0)
    y, _ = kda_reference(q, k, v, g, beta)
    y = y.transpose(1, 2)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * m.o_norm.weight
    gate = x @ m.g_a_proj.weight.T @ m.g_b_proj.weight.T
    if m.g_b_proj.bias is not None:
        gate = gate + m.g_b_proj.bias
    y = y * torch.sigmoid(gate.view(B, T, H, dv))
    want = y.reshape(B, T, H * dv) @ m.o_proj.weight.T
    got, _ = m(x)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_official_init_and_widths():
    """head_dim 128 heads over the width, d_v = expand_v·d_k, gate rank d_v; A = exp(A_log) in
    (1, 16) per head; Δ₀ = softplus(dt_bias) per channel in [1e-3, 0.1] (log-uniform); both exempt
    from weight decay; the short convs N(0, init_std); b_g zero. The ranges over 4096 heads (and
    their channels) cover most of each interval (draws, not fixed values)."""
    cfg = tiny_cfg("kda", d_model=256, n_heads=4, kda={"head_dim": 128})
    assert head_dims(cfg) == (2, 128, 128, 128)
    cfg = tiny_cfg("kda", d_model=64, n_heads=4, kda={"expand_v": 1.5})
    assert head_dims(cfg) == (4, 16, 24, 24)
    torch.manual_seed(0)
    cfg = tiny_cfg("kda", d_model=4096, n_heads=4096, kda={"head_dim": 1, "expand_v": 2.0})
    m = KimiDeltaAttention(cfg, 0)
    A = m.A_log.exp()
    assert A.shape == (4096,) and m.dt_bias.shape == (4096,)
    assert A.min() > A_INIT_MIN and A.max() < A_INIT_MAX and A.max() > 15 and A.min() < 1.1
    dt = F.softplus(m.dt_bias.double())
    assert dt.min() >= DT_MIN * (1 - 1e-6) and dt.max() <= DT_MAX * (1 + 1e-6)
    assert dt.min() < 1.2 * DT_MIN and dt.max() > 0.8 * DT_MAX
    assert abs(torch.log(dt).mean().item() - (math.log(DT_MIN) + math.log(DT_MAX)) / 2) < 0.1
    assert m.A_log._no_weight_decay and m.dt_bias._no_weight_decay
    cfg = tiny_cfg("kda", d_model=128, n_heads=1, init_std=0.05)
    m = KimiDeltaAttention(cfg, 0)
    w = torch.cat([c.conv.weight.flatten() for c in (m.q_conv, m.k_conv, m.v_conv)])
    assert abs(w.std().item() - 0.05) < 0.005 and abs(w.mean().item()) < 0.005
    assert m.g_b_proj.bias is not None and m.q_conv.conv.bias is None


def test_model_init_keeps_the_gate_bias_zero():
    """The LM's init (any scheme) leaves b_g at zero, as flash-linear-attention's _init_weights."""
    torch.manual_seed(0)
    lm = LM(tiny_cfg("kda", n_layers=1, init="ttt"))
    assert torch.equal(lm.layers[0].mixer.g_b_proj.bias, torch.zeros_like(lm.layers[0].mixer.g_b_proj.bias))


def test_gate_ranges_in_the_layer():
    """g ≤ 0 per channel (α ∈ (0, 1]^{d_k}) and β ∈ (0, 1) — (0, 2) with allow_neg_eigval — for
    any input, including large ones; q has norm d_k^−1/2."""
    for neg in (False, True):
        m, cfg = make_mixer("kda", kda={"allow_neg_eigval": neg})
        x = 100 * torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
        inp, _ = m.inputs(x)
        assert inp["g"].shape == (2, m.n_heads, 5, m.dk) and inp["beta"].shape == (2, m.n_heads, 5)
        assert (inp["g"] <= 0).all() and (inp["beta"] >= 0).all() and (inp["beta"] <= (2 if neg else 1)).all()
        assert (inp["beta"].max() > 1) == neg
        torch.testing.assert_close(inp["q"].norm(dim=-1), torch.full((2, m.n_heads, 5), m.dk ** -0.5,
                                                                    dtype=torch.float64), atol=1e-6, rtol=0)


def test_decay_differs_across_channels():
    """The decay is per key channel: two channels of one head and token get different g."""
    m, cfg = make_mixer("kda")
    inp, _ = m.inputs(torch.randn(1, 3, cfg.d_model, dtype=torch.float64))
    assert (inp["g"].std(-1) > 1e-6).all()


@pytest.mark.parametrize("kw, key", [
    ({"kda": {"num_heads": 3}}, "model.kda.num_heads"),        # 3 does not divide d_model 32
    ({"kda": {"head_dim": 5}}, "model.kda.head_dim"),          # nor 5
    ({"kda": {"expand_v": 1.01}}, "model.kda.expand_v"),
    ({"kda": {"num_heads": 0}}, "model.kda.num_heads"),
    ({"kda": {"conv_size": 0}}, "model.kda.conv_size"),
    ({"kda": {"gate_rank": 0}}, "model.kda.gate_rank"),
    ({"kda": {"chunk_size": 0}}, "model.kda.chunk_size"),
])
def test_bad_config_is_refused_naming_the_key(kw, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        tiny_cfg("kda", **kw)


def test_bad_widths_are_refused_at_construction_too():
    cfg = tiny_cfg("kda")
    cfg.kda.head_dim = 7
    with pytest.raises(ValueError, match=r"model\.kda\.head_dim=7"):
        KimiDeltaAttention(cfg, 0)


def test_section_unused_is_not_checked_against_the_width():
    """A model without the kind keeps model.kda as it is (the heads are checked where the kind is used)."""
    cfg = ModelConfig(d_model=48, n_heads=4, n_layers=1, vocab_size=32, layer_pattern=["attention"])
    cfg.kda.head_dim = 128
    cfg.validate()


def test_state_shapes():
    m, cfg = make_mixer("kda", kda={"expand_v": 2.0})
    st = m.init_state(3, dtype=torch.bfloat16)
    H, dk, dv, _ = head_dims(cfg)
    assert st.S.shape == (3, H, dk, dv) and st.S.dtype == torch.float32
    assert st.conv_q.shape == (3, H * dk, 3) and st.conv_v.shape == (3, H * dv, 3)
    m, _ = make_mixer("kda", kda={"use_short_conv": False})
    st = m.init_state(2)
    assert st.conv_q is None and st.conv_k is None and st.conv_v is None


def test_flops_per_token():
    cfg = tiny_cfg("kda")
    H, d, e, _ = head_dims(cfg)
    f = KimiDeltaAttention.flops_per_token(cfg, 1024)
    C = cfg.kda.chunk_size
    assert f == H * (4 * C * d + C * (d + e) + 6 * d * e + 2 * C * e)
    assert KimiDeltaAttention.flops_per_token(cfg, 8) < f     # a chunk no longer than the sequence


def test_scaled_keeps_the_head_size():
    fam = ModelConfig(d_model=768, n_heads=12, n_layers=1, vocab_size=32, layer_pattern=["kda"])
    wide = ModelConfig(d_model=1024, n_heads=16, n_layers=1, vocab_size=32, layer_pattern=["kda"])
    odd = ModelConfig(d_model=960, n_heads=15, n_layers=1, vocab_size=32, layer_pattern=["kda"])
    assert KDAConfig(head_dim=128).scaled(fam, wide) == KDAConfig(head_dim=128)
    assert KDAConfig(head_dim=128).scaled(fam, odd) == KDAConfig()
    assert KDAConfig(num_heads=6).scaled(fam, wide) == KDAConfig(head_dim=128)
    assert KDAConfig(num_heads=6, head_dim=256).scaled(fam, wide) == KDAConfig(num_heads=8, head_dim=256)
    assert KDAConfig().scaled(fam, wide) == KDAConfig()


def test_lm_decode_matches_forward():
    """A KDA LM: token-by-token decode logits equal the training forward's (float64)."""
    torch.manual_seed(0)
    cfg = tiny_cfg("kda", n_layers=2, kda={"chunk_size": 4})
    lm = LM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        logits = lm(ids).logits
        states = lm.init_states(2, dtype=torch.float64)
        steps = []
        for t in range(ids.shape[1]):
            lt, states = lm.step(ids[:, t], states)
            steps.append(lt)
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-10, rtol=0)


def test_triton_backend_is_refused_while_the_op_has_none(monkeypatch):
    """kernel_backend="triton" where kernels.kda lists no Triton backend: a clear error naming it,
    not a silent fallback (only "auto" picks PyTorch); with a Triton backend listed, the layer is
    covered unless allow_neg_eigval (β up to 2, which the op's entry refuses)."""
    import kernels.kda as kda_op
    monkeypatch.setattr(kda_op, "BACKENDS", ("torch", "reference"))
    m, _ = make_mixer("kda")
    assert "kernels.kda has only" in m.triton_unavailable()
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match="triton"):
        m(torch.randn(1, 3, m.d_model, dtype=torch.float64))
    monkeypatch.setattr(kda_op, "BACKENDS", ("torch", "reference", "triton"))
    assert m.triton_unavailable() is None
    m, _ = make_mixer("kda", kda={"allow_neg_eigval": True})
    assert "allow_neg_eigval" in m.triton_unavailable()


def test_packed_documents_equal_each_document_alone():
    """One call over packed rows (resets inside the torch chunked scan, convs masked) equals each
    document run alone (float64; the shared packed-document test checks gradients too)."""
    from ttt_lm.model.docs import DocLayout
    m, cfg = make_mixer("kda", kda={"chunk_size": 4})
    torch.manual_seed(7)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]])
    x = torch.randn(2, 11, cfg.d_model, dtype=torch.float64)
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        y, _ = m(x, docs=DocLayout.build(pos))
        assert len(calls) == 1
        want = torch.zeros_like(y)
        for b in range(2):
            starts = [int(i) for i in (pos[b] == 0).nonzero().flatten()] + [11]
            for a, e in zip(starts, starts[1:]):
                want[b, a:e] = m(x[b:b + 1, a:e])[0][0]
    torch.testing.assert_close(y, want, atol=1e-10, rtol=0)


def test_state_is_affine_with_the_chunk_transition_of_the_summary_run():
    """What the context-parallel summary rests on: run from [0, I] on the values [v, 0], KDA ends
    in [S^loc, P] with P the slice's transition Π (I − β k kᵀ) Diag(α) [d_k, d_k], and from any S_in
    the final state is P S_in + S^loc, the outputs those of the run from S_in (float64, 1e-12;
    strong per-channel decay included)."""
    from kernels.kda.torch_chunk import kda_chunk_torch
    g = torch.Generator().manual_seed(3)
    B, H, T, dk, dv = 2, 2, 11, 4, 3
    q, k = (F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    gate = -5 * torch.rand(B, H, T, dk, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64)
    S_in = torch.randn(B, H, dk, dv, generator=g, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64).expand(B, H, dk, dk)
    init = torch.cat([torch.zeros(B, H, dk, dv, dtype=torch.float64), eye], -1)
    _, fin = kda_chunk_torch(q, k, torch.cat([v, torch.zeros(B, H, T, dk, dtype=torch.float64)], -1), gate, beta,
                             init, True, 4)
    S_loc, P = fin[..., :dv], fin[..., dv:]
    P_want = eye.clone()
    for t in range(T):   # S_t = (I − β k kᵀ) Diag(α) S_{t−1}: the transition multiplies on the left
        kt = k[:, :, t]
        M = (torch.eye(dk, dtype=torch.float64) - beta[:, :, t, None, None] * kt[..., :, None] * kt[..., None, :])
        P_want = M @ (gate[:, :, t].exp()[..., :, None] * P_want)
    torch.testing.assert_close(P, P_want, atol=1e-12, rtol=0)
    o, S_out = kda_chunk_torch(q, k, v, gate, beta, S_in, True, 4)
    o_ref, S_ref = kda_reference(q, k, v, gate, beta, S_in, True)
    torch.testing.assert_close(S_out, P @ S_in + S_loc, atol=1e-12, rtol=0)
    torch.testing.assert_close(S_ref, S_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
