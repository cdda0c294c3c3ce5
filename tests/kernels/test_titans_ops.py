import pytest
import torch
import torch.nn.functional as F

from kernels.titans import chunk_spans, titans_linear, titans_linear_reference

D64 = torch.float64


def _inputs(B=2, H=2, T=7, dk=4, dv=3, dtype=D64, seed=0, with_state=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=dtype)
    theta = 0.5 * torch.rand(B, H, T, generator=g, dtype=dtype)
    log_eta = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=dtype) + 2)
    log_keep = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=dtype) + 3)
    state = None
    if with_state:
        state = tuple(0.3 * torch.randn(B, H, dk, dv, generator=g, dtype=dtype) for _ in range(3))
    return [q, k, v, theta, log_eta, log_keep], state


@pytest.mark.parametrize("T,chunk,offset", [(1, 4, 0), (7, 4, 0), (16, 4, 0), (9, 16, 0), (10, 1, 0),
                                            (10, 4, 3), (5, 4, 2)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_reference_fwd_and_grads(T, chunk, offset, with_state):
    """Forward, final (M, S, M̂) and the gradient of every input (q, k, v, θ, log η, log(1−α),
    M₀, S₀, M̂₀); float64, so differences are rounding: 1e-10 on O(1) values."""
    ins, state = _inputs(T=T, with_state=with_state)
    ins = [t.requires_grad_(True) for t in ins]
    state = None if state is None else tuple(t.requires_grad_(True) for t in state)
    leaves = ins + (list(state) if state is not None else [])
    g = torch.Generator().manual_seed(9)
    wo = torch.randn(2, 2, T, 3, generator=g, dtype=D64)
    ws = [torch.randn(2, 2, 4, 3, generator=g, dtype=D64) for _ in range(3)]
    res = []
    for backend in ("reference", "torch"):
        for t in leaves:
            t.grad = None
        o, fin = titans_linear(*ins, initial_state=state, output_final_state=True, backend=backend,
                               chunk_size=chunk, offset=offset)
        loss = (o * wo).sum() + sum((s * w).sum() for s, w in zip(fin, ws))
        loss.backward()
        res.append([o.detach(), *[s.detach() for s in fin]]
                   + [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in leaves])
    for i, (a, b) in enumerate(zip(res[0], res[1])):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s: f"item {i}: {s}")


@pytest.mark.parametrize("cuts", [(3,), (5, 6), (1, 2, 9)])
def test_segments_with_state_and_offset_equal_one_pass(cuts):
    """Chunks are counted from the start of the sequence; a segment that starts inside a chunk
    takes that chunk's gradients at the carried anchor M̂."""
    C, T = 4, 13
    ins, _ = _inputs(T=T)
    o, fin = titans_linear(*ins, output_final_state=True, chunk_size=C)
    bounds = [0, *cuts, T]
    outs, st = [], None
    for a, b in zip(bounds[:-1], bounds[1:]):
        oi, st = titans_linear(*[t[:, :, a:b] for t in ins], initial_state=st, output_final_state=True,
                               chunk_size=C, offset=a)
        outs.append(oi)
    torch.testing.assert_close(torch.cat(outs, 2), o, atol=1e-12, rtol=0)
    for x, y in zip(st, fin):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


def test_one_chunk_takes_every_gradient_at_its_start():
    """No momentum (η = 0) and no forgetting (α = 0): within one chunk
    M_T = M₀ − Σ_t θ_t · 2 k_tᵀ(k_t M₀ − v_t), every gradient at M₀ — unlike chunk size 1."""
    ins, state = _inputs(T=5, with_state=True)
    q, k, v, theta, log_eta, log_keep = ins
    log_eta = torch.full_like(log_eta, -float("inf"))
    log_keep = torch.zeros_like(log_keep)
    M0 = state[0]
    expect = M0 - 2 * torch.einsum("bht,bhtk,bhtv->bhkv", theta, k, k @ M0 - v)
    for backend in ("reference", "torch"):
        _, (M, _, _) = titans_linear(q, k, v, theta, log_eta, log_keep, (M0, torch.zeros_like(M0)), True,
                                     backend=backend, chunk_size=8)
        torch.testing.assert_close(M, expect, atol=1e-12, rtol=0)
    _, (M1, _, _) = titans_linear(q, k, v, theta, log_eta, log_keep, (M0, torch.zeros_like(M0)), True, chunk_size=1)
    assert (M1 - expect).abs().max() > 1e-3


def test_strong_decay_is_stable_in_log_space():
    """log η = −60 per token makes ā underflow over a chunk of 16; the ratios ā_i/ā_j are formed
    as exp of differences, so outputs and gradients stay finite and equal the reference."""
    ins, state = _inputs(T=16, with_state=True)
    ins[4] = torch.full_like(ins[4], -60.0)
    ins = [t.requires_grad_(True) for t in ins]
    o, _ = titans_linear(*ins, initial_state=state, chunk_size=16)
    o.sum().backward()
    assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in ins)
    o_ref, _ = titans_linear_reference(*[t.detach() for t in ins], initial_state=state, chunk_size=16)
    torch.testing.assert_close(o.detach(), o_ref, atol=1e-10, rtol=0)


def test_float32_close_to_float64_reference():
    """float32 chunked form vs float64 reference on O(1) values: sums of ≤ 16 terms, 1e-4."""
    ins, state = _inputs(T=13, with_state=True)
    o64, _ = titans_linear_reference(*ins, initial_state=state, chunk_size=4, offset=1)
    o32, fin = titans_linear(*[t.float() for t in ins], initial_state=tuple(s.float() for s in state),
                             output_final_state=True, chunk_size=4, offset=1)
    assert o32.dtype == torch.float32 and fin[0].dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, atol=1e-4, rtol=0)


def test_chunk_spans():
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(10, 4, offset=3) == [(0, 1), (1, 5), (5, 9), (9, 10)]
    assert chunk_spans(2, 4, offset=1) == [(0, 2)]
    assert chunk_spans(0, 4) == []


def test_unknown_backend_is_refused():
    ins, _ = _inputs(T=2)
    with pytest.raises(ValueError, match="backend"):
        titans_linear(*ins, backend="nope")


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_bad_shapes_are_refused_with_the_reason(backend):
    """Every backend checks the op's inputs at entry and names what is wrong (before, a
    [B, H, T, 1] gate broadcast silently and a wrong state shape failed deep inside)."""
    ins, st = _inputs(T=6, with_state=True)
    q, k, v, th, le, lk = ins
    cases = [
        ((q, k, v, th[..., None], le, lk), st, {}, r"theta must be \[B, H, T\]"),
        ((q, k, v, th, le[:, :1], lk), st, {}, r"log_eta must be \[B, H, T\]"),
        ((q, k[..., :3], v, th, le, lk), st, {}, "q and k must have the same shape"),
        ((q, k, v[:, :, :5], th, le, lk), st, {}, "v must be"),
        ((q[0], k[0], v, th, le, lk), st, {}, r"must be \[B, H, T, d\]"),
        ((q, k, v, th, le, lk), (st[0][..., :2], st[1]), {}, "initial M must be"),
        ((q, k, v, th, le, lk), st[0], {}, "tuple"),
        ((q, k, v, th.long(), le, lk), st, {}, "floating-point"),
        ((q, k, v, th, le, lk), st, {"chunk_size": 0}, "chunk_size"),
        ((q, k, v, th, le, lk), st, {"offset": -1}, "offset"),
    ]
    for args, state, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            titans_linear(*args, state, backend=backend, **kw)
