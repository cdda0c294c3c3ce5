"""The Triton linear scan (kernels/linear_scan/chunk.py) against the sequential reference.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
which executes every program in numpy and is slow: shapes stay tiny (B ≤ 2, T ≤ 37, D ≤ 32).
The interpreter uses BLOCK_D = 16, so D = 20 and 32 cover a partial and several channel blocks;
small chunk sizes give several tiles per row and tile starts that fall inside sequences.
"""
import pytest
import torch

from kernels import _triton_utils as tu
from kernels.linear_scan import linear_scan
from kernels.linear_scan.chunk import linear_scan_triton
from kernels.linear_scan.reference import linear_scan_ref

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, T, D, dtype, seed=0, h0=True, device="cpu", rows=None):
    g = torch.Generator().manual_seed(seed)
    # log-gates from strong (≈ −3) to weak (≈ −0.01) decay, as RG-LRU and Mamba produce
    log_a = -torch.rand(B, T, D, generator=g, dtype=torch.float64).mul(3).add(0.01)
    b = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    s = torch.randn(rows or B, D, generator=g, dtype=torch.float64) if h0 else None
    w = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    wf = torch.randn(rows or B, D, generator=g, dtype=torch.float64)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype).requires_grad_()
    return cast(log_a), cast(b), cast(s), w.to(device=device, dtype=dtype), wf.to(device)


def _run(fn, log_a, b, h0, w, wf):
    h, hT = fn(log_a, b, h0)
    leaves = [log_a, b] + ([h0] if h0 is not None else [])
    # the loss reaches every output, the final state included, with random weights
    grads = torch.autograd.grad((h * w).float().sum() + (hT * wf.to(hT.dtype)).sum(), leaves)
    return [h.detach(), hT.detach()] + list(grads)


def _compare(got, want, atol, rtol, names=("h", "final_state", "d_log_a", "d_b", "d_initial_state")):
    assert len(got) == len(want)
    for n, x, y in zip(names, got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, n
        torch.testing.assert_close(x.double(), y.double(), atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


# (B, T, D, chunk_size, with_h0, num_segments)
SHAPES = [
    (1, 1, 5, 4, True, None),      # one token
    (2, 21, 20, 8, True, None),    # T, D not multiples of the tile / channel block; batch > 1
    (2, 16, 16, 8, False, None),   # exact multiples, no initial state
    (1, 37, 12, 4, True, 3),       # split along time: 10 tiles in 3 segments (4, 4, 2)
    (2, 29, 8, 4, False, 2),       # split, no initial state
]


@pytest.mark.parametrize("B,T,D,cs,with_h0,nseg", SHAPES)
def test_fp32_matches_reference(B, T, D, cs, with_h0, nseg):
    """float32: both accumulate in float32 but associate differently (a tree scan per tile vs one
    step at a time), so they differ by a few ulps of the O(1–10) states and gradients: 1e-5."""
    log_a, b, h0, w, wf = _inputs(B, T, D, torch.float32, h0=with_h0)
    want = _run(lambda la, bb, s: linear_scan_ref(la, bb, s, True), log_a, b, h0, w, wf)
    got = _run(lambda la, bb, s: linear_scan_triton(la, bb, s, True, cs, num_segments=nseg),
               log_a, b, h0, w, wf)
    _compare(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,T,D,cs,with_h0,nseg", [SHAPES[1], SHAPES[3]])
def test_bf16_matches_reference(B, T, D, cs, with_h0, nseg):
    """bfloat16 inputs: both forms read the same rounded inputs and accumulate in float32, so the
    float32 final state agrees to 1e-5; h and the gradients are rounded to bfloat16 (8-bit
    mantissa) from float32 values that differ in their last bits, so a rounding may land one
    bf16 ulp apart: 2^-8 relative on values up to ≈ 10, i.e. 4e-2 absolute + 1e-2 relative."""
    log_a, b, h0, w, wf = _inputs(B, T, D, torch.bfloat16, h0=with_h0)
    want = _run(lambda la, bb, s: linear_scan_ref(la, bb, s, True), log_a, b, h0, w, wf)
    got = _run(lambda la, bb, s: linear_scan_triton(la, bb, s, True, cs, num_segments=nseg),
               log_a, b, h0, w, wf)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    _compare(got, want, atol=4e-2, rtol=1e-2)


@pytest.mark.parametrize("lens,with_h0", [((5, 13, 9), True), ((11, 0, 6), True), ((3, 17, 8), False)])
def test_varlen_matches_reference(lens, with_h0):
    """Packed sequences (B = 1) with cu_seqlens: the state restarts at every sequence start, from
    initial_state[n]; an empty sequence hands its initial state through as its final state.
    float32 tolerance as in test_fp32_matches_reference."""
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    T, D = sum(lens), 20
    log_a, b, h0, w, wf = _inputs(1, T, D, torch.float32, h0=with_h0, rows=len(lens))
    want = _run(lambda la, bb, s: linear_scan_ref(la, bb, s, True, cu_seqlens=cu), log_a, b, h0, w, wf)
    got = _run(lambda la, bb, s: linear_scan(la, bb, s, True, backend="triton", chunk_size=4, cu_seqlens=cu),
               log_a, b, h0, w, wf)
    assert want[1].shape == (len(lens), D)
    _compare(got, want, atol=1e-5, rtol=1e-5)
    # the reset is real: sequence 2 alone equals its slice of the packed result
    s0, s1 = int(cu[2]), int(cu[3])
    alone, _ = linear_scan_ref(log_a[:, s0:s1], b[:, s0:s1], None if h0 is None else h0[2:3])
    torch.testing.assert_close(got[0][:, s0:s1], alone.detach(), atol=1e-5, rtol=1e-5)
    # the PyTorch backend accepts the same packing
    tor = _run(lambda la, bb, s: linear_scan(la, bb, s, True, backend="torch", chunk_size=4, cu_seqlens=cu),
               log_a, b, h0, w, wf)
    _compare(tor, want, atol=1e-5, rtol=1e-5)


def test_float64_is_exact_and_state_passing():
    """float64 inputs accumulate in float64: agreement to rounding (1e-12); two calls chained by
    the final state equal one call."""
    log_a, b, h0, w, wf = _inputs(2, 19, 6, torch.float64)
    want = _run(lambda la, bb, s: linear_scan_ref(la, bb, s, True), log_a, b, h0, w, wf)
    got = _run(lambda la, bb, s: linear_scan_triton(la, bb, s, True, 4), log_a, b, h0, w, wf)
    _compare(got, want, atol=1e-12, rtol=0)
    with torch.no_grad():   # the inference path stores no tile states
        h1, s1 = linear_scan_triton(log_a[:, :7], b[:, :7], h0, True, 4)
        h2, s2 = linear_scan_triton(log_a[:, 7:], b[:, 7:], s1, True, 4)
    torch.testing.assert_close(torch.cat([h1, h2], 1), want[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, want[1], atol=1e-12, rtol=0)


def test_strong_decay_stays_finite():
    """log-gates of −200 per step: a_t = e^-200 ≈ 0, so h_t = b_t and no gradient overflows."""
    log_a = torch.full((1, 12, 3), -200.0, requires_grad=True)
    b = torch.randn(1, 12, 3)
    h, hT = linear_scan_triton(log_a, b, None, True, 4)
    torch.testing.assert_close(h, b, atol=1e-30, rtol=0)
    h.sum().backward()
    assert torch.isfinite(log_a.grad).all()


def test_rglru_block_triton_equals_torch():
    """RG-LRU with kernel_backend="triton" (the kernel under the interpreter) against "torch":
    outputs, carried state and every gradient, float64, so 1e-9 absolute."""
    from tests.model.mixer_checks import make_mixer

    m, _ = make_mixer("rglru", d_model=16, n_heads=2, rglru={"chunk_size": 4})
    torch.manual_seed(1)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 9, 16, dtype=torch.float64)
    res = []
    for backend in ("torch", "triton"):
        m.kernel_backend = backend
        m.zero_grad()
        x.grad = None
        y, st = m(x, None, True)
        ((y * w).sum() + st.h.sum()).backward()
        res.append([y.detach(), st.h.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    names = ["y", "state h", "x"] + [n for n, _ in m.named_parameters()]
    for n, a, r in zip(names, res[1], res[0]):
        torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9, msg=lambda s: f"{n}: {s}")


def test_autotune_configs_and_availability(monkeypatch):
    space = {"BLOCK_D": [32, 64, 128]}
    assert len(tu.autotune_configs(space, num_warps=(2, 4))) == 1          # the interpreter is on here
    assert tu.autotune_configs(space, interpret={"BLOCK_D": 16})[0].kwargs == {"BLOCK_D": 16}
    assert tu.triton_available("cpu") and tu.triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfgs = tu.autotune_configs(space, num_warps=(2, 4), keep=lambda meta, w: meta["BLOCK_D"] * w <= 256)
    assert sorted((c.kwargs["BLOCK_D"], c.num_warps) for c in cfgs) == [(32, 2), (32, 4), (64, 2), (64, 4), (128, 2)]
    # 8 tile elements per thread: a 64 × BLOCK_D tile keeps (16, 4 warps) and (32, 8 warps)
    prune = tu.prune_by_elements_per_thread(lambda m: m["BT"] * m["BLOCK_D"], 8)
    all_cfgs = tu.autotune_configs({"BLOCK_D": [16, 32, 64]}, num_warps=(2, 4, 8))
    assert sorted((c.kwargs["BLOCK_D"], c.num_warps) for c in prune(all_cfgs, {}, BT=64)) == [(16, 4), (32, 8)]
    assert sorted((c.kwargs["BLOCK_D"], c.num_warps) for c in prune(all_cfgs, {}, BT=2)) == [(64, 2)]
    assert not tu.triton_available("cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        linear_scan_triton(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))


def test_bad_arguments():
    with pytest.raises(ValueError, match="B = 1"):
        linear_scan_triton(torch.zeros(2, 4, 3), torch.zeros(2, 4, 3), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        linear_scan_triton(torch.zeros(1, 4, 3), torch.zeros(1, 4, 3), torch.zeros(1, 3),
                           cu_seqlens=torch.tensor([0, 1, 4]))


# ---- on a GPU: compiled kernels, autotuning, the segment split chosen by the heuristic ---------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 6e-2, 2e-2)])
@pytest.mark.parametrize("B,T,D,nseg", [(2, 1000, 300, None), (3, 777, 96, 5), (1, 4099, 64, None)])
def test_gpu_matches_reference(B, T, D, nseg, dtype, atol, rtol):
    """Tolerances as on CPU, widened for longer sums (hundreds of steps, hardware exp)."""
    log_a, b, h0, w, wf = _inputs(B, T, D, dtype, device="cuda")
    want = _run(lambda la, bb, s: linear_scan_ref(la, bb, s, True), log_a, b, h0, w, wf)
    got = _run(lambda la, bb, s: linear_scan_triton(la, bb, s, True, 64, num_segments=nseg),
               log_a, b, h0, w, wf)
    _compare(got, want, atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_gpu_varlen_matches_reference():
    lens = (300, 1, 1250, 0, 517)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    log_a, b, h0, w, wf = _inputs(1, sum(lens), 200, torch.float32, device="cuda", rows=len(lens))
    want = _run(lambda la, bb, s: linear_scan_ref(la, bb, s, True, cu_seqlens=cu), log_a, b, h0, w, wf)
    got = _run(lambda la, bb, s: linear_scan_triton(la, bb, s, True, 64, cu_seqlens=cu), log_a, b, h0, w, wf)
    _compare(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_rglru_block_triton_equals_torch():
    """The RG-LRU block, float32 on CUDA, kernel vs the PyTorch chunked scan: outputs and every
    gradient. The parameter gradients are sums over 1000 tokens and reach ~1e5 (the same test
    on CPU under the interpreter: conv bias gradient up to 9.8e4), so two float32 summation
    orders differ by ~1e-6 of a tensor's largest entry (CPU: at most 1.1e-6, both forms equally
    far from a float64 run); an absolute 1e-3 on such tensors failed on an H100 (6.6e-3) although
    the kernel agrees with the float64 model as closely as the PyTorch form does. Tolerance: 1e-5
    of each tensor's largest entry plus 1e-3 relative, with TF32 off so that cuDNN's convolution
    does not round the two slightly different gradients it receives to 10-bit mantissas."""
    from tests.model.mixer_checks import make_mixer

    m, _ = make_mixer("rglru", dtype=torch.float32, d_model=256, n_heads=4)
    m = m.cuda()
    x = torch.randn(2, 500, 256, device="cuda", requires_grad=True)
    res = []
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for backend in ("torch", "triton"):
            m.kernel_backend = backend
            m.zero_grad()
            x.grad = None
            y, _ = m(x)
            y.square().sum().backward()
            res.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    names = ["y", "x"] + [n for n, _ in m.named_parameters()]
    for n, a, r in zip(names, res[1], res[0]):
        torch.testing.assert_close(a, r, atol=1e-5 * r.abs().max().item(), rtol=1e-3, msg=lambda s: f"{n}: {s}")


def test_forward_configs_that_spill_are_pruned_per_arch(monkeypatch):
    """The forward's autotune configs at 8 tile elements per thread, less the one per GPU family
    that ptxas spills (the compile gate lists exactly these per arch); the backward keeps all."""
    from kernels.linear_scan import chunk as ls_chunk

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfgs = tu.autotune_configs({"BLOCK_D": [16, 32, 64, 128]}, num_warps=(1, 2, 4, 8, 16))

    def kept(arch, BT, forward):
        return sorted((c.kwargs["BLOCK_D"], c.num_warps)
                      for c in ls_chunk.prune_for_arch(cfgs, arch, {"BT": BT}, forward))
    assert kept(90, 64, True) == [(16, 4), (64, 16)]
    assert kept(80, 64, True) == [(16, 4), (32, 8), (64, 16)]
    assert kept(80, 16, True) == [(16, 1), (32, 2), (64, 4)]
    assert kept(90, 16, True) == [(16, 1), (32, 2), (64, 4), (128, 8)]
    assert kept(90, 64, False) == kept(80, 64, False) == [(16, 4), (32, 8), (64, 16)]
