"""The Mamba-2 mixer: its three forms against each other, the layer written out from mamba_ssm's
``Mamba2`` module (forward and step, which cannot be imported here: mamba_ssm needs CUDA), its
parameter layout and init as mamba_ssm's, its config checks, state, FLOPs and LM decoding.

Tolerances: float64 throughout; forms that differ only in summation order (chunked against
sequential) agree to rounding, so 1e-9 absolute on O(1) values (``mixer_checks``); the written-out
mamba_ssm computation is held to 1e-10."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode, check_gradcheck,
                                      make_mixer, tiny_cfg)
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.mixers.mamba2 import Mamba2

BASE = {"d_state": 8, "headdim": 8, "ngroups": 2, "chunk_size": 4}
CASES = {
    "groups2": BASE,
    "groups1_D_per_channel": {**BASE, "ngroups": 1, "D_has_hdim": True},
    "no_norm_gate_in_op": {**BASE, "rmsnorm": False, "conv_bias": False},
    "norm_before_gate_bias": {**BASE, "norm_before_gate": True, "bias": True},
    "mlp_branch": {**BASE, "d_ssm": 32, "d_conv": 2},
    "dt_limit": {**BASE, "dt_limit": [0.02, 0.05], "chunk_size": 2},
}


def _mixer(kw, seed=0):
    return make_mixer("mamba2", seed=seed, mamba2=dict(kw))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("T", [1, 3, 4, 9, 17])
def test_chunked_matches_reference(name, T):
    """Chunks of 4 (2 for dt_limit): lengths below, at and past a chunk, and ragged tails."""
    m, _ = _mixer(CASES[name])
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("name", CASES)
def test_decode_and_segments(name):
    m, _ = _mixer(CASES[name])
    check_decode(m, 11)


@pytest.mark.parametrize("name", ["groups2", "mlp_branch"])
def test_causal(name):
    m, _ = _mixer(CASES[name])
    check_causal(m, 10)


def test_gradcheck():
    m, _ = _mixer(BASE)
    check_gradcheck(m, T=6)


# ---- mamba_ssm's Mamba2, written out from its operations -----------------------------------------

def _segsum(x):
    """mamba_ssm's ``ssd_minimal.segsum`` (the stable one)."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=-1), 0)
    x = torch.cumsum(x, dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=0), -torch.inf)


def _ssd_minimal_discrete(X, A, B, C, block_len, initial_states=None):
    """mamba_ssm's ``ssd_minimal_discrete`` (the paper's Listing 1): X [b, T, h, p], A [b, T, h]
    (the log decays Δ A), B, C [b, T, h, n]; T a multiple of ``block_len``."""
    b, T, h, p = X.shape
    c = T // block_len
    X, A, B, C = (t.reshape(b, c, block_len, *t.shape[2:]) for t in (X, A, B, C))
    A = A.permute(0, 3, 1, 2)                                        # b h c l
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segsum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    if initial_states is None:
        initial_states = torch.zeros_like(states[:, :1])
    states = torch.cat([initial_states, states], dim=1)
    decay_chunk = torch.exp(_segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, T, h, p), final_state


def _rms_norm_ref(x, weight, z, eps, group_size, norm_before_gate):
    """mamba_ssm's ``layernorm_gated.rms_norm_ref`` (no bias)."""
    if not norm_before_gate:
        x = x * F.silu(z)
    g = x.unflatten(-1, (-1, group_size))
    out = (g / torch.sqrt(g.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    return out * F.silu(z) if norm_before_gate else out


def _mamba_ssm_dims(sd, d_model, headdim, ngroups, d_state, D_has_hdim):
    nheads = sd["A_log"].shape[0]
    d_ssm = nheads * headdim
    d_in_proj = sd["in_proj.weight"].shape[0]
    d_mlp = (d_in_proj - 2 * d_ssm - 2 * ngroups * d_state - nheads) // 2
    return nheads, d_ssm, d_mlp


def _mamba_ssm_forward(sd, u, headdim, ngroups, d_state, d_conv, block_len, rmsnorm=True, norm_before_gate=False,
                       D_has_hdim=False, dt_limit=(0.0, math.inf)):
    """``Mamba2.forward``'s unfused path (use_mem_eff_path=False) with ``mamba_chunk_scan_combined``
    replaced by what it computes: Δ = softplus(dt + dt_bias) (clamped to dt_limit), the SSD of
    (x Δ, A Δ, B, C) by ``ssd_minimal_discrete``, + D x, ∘ SiLU(z) when there is no norm."""
    b, T, _ = u.shape
    nheads, d_ssm, d_mlp = _mamba_ssm_dims(sd, u.shape[-1], headdim, ngroups, d_state, D_has_hdim)
    zxbcdt = F.linear(u, sd["in_proj.weight"], sd.get("in_proj.bias"))
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, d_ssm, d_ssm + 2 * ngroups * d_state, nheads], dim=-1)
    conv_dim = xBC.shape[-1]
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), sd["conv1d.weight"], sd.get("conv1d.bias"), padding=d_conv - 1,
                          groups=conv_dim).transpose(1, 2)[:, :-(d_conv - 1)] if d_conv > 1 else
                 F.conv1d(xBC.transpose(1, 2), sd["conv1d.weight"], sd.get("conv1d.bias"),
                          groups=conv_dim).transpose(1, 2))
    x, B, C = torch.split(xBC, [d_ssm, ngroups * d_state, ngroups * d_state], dim=-1)
    A = -torch.exp(sd["A_log"])
    x = x.reshape(b, T, nheads, headdim)
    rep = nheads // ngroups
    B = B.reshape(b, T, ngroups, d_state).repeat_interleave(rep, 2)
    C = C.reshape(b, T, ngroups, d_state).repeat_interleave(rep, 2)
    delta = F.softplus(dt + sd["dt_bias"]).clamp(*dt_limit)
    y, _ = _ssd_minimal_discrete(x * delta[..., None], A * delta, B, C, block_len)
    D = sd["D"].reshape(nheads, headdim) if D_has_hdim else sd["D"][:, None]
    y = y + x * D
    if not rmsnorm:
        y = y * F.silu(z.reshape(b, T, nheads, headdim))
    y = y.reshape(b, T, d_ssm)
    if rmsnorm:
        y = _rms_norm_ref(y, sd["norm.weight"], z, 1e-5, d_ssm // ngroups, norm_before_gate)
    if d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return F.linear(y, sd["out_proj.weight"], sd.get("out_proj.bias"))


def _mamba_ssm_step(sd, u, conv_state, ssm_state, headdim, ngroups, d_state, rmsnorm=True, norm_before_gate=False,
                    D_has_hdim=False):
    """``Mamba2.step`` without causal_conv1d (the roll of conv_state [B, conv_dim, d_conv]) and with
    ``selective_state_update``'s math (heads reading their group's B and C)."""
    nheads, d_ssm, d_mlp = _mamba_ssm_dims(sd, u.shape[-1], headdim, ngroups, d_state, D_has_hdim)
    zxbcdt = F.linear(u.squeeze(1), sd["in_proj.weight"], sd.get("in_proj.bias"))
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, d_ssm, d_ssm + 2 * ngroups * d_state, nheads], dim=-1)
    conv_state = torch.roll(conv_state, shifts=-1, dims=-1)
    conv_state[:, :, -1] = xBC
    xBC = torch.sum(conv_state * sd["conv1d.weight"][:, 0, :], dim=-1)
    if "conv1d.bias" in sd:
        xBC = xBC + sd["conv1d.bias"]
    xBC = F.silu(xBC)
    x, B, C = torch.split(xBC, [d_ssm, ngroups * d_state, ngroups * d_state], dim=-1)
    A = -torch.exp(sd["A_log"])
    dt = F.softplus(dt + sd["dt_bias"])
    dA = torch.exp(dt * A)
    x = x.reshape(-1, nheads, headdim)
    rep = nheads // ngroups
    B = B.reshape(-1, ngroups, d_state).repeat_interleave(rep, 1)
    C = C.reshape(-1, ngroups, d_state).repeat_interleave(rep, 1)
    dBx = torch.einsum("bh,bhn,bhp->bhpn", dt, B, x)
    ssm_state = ssm_state * dA[:, :, None, None] + dBx
    y = torch.einsum("bhpn,bhn->bhp", ssm_state, C)
    D = sd["D"].reshape(nheads, headdim) if D_has_hdim else sd["D"][:, None]
    y = y + D * x
    if not rmsnorm:
        y = y * F.silu(z.reshape(-1, nheads, headdim))
    y = y.reshape(-1, d_ssm)
    if rmsnorm:
        y = _rms_norm_ref(y, sd["norm.weight"], z, 1e-5, d_ssm // ngroups, norm_before_gate)
    if d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return F.linear(y, sd["out_proj.weight"], sd.get("out_proj.bias")).unsqueeze(1), conv_state, ssm_state


OFFICIAL = ["groups2", "groups1_D_per_channel", "no_norm_gate_in_op", "norm_before_gate_bias", "mlp_branch",
            "dt_limit"]


@pytest.mark.parametrize("name", OFFICIAL)
def test_layer_is_mamba_ssm_computation(name):
    """The mixer's chunked and reference forms equal mamba_ssm's ``Mamba2.forward`` written out
    from its operations (12 tokens, its minimal SSD in blocks of 4), with the mixer's own tensors
    under their mamba_ssm names; then mamba_ssm's ``step`` from its zero caches, token by token,
    equals the mixer's ``step`` and the forward (and the caches equal the mixer's state after
    the same tokens). float64, 1e-10."""
    kw = CASES[name]
    m, cfg = _mixer(kw, seed=3)
    c = cfg.mamba2
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    torch.manual_seed(5)
    u = torch.randn(2, 12, cfg.d_model, dtype=torch.float64)
    opts = dict(rmsnorm=c.rmsnorm, norm_before_gate=c.norm_before_gate, D_has_hdim=c.D_has_hdim)
    want = _mamba_ssm_forward(sd, u, m.headdim, c.ngroups, c.d_state, c.d_conv, 4,
                              dt_limit=tuple(c.dt_limit), **opts)
    with torch.no_grad():
        got, st = m(u, output_state=True)
        ref, _ = m.reference(u)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(ref, want, atol=1e-10, rtol=0)
    if name == "dt_limit":       # mamba_ssm's step() does not clamp Δ (only its chunked kernels do)
        return
    conv = torch.zeros(2, m.conv_dim, c.d_conv, dtype=torch.float64)
    ssm = torch.zeros(2, m.nheads, m.headdim, c.d_state, dtype=torch.float64)
    mine = m.init_state(2, dtype=torch.float64)
    with torch.no_grad():
        for t in range(u.shape[1]):
            y_off, conv, ssm = _mamba_ssm_step(sd, u[:, t:t + 1], conv, ssm, m.headdim, c.ngroups, c.d_state, **opts)
            y_mine, mine = m.step(u[:, t:t + 1], mine)
            torch.testing.assert_close(y_mine, y_off, atol=1e-10, rtol=0)
            torch.testing.assert_close(y_off[:, 0], want[:, t], atol=1e-10, rtol=0)
    for s in (mine, st):
        torch.testing.assert_close(s.conv, conv, atol=1e-12, rtol=0)
        torch.testing.assert_close(s.ssm, ssm, atol=1e-10, rtol=0)


# ---- layout, init, config ---------------------------------------------------------------------

def test_parameters_are_mamba_ssm_checkpoint_layout():
    """The state_dict keys and shapes of mamba_ssm's ``Mamba2(d_model=64, d_state=16, headdim=16,
    ngroups=2)`` (d_inner 128, 8 heads, conv over 128 + 2·2·16 channels), and their variants with
    D per channel, no norm and biases: a checkpoint's tensors load one to one (strict)."""
    cfg = tiny_cfg("mamba2", d_model=64, mamba2={"d_state": 16, "headdim": 16, "ngroups": 2})
    m = Mamba2(cfg, 0)
    want = {"in_proj.weight": (2 * 128 + 2 * 2 * 16 + 8, 64), "conv1d.weight": (128 + 64, 1, 4),
            "conv1d.bias": (192,), "dt_bias": (8,), "A_log": (8,), "D": (8,), "norm.weight": (128,),
            "out_proj.weight": (64, 128)}
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == want
    checkpoint = {k: torch.randn(s) for k, s in want.items()}
    m.load_state_dict(checkpoint, strict=True)
    assert torch.equal(m.A_log, checkpoint["A_log"]) and torch.equal(m.conv1d.weight, checkpoint["conv1d.weight"])
    cfg2 = tiny_cfg("mamba2", d_model=64, mamba2={"d_state": 16, "headdim": 16, "ngroups": 2, "D_has_hdim": True,
                                                  "rmsnorm": False, "bias": True, "conv_bias": False})
    shapes = {k: tuple(v.shape) for k, v in Mamba2(cfg2, 0).state_dict().items()}
    assert shapes == {"in_proj.weight": (328, 64), "in_proj.bias": (328,), "conv1d.weight": (192, 1, 4),
                      "dt_bias": (8,), "A_log": (8,), "D": (128,), "out_proj.weight": (64, 128),
                      "out_proj.bias": (64,)}


def test_init_matches_mamba_ssm():
    """A = exp(A_log) in [1, 16], Δ₀ = softplus(dt_bias) in [1e-3, 1e-1] (log-uniform: about half
    of the heads below 1e-2), D = 1, the norm's gain 1, the conv within PyTorch's default bound
    1/√(fan_in) = 1/√d_conv; every decay parameter out of weight decay."""
    cfg = tiny_cfg("mamba2", d_model=256, mamba2={"d_state": 4, "headdim": 2, "ngroups": 1})
    m = Mamba2(cfg, 0)
    A = m.A_log.exp()
    assert m.nheads == 256 and A.min() >= 1 and A.max() <= 16 and A.max() > 12 and A.min() < 4
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-6) and dt.max() <= 0.1 * (1 + 1e-6)
    assert 0.3 < (dt < 1e-2).float().mean() < 0.7
    assert torch.equal(m.D, torch.ones_like(m.D)) and torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    bound = 1 / math.sqrt(cfg.mamba2.d_conv)
    assert m.conv1d.weight.abs().max() <= bound and m.conv1d.weight.abs().max() > 0.8 * bound
    assert all(getattr(p, "_no_weight_decay", False) for p in (m.A_log, m.dt_bias, m.D))
    cfg.mamba2.A_init_range, cfg.mamba2.dt_min, cfg.mamba2.dt_max = [2.0, 3.0], 0.01, 0.02
    m2 = Mamba2(cfg, 0)
    assert m2.A_log.exp().min() >= 2 and m2.A_log.exp().max() <= 3
    assert F.softplus(m2.dt_bias).min() >= 0.01 * (1 - 1e-6) and F.softplus(m2.dt_bias).max() <= 0.02 * (1 + 1e-6)


def test_headdim_default_is_mamba_ssms():
    """Unset, headdim is mamba_ssm's 64 (d_ssm when narrower)."""
    assert Mamba2(ModelConfig(d_model=768, n_layers=1, layer_pattern=["mamba2"]).validate(), 0).headdim == 64
    assert Mamba2(ModelConfig(d_model=16, n_layers=1, layer_pattern=["mamba2"]).validate(), 0).headdim == 32


@pytest.mark.parametrize("field,value,match", [
    ("headdim", 24, r"model\.mamba2\.headdim=24 must divide the SSM width d_ssm = 64"),
    ("ngroups", 3, r"model\.mamba2\.ngroups=3 must divide the number of heads d_ssm / headdim = 8"),
    ("chunk_size", 48, r"model\.mamba2\.chunk_size=48 must be a power of two"),
    ("chunk_size", 0, r"model\.mamba2\.chunk_size must be >= 1, got 0"),
    ("d_ssm", 96, r"model\.mamba2\.d_ssm=96 is more than d_inner"),
    ("A_init_range", [0.0, 16.0], r"model\.mamba2\.A_init_range=\[0\.0, 16\.0\] must be \[lo, hi\]"),
    ("dt_limit", [0.1, 0.05], r"model\.mamba2\.dt_limit=\[0\.1, 0\.05\] must be \[lo, hi\]"),
    ("dt_max", 1e-4, r"model\.mamba2\.dt_min=0\.001 must be <= model\.mamba2\.dt_max=0\.0001"),
    ("d_state", 0, r"model\.mamba2\.d_state must be >= 1, got 0"),
])
def test_bad_config_is_refused_naming_the_key(field, value, match):
    cfg = ModelConfig(d_model=32, n_layers=1, layer_pattern=["mamba2"])
    cfg.mamba2.headdim = 8
    setattr(cfg.mamba2, field, value)
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_bad_override_is_refused_naming_the_key():
    from ttt_lm.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"model\.mamba2\.headdimm"):
        load_config("configs/tiny_mamba2.yaml", ["model.mamba2.headdimm=8"])
    with pytest.raises((ConfigError, ValueError), match=r"model\.mamba2\.headdim"):
        load_config("configs/tiny_mamba2.yaml", ["model.mamba2.headdim=48"])


# ---- state, backends, FLOPs, TP plan, LM ------------------------------------------------------

def test_state_shapes_and_dtypes():
    """conv [B, conv_dim, d_conv] in the input dtype (mamba_ssm's conv_state), ssm [B, h, p, n] in
    the accumulation dtype; after a forward the conv cache holds the last d_conv conv inputs."""
    m, cfg = _mixer(BASE)
    st = m.init_state(3, dtype=torch.bfloat16)
    assert st.conv.shape == (3, 64 + 2 * 2 * 8, 4) and st.conv.dtype == torch.bfloat16
    assert st.ssm.shape == (3, 8, 8, 8) and st.ssm.dtype == torch.float32
    u = torch.randn(3, 6, cfg.d_model, dtype=torch.float64)
    _, st = m(u, output_state=True)
    xBC = m.in_proj(u)[..., 64:64 + m.conv_dim]                # [z | xBC | dt], z of d_inner = 64
    torch.testing.assert_close(st.conv, xBC[:, -4:].transpose(1, 2), atol=0, rtol=0)
    _, st2 = m(u[:, :2], output_state=True)                  # fewer tokens than the conv: zeros before
    torch.testing.assert_close(st2.conv[..., :2], torch.zeros_like(st2.conv[..., :2]), atol=0, rtol=0)
    assert st.pos == 6 and st2.pos == 2


def test_triton_is_refused_until_the_op_has_it():
    """kernel_backend=triton names the op's missing backend; auto runs PyTorch on CPU."""
    import kernels.ssd as ssd
    m, _ = _mixer(BASE)
    x = torch.randn(1, 5, m.d_model, dtype=torch.float64)
    if "triton" in ssd.BACKENDS:       # the op has it now: the layer takes it, nothing refused
        assert m.triton_unavailable() is None
        return
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match=r"kernels\.ssd has only \['torch', 'reference'\]"):
        m(x)
    m.kernel_backend = "auto"
    assert m.resolve_backend(x.device, x.dtype) == "torch"


def test_flops_per_token():
    """d_model 32: d_inner 64, 8 heads of 8, 2 groups of 8 states, chunks of 4: 2·2·4·8 for the
    groups' scores and 8·(2·4·8 + 4·8·8) for the heads."""
    _, cfg = _mixer(BASE)
    assert Mamba2.flops_per_token(cfg, 64) == 2 * 2 * 4 * 8 + 8 * (2 * 4 * 8 + 4 * 8 * 8)
    assert Mamba2.flops_per_token(cfg, 2) == 2 * 2 * 2 * 8 + 8 * (2 * 2 * 8 + 4 * 8 * 8)   # Q ≤ T


def test_tp_plan_splits_every_fused_part_and_refuses_the_mlp_branch():
    _, cfg = _mixer(BASE)
    plan = Mamba2.tp_plan(cfg)
    assert dict(plan.fused) == {"in_proj": (64, 64, 16, 16, 8), "conv1d": (64, 16, 16)}
    assert "ngroups" in plan.head_counts and "nheads" in plan.head_counts
    _, cfg2 = _mixer(CASES["mlp_branch"])
    assert Mamba2.tp_plan(cfg2) is None


def test_lm_decode_matches_forward():
    """A pure Mamba-2 model: token-by-token LM.step equals one forward pass, and the reference
    forms equal the chunked ones (float64)."""
    from ttt_lm.model.lm import LM
    cfg = tiny_cfg("mamba2", n_layers=2, mamba2=BASE)
    torch.manual_seed(0)
    lm = LM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        logits = lm(ids).logits
        st = lm.init_states(2, dtype=torch.float64)
        steps = []
        for t in range(ids.shape[1]):
            lt, st = lm.step(ids[:, t], st)
            steps.append(lt)
        ref = lm.set_impl("reference")(ids).logits
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(ref, logits, atol=1e-10, rtol=0)
