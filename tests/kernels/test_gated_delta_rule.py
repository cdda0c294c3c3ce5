"""The gated delta rule's PyTorch forms against its specification and against the recurrent form
of flash-linear-attention's ``naive_recurrent_gated_delta_rule`` (written out below in that
code's layout, [B, T, H, ·], with its query scale set to 1: our op applies no scale)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.delta_rule import delta_rule
from kernels.gated_delta_rule import (BACKENDS, gated_delta_rule, gated_delta_rule_chunk_torch,
                                      gated_delta_rule_reference)

D64 = torch.float64


def _inputs(B=2, H=2, T=7, dk=5, dv=3, dtype=D64, seed=0, with_state=False, g_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, dk, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, dv, generator=gen, dtype=dtype)
    g = -g_scale * torch.rand(B, H, T, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    S0 = torch.randn(B, H, dk, dv, generator=gen, dtype=dtype) if with_state else None
    return q, k, v, g, beta, S0


def fla_naive_recurrent(q, k, v, g, beta, initial_state=None):
    """flash-linear-attention's recurrent specification in its own layout: per token,
    h ← h·exp(g_t); δ = β_t (v_t − Σ_k h[k, :] k_t[k]); h ← h + k_t δᵀ; o_t = hᵀ q_t (scale 1).
    Takes [B, H, T, ·] inputs, runs in [B, T, H, ·] as that code does, returns [B, H, T, d_v]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    B, T, H, K = k.shape
    h = k.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        h = h * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - (h * k[:, t, :, :, None]).sum(-2))
        h = h + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((q[:, t, :, :, None] * h).sum(-2))
    return torch.stack(outs, 1).transpose(1, 2), h


def _fwd_bwd(fn, leaves, wo, wS):
    for t in leaves:
        if t is not None:
            t.grad = None
    o, S = fn(*leaves)
    ((o * wo).sum() + (S * wS).sum()).backward()
    return [o.detach(), S.detach()] + [t.grad.clone() for t in leaves if t is not None]


def _weights(shape_o, shape_S, dtype=D64, seed=9):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape_o, generator=gen, dtype=dtype), torch.randn(*shape_S, generator=gen, dtype=dtype)


NAMES = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial_state"]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("dtype,tol", [(D64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("T,with_state", [(1, False), (9, True), (33, True)])
def test_matches_fla_naive_recurrent_fwd_and_every_grad(backend, dtype, tol, T, with_state):
    """Output, final state and the gradients of q, k, v, g, β and the initial state equal the fla
    recurrent form: float64 within 1e-10, float32 within 2e-5 relative (to the largest entry of
    each tensor; both sides round in float32 along ≤ 33 steps of O(1) values)."""
    ins = _inputs(T=T, with_state=with_state, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in ins]
    wo, wS = _weights((2, 2, T, 3), (2, 2, 5, 3), dtype)
    ref = _fwd_bwd(fla_naive_recurrent, leaves, wo, wS)
    got = _fwd_bwd(lambda *a: gated_delta_rule(*a, output_final_state=True, backend=backend, chunk_size=4),
                   leaves, wo, wS)
    for name, a, b in zip(NAMES, ref, got):
        assert b.dtype == dtype, name
        scale = a.abs().max().clamp_min(1.0)
        torch.testing.assert_close(b / scale, a / scale, atol=tol, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (16, 4), (9, 16), (10, 1), (70, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_reference_fwd_and_grads(T, chunk, with_state):
    """float64: the chunked form and the reference differ by rounding only; 1e-10 on O(1) values.
    Lengths that are not a multiple of the chunk included."""
    ins = _inputs(T=T, with_state=with_state)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in ins]
    wo, wS = _weights((2, 2, T, 3), (2, 2, 5, 3))
    res = [_fwd_bwd(lambda *a: gated_delta_rule_reference(*a, output_final_state=True), leaves, wo, wS),
           _fwd_bwd(lambda *a: gated_delta_rule(*a, output_final_state=True, backend="torch", chunk_size=chunk),
                    leaves, wo, wS)]
    for name, a, b in zip(NAMES, res[0], res[1]):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")


def test_strong_decay_stays_finite_and_forgets():
    """g = −60 per token (α ≈ 1e-26): nothing overflows (every exponent of the chunked form is
    ≤ 0), gradients are finite, and the state forgets the initial state entirely."""
    q, k, v, g, beta, S0 = _inputs(T=12, with_state=True)
    g = torch.full_like(g, -60.0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, S0)]
    o, S = gated_delta_rule(*leaves, output_final_state=True, chunk_size=8)
    (o.sum() + S.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    o_ref, S_ref = gated_delta_rule_reference(q, k, v, g, beta, S0, True)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    # with α ≈ 0 each token sees only its own write: S_t = β_t k_t v_tᵀ
    last = beta[:, :, -1, None, None] * k[:, :, -1, :, None] * v[:, :, -1, None, :]
    torch.testing.assert_close(S, last, atol=1e-12, rtol=0)


def test_no_decay_is_the_delta_rule():
    """g = 0 (α = 1) gives exactly the ungated delta rule."""
    q, k, v, g, beta, S0 = _inputs(T=11, with_state=True)
    o, S = gated_delta_rule(q, k, v, torch.zeros_like(g), beta, S0, True, chunk_size=4)
    o_d, S_d = delta_rule(q, k, v, beta, S0, True, backend="reference")
    torch.testing.assert_close(o, o_d, atol=1e-12, rtol=0)
    torch.testing.assert_close(S, S_d, atol=1e-12, rtol=0)
    # and the decay changes the result (the test can fail)
    o_g, _ = gated_delta_rule(q, k, v, g, beta, S0, True, chunk_size=4)
    assert (o_g - o).abs().max() > 1e-2


def test_decay_only_scales_the_state():
    """β = 0: nothing is written, the state decays: S_T = exp(Σ g) S_0, o_t = exp(Σ_{s≤t} g_s) S_0ᵀ q_t."""
    q, k, v, g, beta, S0 = _inputs(T=9, with_state=True)
    o, S = gated_delta_rule(q, k, v, g, torch.zeros_like(beta), S0, True, chunk_size=4)
    cum = g.cumsum(-1)
    torch.testing.assert_close(S, cum[..., -1, None, None].exp() * S0, atol=1e-12, rtol=0)
    torch.testing.assert_close(o, cum.exp()[..., None] * torch.einsum("bhtk,bhkv->bhtv", q, S0), atol=1e-12, rtol=0)


@pytest.mark.parametrize("cut", [3, 4, 5])
def test_segments_with_state_equal_one_pass(cut):
    q, k, v, g, beta, _ = _inputs(T=11)
    o, S = gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=4)
    sl = lambda t, a, b: t[:, :, a:b]
    o1, S1 = gated_delta_rule(*(sl(t, 0, cut) for t in (q, k, v, g, beta)), None, True, chunk_size=4)
    o2, S2 = gated_delta_rule(*(sl(t, cut, None) for t in (q, k, v, g, beta)), S1, True, chunk_size=4)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o, atol=1e-12, rtol=0)
    torch.testing.assert_close(S2, S, atol=1e-12, rtol=0)


def test_bfloat16_inputs_accumulate_in_float32():
    """bf16 q, k, v (g, β in float32): the state is kept in float32; outputs rounded to bf16
    (relative error 2^-8 on O(1) outputs), so 5e-2 absolute."""
    q, k, v, g, beta, _ = _inputs(T=9)
    o_ref, _ = gated_delta_rule_reference(q, k, v, g, beta)
    o, S = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(), beta.float(),
                            output_final_state=True, chunk_size=4)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, atol=5e-2, rtol=0)


def test_empty_sequence_passes_the_state():
    q, k, v, g, beta, S0 = _inputs(T=0, with_state=True)
    for be in BACKENDS:
        o, S = gated_delta_rule(q, k, v, g, beta, S0, True, backend=be)
        assert o.shape == (2, 2, 0, 3)
        torch.testing.assert_close(S, S0)


def test_chunk_function_direct_call_matches():
    q, k, v, g, beta, S0 = _inputs(T=6, with_state=True)
    a = gated_delta_rule_chunk_torch(q, k, v, g, beta, S0, True, chunk_size=5)
    b = gated_delta_rule(q, k, v, g, beta, S0, True, backend="reference")
    torch.testing.assert_close(a[0], b[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_bad_input_is_refused_naming_the_argument(backend):
    q, k, v, g, beta, S0 = _inputs(T=5, with_state=True)
    bad = [
        (dict(g=g[..., :4]), r"g \(the log decay\) must be \[B, H, T\]"),
        (dict(g=(g < -0.5)), "g must be a floating-point"),
        (dict(g=-g + 0.1), "g is the log decay and must be <= 0"),
        (dict(g=g.masked_fill(g < -0.5, float("nan"))), "g is the log decay"),
        (dict(beta=beta + 1.0), r"beta must lie in \[0, 1\]"),
        (dict(beta=beta - 1.0), r"beta must lie in \[0, 1\]"),
        (dict(beta=beta[..., :4]), r"beta must be \[B, H, T\]"),
        (dict(beta=beta[..., None].expand(2, 2, 5, 3)), r"beta must be \[B, H, T\]"),
        (dict(k=k[..., :4]), "q and k must have the same shape"),
        (dict(v=v[:, :1]), "v must be"),
        (dict(initial_state=S0[..., :2]), "initial_state must be"),
        (dict(v=v.float()), "share one dtype"),
        (dict(beta=(beta > 0.5)), "floating-point"),
    ]
    base = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=S0)
    for change, msg in bad:
        args = {**base, **change}
        with pytest.raises(ValueError, match=msg):
            gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"], args["initial_state"],
                             backend=backend)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule(q, k, v, g, beta, backend=backend, chunk_size=0)
    with pytest.raises(ValueError, match="unknown backend 'cuda-magic'"):
        gated_delta_rule(q, k, v, g, beta, backend="cuda-magic")
