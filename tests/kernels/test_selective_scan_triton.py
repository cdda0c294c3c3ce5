"""The Triton selective scan (kernels/selective_scan/chunk.py) against the sequential reference.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
which executes every program in numpy: shapes stay tiny (Bt ≤ 2, T ≤ 37, Di ≤ 20, N ≤ 16). The
interpreter uses BLOCK_D = 8, so Di = 12 and 20 cover partial and several channel blocks (whose
∂B, ∂C partial sums must add up); N = 3 and 5 are padded to 4 and 8 states; chunk sizes of 4 and 8
give several tiles per sequence and lengths that are not a multiple of the tile.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.selective_scan import selective_scan
from kernels.selective_scan.chunk import selective_scan_triton, tile_sizes
from kernels.selective_scan.reference import selective_scan_ref

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

NAMES = ("x", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def _inputs(Bt, T, Di, N, dtype, seed=0, h0=True, gate=True, rows=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    # A = −(0.5 … 4.5) and Δ = softplus(N(0,1) + N(0,1)): decays per step from ≈ 0 to ≈ 1
    t = dict(x=r(Bt, T, Di), delta=r(Bt, T, Di), A=-torch.rand(Di, N, generator=g, dtype=torch.float64) * 4 - 0.5,
             B=r(Bt, T, N), C=r(Bt, T, N), D=r(Di), z=r(Bt, T, Di) if gate else None, delta_bias=r(Di),
             initial_state=r(rows or Bt, Di, N) if h0 else None)
    w, wf = r(Bt, T, Di), r(rows or Bt, Di, N)
    a = {k: None if v is None else v.to(device=device, dtype=dtype).requires_grad_() for k, v in t.items()}
    return a, w.to(device=device, dtype=dtype), wf.to(device)


def _run(fn, a, w, wf, **kw):
    """Output, final state and the gradient of every input of a loss that reaches both outputs."""
    out, hT = fn(**a, delta_softplus=True, output_final_state=True, **kw)
    leaves = [a[k] for k in NAMES if a[k] is not None]
    grads = torch.autograd.grad((out * w).float().sum() + (hT * wf.to(hT.dtype)).sum(), leaves)
    names = ["out", "final_state"] + [k for k in NAMES if a[k] is not None]
    return dict(zip(names, [out.detach(), hT.detach(), *grads]))


def _compare(got, want, atol, rtol):
    assert got.keys() == want.keys()
    for n in want:
        x, y = got[n], want[n]
        assert x.dtype == y.dtype and x.shape == y.shape, n
        torch.testing.assert_close(x.double(), y.double(), atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


# (Bt, T, Di, N, chunk_size, with_h0, with_gate)
SHAPES = [
    (1, 1, 5, 4, 4, True, True),        # one token
    (2, 11, 12, 4, 4, True, True),      # T not a multiple of the tile; two channel blocks, one partial
    (2, 16, 16, 16, 8, False, False),   # exact multiples, Mamba's N = 16, no gate, no initial state
    (1, 23, 20, 3, 4, True, True),      # N padded (3 → 4), three channel blocks
    (2, 13, 8, 5, 16, False, True),     # one tile longer than the sequence; N 5 → 8
]


@pytest.mark.parametrize("Bt,T,Di,N,cs,with_h0,gate", SHAPES)
def test_fp32_matches_reference(Bt, T, Di, N, cs, with_h0, gate):
    """float32: both forms accumulate in float32 but associate differently (a tree scan per tile
    against one step at a time; per-block partial sums for ∂B, ∂C), so they differ by a few ulps
    of values up to ≈ 20 (observed ≤ 2e-6): 2e-5 absolute + 1e-5 relative."""
    a, w, wf = _inputs(Bt, T, Di, N, torch.float32, h0=with_h0, gate=gate)
    want = _run(selective_scan_ref, a, w, wf)
    got = _run(selective_scan_triton, a, w, wf, chunk_size=cs)
    _compare(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("Bt,T,Di,N,cs,with_h0,gate", [SHAPES[1], SHAPES[3]])
def test_bf16_matches_reference(Bt, T, Di, N, cs, with_h0, gate):
    """bfloat16 inputs: both forms read the same rounded inputs and accumulate in float32, so the
    float32 final state agrees as in float32; the output and the input gradients are rounded to
    bfloat16 (8-bit mantissa) from float32 values that differ in their last bits, so a rounding
    may land one bf16 ulp apart, at most 2^-7 of the value (observed: 0.0625 on ∂x ≈ 10):
    1e-2 absolute + 8e-3 relative."""
    a, w, wf = _inputs(Bt, T, Di, N, torch.bfloat16, h0=with_h0, gate=gate)
    want = _run(selective_scan_ref, a, w, wf)
    got = _run(selective_scan_triton, a, w, wf, chunk_size=cs)
    assert got["out"].dtype == torch.bfloat16 and got["final_state"].dtype == torch.float32
    torch.testing.assert_close(got["final_state"], want["final_state"], atol=2e-5, rtol=1e-5)
    _compare(got, want, atol=1e-2, rtol=8e-3)


def test_float64_exact_and_state_passing():
    """float64 accumulates in float64: agreement to rounding (1e-12); two calls chained by the
    final state equal one call, and the inference path (no gradients, no stored states) too."""
    a, w, wf = _inputs(2, 19, 12, 4, torch.float64)
    want = _run(selective_scan_ref, a, w, wf)
    _compare(_run(selective_scan_triton, a, w, wf, chunk_size=4), want, atol=1e-12, rtol=0)
    with torch.no_grad():
        cut = lambda sl: {k: (v[:, sl] if v is not None and v.dim() == 3 and k != "initial_state" else v)
                          for k, v in a.items()}
        o1, s1 = selective_scan_triton(**cut(slice(0, 7)), delta_softplus=True, output_final_state=True, chunk_size=4)
        rest = cut(slice(7, None))
        rest["initial_state"] = s1
        o2, s2 = selective_scan_triton(**rest, delta_softplus=True, output_final_state=True, chunk_size=4)
    torch.testing.assert_close(torch.cat([o1, o2], 1), want["out"], atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, want["final_state"], atol=1e-12, rtol=0)


@pytest.mark.parametrize("lens,with_h0", [((5, 13, 9), True), ((11, 0, 6), True), ((3, 17, 8), False)])
def test_varlen_matches_reference(lens, with_h0):
    """Packed sequences (Bt = 1) with cu_seqlens in one launch: the state restarts at every
    sequence start, from initial_state[s]; an empty sequence hands its initial state through as
    its final state. Against the reference run sequence by sequence; float32 tolerance as above."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    a, w, wf = _inputs(1, sum(lens), 12, 4, torch.float32, h0=with_h0, rows=len(lens))
    want = _run(selective_scan, a, w, wf, backend="reference", cu_seqlens=cu)
    got = _run(selective_scan, a, w, wf, backend="triton", chunk_size=4, cu_seqlens=cu)
    assert want["final_state"].shape == (len(lens), 12, 4)
    _compare(got, want, atol=2e-5, rtol=1e-5)
    # the reset is real: sequence 2 alone equals its slice of the packed output
    s0, s1 = int(cu[2]), int(cu[3])
    alone, _ = selective_scan_ref(a["x"][:, s0:s1], a["delta"][:, s0:s1], a["A"], a["B"][:, s0:s1],
                                  a["C"][:, s0:s1], a["D"], a["z"][:, s0:s1], a["delta_bias"], True,
                                  None if a["initial_state"] is None else a["initial_state"][2:3])
    torch.testing.assert_close(got["out"][:, s0:s1], alone.detach(), atol=1e-5, rtol=1e-5)
    # the PyTorch backend accepts the same packing
    _compare(_run(selective_scan, a, w, wf, backend="torch", chunk_size=4, cu_seqlens=cu), want,
             atol=2e-5, rtol=1e-5)


def test_strong_decay_stays_finite():
    """Δ·A ≈ −300 per step: Ā = e^-300 ≈ 0, so y_t = Δ x_t (B_t·C_t) + D x_t and no gradient
    overflows (products of decays, never ratios). float32 with Δ ≈ 100: 1e-3 absolute."""
    a, _, _ = _inputs(1, 12, 8, 4, torch.float32, h0=False, gate=False)
    with torch.no_grad():
        a["delta_bias"].fill_(100.0)
        a["A"].fill_(-3.0)
    out, _ = selective_scan_triton(**a, delta_softplus=True, chunk_size=4)
    out.sum().backward()
    assert torch.isfinite(a["A"].grad).all() and torch.isfinite(a["delta"].grad).all()
    with torch.no_grad():
        Delta = F.softplus(a["delta"] + a["delta_bias"])
        y = Delta * a["x"] * (a["B"] * a["C"]).sum(-1, keepdim=True) + a["D"] * a["x"]
    torch.testing.assert_close(out, y, atol=1e-3, rtol=1e-5)


def test_mamba_mixer_triton_equals_torch():
    """The Mamba mixer with kernel_backend="triton" (the kernel, under the interpreter here)
    against "torch": output, carried state and every gradient, float64, so 1e-9 absolute."""
    from tests.model.mixer_checks import backend_results, make_mixer

    m, _ = make_mixer("mamba", d_model=8, n_heads=2, mamba={"chunk_size": 4, "d_state": 4})
    torch.manual_seed(1)
    x = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    res = backend_results(m, x, torch.randn(2, 9, 8, dtype=torch.float64), "ssm")
    names = ["y", "state ssm", "x"] + [n for n, _ in m.named_parameters()]
    for n, got, want in zip(names, res[1], res[0]):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9, msg=lambda s: f"{n}: {s}")


def test_tile_sizes_and_bad_arguments():
    assert tile_sizes(8, 16)[0] == 8 and tile_sizes(64, 16)[0] == 16 and tile_sizes(1, 16)[0] == 4
    assert tile_sizes(8, 5)[2] == 8
    a, _, _ = _inputs(2, 4, 3, 2, torch.float32)
    with pytest.raises(ValueError, match="Bt = 1"):
        selective_scan(**a, backend="triton", cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        b, _, _ = _inputs(1, 4, 3, 2, torch.float32)
        selective_scan(**b, backend="triton", cu_seqlens=torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="A \\[Di, N\\]"):
        selective_scan_triton(a["x"], a["delta"], a["A"][:, :1], a["B"], a["C"])
    with pytest.raises(ValueError, match="backend"):
        selective_scan(**a, backend="cuda")
    c, _, _ = _inputs(1, 4, 3, 2, torch.float32, h0=False)
    with pytest.raises(ValueError, match="rise from 0 to T = 4"):
        selective_scan(**c, backend="torch", cu_seqlens=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="1-D"):
        selective_scan(**c, backend="triton", cu_seqlens=torch.tensor([[0, 4]]))


# ---- on a GPU: compiled kernels at Mamba's shapes -----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 2e-3, 1e-3), (torch.bfloat16, 0.5, 2e-2)])
@pytest.mark.parametrize("Bt,T,Di,N,cs", [(2, 1000, 300, 16, 8), (1, 2051, 1536, 16, 16), (3, 77, 64, 8, 4)])
def test_gpu_matches_reference(Bt, T, Di, N, cs, dtype, atol, rtol):
    """Tolerances as on CPU, widened for sums over hundreds of tokens and channels (∂A, ∂B, ∂C)
    and the GPU's fast exp."""
    a, w, wf = _inputs(Bt, T, Di, N, dtype, device="cuda")
    want = _run(selective_scan_ref, a, w, wf)
    got = _run(selective_scan_triton, a, w, wf, chunk_size=cs)
    _compare(got, want, atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_gpu_varlen_matches_reference():
    lens = (300, 1, 1250, 0, 517)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    a, w, wf = _inputs(1, sum(lens), 256, 16, torch.float32, rows=len(lens), device="cuda")
    want = _run(selective_scan, a, w, wf, backend="reference", cu_seqlens=cu)
    got = _run(selective_scan, a, w, wf, backend="triton", chunk_size=16, cu_seqlens=cu)
    _compare(got, want, atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_mamba_mixer_triton_equals_torch():
    from tests.model.mixer_checks import backend_results, make_mixer

    m, _ = make_mixer("mamba", dtype=torch.float32, d_model=256, n_heads=4)
    m = m.cuda()
    x = torch.randn(2, 500, 256, device="cuda", requires_grad=True)
    res = backend_results(m, x, torch.randn(2, 500, 256, device="cuda"), "ssm")
    # every tensor is checked before failing, so one run names all that are off and by how much
    names = ["y", "state ssm", "x"] + [n for n, _ in m.named_parameters()]
    off = []
    for n, got, want in zip(names, res[1], res[0]):
        err, bound = (got - want).abs(), 1e-3 + 1e-3 * want.abs()
        if (err > bound).any():
            off.append(f"{n}: {int((err > bound).sum())} of {err.numel()} off, largest error {err.max().item():.3g} "
                       f"(|want| up to {want.abs().max().item():.3g})")
    assert not off, "; ".join(off)
