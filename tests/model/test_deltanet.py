import pytest
import torch

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers.deltanet import DeltaNet, dpfp

CASES = [
    {"deltanet": {"chunk_size": 4}},                                           # identity φ, conv
    {"deltanet": {"feature_map": "dpfp", "dpfp_nu": 2, "chunk_size": 3}},
    {"deltanet": {"conv_width": 0, "chunk_size": 64}},                         # one chunk, no conv
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("T", [1, 7, 9])
def test_chunked_matches_reference(kw, T):
    m, _ = make_mixer("deltanet", **kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kw", CASES)
def test_decode_and_segments(kw):
    m, _ = make_mixer("deltanet", **kw)
    check_decode(m, 11)


@pytest.mark.parametrize("kw", CASES)
def test_causal(kw):
    m, _ = make_mixer("deltanet", **kw)
    check_causal(m, 12)


@pytest.mark.parametrize("kw", CASES[:2])
def test_gradcheck(kw):
    m, _ = make_mixer("deltanet", d_model=16, **kw)
    check_gradcheck(m)


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_features(nu):
    """φ(x) has 2·d·ν non-negative entries; entry 2d(i−1)+j is r_j · r_{(j+i) mod 2d} with
    r = ReLU([x, −x]), divided by their sum, so the features sum to one (float64 rounding:
    1e-12) — at any input scale, small inputs included (an absolute ε of 1e-6 made inputs of
    size 1e-4 sum to ~1e-2), and φ(c x) = φ(x)."""
    d = 5
    torch.manual_seed(0)
    x = torch.randn(3, 4, d, dtype=torch.float64)
    phi = dpfp(x, nu)
    assert phi.shape == (3, 4, 2 * d * nu)
    assert (phi >= 0).all()
    r = torch.relu(torch.cat([x, -x], -1))
    raw = torch.empty(3, 4, 2 * d * nu, dtype=torch.float64)
    for i in range(1, nu + 1):
        for j in range(2 * d):
            raw[..., 2 * d * (i - 1) + j] = r[..., j] * r[..., (j + i) % (2 * d)]
    big = raw.sum(-1) > 1e-6 * r.square().amax(-1)
    assert big.all()   # random inputs never hit the floor
    torch.testing.assert_close(phi, raw / raw.sum(-1, keepdim=True), atol=1e-12, rtol=0)
    for scale in (1e-4, 1e-8, 1e4):
        phi_s = dpfp(scale * x, nu)
        torch.testing.assert_close(phi_s.sum(-1), torch.ones(3, 4, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(phi_s, phi, atol=1e-12, rtol=1e-10)
    small = dpfp(1e-4 * x.float(), nu)   # float32: x² ≈ 1e-8, still summing to one
    torch.testing.assert_close(small.sum(-1), torch.ones(3, 4), atol=1e-5, rtol=0)


def test_dpfp_nu1_can_be_all_zero_without_nan():
    """ν = 1 multiplies neighbours of [x, −x]; signs alternating over an odd d make every product
    zero. The floor keeps the features at 0 instead of 0/0, for x = 0 too, gradients included."""
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0], dtype=torch.float64, requires_grad=True)
    phi = dpfp(x, 1)
    assert torch.isfinite(phi).all() and phi.abs().max() == 0
    phi.sum().backward()
    assert torch.isfinite(x.grad).all()
    z = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    phi0 = dpfp(z, 2)
    phi0.sum().backward()
    assert phi0.abs().max() == 0 and torch.isfinite(z.grad).all()


def test_dpfp_state_shape_and_invalid_nu():
    m, cfg = make_mixer("deltanet", deltanet={"feature_map": "dpfp", "dpfp_nu": 2})
    st = m.init_state(2, dtype=torch.float64)
    assert st.S.shape == (2, cfg.n_heads, 2 * cfg.hd * 2, cfg.hd)
    with pytest.raises(ValueError, match="dpfp_nu"):
        DeltaNet(tiny_cfg("deltanet", deltanet={"feature_map": "dpfp", "dpfp_nu": 2 * cfg.hd}), 0)
    with pytest.raises(ValueError, match="feature_map"):
        DeltaNet(tiny_cfg("deltanet", deltanet={"feature_map": "elu"}), 0)


def test_flops_per_token():
    cfg = tiny_cfg("deltanet")
    f = DeltaNet.flops_per_token(cfg, 1024)
    assert f > 6 * cfg.n_heads * cfg.hd ** 2
    cfg.deltanet.feature_map, cfg.deltanet.dpfp_nu = "dpfp", 2
    assert DeltaNet.flops_per_token(cfg, 1024) > f


def test_lm_decode_matches_forward():
    """A DeltaNet LM: token-by-token decode logits equal the training forward's (float64)."""
    torch.manual_seed(0)
    cfg = tiny_cfg("deltanet", n_layers=2, deltanet={"chunk_size": 4})
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


def test_triton_backend_is_refused_until_a_kernel_exists(monkeypatch):
    """kernel_backend="triton" names an implementation kernels.delta_rule lacks (here: without
    triton installed): a clear error, not a silent fallback (only "auto" falls back to PyTorch)."""
    import kernels.delta_rule as dr
    monkeypatch.setattr(dr, "BACKENDS", ("torch", "reference"))
    m, _ = make_mixer("deltanet")
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match="triton"):
        m(torch.randn(1, 3, m.d_model, dtype=torch.float64))
