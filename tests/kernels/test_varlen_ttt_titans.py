"""Variable-length (packed) batches for ``ttt_linear``, ``ttt_mlp`` and ``titans_linear``:
with ``cu_seqlens`` the output, the stacked final states and the gradient of every input must
equal running each sequence on its own through the reference, including an empty sequence
(final state = initial state). Backends "torch" and "triton" (under the Triton interpreter on CPU,
tests/conftest.py, where tl.dot needs 16-wide blocks: d = b = 16 there), all in float64."""
import pytest
import torch
import torch.nn.functional as F

from kernels.titans import titans_linear
from kernels.ttt import ttt_linear, ttt_mlp

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

D64 = torch.float64
H = 2
LENGTHS = (5, 0, 17, 11)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _weighted_loss(tensors, seed=7):
    """A fixed random linear functional of every returned tensor, so that each one's gradient
    path is exercised and a mismatch anywhere changes the input gradients."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g, dtype=D64)).sum() for t in tensors)


def _assert_close(got, want, what, tol):
    """Relative to each tensor's largest entry: the gradients of τ and of the weights sum over
    every token and are much larger than those of single tokens."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.numel() == 0:   # e.g. the outputs of a batch of empty sequences
        return
    scale = want.abs().max().item() + 1e-30
    err = (got - want).abs().max().item()
    assert err <= tol * scale + 1e-13, f"{what}: max error {err:.3e} (scale {scale:.3e})"


# ---- TTT ----------------------------------------------------------------------------------------
TTT_WEIGHTS = {"linear": ("W1", "b1"), "mlp": ("W1", "b1", "W2", "b2")}


def _ttt_inputs(kind, T, d, b, N, with_state, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return scale * torch.randn(*s, generator=g, dtype=D64)

    m = 2 * d
    xs = {"XQ": r(1, H, T, d), "XK": r(1, H, T, d), "XV": r(1, H, T, d),
          "eta": 0.5 * torch.rand(1, H, T, generator=g, dtype=D64),
          "token_idx": 1.0 / torch.arange(1, b + 1, dtype=D64) + 0.1 * r(b),
          "ln_weight": 1 + 0.1 * r(H, d), "ln_bias": r(H, d, scale=0.1)}
    shapes = {"W1": (d, d), "b1": (1, d)} if kind == "linear" else {"W1": (d, m), "b1": (1, m),
                                                                     "W2": (m, d), "b2": (1, d)}
    xs.update({k: r(H, *s, scale=0.3) for k, s in shapes.items()})
    state = None
    if with_state:
        # a state at a mini-batch boundary: per-sequence θ_0, zero carried sums, pos 0
        state = {k: r(N, H, *s, scale=0.3) for k, s in shapes.items()}
        state.update({"grad_" + k: torch.zeros(N, H, *s, dtype=D64) for k, s in shapes.items()})
        state["pos"] = 0
    return xs, state


def _ttt_call(kind, xs, state, b, backend, cu_seqlens):
    fn = ttt_linear if kind == "linear" else ttt_mlp
    args = [xs[k] for k in ("XQ", "XK", "XV", "eta", "token_idx", "ln_weight", "ln_bias")]
    args += [xs[k] for k in TTT_WEIGHTS[kind]]
    return fn(*args, mini_batch_size=b, initial_state=state, output_final_state=True, backend=backend,
              cu_seqlens=cu_seqlens)


def _ttt_packed(kind, xs, state, b, backend, lengths):
    return _ttt_call(kind, xs, state, b, backend, _cu(lengths))


def _ttt_separate(kind, xs, state, b, lengths, backend="reference"):
    """Each sequence alone through ``backend`` (fixed-length calls); an empty one keeps its initial
    state, with zero sums (the per-sequence path launches nothing for it)."""
    keys = TTT_WEIGHTS[kind]
    outs, finals, t0 = [], [], 0
    for n, L in enumerate(lengths):
        st = None if state is None else {**{k: v[n:n + 1] for k, v in state.items() if k != "pos"}, "pos": 0}
        if L == 0:
            st = st or {k: xs[k].unsqueeze(0) for k in keys}
            finals.append({**{k: st[k] for k in keys}, **{"grad_" + k: torch.zeros_like(st[k]) for k in keys},
                           "pos": 0})
            continue
        seg = {k: (v[:, :, t0:t0 + L] if k in ("XQ", "XK", "XV", "eta") else v) for k, v in xs.items()}
        o, f = _ttt_call(kind, seg, st, b, backend, None)
        outs.append(o)
        finals.append(f)
        t0 += L
    final = {k: torch.cat([f[k] for f in finals], 0) for k in finals[0] if k != "pos"}
    final["pos"] = [f["pos"] for f in finals]
    return torch.cat(outs, 2), final


def _ttt_run(fn, xs, state):
    xs = {k: _leaf(v) for k, v in xs.items()}
    st = None
    if state is not None:
        st = {k: (_leaf(v) if torch.is_tensor(v) and not k.startswith("grad_") else v) for k, v in state.items()}
    out, fin = fn(xs, st)
    tensor_keys = sorted(k for k in fin if k != "pos")
    _weighted_loss([out] + [fin[k] for k in tensor_keys]).backward()
    leaves = dict(xs)
    if st is not None:
        leaves.update({"state." + k: v for k, v in st.items() if torch.is_tensor(v) and v.requires_grad})
    grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v)) for k, v in leaves.items()}
    return out.detach(), {k: (v.detach() if torch.is_tensor(v) else v) for k, v in fin.items()}, grads


# The Triton backend against the separate reference: without initial states in
# test_ttt_triton_varlen_reads_no_unwritten_buffer_nor_outside_its_inputs (b = 16, 17, 0, 5, 18
# tokens), with them (TTT-Linear: also without) in the one-launch tests below (b = 16 and 8)
TTT_CASES = [("linear", "torch", 8, 4, LENGTHS), ("mlp", "torch", 8, 4, LENGTHS),
             ("linear", "primal", 8, 4, LENGTHS)]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("kind,backend,d,b,lengths", TTT_CASES)
def test_ttt_varlen_matches_separate_reference(kind, backend, d, b, lengths, with_state):
    xs, state = _ttt_inputs(kind, sum(lengths), d, b, len(lengths), with_state)
    got = _ttt_run(lambda x, s: _ttt_packed(kind, x, s, b, backend, lengths), xs, state)
    want = _ttt_run(lambda x, s: _ttt_separate(kind, x, s, b, lengths), xs, state)
    # float64 throughout; the dual form and the kernels reorder sums against the reference's
    # autograd, so agreement is to ~1e-12 of each tensor's scale
    tol = 1e-9
    _assert_close(got[0], want[0], "out", tol)
    assert got[1]["pos"] == want[1]["pos"] == [L % b for L in lengths]
    assert set(got[1]) == set(want[1])
    for k in want[1]:
        if k != "pos":
            _assert_close(got[1][k], want[1][k], f"final {k}", tol)
    assert set(got[2]) == set(want[2])
    for k in want[2]:
        _assert_close(got[2][k], want[2][k], f"grad {k}", tol)
    # the packed sequences are independent: a nonzero gradient reaches every state row in use
    if with_state:
        assert all(got[2]["state.W1"][n].abs().max() > 0 for n in range(len(lengths)))


def test_ttt_varlen_empty_sequence_keeps_initial_state_and_chains():
    """A final state with every pos = 0 can be fed back; the empty sequence's state passes through."""
    lengths = (8, 0, 4)
    xs, state = _ttt_inputs("linear", 12, 8, 4, 3, True)
    out, fin = _ttt_packed("linear", xs, state, 4, "torch", lengths)
    assert fin["pos"] == [0, 0, 0] and out.shape == (1, H, 12, 8)
    assert torch.equal(fin["W1"][1], state["W1"][1])
    assert not torch.allclose(fin["W1"][0], state["W1"][0])
    out2, fin2 = _ttt_packed("linear", xs, fin, 4, "torch", lengths)
    want, _ = _ttt_packed("linear", xs, {**fin, "pos": 0}, 4, "reference", lengths)
    _assert_close(out2, want, "chained out", 1e-9)


def test_ttt_varlen_refuses_bad_input():
    xs, state = _ttt_inputs("linear", 9, 8, 4, 2, True)
    with pytest.raises(ValueError, match="mini-batch boundary"):
        _ttt_packed("linear", xs, {**state, "pos": 1}, 4, "torch", (4, 5))
    with pytest.raises(ValueError, match="mini-batch boundary"):
        _ttt_packed("linear", xs, {**state, "pos": [0, 3]}, 4, "torch", (4, 5))
    with pytest.raises(ValueError, match="rise from 0"):
        _ttt_packed("linear", xs, state, 4, "torch", (4, 4))
    with pytest.raises(ValueError, match=r"\[N = 3"):
        _ttt_packed("linear", xs, state, 4, "torch", (4, 5, 0))
    xs2 = {k: (torch.cat([v, v]) if k in ("XQ", "XK", "XV", "eta") else v) for k, v in xs.items()}
    with pytest.raises(ValueError, match="B = 1"):
        _ttt_packed("linear", xs2, state, 4, "torch", (4, 5))


# ---- Titans -------------------------------------------------------------------------------------
def _titans_inputs(T, dk, dv, N, with_state, seed=0):
    g = torch.Generator().manual_seed(seed)
    ins = [F.normalize(torch.randn(1, H, T, dk, generator=g, dtype=D64), dim=-1),
           F.normalize(torch.randn(1, H, T, dk, generator=g, dtype=D64), dim=-1),
           torch.randn(1, H, T, dv, generator=g, dtype=D64),
           0.5 * torch.rand(1, H, T, generator=g, dtype=D64),
           F.logsigmoid(torch.randn(1, H, T, generator=g, dtype=D64) + 2),
           F.logsigmoid(torch.randn(1, H, T, generator=g, dtype=D64) + 3)]
    state = [0.3 * torch.randn(N, H, dk, dv, generator=g, dtype=D64) for _ in range(2)] if with_state else None
    return ins, state


def _titans_separate(ins, state, C, lengths):
    """Each sequence alone through the reference (which handles T = 0 itself)."""
    outs, finals, t0 = [], [], 0
    for n, L in enumerate(lengths):
        st = None if state is None else [s[n:n + 1] for s in state]
        o, f = titans_linear(*(x[:, :, t0:t0 + L] for x in ins), initial_state=st, output_final_state=True,
                             backend="reference", chunk_size=C)
        outs.append(o)
        finals.append(f)
        t0 += L
    return torch.cat(outs, 2), tuple(torch.cat([f[i] for f in finals], 0) for i in range(3))


def _titans_run(fn, ins, state):
    ins = [_leaf(x) for x in ins]
    state = None if state is None else [_leaf(s) for s in state]
    o, fin = fn(ins, state)
    _weighted_loss([o, *fin]).backward()
    leaves = ins + (state or [])
    return o.detach(), [f.detach() for f in fin], [x.grad if x.grad is not None else torch.zeros_like(x)
                                                   for x in leaves]


TITANS_NAMES = ["q", "k", "v", "theta", "log_eta", "log_keep", "state.M", "state.S"]


# the Triton backend with initial states: test_titans_triton_varlen_is_one_launch_per_kernel
@pytest.mark.parametrize("backend,dk,with_state", [("torch", 8, False), ("torch", 8, True), ("reference", 8, False),
                                                   ("reference", 8, True), ("triton", 16, False)])
def test_titans_varlen_matches_separate_reference(backend, dk, with_state):
    C = 4
    ins, state = _titans_inputs(sum(LENGTHS), dk, dk, len(LENGTHS), with_state)
    got = _titans_run(lambda x, s: titans_linear(*x, initial_state=s, output_final_state=True, backend=backend,
                                                 chunk_size=C, cu_seqlens=_cu(LENGTHS)), ins, state)
    want = _titans_run(lambda x, s: _titans_separate(x, s, C, LENGTHS), ins, state)
    # float64; the chunked forms reorder sums, agreement to ~1e-12 of each tensor's scale
    tol = 1e-9
    _assert_close(got[0], want[0], "out", tol)
    for name, a, b in zip(("M", "S", "M̂"), got[1], want[1]):
        _assert_close(a, b, f"final {name}", tol)
    for name, a, b in zip(TITANS_NAMES, got[2], want[2]):
        _assert_close(a, b, f"grad {name}", tol)
    if with_state:  # the empty sequence's state passes through untouched, with M̂ = M
        assert torch.equal(got[1][0][1], state[0][1]) and torch.equal(got[1][2][1], state[0][1])
        assert torch.equal(got[1][1][1], state[1][1])


def test_titans_varlen_chunk_aligned_offset_and_refusals():
    C = 4
    ins, state = _titans_inputs(sum(LENGTHS), 8, 8, len(LENGTHS), True)
    base = titans_linear(*ins, initial_state=state, output_final_state=True, chunk_size=C, cu_seqlens=_cu(LENGTHS))
    # an offset that is a whole number of chunks is a chunk boundary; a given M̂ is never read there
    shifted = titans_linear(*ins, initial_state=state + [torch.full_like(state[0], 9.0)], output_final_state=True,
                            chunk_size=C, offset=2 * C, cu_seqlens=_cu(LENGTHS))
    assert torch.equal(base[0], shifted[0]) and all(torch.equal(a, b) for a, b in zip(base[1], shifted[1]))
    o, fin = titans_linear(*ins, chunk_size=C, cu_seqlens=_cu(LENGTHS))
    assert fin is None and o.shape == (1, H, sum(LENGTHS), 8)
    with pytest.raises(ValueError, match="chunk boundary"):
        titans_linear(*ins, initial_state=state, chunk_size=C, offset=1, cu_seqlens=_cu(LENGTHS))
    with pytest.raises(ValueError, match=r"\[N, H, d_k, d_v\]"):
        titans_linear(*ins, initial_state=[s[:2] for s in state], chunk_size=C, cu_seqlens=_cu(LENGTHS))
    with pytest.raises(ValueError, match="rise from 0"):
        titans_linear(*ins, chunk_size=C, cu_seqlens=_cu((5, 0, 17, 10)))


class _CountLaunches:
    """Wraps a Triton kernel: counts its launches (``kernel[grid](...)``) and records the grids."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


TITANS_KERNELS = ("_titans_fwd_state_kernel", "_titans_fwd_kernel", "_titans_bwd_state_kernel",
                  "_titans_bwd_kernel", "_titans_bwd_gates_kernel")


@pytest.mark.parametrize("lengths", [(5, 0, 8, 3), (3,), (0, 0)])
def test_titans_triton_varlen_is_one_launch_per_kernel(monkeypatch, lengths):
    """With cu_seqlens the Triton backend launches each of its five kernels once for the whole
    packed batch (no per-sequence loop), d_v = 24 in blocks of 16 (two per program row), and
    equals the same kernels run on each sequence alone as its own batch (float64, forward, final
    states and every gradient, initial states included). Lengths: partial last chunks, a whole
    number of chunks (8 = 2 · 4), a sequence shorter than one chunk, empty sequences; an empty
    sequence's state passes through untouched, with M̂ = M."""
    import kernels.titans.chunk as tchunk

    monkeypatch.setattr(tchunk, "BV_MAX", 16)
    C, dk, dv = 4, 16, 24
    ins, state = _titans_inputs(sum(lengths), dk, dv, len(lengths), True, seed=3)
    # the reference on each sequence alone (which the fixed-length kernels equal:
    # tests/kernels/test_titans_triton.py)
    want = _titans_run(lambda x, s: _titans_separate(x, s, C, lengths), ins, state)
    counters = {name: _CountLaunches(getattr(tchunk, name)) for name in TITANS_KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(tchunk, name, counter)
    got = _titans_run(lambda x, s: titans_linear(*x, initial_state=s, output_final_state=True, backend="triton",
                                                 chunk_size=C, cu_seqlens=_cu(lengths)), ins, state)
    N, T = len(lengths), sum(lengths)
    slots = T // C + N   # chunk slots per head: ≥ the Σ ⌈T_i / C⌉ chunks, spare ones masked
    assert counters["_titans_fwd_state_kernel"].grids == [(2, N * H)]
    assert counters["_titans_bwd_state_kernel"].grids == [(2, N * H)]
    assert counters["_titans_fwd_kernel"].grids == [(slots, 2, H)]
    assert counters["_titans_bwd_kernel"].grids == [(slots, 2, H)]
    assert counters["_titans_bwd_gates_kernel"].grids == [(slots, H)]
    for n in (n for n, L in enumerate(lengths) if L == 0):
        assert torch.equal(got[1][0][n], state[0][n]) and torch.equal(got[1][2][n], state[0][n])
        assert torch.equal(got[1][1][n], state[1][n])
    tol = 1e-10   # float64: the chunked kernels reorder the reference's sums
    _assert_close(got[0], want[0], "out", tol)
    for name, a, b in zip(("M", "S", "M̂"), got[1], want[1]):
        _assert_close(a, b, f"final {name}", tol)
    for name, a, b in zip(TITANS_NAMES, got[2], want[2]):
        _assert_close(a, b, f"grad {name}", tol)


LINEAR_KERNELS = ("_ttt_linear_state_kernel", "_ttt_linear_out_kernel", "_ttt_linear_bwd_mb_kernel",
                  "_ttt_linear_bwd_kernel")


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("b,lengths", [(16, (5, 0, 16, 21)), (8, (0, 3, 20, 8))])
def test_ttt_linear_triton_varlen_is_one_launch_per_kernel(monkeypatch, b, lengths, with_state):
    """With cu_seqlens the Triton TTT-Linear backend launches each of its four kernels once for the
    whole packed batch — the serial kernels one program per (sequence, head), the per-mini-batch
    ones one per (head, mini-batch slot[, row block]) over ⌊T/b⌋ + N slots — and equals the same
    reference run on each sequence alone (float64: output, final states with per-sequence "pos", and
    every gradient, initial states included). Lengths: an empty sequence, one shorter than b, a
    whole number of mini-batches, mini-batches and a partial tail (b = 16: one and 5 rows, b = 8:
    two and 4 rows); b = 8 pads the mini-batch to 16 rows."""
    import kernels.ttt.chunk as lchunk

    d = 16
    xs, state = _ttt_inputs("linear", sum(lengths), d, b, len(lengths), with_state, seed=5)

    want = _ttt_run(lambda x, s: _ttt_separate("linear", x, s, b, lengths), xs, state)
    counters = {name: _CountLaunches(getattr(lchunk, name)) for name in LINEAR_KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(lchunk, name, counter)
    got = _ttt_run(lambda x, s: _ttt_packed("linear", x, s, b, "triton", lengths), xs, state)
    N, T = len(lengths), sum(lengths)
    NC, NRB = T // b + N, 16 // 16
    assert [c.grids for c in counters.values()] == [[(N * H,)], [(H, NC, NRB)], [(H, NC)], [(N * H,)]]
    tol = 1e-10     # float64; the kernels reorder the reference's sums, agreement to ~1e-13
    _assert_close(got[0], want[0], "out", tol)
    assert got[1]["pos"] == want[1]["pos"] == [L % b for L in lengths]
    for k in want[1]:
        if k != "pos":
            _assert_close(got[1][k], want[1][k], f"final {k}", tol)
    assert set(got[2]) == set(want[2])
    for k in want[2]:
        _assert_close(got[2][k], want[2][k], f"grad {k}", tol)
    if with_state:  # every sequence's own initial state gets its gradient (the empty one: its final state's)
        assert all(got[2]["state.W1"][n].abs().max() > 0 for n in range(N))


def test_ttt_linear_triton_varlen_no_grad_and_refusals():
    """Without autograd the packed launch gives the same output and final state as with it (every
    start weight is stored: the packed launch has no windows), float64 to 1e-12; bad offsets are
    refused by the one flag read back, naming the problem."""
    lengths, b = (21, 0, 7), 16
    xs, state = _ttt_inputs("linear", sum(lengths), 16, b, len(lengths), True, seed=2)
    with torch.no_grad():
        o_ng, f_ng = _ttt_packed("linear", xs, state, b, "triton", lengths)
        o_t, f_t = _ttt_packed("linear", xs, state, b, "torch", lengths)
    _assert_close(o_ng, o_t, "out", 1e-10)
    assert f_ng["pos"] == f_t["pos"] == [5, 0, 7]
    for k in ("W1", "b1", "grad_W1", "grad_b1"):
        _assert_close(f_ng[k], f_t[k], f"final {k}", 1e-10)
    with pytest.raises(ValueError, match="rise from 0"):
        _ttt_packed("linear", xs, state, b, "triton", (21, 8, -1))
    with pytest.raises(ValueError, match=r"\[N = 2"):
        _ttt_packed("linear", xs, state, b, "triton", (21, 7))


@pytest.mark.parametrize("with_state", [False, True])
def test_ttt_linear_triton_varlen_all_empty_batch_launches_nothing(monkeypatch, with_state):
    """A packed batch of empty sequences only (T = 0) launches no kernel: the output is [1, H, 0, d],
    every sequence's final state is its initial one (pos 0, zero sums), and the final state's
    gradient reaches the initial state unchanged (float64, same as the PyTorch backend)."""
    import kernels.ttt.chunk as lchunk

    lengths, b = (0, 0, 0), 16
    xs, state = _ttt_inputs("linear", 0, 16, b, len(lengths), with_state, seed=4)
    counters = {name: _CountLaunches(getattr(lchunk, name)) for name in LINEAR_KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(lchunk, name, counter)
    got = _ttt_run(lambda x, s: _ttt_packed("linear", x, s, b, "triton", lengths), xs, state)
    want = _ttt_run(lambda x, s: _ttt_packed("linear", x, s, b, "torch", lengths), xs, state)
    assert all(c.grids == [] for c in counters.values())
    assert got[0].shape == (1, H, 0, 16)
    assert got[1]["pos"] == [0, 0, 0]
    for k in ("W1", "b1"):
        start = state[k] if with_state else xs[k].unsqueeze(0).expand(len(lengths), *xs[k].shape)
        _assert_close(got[1][k], start, f"final {k}", 0.0)
        assert got[1]["grad_" + k].abs().max() == 0
    for k in want[2]:
        _assert_close(got[2][k], want[2][k], f"grad {k}", 1e-12)
    if with_state:
        assert got[2]["state.W1"].abs().max() > 0


MLP_KERNELS = ("_ttt_mlp_fwd_kernel", "_ttt_mlp_out_kernel", "_ttt_mlp_bwd_mb_kernel", "_ttt_mlp_bwd_kernel")


def _assert_runs_close(got, want, tol):
    _assert_close(got[0], want[0], "out", tol)
    assert got[1]["pos"] == want[1]["pos"]
    assert set(got[1]) == set(want[1])
    for k in want[1]:
        if k != "pos":
            _assert_close(got[1][k], want[1][k], f"final {k}", tol)
    assert set(got[2]) == set(want[2])
    for k in want[2]:
        _assert_close(got[2][k], want[2][k], f"grad {k}", tol)


@pytest.mark.parametrize("b,lengths", [(16, (5, 0, 16, 21)), (8, (0, 3, 20, 8))])
def test_ttt_mlp_triton_varlen_is_one_launch_per_kernel(monkeypatch, b, lengths):
    """With cu_seqlens the Triton TTT-MLP backend launches each of its four kernels once for the
    whole packed batch — the state pass and the backward carry one program per (sequence, head),
    the output and the per-mini-batch backward one per (head, mini-batch slot) over ⌊T/b⌋ + N
    slots — and equals the reference run on each sequence alone (float64: output, final states
    with per-sequence "pos", every gradient, initial states included). Lengths: an empty
    sequence, one shorter than b, a whole number of mini-batches, full ones with a partial tail
    (b = 16: one and 5 rows, b = 8: two and 4 rows); b = 8 pads the mini-batch to 16 rows; m = 32
    runs two hidden tiles. With initial states (each case ~15 s under the interpreter); without
    them: test_ttt_triton_varlen_reads_no_unwritten_buffer_nor_outside_its_inputs, which counts
    the launches too."""
    import kernels.ttt.mlp_chunk as mchunk

    d, with_state = 16, True
    xs, state = _ttt_inputs("mlp", sum(lengths), d, b, len(lengths), with_state, seed=5)
    want = _ttt_run(lambda x, s: _ttt_separate("mlp", x, s, b, lengths), xs, state)
    counters = {name: _CountLaunches(getattr(mchunk, name)) for name in MLP_KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(mchunk, name, counter)
    got = _ttt_run(lambda x, s: _ttt_packed("mlp", x, s, b, "triton", lengths), xs, state)
    N, T = len(lengths), sum(lengths)
    NC = T // b + N
    assert [c.grids for c in counters.values()] == [[(N * H,)], [(H * NC,)], [(H * NC,)], [(N * H,)]]
    assert got[1]["pos"] == [L % b for L in lengths]
    _assert_runs_close(got, want, 1e-10)    # float64; the kernels reorder the reference's sums (~1e-13)
    # every sequence's own initial state gets its gradient (the empty one: its final state's)
    assert all(got[2]["state.W1"][n].abs().max() > 0 for n in range(N))
    assert all(got[2]["state.b2"][n].abs().max() > 0 for n in range(N))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_ttt_triton_packed_path_refuses_bad_batch_at_entry(kind):
    """The one-launch packed path checks its input before any launch: B > 1, a cu_seqlens that is
    not [N+1] with N ≥ 1, and an initial state with the wrong number of rows, each named."""
    xs, state = _ttt_inputs(kind, 9, 16, 4, 2, True)
    xs2 = {k: (torch.cat([v, v]) if k in ("XQ", "XK", "XV", "eta") else v) for k, v in xs.items()}
    with pytest.raises(ValueError, match=f"ttt_{kind}: cu_seqlens needs packed input with B = 1, got B = 2"):
        _ttt_packed(kind, xs2, state, 4, "triton", (4, 5))
    with pytest.raises(ValueError, match=f"ttt_{kind}: cu_seqlens must be an integer tensor \\[N\\+1\\]"):
        _ttt_call(kind, xs, state, 4, "triton", _cu((4, 5)).view(1, -1))
    with pytest.raises(ValueError, match=r"\[N = 3"):
        _ttt_packed(kind, xs, state, 4, "triton", (4, 5, 0))


def test_ttt_mlp_triton_varlen_no_grad_and_refusals():
    """Without autograd the packed launch gives the same output and final state as the PyTorch
    dual form (float64 to 1e-10); bad offsets are refused by the one flag read back, naming the
    problem; a batch of empty sequences only (T = 0) keeps its initial states."""
    lengths, b = (21, 0, 7), 16
    xs, state = _ttt_inputs("mlp", sum(lengths), 16, b, len(lengths), True, seed=2)
    with torch.no_grad():
        o_ng, f_ng = _ttt_packed("mlp", xs, state, b, "triton", lengths)
        o_t, f_t = _ttt_packed("mlp", xs, state, b, "torch", lengths)
    _assert_close(o_ng, o_t, "out", 1e-10)
    assert f_ng["pos"] == f_t["pos"] == [5, 0, 7]
    for k in ("W1", "b1", "W2", "b2", "grad_W1", "grad_b1", "grad_W2", "grad_b2"):
        _assert_close(f_ng[k], f_t[k], f"final {k}", 1e-10)
    with pytest.raises(ValueError, match="rise from 0"):
        _ttt_packed("mlp", xs, state, b, "triton", (21, 8, -1))
    with pytest.raises(ValueError, match=r"\[N = 2"):
        _ttt_packed("mlp", xs, state, b, "triton", (21, 7))
    empty_xs, empty_state = _ttt_inputs("mlp", 0, 16, b, 2, True, seed=3)
    out, fin = _ttt_packed("mlp", empty_xs, empty_state, b, "triton", (0, 0))
    assert out.shape == (1, H, 0, 16) and fin["pos"] == [0, 0]
    assert torch.equal(fin["W2"], empty_state["W2"])


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_ttt_triton_varlen_reads_no_unwritten_buffer_nor_outside_its_inputs(monkeypatch, kind):
    """Every buffer the packed path allocates uninitialized is written before it is read, and no
    program reads memory before its inputs: with torch.empty, torch.empty_like and
    Tensor.new_empty handing out NaN-filled tensors, and XQ, XK, XV, η placed right after
    NaN-filled memory, output, final state and gradients still match the per-sequence reference.
    The spare chunk slots (here one: 17, 0, 5, 18 tokens at b = 16) and the rows past a sequence's
    end must add nothing to ∂τ, ∂γ, ∂β, which are summed over every slot; a read of row −1 (the
    last valid row, clamped, of a slot with none) would make them NaN. Without initial states, each
    kernel launches once for the packed batch (the one-launch tests: with them); float64, 1e-9 of
    each tensor's scale (the kernels reorder the reference's sums)."""
    import kernels.ttt.chunk as lchunk
    import kernels.ttt.mlp_chunk as mchunk

    lengths = (17, 0, 5, 18)
    xs, _ = _ttt_inputs(kind, sum(lengths), 16, 16, len(lengths), False)
    want = _ttt_run(lambda x, s: _ttt_separate(kind, x, s, 16, lengths), xs, None)
    pad = 64 * 16
    leaves = {}
    for k, v in xs.items():
        if k in ("XQ", "XK", "XV", "eta"):
            buf = torch.full((pad + v.numel(),), float("nan"), dtype=v.dtype)
            buf[pad:] = v.flatten()
            leaves[k] = buf[pad:].view(v.shape).detach().requires_grad_(True)
            assert leaves[k].storage_offset() == pad
        else:
            leaves[k] = _leaf(v)
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(new_empty(self, *a, **k)))
    assert torch.isnan(torch.empty(2)).all() and torch.isnan(xs["XQ"].new_empty(2)).all()
    mod, names = (lchunk, LINEAR_KERNELS) if kind == "linear" else (mchunk, MLP_KERNELS)
    counters = {name: _CountLaunches(getattr(mod, name)) for name in names}
    for name, counter in counters.items():
        monkeypatch.setattr(mod, name, counter)
    out, fin = _ttt_packed(kind, leaves, None, 16, "triton", lengths)
    _weighted_loss([out] + [fin[k] for k in sorted(k for k in fin if k != "pos")]).backward()
    monkeypatch.undo()
    N, NC = len(lengths), sum(lengths) // 16 + len(lengths)
    if kind == "linear":
        assert [c.grids for c in counters.values()] == [[(N * H,)], [(H, NC, 1)], [(H, NC)], [(N * H,)]]
    else:
        assert [c.grids for c in counters.values()] == [[(N * H,)], [(H * NC,)], [(H * NC,)], [(N * H,)]]
    _assert_close(out.detach(), want[0], "out", 1e-9)
    assert fin["pos"] == want[1]["pos"] == [L % 16 for L in lengths]
    assert set(fin) == set(want[1]) and set(leaves) == set(want[2])
    for k in want[1]:
        if k != "pos":
            _assert_close(fin[k].detach(), want[1][k], f"final {k}", 1e-9)
    for k in want[2]:
        _assert_close(leaves[k].grad, want[2][k], f"grad {k}", 1e-9)
