"""Gated DeltaNet: its three forms held equal, the official parameterization (gate, init, head
widths), and an LM that decodes as it trains."""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta_rule import gated_delta_rule_reference
from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers.gated_deltanet import DT_MAX, DT_MIN, GatedDeltaNet, head_dims

CASES = [
    {"gated_deltanet": {"chunk_size": 4}},                                    # conv, 2 heads
    {"gated_deltanet": {"chunk_size": 3, "num_heads": 4, "expand_v": 2.0}},
    {"gated_deltanet": {"conv_width": 0, "chunk_size": 64}},                  # one chunk, no conv
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("T", [1, 7, 9])
def test_chunked_matches_reference(kw, T):
    m, _ = make_mixer("gated_deltanet", **kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kw", CASES)
def test_decode_and_segments(kw):
    m, _ = make_mixer("gated_deltanet", **kw)
    check_decode(m, 11)


@pytest.mark.parametrize("kw", CASES)
def test_causal(kw):
    m, _ = make_mixer("gated_deltanet", **kw)
    check_causal(m, 12)


@pytest.mark.parametrize("kw", CASES[:2])
def test_gradcheck(kw):
    m, _ = make_mixer("gated_deltanet", d_model=16, **kw)
    check_gradcheck(m)


def test_layer_is_the_official_computation():
    """The mixer's output equals the layer written out from the official code's operations
    (separate short convs with SiLU, l2-normalized q and k, q scaled by d_k^−1/2, Mamba2's gate,
    σ(W_β x), per-head RMSNorm times SiLU(W_g x), W_o) around the sequential gated delta rule;
    float64, 1e-10."""
    m, cfg = make_mixer("gated_deltanet", gated_deltanet={"chunk_size": 4})
    torch.manual_seed(5)
    B, T, H, dk, dv = 2, 9, m.n_heads, m.dk, m.dv
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)

    def conv(c, z):   # causal depthwise conv, zero history, then SiLU
        w = c.conv.weight                                                 # [C, 1, width]
        zp = F.pad(z.transpose(1, 2), (w.shape[-1] - 1, 0))
        return F.silu(F.conv1d(zp, w, groups=w.shape[0]).transpose(1, 2))

    def heads(z, d):
        return z.view(B, T, H, d).transpose(1, 2)

    q = heads(conv(m.q_conv, x @ m.q_proj.weight.T), dk)
    k = heads(conv(m.k_conv, x @ m.k_proj.weight.T), dk)
    v = heads(conv(m.v_conv, x @ m.v_proj.weight.T), dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = (-m.A_log.exp() * F.softplus(x @ m.a_proj.weight.T + m.dt_bias)).transpose(1, 2)
    beta = torch.sigmoid(x @ m.b_proj.weight.T).transpose(1, 2)
    y, _ = gated_delta_rule_reference(q, k, v, g, beta)
    y = y.transpose(1, 2)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * m.o_norm.weight
    y = y * F.silu((x @ m.g_proj.weight.T).view(B, T, H, dv))
    want = y.reshape(B, T, H * dv) @ m.o_proj.weight.T
    got, _ = m(x)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_official_init_and_widths():
    """Key width 0.75·d_model and value width 1.5·d_model split over the heads; A = exp(A_log) in
    (0, 16); Δ₀ = softplus(dt_bias) in [1e-3, 0.1] (log-uniform); both exempt from weight decay.
    Δ₀'s range over 4096 heads covers most of the interval (the draw is log-uniform, not fixed)."""
    cfg = tiny_cfg("gated_deltanet", d_model=64, n_heads=4)
    assert head_dims(cfg) == (4, 12, 24)
    torch.manual_seed(0)
    cfg.gated_deltanet.num_heads = 4096
    cfg.d_model = 4096
    cfg.gated_deltanet.expand_k = cfg.gated_deltanet.expand_v = 1.0
    m = GatedDeltaNet(cfg, 0)
    A = m.A_log.exp()
    assert A.min() > 0 and A.max() < 16 and A.max() > 15 and A.min() < 1
    dt = F.softplus(m.dt_bias.double())
    assert dt.min() >= DT_MIN * (1 - 1e-6) and dt.max() <= DT_MAX * (1 + 1e-6)
    assert dt.min() < 1.2 * DT_MIN and dt.max() > 0.8 * DT_MAX
    assert abs(torch.log(dt).mean().item() - (math.log(DT_MIN) + math.log(DT_MAX)) / 2) < 0.1
    assert m.A_log._no_weight_decay and m.dt_bias._no_weight_decay


def test_gate_ranges_in_the_layer():
    """g ≤ 0 (α ∈ (0, 1]) and β ∈ (0, 1) for any input, including large ones."""
    m, cfg = make_mixer("gated_deltanet")
    x = 100 * torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    inp, _ = m.inputs(x)
    assert (inp["g"] <= 0).all() and ((inp["beta"] >= 0) & (inp["beta"] <= 1)).all()
    assert inp["g"].shape == inp["beta"].shape == (2, m.n_heads, 5)
    torch.testing.assert_close(inp["q"].norm(dim=-1), torch.full((2, m.n_heads, 5), m.dk ** -0.5,
                                                                dtype=torch.float64), atol=1e-6, rtol=0)


def test_bad_widths_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.gated_deltanet.expand_k"):
        GatedDeltaNet(tiny_cfg("gated_deltanet", gated_deltanet={"num_heads": 5}), 0)
    with pytest.raises(ValueError, match="model.gated_deltanet.expand_v"):
        GatedDeltaNet(tiny_cfg("gated_deltanet", gated_deltanet={"expand_v": 1.01}), 0)
    with pytest.raises(ValueError, match="model.gated_deltanet.num_heads"):
        GatedDeltaNet(tiny_cfg("gated_deltanet", gated_deltanet={"num_heads": 0}), 0)


def test_state_shapes():
    m, cfg = make_mixer("gated_deltanet")
    st = m.init_state(3, dtype=torch.bfloat16)
    H, dk, dv = head_dims(cfg)
    assert st.S.shape == (3, H, dk, dv) and st.S.dtype == torch.float32
    assert st.conv_q.shape == (3, H * dk, 3) and st.conv_v.shape == (3, H * dv, 3)


def test_flops_per_token():
    cfg = tiny_cfg("gated_deltanet")
    H, d, e = head_dims(cfg)
    assert GatedDeltaNet.flops_per_token(cfg, 1024) > 6 * H * d * e


def test_lm_decode_matches_forward():
    """A Gated DeltaNet LM: token-by-token decode logits equal the training forward's (float64)."""
    torch.manual_seed(0)
    cfg = tiny_cfg("gated_deltanet", n_layers=2, gated_deltanet={"chunk_size": 4})
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
    """kernel_backend="triton" where kernels.gated_delta_rule lists no Triton backend: a clear
    error naming it, not a silent fallback (only "auto" picks PyTorch)."""
    import kernels.gated_delta_rule as gdr
    monkeypatch.setattr(gdr, "BACKENDS", ("torch", "reference"))
    m, _ = make_mixer("gated_deltanet")
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match="triton"):
        m(torch.randn(1, 3, m.d_model, dtype=torch.float64))
