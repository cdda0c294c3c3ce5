"""Packed documents through context parallelism's parallel forms (``cp_summary``,
``cp_kv_exchange``) against the one-process run, on CPU with gloo.

Each world size (2 and 4) is spawned once (a module fixture); every rank runs every check: the
one-process run ``mixer(x, docs=DocLayout.build(pos), segment_pos=...)`` over the whole rows and
``cp_mixer(..., docs=SliceDocs)`` over its own slice, and reports the largest difference it saw
(outputs, input gradients, parameter gradients summed over the ranks; relative to each tensor's
largest entry). Float64 throughout, TOL = 1e-9 as in ``test_context_parallel.py``: the split runs
only reorder sums (~1e-14); a state leaking across a document start, an unmasked halo or a
wrong RoPE offset shows up at ≥ 1e-4.

The packed positions (``POSITIONS``, T = 13, split [7, 6] on 2 ranks and [4, 3, 3, 3] on 4, so
not multiples of the world size) hold: a row starting inside a document; documents crossing rank
boundaries; a document starting exactly at a rank's first token; one-token documents; documents
of 2 tokens (shorter than the convolutions' width 4) crossing a boundary with an earlier
document's tokens in the halo; a row without an inner start (its state crosses every rank).

The op-level checks run ``cp_delta_rule`` / ``cp_gated_delta_rule`` with ``docs`` against the
sequential reference run on each document piece alone (a plain loop over the pieces), outputs,
the state after each slice, and the gradients of every input. The whole LM of these kinds with
``model.reset_at_doc_boundaries`` runs through ``context_parallel_forward``, with every other
layer kind of the registry in it (the state-passing ones: ``test_cp_docs_state.py``).

The Triton route (marked slow, the interpreter on CPU): ``delta_rule_docs`` and
``selective_scan_docs`` on the kernels' ``cu_seqlens`` path against their PyTorch chunked forms
with resets, in one process; DeltaNet on its kernel through ``cp_mixer`` on 2 ranks.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ttt_lm.model.docs import DocLayout
from ttt_lm.model.registry import mixer_class
from ttt_lm.parallel import cp
from ttt_lm.parallel.cp.summary import _docs_backend
from tests.distributed import assert_within, spawn_checks
from tests.parallel.test_context_parallel import KINDS, TOL, _bounds, _leaf, _maxdiff, _sum_grads, _tiny_lm

T = 13
#: [B, T] packed positions (see the module docstring; global indices 0 … 12)
POSITIONS = torch.tensor([
    # starts inside a document; [3, 4] (2 tokens) crosses 4; one-token documents at 5, 6, 12;
    # a document starts at 7 (the first token of rank 1 of 2, rank 2 of 4) and crosses 10
    [5, 6, 7, 0, 1, 0, 0, 0, 1, 2, 3, 4, 0],
    # [0 … 5] crosses 4; [6, 7] (2 tokens) crosses 7 with [4, 5] in its halo; [8, 9, 10] crosses
    # 10 with 7 in its halo
    [0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 0, 1],
    # one document over the whole row (from position 2): its state crosses every rank
    [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
])
#: every kind with a parallel form (summary combine or KV exchange)
FORM_KINDS = [k for k in KINDS if mixer_class(k).cp_form != "state_passing"]
#: a summary kind that reads segment positions, and one that does not
POS_SUMMARY = next(k for k in FORM_KINDS if mixer_class(k).cp_form == "summary" and mixer_class(k).takes_segment_pos)
PLAIN_SUMMARY = next(k for k in FORM_KINDS if mixer_class(k).cp_form == "summary" and not mixer_class(k).takes_segment_pos)


def check_mixer_docs(kind, rank, world, impl="chunked", backend=None):
    """One mixer (inside a 1-layer LM, for its initialization) through ``cp_mixer`` with this
    rank's ``SliceDocs``, against the one-process packed-documents run (``backend``: the mixer's
    ``kernel_backend``, which both runs use)."""
    mixer = _tiny_lm([kind]).set_impl(impl).layers[0].mixer
    if backend is not None:
        mixer.kernel_backend = backend
        assert mixer.resolve_backend(torch.device("cpu"), torch.float64) == backend
    pos = POSITIONS
    B = pos.shape[0]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    xf = _leaf(x)
    kw = {"segment_pos": pos} if mixer.takes_segment_pos else {}
    y, _ = mixer(xf, docs=DocLayout.build(pos), **kw)
    (y * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    lengths = cp.split_lengths(T, world)
    docs = cp.slice_docs(pos[:, s:e], lengths)
    assert docs is not None
    xr = _leaf(x[:, s:e])
    y_r = cp.cp_mixer(mixer, xr, lengths, tag=5, position_ids_local=pos[:, s:e], docs=docs)
    (y_r * w[:, s:e]).sum().backward()
    cp.wait_pending()
    _sum_grads(mixer.parameters())
    err = max(_maxdiff(y_r, y[:, s:e]), _maxdiff(xr.grad, xf.grad[:, s:e]))
    missing = [n for n in ref if mixer.get_parameter(n).grad is None]
    if missing:
        raise AssertionError(f"{kind}: no gradient for {missing}")
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in mixer.named_parameters() if n in ref])


def check_lm_docs(rank, world):
    """A whole LM of every layer kind of the registry (the parallel forms and state passing, the
    TTT blocks with their pre-conv), ``model.reset_at_doc_boundaries`` on:
    ``context_parallel_forward`` with the loader's positions (mean loss, logits, all-reduced
    gradients) equals ``LM.forward(ids, position_ids=pos)``."""
    import torch.distributed as dist
    model = _tiny_lm(KINDS, pre_conv=True)
    model.cfg.reset_at_doc_boundaries = True
    pos = POSITIONS
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 61, tuple(pos.shape), generator=g)
    labels = torch.randint(0, 61, tuple(pos.shape), generator=g)
    labels[0, 2] = -100
    logits = model(ids, position_ids=pos).logits
    loss = F.cross_entropy(logits.reshape(-1, 61), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    loss_r, logits_r = cp.context_parallel_forward(model, ids[:, s:e], labels[:, s:e], position_ids_local=pos[:, s:e])
    loss_r.backward()
    cp.allreduce_gradients(model)
    mean_loss = loss_r.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    err = max(abs(float(mean_loss - loss.detach())) / float(loss.detach()), _maxdiff(logits_r, logits[:, s:e]))
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in model.named_parameters()])


def _pieces(pos_row):
    """[(start, end)) of each document piece of one row."""
    starts = DocLayout.build(pos_row[None]).starts[0].nonzero()[:, 0].tolist()
    return list(zip(starts, starts[1:] + [pos_row.shape[0]]))


def _per_piece_reference(op, ts, pos, e):
    """The sequential reference ``op`` (tensors [B, H, T, ...]) on each document piece of each row
    alone, from the zero state: (o [B, H, T, d_v], the state after token e − 1 [B, H, d_k, d_v])."""
    outs, states = [], []
    for b in range(pos.shape[0]):
        row, fin = [], None
        for a, z in _pieces(pos[b]):
            o, S = op(*(t[b:b + 1, :, a:z] for t in ts), None, True)
            row.append(o)
            if a < e <= z:   # the piece holding token e − 1: its state after it
                _, fin = op(*(t[b:b + 1, :, a:e] for t in ts), None, True)
        outs.append(torch.cat(row, 2))
        states.append(fin)
    return torch.cat(outs, 0), torch.cat(states, 0)


def check_delta_rule_resets(rank, world, gated):
    """``cp_delta_rule`` (or the gated one) with ``resets`` = ``SliceDocs.starts``."""
    from kernels.delta_rule import delta_rule_reference
    from kernels.gated_delta_rule import gated_delta_rule
    g = torch.Generator().manual_seed(12)
    pos = POSITIONS
    B, H, dk, dv = pos.shape[0], 2, 4, 3
    q = torch.randn(B, H, T, dk, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    lg = -0.3 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64))
    w = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    ins = (q, k, v, lg, beta) if gated else (q, k, v, beta)
    if gated:
        op = lambda *a: gated_delta_rule(*a, backend="reference")
    else:
        op = lambda *a: delta_rule_reference(*a)
    s, e = _bounds(T, world, rank)
    full = [_leaf(t) for t in ins]
    o, S_here = _per_piece_reference(op, full, pos, e)
    (o * w).sum().backward()
    docs = cp.slice_docs(pos[:, s:e], cp.split_lengths(T, world))
    loc = [_leaf(t[:, :, s:e]) for t in ins]
    fn = cp.cp_gated_delta_rule if gated else cp.cp_delta_rule
    o_r, S_r = fn(*loc, backend="torch", chunk_size=2, docs=docs)
    (o_r * w[:, :, s:e]).sum().backward()
    err = max(_maxdiff(o_r, o[:, :, s:e]), _maxdiff(S_r, S_here.detach()))
    for a, f in zip(loc, full):
        err = max(err, _maxdiff(a.grad, f.grad[:, :, s:e]))
    return err


def check_refusals(rank, world):
    """A backend that cannot run the ops with documents from carried states is refused, naming it;
    docs that do not match the slice are refused; a mixer that reads segment positions (the RG-LRU)
    without them is refused."""
    with pytest.raises(ValueError, match=r"selective scan op run on backend torch or triton, not 'sdpa'"):
        _docs_backend("selective scan", "sdpa")
    assert _docs_backend("delta rule", "reference") == "torch"
    mixer = _tiny_lm([PLAIN_SUMMARY]).layers[0].mixer
    s, e = _bounds(T, world, rank)
    lengths = cp.split_lengths(T, world)
    docs = cp.slice_docs(POSITIONS[:, s:e], lengths)
    with pytest.raises(ValueError, match=r"docs cover"):
        cp.cp_mixer(mixer, torch.zeros(2, e - s, 16, dtype=torch.float64), lengths, docs=docs)
    rg = _tiny_lm([POS_SUMMARY]).layers[0].mixer
    with pytest.raises(ValueError, match=r"position_ids_local"):
        cp.cp_mixer(rg, torch.zeros(3, e - s, 16, dtype=torch.float64), lengths, docs=docs)


def _checks(rank, world):
    out = {"delta_rule_resets": lambda: check_delta_rule_resets(rank, world, False),
           "gated_delta_rule_resets": lambda: check_delta_rule_resets(rank, world, True),
           "refusals": lambda: check_refusals(rank, world),
           "lm": lambda: check_lm_docs(rank, world)}
    for kind in FORM_KINDS:
        out["mixer_" + kind] = (lambda kk: lambda: check_mixer_docs(kk, rank, world))(kind)
        out["reference_" + kind] = (lambda kk: lambda: check_mixer_docs(kk, rank, world, "reference"))(kind)
    return out


#: the summary kinds on their Triton kernels through cp_mixer: DeltaNet (~35-45 s under the
#: interpreter). Gated DeltaNet shares its combine (``_summary_runs``) and Mamba's selective scan
#: its row routing (``_route_rows``, ``_rows_final``); both routes are tested op by op below; the
#: RG-LRU's linear scan takes its resets through ``linear_scan_reset``, tested with the kernel
#: elsewhere
TRITON_KINDS = ["deltanet"]


def _triton_checks(rank, world):
    return {kind: (lambda kk: lambda: check_mixer_docs(kk, rank, world, backend="triton"))(kind)
            for kind in TRITON_KINDS}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory):
    world = request.param
    res, err = spawn_checks(world, __name__, tmp_path_factory.mktemp(f"cpdocs{world}"), "_checks",
                            stop_on_failure=True, timeout_s=60)
    return world, res, err


@pytest.mark.dist
@pytest.mark.parametrize("kind", FORM_KINDS)
def test_mixer_docs(results, kind):
    """Every kind with a parallel form, through cp_mixer with SliceDocs: outputs, input gradients and
    summed parameter gradients equal the one-process packed-documents run."""
    assert_within(results, "mixer_" + kind, TOL)


@pytest.mark.dist
@pytest.mark.parametrize("kind", FORM_KINDS)
def test_mixer_docs_reference_impl(results, kind):
    """The same with impl="reference" (the one-process run in its sequential / padded form; the
    split run's ops with resets in their PyTorch chunked form, attention's explicit softmax)."""
    assert_within(results, "reference_" + kind, TOL)


@pytest.mark.dist
def test_delta_rule_summaries_with_resets(results):
    """cp_delta_rule with resets: [S^loc, P] with P = 0 on a row with a start in the slice; outputs,
    the state after each slice and every input's gradient equal each piece run alone."""
    assert_within(results, "delta_rule_resets", TOL)


@pytest.mark.dist
def test_gated_delta_rule_summaries_with_resets(results):
    """The same for the gated delta rule."""
    assert_within(results, "gated_delta_rule_resets", TOL)


@pytest.mark.dist
def test_lm_docs(results):
    """The whole LM of every layer kind with document resets under context parallelism equals
    the one-process run."""
    assert_within(results, "lm", TOL)


@pytest.mark.dist
def test_refusals(results):
    world, res, err = results
    for r, rr in enumerate(res):
        assert "refusals" in rr and rr["refusals"] is None, f"rank {r} of {world}: {rr.get('refusals')} ({err})"


# ---- the Triton route (one process, the interpreter on CPU) ---------------------------------

def _slice_docs(start, end):
    return cp.SliceDocs.of(DocLayout.build(POSITIONS), start, end)


#: slices of POSITIONS: [4, 10) (row 0 continues a document into a one-token piece, row 1 has a
#: 2-token piece at its end, row 2 no start) and [7, 13) (a start on the first token of row 0)
TRITON_SLICES = [(4, 10), (7, 13)]


def _grads(outs, ins, seed):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    return torch.autograd.grad(loss, ins)


def _compare_backends(fn, ins, seed):
    """fn(backend, *ins) → (y, final per row) on "torch" and "triton": the largest relative
    difference of the outputs, the final states and every input's gradient."""
    leaves = {b: [_leaf(t) if t is not None else None for t in ins] for b in ("torch", "triton")}
    res = {}
    for b, ls in leaves.items():
        outs = fn(b, *ls)
        res[b] = (outs, _grads(outs, [t for t in ls if t is not None], seed))
    (o_t, g_t), (o_x, g_x) = res["torch"], res["triton"]
    return max([_maxdiff(a, b) for a, b in zip(o_x, o_t)] + [_maxdiff(a, b) for a, b in zip(g_x, g_t)])


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True], ids=["delta_rule", "gated_delta_rule"])
def test_delta_rule_docs_triton_route(gated):
    """delta_rule_docs on the Triton kernel's cu_seqlens path (each row's state routed to its first
    piece, its final state its last piece's) equals the PyTorch chunked form with resets: outputs,
    final states, gradients of q, k, v, (g,) β and the initial states. Float64 under the
    interpreter (the two forms differ by summation order only, ~1e-15)."""
    torch.manual_seed(0)
    for start, end in TRITON_SLICES:
        docs = _slice_docs(start, end)
        B, T, H, dk, dv = 3, end - start, 2, 4, 3
        q = torch.randn(B, H, T, dk, dtype=torch.float64)
        k = F.normalize(torch.randn(B, H, T, dk, dtype=torch.float64), dim=-1)
        v = torch.randn(B, H, T, dv, dtype=torch.float64)
        beta = torch.sigmoid(torch.randn(B, H, T, dtype=torch.float64))
        g = -0.3 * torch.rand(B, H, T, dtype=torch.float64) if gated else None
        S0 = torch.randn(B, H, dk, dv, dtype=torch.float64)
        fn = lambda b, q, k, v, beta, S0, g: cp.delta_rule_docs(q, k, v, beta, S0, docs, b, 16, g)
        err = _compare_backends(fn, [q, k, v, beta, S0, g], seed=start)
        assert err < TOL, f"slice [{start}, {end}): {err:.3e}"


@pytest.mark.slow
def test_selective_scan_docs_triton_route():
    """selective_scan_docs on the Triton kernel's cu_seqlens path equals the PyTorch chunked form
    with resets: outputs, final states and the gradients of every input and the initial states."""
    torch.manual_seed(1)
    Di, N = 5, 4
    A = -torch.rand(Di, N, dtype=torch.float64) - 0.5
    D = torch.randn(Di, dtype=torch.float64)
    bias = torch.randn(Di, dtype=torch.float64) * 0.1
    for start, end in TRITON_SLICES:
        docs = _slice_docs(start, end)
        B, T = 3, end - start
        x, z, delta = (torch.randn(B, T, Di, dtype=torch.float64) for _ in range(3))
        Bm, Cm = torch.randn(B, T, N, dtype=torch.float64), torch.randn(B, T, N, dtype=torch.float64)
        h0 = torch.randn(B, Di, N, dtype=torch.float64)

        def fn(b, x, delta, A, Bm, Cm, D, z, bias, h0):
            inp = dict(x=x, delta=delta, A=A, B=Bm, C=Cm, D=D, z=z, delta_bias=bias, delta_softplus=True,
                       chunk_size=4, resets=docs.starts)
            return cp.selective_scan_docs(inp, h0, docs, b)
        err = _compare_backends(fn, [x, delta, A, Bm, Cm, D, z, bias, h0], seed=start)
        assert err < TOL, f"slice [{start}, {end}): {err:.3e}"


@pytest.mark.slow
@pytest.mark.dist
def test_mixer_docs_triton(tmp_path):
    """DeltaNet on its Triton kernel (the interpreter on CPU) through cp_mixer with
    SliceDocs, 2 ranks: equal to the one-process packed run on the same kernels."""
    res = spawn_checks(2, __name__, tmp_path, "_triton_checks", stop_on_failure=True, timeout_s=120)
    for kind in TRITON_KINDS:
        assert_within((2,) + tuple(res), kind, TOL)
