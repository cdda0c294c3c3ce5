"""``kernels.kda``: the chunked PyTorch form against the sequential reference, forward, final state
and every gradient; the gated delta rule as its channel-equal case; strong decays; packed batches.

Tolerances: float64 1e-10 absolute on O(1) values (the forms differ by the order of summation
only); float32 2e-4 (chunks of 64 with a triangular solve, about 1e-5 typical).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta_rule import gated_delta_rule
from kernels.kda import BACKENDS, kda, kda_chunk_torch, kda_reference
from kernels.kda.torch_chunk import decayed_scores

#: every backend; the Triton one runs under the interpreter on CPU, so it is in the slow tier
#: (its own comparisons: test_kda_triton.py)
ALL_BACKENDS = [pytest.param(b, marks=pytest.mark.slow) if b == "triton" else b for b in BACKENDS]


def inputs(B=2, H=2, T=50, dk=16, dv=8, dtype=torch.float64, g_min=-2.0, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = r(B, H, T, dk)
    k = F.normalize(r(B, H, T, dk), dim=-1)
    v = r(B, H, T, dv)
    g = torch.rand(B, H, T, dk, generator=gen, dtype=torch.float64) * g_min
    beta = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    h0 = r(B, H, dk, dv) if state else None
    out = [q, k, v, g, beta] + ([h0] if state else [])
    return [t.to(dtype).requires_grad_() for t in out] + ([] if state else [None])


def run(fn, args, w_o, w_s):
    for t in args:
        if t is not None:
            t.grad = None
    o, s = fn(*args)
    ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
    return o.detach(), s.detach(), [None if t is None else t.grad.clone() for t in args]


def compare(args, atol, chunk_size=64, ref_args=None, rtol=0.0):
    """torch form on ``args`` vs the reference on ``ref_args`` (default the same tensors)."""
    ref_args = args if ref_args is None else ref_args
    B, H, T, dv = args[2].shape
    dk = args[1].shape[-1]
    gen = torch.Generator().manual_seed(7)
    w_o = torch.randn(B, H, T, dv, generator=gen, dtype=torch.float64)
    w_s = torch.randn(B, H, dk, dv, generator=gen, dtype=torch.float64)
    o0, s0, g0 = run(lambda *a: kda_reference(*a, output_final_state=True), ref_args, w_o, w_s)
    o1, s1, g1 = run(lambda *a: kda_chunk_torch(*a, output_final_state=True, chunk_size=chunk_size), args, w_o, w_s)
    for name, a, b in [("o", o1, o0), ("final state", s1, s0)] + \
            [(f"grad of {n}", x, y) for n, x, y in zip(["q", "k", "v", "g", "beta", "h0"], g1, g0) if y is not None]:
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("T,chunk", [(50, 64), (50, 16), (100, 64), (77, 24), (5, 64), (64, 64)])
def test_torch_equals_reference_float64(T, chunk):
    """Chunks of 64 and 16 (blocks of 16 in P), 24 (not a multiple of 16: P per pair), a ragged
    tail, one short chunk, an exact multiple."""
    compare(inputs(T=T), 1e-10, chunk)


def test_torch_equals_reference_without_state():
    compare(inputs(T=70, state=False), 1e-10)


def test_torch_equals_reference_float32():
    args64 = inputs(T=90)
    args32 = [t.detach().float().requires_grad_() for t in args64]
    compare(args32, 2e-4, ref_args=args64)


def test_channel_equal_decay_is_the_gated_delta_rule():
    q, k, v, g, beta, h0 = inputs(T=60)
    g1 = g[..., :1].detach()                                   # one decay per token and head
    o, s = kda(q, k, v, g1.expand_as(g).contiguous(), beta, h0, True)
    # the gated rule's own chunked form (scalar decay, Γ = e^{γ_i − γ_j}), not KDA's reference
    o2, s2 = gated_delta_rule(q, k, v, g1[..., 0], beta, h0, True, backend="torch")
    torch.testing.assert_close(o, o2, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s2, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 2e-4, 0.0), (torch.bfloat16, 5e-2, 2e-2)])
def test_strong_decay_stays_finite_and_accurate(dtype, atol, rtol):
    """Log decays down to −20 per token (a chunk's cumulative decay near −1280, e^{+1280} in the
    naive factorization): outputs, state and gradients finite and equal to the float64 reference
    on the unrounded inputs (bfloat16: its inputs carry 2^−8 relative rounding, hence 2% relative)."""
    args64 = inputs(T=130, g_min=-20.0, seed=3)
    args = [t.detach().to(dtype).requires_grad_() for t in args64]
    compare(args, atol, ref_args=args64, rtol=rtol)


def test_decayed_scores_avoid_the_overflow_of_the_naive_factorization():
    """P(x)_ti = Σ_c x_tc k_ic e^{γ_tc − γ_ic}: the naive (X ∘ e^{γ})(K ∘ e^{−γ})ᵀ overflows under
    strong decay (float32), the blocked form does not and equals the per-pair definition."""
    gen = torch.Generator().manual_seed(0)
    C, d = 64, 8
    x, k = torch.randn(C, d, generator=gen), torch.randn(C, d, generator=gen)
    gam = (-torch.rand(C, d, generator=gen) * 20).cumsum(0)
    naive = (x * gam.exp()) @ (k * (-gam).exp()).T
    assert not torch.isfinite(naive).all()
    pair = (x[:, None, :] * k[None, :, :] * (gam[:, None, :] - gam[None, :, :]).double().exp()).sum(-1)
    pair = pair.tril()
    got = decayed_scores(x, k, gam)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), pair, atol=1e-5, rtol=1e-5)


def test_state_carries_across_calls():
    q, k, v, g, beta, h0 = (t.detach() for t in inputs(T=80))
    o, s = kda(q, k, v, g, beta, h0, True)
    o1, s1 = kda(*(t[:, :, :33] for t in (q, k, v, g, beta)), h0, True)
    o2, s2 = kda(*(t[:, :, 33:] for t in (q, k, v, g, beta)), s1, True)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o, atol=1e-10, rtol=0)
    torch.testing.assert_close(s2, s, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_packed_sequences(backend):
    """cu_seqlens: each sequence as alone, with its own initial and final state; without states
    the torch form's one call with resets (documents crossing chunk boundaries) does the same."""
    lens = [30, 1, 70, 19]
    cu = torch.tensor([0, 30, 31, 101, 120])
    q, k, v, g, beta, _ = (t.detach() for t in inputs(B=1, T=120, seed=5))
    h0 = torch.randn(4, 2, 16, 8, dtype=torch.float64)
    o, s = kda(q, k, v, g, beta, h0, True, backend, chunk_size=16, cu_seqlens=cu)
    o_free, s_free = kda(q, k, v, g, beta, None, False, backend, chunk_size=16, cu_seqlens=cu)
    assert s_free is None
    for n, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        part = [t[:, :, a:b] for t in (q, k, v, g, beta)]
        on, sn = kda_reference(*part, h0[n:n + 1], True)
        torch.testing.assert_close(o[:, :, a:b], on, atol=1e-10, rtol=0)
        torch.testing.assert_close(s[n:n + 1], sn, atol=1e-10, rtol=0)
        torch.testing.assert_close(o_free[:, :, a:b], kda_reference(*part)[0], atol=1e-10, rtol=0)
    assert sum(lens) == 120


def test_refuses_bad_input():
    q, k, v, g, beta, h0 = (t.detach() for t in inputs(T=10))
    with pytest.raises(ValueError, match=r"g \(the per-channel log decay\) must be \[B, H, T, d_k\]"):
        kda(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="g is the log decay and must be <= 0"):
        kda(q, k, v, g.abs() + 0.1, beta)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        kda(q, k, v, g, beta + 1.5)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        kda(q, k, v, g, beta, backend="cuda")
    q1, k1, v1, g1, b1, _ = (t.detach() for t in inputs(B=1, T=10))
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to T = 10"):
        kda(q1, k1, v1, g1, b1, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        kda(q, k, v, g, beta, chunk_size=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_gated_delta_rule_takes_a_per_channel_decay(backend):
    """``gated_delta_rule`` with g [B, H, T, d_k] runs KDA's recurrence on the same backend."""
    q, k, v, g, beta, h0 = (t.detach() for t in inputs(T=40))
    o, s = gated_delta_rule(q, k, v, g, beta, h0, True, backend=backend)
    o2, s2 = kda_reference(q, k, v, g, beta, h0, True)
    torch.testing.assert_close(o, o2, atol=1e-10, rtol=0)
    torch.testing.assert_close(s, s2, atol=1e-10, rtol=0)
