"""The Triton Titans linear-memory kernel (kernels/titans/chunk.py) against the specification
(kernels/titans/reference.py): output, final (M, S, M̂) and the gradient of every input. Without
CUDA these run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes
are tiny; the ``gpu`` tests repeat them at larger shapes."""
import pytest
import torch
import torch.nn.functional as F

from kernels.titans import BACKENDS, titans_linear, titans_linear_reference

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

D64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, H, T, dk, dv, seed=0, with_state=True):
    """Unit-norm q, k as the mixer feeds them; gates in the range the mixer's init gives."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=D64), dim=-1)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=D64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=D64)
    theta = 0.5 * torch.rand(B, H, T, generator=g, dtype=D64)
    log_eta = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=D64) + 2)
    log_keep = F.logsigmoid(torch.randn(B, H, T, generator=g, dtype=D64) + 3)
    state = None
    if with_state:
        state = [0.3 * torch.randn(B, H, dk, dv, generator=g, dtype=D64) for _ in range(3)]
    return [q, k, v, theta, log_eta, log_keep], state


def _run(fn, ins, state, chunk, offset, seed=9):
    """Output, final state and the gradients of all inputs and of the initial (M, S, M̂) under a
    random linear loss on the output and all three returned states."""
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    state = None if state is None else [t.detach().clone().requires_grad_(True) for t in state]
    leaves = ins + (state or [])
    o, fin = fn(*ins, initial_state=state, output_final_state=True, chunk_size=chunk, offset=offset)
    g = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=g, dtype=D64).to(o.device)
    ws = [torch.randn(s.shape, generator=g, dtype=D64).to(s.device) for s in fin]
    loss = (o.double() * wo).sum() + sum((s.double() * w).sum() for s, w in zip(fin, ws))
    loss.backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return [o, *fin, *grads]


NAMES = ["o", "M_T", "S_T", "Mh_T", "dq", "dk", "dv", "dtheta", "dlog_eta", "dlog_keep", "dM0", "dS0", "dMh0"]


def _compare(B, H, T, dk, dv, chunk, dtype, with_state, offset=0, atol=1e-10, rtol=1e-10, seed=0):
    ins, state = _inputs(B, H, T, dk, dv, seed=seed, with_state=with_state)
    ins = [t.to(DEV, dtype) for t in ins]
    state = None if state is None else [t.to(DEV) for t in state]
    # the reference sees the same (rounded) inputs, in float64
    ref = _run(titans_linear_reference, [t.double() for t in ins], state, chunk, offset)
    tri = _run(lambda *a, **kw: titans_linear(*a, backend="triton", **kw), ins, state, chunk, offset)
    for name, r, t in zip(NAMES, ref, tri):
        torch.testing.assert_close(t.double(), r.double(), atol=atol, rtol=rtol, msg=lambda s: f"{name}: {s}")
    return ref, tri


# float64: kernel and reference differ by rounding only; values are O(1)–O(400), hence 1e-10.
@pytest.mark.parametrize("B,H,T,dk,dv,chunk,with_state,offset", [
    (2, 2, 37, 16, 16, 16, True, 0),    # T not a multiple of C: masked trailing chunk
    (1, 2, 32, 16, 16, 16, False, 0),   # whole chunks, no initial state
    (2, 1, 21, 12, 20, 16, True, 0),    # d_k ≠ d_v, neither a power of two (masked tiles)
    (1, 1, 13, 8, 8, 4, True, 0),       # C < 16: a chunk in the first rows of a 16-row tile
    (1, 1, 5, 8, 8, 1, True, 0),        # C = 1: the per-token rule M̂_t = M_{t−1}
    (1, 2, 30, 16, 16, 16, True, 5),    # starts inside a chunk: first 11 tokens at the anchor M̂
])
def test_float64_matches_reference(B, H, T, dk, dv, chunk, with_state, offset):
    _compare(B, H, T, dk, dv, chunk, D64, with_state, offset)


def test_several_dv_blocks(monkeypatch):
    """d_v split over programs (d_v = 40 in blocks of 16 → three, the last ragged) and d_k summed
    over blocks (d_k = 40 in blocks of 16), as d = 64 and 128 run on a GPU (blocks of 32): the
    d_v blocks are independent, the gradients of q, k and the gates are summed over them (float64,
    rounding only)."""
    import kernels.titans.chunk as ti_chunk

    monkeypatch.setattr(ti_chunk, "BK_MAX", 16)
    monkeypatch.setattr(ti_chunk, "BV_MAX", 16)
    mt = ti_chunk.launch_meta(40, 40, D64)
    assert (mt["BK"], mt["BV"], mt["BK_chunk"], mt["BV_chunk"]) == (16, 16, 16, 16)
    _compare(1, 2, 21, 40, 40, 16, D64, True)


@pytest.mark.parametrize("bk_state,bv_state,bk_chunk,bv_chunk", [(16, 16, 32, 32), (32, 64, 16, 16)])
def test_dk_and_dv_blocks_of_serial_and_chunk_parallel_kernels(monkeypatch, bk_state, bv_state, bk_chunk,
                                                               bv_chunk):
    """The serial kernels (chunk-start states, end-of-chunk state gradients) and the
    chunk-parallel ones (output, input gradients) are separate launches over the stored states,
    each with its own d_v block, and each sums its products over d_k in blocks of BK rows: at
    d_k = d_v = 40, blocks of 16 (three, the last ragged), 32 (two, the last ragged) or 64 (one)
    give the reference's values (float64)."""
    import kernels.titans.chunk as ti_chunk

    meta = ti_chunk.launch_meta

    def launch_meta(*a, **kw):
        return {**meta(*a, **kw), "BK": bk_state, "BV": bv_state, "BK_chunk": bk_chunk, "BV_chunk": bv_chunk}
    monkeypatch.setattr(ti_chunk, "launch_meta", launch_meta)
    _compare(1, 2, 37, 40, 40, 16, D64, True)


def test_float32_matches_reference():
    """float32 inputs, float32 accumulation (TF32×3 products on a GPU, float32 ones under the
    interpreter): ~40 steps of rounding (2⁻²⁴) on sums of O(100) terms, on values up to ~400: 1e-3 absolute, 1e-5 relative."""
    _compare(2, 2, 37, 16, 16, 16, torch.float32, True, atol=1e-3, rtol=1e-5)


def test_bfloat16_inputs():
    """bf16 inputs with float32 accumulation. The output and the input gradients come back in
    bf16 (8-bit mantissa, relative step 2⁻⁸ ≈ 4e-3); the state stays float32. Hence 1e-2 relative
    plus 0.1 absolute on values up to O(100)."""
    ref, tri = _compare(1, 2, 37, 16, 16, 16, torch.bfloat16, True, atol=1e-1, rtol=1e-2)
    assert tri[0].dtype == torch.bfloat16 and tri[1].dtype == torch.float32


def test_closed_gates_are_exact():
    """η_t = 0 or α_t = 1 (log-gate −inf) at some tokens: no nan, and the same values and
    gradients as the reference. The kernel clamps the log-gates at −1e4, so the within-chunk
    differences A_i − A_j cancel terms of size 1e4: float64 rounding of ~1e-12 relative, hence
    1e-9."""
    ins, state = _inputs(1, 1, 20, 8, 8)
    ins[4][0, 0, [3, 17]] = float("-inf")
    ins[5][0, 0, 5] = float("-inf")
    ref = _run(titans_linear_reference, ins, state, 16, 0)
    tri = _run(lambda *a, **kw: titans_linear(*a, backend="triton", **kw), ins, state, 16, 0)
    for name, r, t in zip(NAMES, ref, tri):
        assert not t.isnan().any(), name
        torch.testing.assert_close(t, r, atol=1e-9, rtol=1e-9, msg=lambda s: f"{name}: {s}")


def test_segments_chain_like_one_pass():
    """Segments cut inside chunks chain through (M, S, M̂) and the offset like one call."""
    C, T = 16, 40
    ins, _ = _inputs(1, 1, T, 8, 8)
    o, fin = titans_linear(*ins, output_final_state=True, backend="triton", chunk_size=C)
    outs, st = [], None
    for a, b in [(0, 7), (7, 33), (33, 40)]:
        y, st = titans_linear(*[t[:, :, a:b] for t in ins], initial_state=st, output_final_state=True,
                              backend="triton", chunk_size=C, offset=a)
        outs.append(y)
    # float64, same arithmetic in a different grouping: rounding only
    torch.testing.assert_close(torch.cat(outs, 2), o, atol=1e-10, rtol=1e-10)
    for a, b in zip(st, fin):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_mixer_triton_equals_torch():
    """TitansMemory (linear memory) with kernel_backend="triton" vs "torch", over two segments
    (the second starts inside a chunk): same outputs, states and parameter gradients (float64,
    two chunked forms of the same recurrence: 1e-9 on O(1) values)."""
    from tests.model.mixer_checks import make_mixer

    assert "triton" in BACKENDS
    m, _ = make_mixer("titans", titans={"chunk_size": 16})
    torch.manual_seed(1)
    x = torch.randn(2, 23, m.d_model, dtype=D64, requires_grad=True)
    w = torch.randn(2, 23, m.d_model, dtype=D64)
    res = []
    for be in ("torch", "triton"):
        m.kernel_backend = be
        m.zero_grad()
        x.grad = None
        y1, st = m.chunked(x[:, :9], output_state=True)
        y2, st = m.chunked(x[:, 9:], st, output_state=True)
        y = torch.cat([y1, y2], 1)
        ((y * w).sum() + st.M[0].sum() + st.S[0].sum()).backward()
        res.append([y.detach(), st.M[0].detach(), st.S[0].detach(), st.Mh[0].detach(), x.grad.clone()]
                   + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-7)


def test_mixer_triton_rejects_mlp_memory():
    from tests.model.mixer_checks import make_mixer

    m, _ = make_mixer("titans", titans={"memory": "mlp", "chunk_size": 16})
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match="linear memory"):
        m.chunked(torch.randn(1, 4, m.d_model, dtype=D64))


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,d,chunk", [(2, 4, 1000, 64, 64), (1, 2, 777, 128, 16), (2, 2, 300, 32, 32)])
def test_gpu_float32_matches_reference(B, H, T, d, chunk):
    """float32, TF32×3 products (about float32 accuracy), up to 1000 steps of O(1)–O(100) values: 2e-3 relative and absolute
    (the kernel's rounding compounds through the carried M and S, ~1e-6 per chunk)."""
    _compare(B, H, T, d, d, chunk, torch.float32, True, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_gpu_float64_offset_matches_reference():
    """float64 on the GPU, starting inside a chunk: rounding only."""
    _compare(2, 2, 200, 64, 64, 64, D64, True, offset=17, atol=1e-9, rtol=1e-9)


@pytest.mark.gpu
def test_gpu_bfloat16_inputs():
    """bf16 inputs and outputs with TF32 products (10-bit mantissa) over 512 steps: 1e-1 absolute
    plus 5e-2 relative on values up to O(100)."""
    _compare(2, 2, 512, 64, 64, 64, torch.bfloat16, True, atol=1e-1, rtol=5e-2)
