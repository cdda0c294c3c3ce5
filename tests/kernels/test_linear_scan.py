import pytest
import torch

from kernels.linear_scan import linear_scan


def _inputs(B, T, D, dtype=torch.float64, seed=0, h0=True):
    g = torch.Generator().manual_seed(seed)
    # log-gates spread over strong (≈ −3) to weak (≈ −0.01) decay, as RG-LRU and Mamba produce
    log_a = -torch.rand(B, T, D, generator=g, dtype=torch.float64).mul(3).add(0.01)
    b = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    s = torch.randn(B, D, generator=g, dtype=torch.float64) if h0 else None
    cast = lambda t: None if t is None else t.to(dtype).requires_grad_()
    return cast(log_a), cast(b), cast(s)


def test_reference_matches_hand_computation():
    log_a = torch.log(torch.tensor([[[0.5], [0.25], [1.0]]], dtype=torch.float64))
    b = torch.tensor([[[1.0], [2.0], [3.0]]], dtype=torch.float64)
    h, hT = linear_scan(log_a, b, torch.tensor([[4.0]], dtype=torch.float64), True, backend="reference")
    # h0 = .5·4 + 1 = 3; h1 = .25·3 + 2 = 2.75; h2 = 2.75 + 3 = 5.75
    torch.testing.assert_close(h[0, :, 0], torch.tensor([3.0, 2.75, 5.75], dtype=torch.float64))
    torch.testing.assert_close(hT, torch.tensor([[5.75]], dtype=torch.float64))


@pytest.mark.parametrize("T", [1, 7, 16, 21])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_matches_reference_fwd_bwd(T, with_h0):
    """float64: the two forms differ by rounding only, so 1e-10 absolute on O(1) values."""
    log_a, b, h0 = _inputs(2, T, 5, h0=with_h0)
    w = torch.randn(2, T, 5, dtype=torch.float64)
    wf = torch.randn(2, 5, dtype=torch.float64)
    res = []
    for backend in ("reference", "torch"):
        h, hT = linear_scan(log_a, b, h0, True, backend=backend, chunk_size=4)
        leaves = [log_a, b] + ([h0] if with_h0 else [])
        grads = torch.autograd.grad((h * w).sum() + (hT * wf).sum(), leaves)
        res.append((h, hT, grads))
    (h_r, s_r, g_r), (h_c, s_c, g_c) = res
    torch.testing.assert_close(h_c, h_r, atol=1e-10, rtol=0)
    torch.testing.assert_close(s_c, s_r, atol=1e-10, rtol=0)
    for a, r in zip(g_c, g_r):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_close_to_float64(dtype, atol):
    """Both forms accumulate in float32; inputs rounded to `dtype` and (bf16) an output rounded to
    8 bits of mantissa bound the error: ≈1e-6 relative for float32, ≈2^-8 for bfloat16, on
    states of size O(1)–O(3)."""
    log_a, b, h0 = _inputs(2, 13, 6)
    ref, _ = linear_scan(log_a.detach(), b.detach(), h0.detach(), backend="reference")
    for backend in ("reference", "torch"):
        h, hT = linear_scan(log_a.detach().to(dtype), b.detach().to(dtype), h0.detach().to(dtype), True,
                            backend=backend, chunk_size=4)
        assert h.dtype == dtype and hT.dtype == torch.float32
        torch.testing.assert_close(h.double(), ref, atol=atol * 3, rtol=atol)


def test_state_passing_equals_one_pass():
    log_a, b, _ = _inputs(1, 19, 3, h0=False)
    with torch.no_grad():
        full, fT = linear_scan(log_a, b, None, True, chunk_size=4)
        h1, s1 = linear_scan(log_a[:, :6], b[:, :6], None, True, chunk_size=4)
        h2, s2 = linear_scan(log_a[:, 6:], b[:, 6:], s1, True, chunk_size=4)
    torch.testing.assert_close(torch.cat([h1, h2], 1), full, atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, fT, atol=1e-12, rtol=0)


def test_strong_decay_stays_finite():
    """log-gates of −200 per step: a naive exp(−cumsum) form overflows; the masked form may not."""
    log_a = torch.full((1, 20, 2), -200.0)
    b = torch.randn(1, 20, 2)
    log_a.requires_grad_()
    h, _ = linear_scan(log_a, b, chunk_size=8)
    torch.testing.assert_close(h, b, atol=1e-30, rtol=0)   # a_t = e^-200 ≈ 0: h_t = b_t
    h.sum().backward()
    assert torch.isfinite(log_a.grad).all()


def test_gradcheck_chunk():
    log_a, b, h0 = _inputs(1, 6, 2)
    assert torch.autograd.gradcheck(
        lambda la, bb, s: linear_scan(la, bb, s, True, chunk_size=4), (log_a, b, h0), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_bad_inputs_are_refused_with_the_reason(backend):
    """Every backend checks shapes, dtypes and the chunk size at entry and names the problem."""
    la, b, s = (t.detach() for t in _inputs(2, 5, 3))
    cases = [
        ((la[:, :4], b, s), {}, r"log_a and b must both be \[B, T, D\]"),
        ((la, b, s[:, :2]), {}, "initial_state must be"),
        ((la, b.long(), s), {}, "floating-point"),
        ((la, b, s), {"chunk_size": 0}, "chunk_size"),
        ((la[:1], b[:1], None), {"cu_seqlens": torch.tensor([[0, 5]])}, "cu_seqlens must be"),
        ((la, b, None), {"cu_seqlens": torch.tensor([0, 5])}, "B = 1"),
    ]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            linear_scan(*args, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_resets_restart_the_recurrence(backend):
    """linear_scan_reset = the recurrence with a_t replaced by 0 where reset (one step per
    token), the carried state dropped by a reset at a row's first token; float64, so the chunked
    form matches the steps to rounding (1e-12)."""
    from kernels.linear_scan import linear_scan_reset
    log_a, b, h0 = _inputs(2, 9, 3)
    log_a, b, h0 = log_a.detach(), b.detach(), h0.detach()
    reset = torch.zeros(2, 9, dtype=torch.bool)
    reset[0, 0] = reset[0, 4] = reset[1, 7] = True
    h, hT = linear_scan_reset(log_a, b, h0, reset, True, backend, 4)
    want, prev = [], h0
    for t in range(9):
        a = torch.where(reset[:, t, None], torch.zeros_like(prev), log_a[:, t].exp())
        prev = a * prev + b[:, t]
        want.append(prev)
    want = torch.stack(want, 1)
    torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hT, want[:, -1], rtol=1e-12, atol=1e-12)
