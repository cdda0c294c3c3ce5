"""``kernels.ssd`` (Mamba-2's SSD): the chunked PyTorch form against the sequential reference and
against mamba_ssm's minimal SSD (``ssd_minimal_discrete``, transcribed below from its math), forward,
final state and every gradient; strong decays; packed batches; refused input.

Errors are relative: max |got − want| / max |want| per tensor. Tolerances: float64 1e-10 (the forms
differ in the order of summation only; about 1e-15 is typical); float32 2e-5 against the float64
reference on the same (float32-rounded) inputs (chunks of up to 64 summed in float32; about 1e-6
typical); bfloat16 inputs 2e-2 (the output is rounded to bfloat16, 2^−8 relative).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.ssd import BACKENDS, ssd, ssd_chunk_torch, ssd_reference
from kernels.ssd.torch_chunk import segsum

NAMES = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0"]


def inputs(b=2, T=50, h=4, p=8, g=2, n=6, dtype=torch.float64, seed=0, state=True, D="h", z=True, bias=True,
           dA=None):
    """Leaves named as in ``NAMES`` (None where absent). dt is a raw step fed through softplus with
    dt_bias (as Mamba-2 does) unless ``dA`` is given: then Δ = dt itself near 1 and A = dA, a log
    decay of about dA per token."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x, B, C = r(b, T, h, p), r(b, T, g, n), r(b, T, g, n)
    if dA is None:
        dt = r(b, T, h) - 1.0
        A = -torch.rand(h, generator=gen, dtype=torch.float64) * 3 - 0.1
    else:
        dt = 0.5 + torch.rand(b, T, h, generator=gen, dtype=torch.float64)
        A = torch.full((h,), float(dA), dtype=torch.float64)
    Dp = {None: None, "h": r(h), "hp": r(h, p)}[D]
    zz = r(b, T, h, p) if z else None
    db = r(h) * 0.5 if bias else None
    h0 = r(b, h, p, n) if state else None
    out = [x, dt, A, B, C, Dp, zz, db, h0]
    return [None if t is None else t.to(dtype).requires_grad_() for t in out]


def call(fn, args, softplus, **kw):
    x, dt, A, B, C, D, z, db, h0 = args
    return fn(x, dt, A, B, C, D=D, z=z, dt_bias=db, dt_softplus=softplus, initial_state=h0,
              output_final_state=True, **kw)


def run(fn, args, softplus=True, seed=7, **kw):
    """Forward and every gradient of a fixed random projection of (y, final state)."""
    for t in args:
        if t is not None:
            t.grad = None
    y, s = call(fn, args, softplus, **kw)
    gen = torch.Generator().manual_seed(seed)
    w_y = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    w_s = torch.randn(s.shape, generator=gen, dtype=torch.float64)
    ((y.double() * w_y).sum() + (s.double() * w_s).sum()).backward()
    return [y.detach(), s.detach()], [None if t is None else t.grad.clone() for t in args]


def rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-300)).item()


def assert_rel(got, want, tol, what):
    assert torch.isfinite(got).all(), f"{what}: not finite"
    e = rel(got, want)
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol}"


def compare(outs, grads, ref_outs, ref_grads, tol):
    for name, a, b_ in zip(["y", "final state"], outs, ref_outs):
        assert_rel(a, b_, tol, name)
    for name, a, b_ in zip(NAMES, grads, ref_grads):
        if b_ is not None:
            assert_rel(a, b_, tol, f"grad of {name}")


def detached(args, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in args]


# ---- the chunked form against the sequential reference ----------------------------------------------

@pytest.mark.parametrize("T,chunk,g,state,D", [
    (50, 16, 2, True, "h"),      # ragged tail, 2 groups (heads 0-1 read group 0, 2-3 group 1)
    (50, 16, 1, False, "hp"),    # 1 group, no initial state, D per channel
    (64, 16, 1, True, None),     # an exact multiple
    (77, 32, 4, True, "h"),      # one group per head
    (5, 256, 2, True, "h"),      # one short chunk
])
def test_torch_equals_reference_float64(T, chunk, g, state, D):
    args = inputs(T=T, g=g, state=state, D=D)
    ref = run(ssd_reference, args)
    got = run(ssd_chunk_torch, args, chunk_size=chunk)
    compare(*got, *ref, 1e-10)


@pytest.mark.parametrize("piece", [1, 3 * 4 * 16 * 16])
def test_chunks_in_pieces(monkeypatch, piece):
    """The chunks' own tokens computed one chunk at a time, or 3 chunks at a time with a short last
    piece (T = 150 in chunks of 16: 10 chunks), packed or not: the same forward and gradients."""
    import kernels.ssd.torch_chunk as tc

    monkeypatch.setattr(tc, "PIECE", piece)
    args = inputs(b=1, T=150, seed=12)
    compare(*run(ssd_chunk_torch, args, chunk_size=16), *run(ssd_reference, args), 1e-10)
    cu = torch.tensor([0, 20, 21, 90, 150])
    h0 = torch.randn(4, 4, 8, 6, dtype=torch.float64, requires_grad=True)
    args = args[:8] + [h0]
    compare(*run(ssd_chunk_torch, args, chunk_size=16, cu_seqlens=cu),
            *run(ssd_reference, args, cu_seqlens=cu), 1e-10)


def test_without_softplus_bias_or_gate():
    """Δ = dt as given (dt ≥ 0 here), no dt_bias, no z: the bare recurrence."""
    args = inputs(T=40, z=False, bias=False, dA=-0.7)
    compare(*run(ssd_chunk_torch, args, softplus=False, chunk_size=8),
            *run(ssd_reference, args, softplus=False), 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_equals_the_float64_reference(backend):
    args64 = inputs(T=150, seed=1)
    args32 = detached(args64, torch.float32)
    ref = run(ssd_reference, detached([None if t is None else t.float().double() for t in args64]))
    fn = ssd_chunk_torch if backend == "torch" else ssd_reference
    kw = {"chunk_size": 64} if backend == "torch" else {}
    compare(*run(fn, args32, **kw), *ref, 2e-5)


def test_bfloat16_inputs():
    """bfloat16 x, B, C, z (float32 dt, A, D, dt_bias, state): y in bfloat16, the final state in
    float32 (the accumulation dtype), both near the float64 result on the same values."""
    args64 = inputs(T=70, seed=2)
    args16 = [None if t is None else t.detach().to(torch.bfloat16 if i in (0, 3, 4, 6) else torch.float32)
              for i, t in enumerate(args64)]
    y, s = call(ssd_chunk_torch, args16, True, chunk_size=32)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    y0, s0 = call(ssd_reference, [None if t is None else t.double() for t in args16], True)
    assert_rel(y, y0, 2e-2, "y")
    assert_rel(s, s0, 2e-5, "final state")


def test_result_does_not_depend_on_the_chunk_size():
    args = [None if t is None else t.detach() for t in inputs(T=100, seed=4)]
    y0, s0 = call(ssd_chunk_torch, args, True, chunk_size=256)
    for chunk in (1, 2, 8, 64):
        y, s = call(ssd_chunk_torch, args, True, chunk_size=chunk)
        assert_rel(y, y0, 1e-12, f"y, chunk {chunk}")
        assert_rel(s, s0, 1e-12, f"final state, chunk {chunk}")


def test_state_carries_across_calls():
    x, dt, A, B, C, D, z, db, h0 = (None if t is None else t.detach() for t in inputs(T=90, seed=5))
    y, s = ssd(x, dt, A, B, C, D, z, db, True, h0, True, chunk_size=16)
    cut = 37
    y1, s1 = ssd(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], D, z[:, :cut], db, True, h0, True, chunk_size=16)
    y2, s2 = ssd(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], D, z[:, cut:], db, True, s1, True, chunk_size=16)
    assert_rel(torch.cat([y1, y2], 1), y, 1e-12, "y")
    assert_rel(s2, s, 1e-12, "final state")


def test_empty_sequence():
    x, dt, A, B, C, D, z, db, h0 = (None if t is None else t.detach() for t in inputs(T=0))
    for backend in BACKENDS:
        y, s = ssd(x, dt, A, B, C, D, z, db, True, h0, True, backend=backend)
        assert y.shape == (2, 0, 4, 8) and torch.equal(s, h0)


# ---- mamba_ssm's minimal SSD --------------------------------------------------------------------------

def minimal_segsum(x):
    """mamba_ssm's stable segsum: x [..., T] → [..., T, T]."""
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)
    x = x.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), 0).cumsum(-2)
    return x.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(0), float("-inf"))


def ssd_minimal_discrete(X, A, B, C, block_len, initial_states=None):
    """The math of mamba_ssm's ``ssd_minimal_discrete`` (mamba_ssm/modules/ssd_minimal.py, Listing 1
    of the paper), written with plain reshapes: X [b, T, h, p] (already Δ ∘ x), A [b, T, h] (already
    Δ A), B, C [b, T, h, n] (per head), T a multiple of ``block_len``; initial_states [b, 1, h, p, n].
    Returns (Y [b, T, h, p], final state [b, h, p, n])."""
    b, T, h, p = X.shape
    c, l = T // block_len, block_len
    X, B, C = (t.reshape(b, c, l, h, -1) for t in (X, B, C))
    A = A.reshape(b, c, l, h).permute(0, 3, 1, 2)                          # b h c l
    A_cumsum = A.cumsum(-1)
    Lm = minimal_segsum(A).exp()
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, Lm, X)
    decay_states = (A_cumsum[..., -1:] - A_cumsum).exp()
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    if initial_states is None:
        initial_states = torch.zeros_like(states[:, :1])
    states = torch.cat([initial_states, states], 1)
    decay_chunk = minimal_segsum(F.pad(A_cumsum[..., -1], (1, 0))).exp()
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, A_cumsum.exp())
    return (Y_diag + Y_off).reshape(b, T, h, p), final_state


def minimal_as_ssd(block_len):
    """``ssd_minimal_discrete`` behind ``ssd``'s signature, as mamba_ssm's tests call it: x·Δ, A·Δ,
    B and C repeated to the heads; D and z applied after it."""
    def fn(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, initial_state=None,
           output_final_state=True):
        delta = dt + dt_bias if dt_bias is not None else dt
        delta = F.softplus(delta) if dt_softplus else delta
        rep = x.shape[2] // B.shape[2]
        y, s = ssd_minimal_discrete(x * delta[..., None], A * delta, B.repeat_interleave(rep, 2),
                                    C.repeat_interleave(rep, 2), block_len,
                                    None if initial_state is None else initial_state[:, None])
        if D is not None:
            y = y + x * (D[:, None] if D.dim() == 1 else D)
        if z is not None:
            y = y * F.silu(z)
        return y, s
    return fn


@pytest.mark.parametrize("g,state", [(1, True), (2, False), (2, True)])
def test_torch_equals_mamba_minimal_float64(g, state):
    """T = 60: minimal in blocks of 20, ours in chunks of 16 (a ragged tail of 12)."""
    args = inputs(T=60, g=g, state=state, seed=8)
    compare(*run(ssd_chunk_torch, args, chunk_size=16), *run(minimal_as_ssd(20), args), 1e-10)


def test_torch_equals_mamba_minimal_float32():
    args64 = inputs(T=128, seed=9)
    args32 = detached(args64, torch.float32)
    ref = run(minimal_as_ssd(32), detached([None if t is None else t.float().double() for t in args64]))
    compare(*run(ssd_chunk_torch, args32, chunk_size=64), *ref, 2e-5)


# ---- strong decay -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_strong_decay_stays_finite_and_accurate(dtype, tol):
    """Δ A of about −70 per token (a chunk of 256 sums to about −18000, e^{+18000} in the naive
    factorization): outputs, state and every gradient finite and equal to the float64 reference."""
    args64 = inputs(T=300, seed=10, dA=-70.0, bias=False)
    ref = run(ssd_reference, detached([None if t is None else t.to(dtype).double() for t in args64]),
              softplus=False)
    got = run(ssd_chunk_torch, detached(args64, dtype), softplus=False, chunk_size=256)
    compare(*got, *ref, tol)


def test_segsum_avoids_the_overflow_of_the_naive_factorization():
    """e^{γ_l} e^{−γ_s} overflows under −70 per token (float32), e^{σ(l, s)} does not, and σ equals
    the definition (the sum of the log decays between s and l)."""
    a = -70.0 * (0.5 + torch.rand(64, generator=torch.Generator().manual_seed(0)))
    gam = a.cumsum(0)
    naive = gam.exp()[:, None] * (-gam).exp()[None, :]
    assert not torch.isfinite(naive).all()
    sig = segsum(a)
    want = torch.full((64, 64), float("-inf"), dtype=torch.float64)
    for l_ in range(64):
        for s in range(l_ + 1):
            want[l_, s] = a[s + 1:l_ + 1].double().sum()
    assert torch.equal(torch.isinf(sig), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(sig[fin].double(), want[fin], rtol=1e-6, atol=1e-4)
    assert torch.isfinite(sig.exp()).all() and (sig.exp() <= 1).all()


# ---- packed sequences ---------------------------------------------------------------------------------

CU = [0, 13, 13, 14, 60, 81]        # an empty sequence, one of one token, sequences across chunk edges


def _per_sequence(args, with_state):
    """Each sequence alone (reference backend), stacked: y [1, T, h, p], final [N, h, p, n]."""
    x, dt, A, B, C, D, z, db, h0 = args
    ys, ss = [], []
    for k, (a, e) in enumerate(zip(CU, CU[1:])):
        y, s = ssd_reference(x[:, a:e], dt[:, a:e], A, B[:, a:e], C[:, a:e], D, z[:, a:e], db, True,
                             h0[k:k + 1] if with_state else None, True)
        ys.append(y)
        ss.append(s)
    return torch.cat(ys, 1), torch.cat(ss, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_state", [True, False])
def test_packed_sequences_equal_per_sequence_calls(backend, with_state):
    """cu_seqlens: one call, the state restarting at every sequence start (from its own initial
    state or zero), one final state per sequence; forward and gradients equal the calls one
    sequence at a time. Chunks of 8 and 16: starts and ends inside chunks, on a chunk's first and
    last token, several sequences in one chunk."""
    N, T = len(CU) - 1, CU[-1]
    x, dt, A, B, C, D, z, db, _ = inputs(b=1, T=T, seed=11)
    h0 = torch.randn(N, 4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    args = [x, dt, A, B, C, D, z, db, h0 if with_state else None]
    cu = torch.tensor(CU, dtype=torch.int32)
    ref = run(lambda *a, **k: _per_sequence([*a[:5], k["D"], k["z"], k["dt_bias"], h0], with_state),
              args)
    for chunk in ((8, 16) if backend == "torch" else (None,)):
        fn = ssd_chunk_torch if backend == "torch" else ssd_reference
        kw = {"cu_seqlens": cu} | ({"chunk_size": chunk} if chunk else {})
        got = run(fn, args, **kw)
        compare(*got, *ref, 1e-10)
        if not with_state:
            assert torch.equal(got[0][1][1], torch.zeros(4, 8, 6, dtype=torch.float64))   # the empty one
    if with_state:
        y, s = ssd(*(t.detach() for t in args[:5]), D.detach(), z.detach(), db.detach(), True, h0.detach(), True,
                   backend=backend, chunk_size=16, cu_seqlens=cu)
        assert torch.equal(s[1], h0[1].detach())             # an empty sequence keeps its initial state


# ---- refused input ------------------------------------------------------------------------------------

def test_refuses_bad_input():
    x, dt, A, B, C, D, z, db, h0 = (None if t is None else t.detach() for t in inputs(T=10))
    dt = dt.abs()                                   # a valid step without the softplus
    with pytest.raises(ValueError, match=r"h = 4 must be divisible by the number of groups g = 3"):
        ssd(x, dt, A, B[:, :, :1].expand(2, 10, 3, 6), C[:, :, :1].expand(2, 10, 3, 6))
    with pytest.raises(ValueError, match=r"A must be <= 0"):
        ssd(x, dt, A.abs(), B, C)
    with pytest.raises(ValueError, match=r"dt must be \[b, T, h\] = \(2, 10, 4\)"):
        ssd(x, dt[..., :2], A, B, C)
    with pytest.raises(ValueError, match=r"chunk_size must be a power of two .* got 48"):
        ssd(x, dt, A, B, C, chunk_size=48)
    with pytest.raises(ValueError, match=r"chunk_size must be a power of two .* got 0"):
        ssd(x, dt, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ssd(x, dt, A, B, C, backend="cuda")
    with pytest.raises(ValueError, match=r"the step dt must be >= 0"):
        ssd(x, dt - 5.0, A, B, C)
    with pytest.raises(ValueError, match=r"A must be \[h\] = \(4,\)"):
        ssd(x, dt, A[:2], B, C)
    with pytest.raises(ValueError, match=r"C must have B's shape"):
        ssd(x, dt, A, B, C[..., :3])
    with pytest.raises(ValueError, match=r"D must be \[h\] = \(4,\) or \[h, p\] = \(4, 8\)"):
        ssd(x, dt, A, B, C, D=D[:3])
    with pytest.raises(ValueError, match=r"z must have x's shape"):
        ssd(x, dt, A, B, C, z=z[..., :3])
    with pytest.raises(ValueError, match=r"initial_state must be \[b, h, p, n\] = \(2, 4, 8, 6\)"):
        ssd(x, dt, A, B, C, initial_state=h0[:, :, :, :2])
    with pytest.raises(ValueError, match=r"x, B, C \(and z\) must share one dtype"):
        ssd(x, dt, A, B.float(), C)
    with pytest.raises(ValueError, match=r"cu_seqlens needs a packed batch of b = 1"):
        ssd(x, dt, A, B, C, cu_seqlens=torch.tensor([0, 10]))
    x1, dt1, B1, C1 = x[:1], dt[:1], B[:1], C[:1]
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to T = 10"):
            ssd(x1, dt1, A, B1, C1, cu_seqlens=torch.tensor([0, 6, 4, 10]), backend=backend)
    with pytest.raises(ValueError, match=r"initial_state must be \[N sequences, h, p, n\] = \(3, 4, 8, 6\)"):
        ssd(x1, dt1, A, B1, C1, initial_state=h0[:1], cu_seqlens=torch.tensor([0, 3, 6, 10]))
    with pytest.raises(ValueError, match=r"dt and dt_bias must not be NaN"):
        ssd(x, dt * float("nan"), A, B, C, dt_bias=db, dt_softplus=True)
    # softplus makes any dt a valid step; only the sign of A and NaN are checked then
    y, _ = ssd(x, dt - 5.0, A, B, C, dt_bias=db, dt_softplus=True)
    assert torch.isfinite(y).all()
