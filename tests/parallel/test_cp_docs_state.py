"""State passing with packed documents (``pass_state_forward(..., docs=SliceDocs)``) against the
single-process run ``module(x, docs=DocLayout.build(position_ids))``, on CPU with gloo, with 2
and 4 ranks.

Each world size is spawned once; every rank runs every check (the one-process run and its own
slice of the split run) and returns the largest difference it saw in the outputs of its slice,
the input gradients and the parameter gradients summed over the ranks, each relative to the
reference tensor's largest entry. float64 throughout, TOL = 1e-9 as in
``test_context_parallel``: the split run is the same arithmetic cut at other places (the
pieces before a slice's first document start run from the state handed on), so it agrees to
rounding (~1e-14); a state read where a document starts, or a piece's output taken from the wrong
call, shows up at ≥ 1e-3.

The positions (``POS``, 12 tokens, slices [0, 6) [6, 12) with 2 ranks, [0, 3) [3, 6) [6, 9)
[9, 12) with 4): rows 0, 2 and 3 start inside a document; row 0's second document starts at rank 1's
first token (4 ranks) and crosses every later boundary, spanning whole slices; row 1 has
one-token documents (at a slice's last token: the state handed on is that of a one-token
piece) and documents starting at the first token of a slice (6 with 2 ranks; 3, 6, 9 with 4);
row 2 continues a document into the next slice and starts another inside it (with 4 ranks the
state rank 1 hands on is its last piece's from a fresh state, not a continuation of the state it
received); row 3 is one document. The chunks and mini-batches of the state-passing kinds are 3
and 4 (test_context_parallel's tiny model), so document and slice boundaries fall inside them. Only 4 ranks have a rank after a rank > 0 (the state
such a rank hands on, after receiving one, is checked there).

Each spawn takes ~25 s (2 ranks) and ~40 s (4 ranks) on 2 cores: the tests are marked slow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ttt_lm.model.docs import DocLayout
from ttt_lm.model.registry import builtin_kinds, mixer_class
from ttt_lm.parallel import cp
from tests.distributed import assert_within, spawn_checks
from tests.parallel.test_context_parallel import _bounds, _leaf, _maxdiff, _sum_grads, _tiny_lm

TOL = 1e-9
T = 12
POS = torch.tensor([[5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 8],
                    [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 2],
                    [4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 0, 1],
                    [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
B = POS.shape[0]
#: every built-in kind that runs split across ranks by handing its state on (the registry's cp_form)
STATE_PASSING_KINDS = [k for k in builtin_kinds() if mixer_class(k).cp_form == "state_passing"]
#: (case name, kind, section settings): each state-passing kind, one case per entry of its class's
#: ``variants`` (Titans' linear and MLP memories)
MIXER_CASES = [(k if not v else f"{k}_{v}", k, dict(sub))
               for k in STATE_PASSING_KINDS for v, sub in (mixer_class(k).variants.items() or [(None, {})])]
#: the kind the pipelined, handed-on, block and refusal checks run: the last state-passing kind
LAST = STATE_PASSING_KINDS[-1]


#: every row restarts at every slice's first token (3, 6, 9): no row of a rank > 0 reads the state
#: handed to it, whose gradient (zero) must still go back
POS_AT_SLICES = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
                              [1, 0, 1, 0, 1, 2, 0, 1, 2, 0, 0, 1]])


def _slice_docs(rank, world, pos=POS):
    s, e = _bounds(T, world, rank)
    return cp.SliceDocs.of(DocLayout.build(pos), s, e), s, e


def _compare(module, run_split, rank, world, seed, pos=POS):
    """The one-process run of ``module`` over the whole rows with ``DocLayout.build(pos)`` against
    ``run_split(x_local, docs)`` on this rank's slice: outputs, input gradients, parameter
    gradients (summed over the ranks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pos.shape[0], T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(pos.shape[0], T, 16, generator=g, dtype=torch.float64)
    xf = _leaf(x)
    y, _ = module(xf, None, False, docs=DocLayout.build(pos))
    (y * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    docs, s, e = _slice_docs(rank, world, pos)
    xr = _leaf(x[:, s:e])
    y_r = run_split(xr, docs)
    (y_r * w[:, s:e]).sum().backward()
    cp.wait_pending()
    _sum_grads(module.parameters())
    err = max(_maxdiff(y_r, y[:, s:e]), _maxdiff(xr.grad, xf.grad[:, s:e]))
    missing = [n for n in ref if module.get_parameter(n).grad is None]
    if missing:
        raise AssertionError(f"no gradient for {missing}")
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in module.named_parameters() if n in ref])


def check_mixer(kind, rank, world, chunks=1, pos=POS, **section):
    """One state-passing mixer (of a 1-layer LM, for its initialization) through ``cp_mixer``;
    ``section``: settings of the kind's config section (a variant)."""
    model = _tiny_lm([kind])
    if section:   # the same config with these settings, the same seed on every rank
        sec = getattr(model.cfg, mixer_class(kind).config_section)
        for k, v in section.items():
            setattr(sec, k, v)
        torch.manual_seed(0)
        model = type(model)(model.cfg).to(torch.float64)
    mixer = model.layers[0].mixer
    lengths = cp.split_lengths(T, world)
    return _compare(mixer, lambda xr, docs: cp.cp_mixer(mixer, xr, lengths, tag=3, chunks=chunks, docs=docs),
                    rank, world, seed=10, pos=pos)


def check_block(rank, world, chunks=1, model=None):
    """A block (its state nested: the mixer's inside the block's) through ``pass_state_forward``;
    ``model``: the 1-layer LM whose block it is (default: LAST's)."""
    block = (model if model is not None else _tiny_lm([LAST])).layers[0]
    return _compare(block, lambda xr, docs: cp.pass_state_forward(block, xr, tag=4, chunks=chunks, docs=docs)[0],
                    rank, world, seed=11)


def check_handed_on(rank, world):
    """The states a rank hands on (one per row) are those of the one-process run after its
    slice: each row's last piece read alone (every tensor of the state, and its position)."""
    mixer = _tiny_lm([LAST]).layers[0].mixer
    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    docs, s, e = _slice_docs(rank, world)
    with torch.no_grad():
        _, finals = cp.pass_state_forward(mixer, x[:, s:e], tag=5, docs=docs)
    cp.wait_pending()
    if rank == world - 1:
        return 0.0 if finals is None else float("inf")
    layout = DocLayout.build(POS)
    err = 0.0
    for b in range(B):
        begin = int(torch.nonzero(layout.starts[b, :e])[-1])     # the start of the piece holding e − 1
        with torch.no_grad():
            _, st = mixer(x[b:b + 1, begin:e], None, True)
        got, want = finals[b].named_tensors(), st.named_tensors()
        if not want or [n for n, _ in got] != [n for n, _ in want]:
            return float("inf")
        err = max([err] + [_maxdiff(a, w) for (_, a), (_, w) in zip(got, want)])
        if finals[b].pos != st.pos:
            err = float("inf")
    return err


def check_lm(rank, world, chunks, model=None):
    """``context_parallel_forward`` of an LM whose blocks all pass their state (default: one layer
    of every state-passing kind), with ``model.reset_at_doc_boundaries`` and the loader's
    positions, against ``LM.forward(ids, position_ids=POS)``: loss, logits, every gradient."""
    model = model if model is not None else _tiny_lm(STATE_PASSING_KINDS)
    model.cfg.reset_at_doc_boundaries = True
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, 61, (B, T), generator=g)
    labels = torch.randint(0, 61, (B, T), generator=g)
    logits = model(ids, position_ids=POS).logits
    loss = F.cross_entropy(logits.reshape(-1, 61), labels.reshape(-1))
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    loss_r, logits_r = cp.context_parallel_forward(model, ids[:, s:e], labels[:, s:e], chunks=chunks,
                                                   position_ids_local=POS[:, s:e])
    loss_r.backward()
    cp.allreduce_gradients(model)
    mean_loss = loss_r.detach().clone()
    torch.distributed.all_reduce(mean_loss)
    mean_loss /= world
    err = max(abs(float(mean_loss - loss.detach())) / float(loss.detach()), _maxdiff(logits_r, logits[:, s:e]))
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in model.named_parameters()])


def check_bad_docs(rank, world):
    """Rank 0 given the next rank's SliceDocs (rows continuing an earlier rank's document) raises
    before any exchange, naming the problem."""
    if rank != 0:
        return 0.0
    mixer = _tiny_lm([LAST]).layers[0].mixer
    docs, s, e = _slice_docs(1, world)
    x = torch.zeros(B, e - s, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="rank 0's rows cannot continue a document of an earlier rank"):
        cp.pass_state_forward(mixer, x, tag=6, docs=docs)
    return 0.0


def _checks(rank, world):
    out = {f"mixer_{name}": (lambda kk, sub: lambda: check_mixer(kk, rank, world, **sub))(k, sub)
           for name, k, sub in MIXER_CASES}
    # the row-group pipeline: 2 groups of 2 rows, each with its own SliceDocs
    out["mixer_pipelined_chunks2"] = lambda: check_mixer(LAST, rank, world, chunks=2)
    out["mixer_at_slices"] = lambda: max(check_mixer(LAST, rank, world, pos=POS_AT_SLICES),
                                         check_mixer(LAST, rank, world, chunks=2, pos=POS_AT_SLICES))
    out["block"] = lambda: check_block(rank, world)
    out["block_chunks2"] = lambda: check_block(rank, world, chunks=2)
    out["handed_on"] = lambda: check_handed_on(rank, world)
    out["lm_chunks2"] = lambda: check_lm(rank, world, chunks=2)
    out["bad_docs"] = lambda: check_bad_docs(rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory):
    world = request.param
    # a broken exchange fails the run in 60 s instead of hanging it
    res, err = spawn_checks(world, __name__, tmp_path_factory.mktemp(f"cpdocs{world}"), "_checks",
                            stop_on_failure=True, timeout_s=60)
    return world, res, err


def test_positions_cover_the_cases():
    """The cases the module docstring names are in POS for both world sizes."""
    layout = DocLayout.build(POS)
    for world in (2, 4):
        firsts = [_bounds(T, world, r)[0] for r in range(1, world)]
        assert any(bool(layout.starts[b, f]) for b in range(B) for f in firsts)   # a start at a slice's first token
        heads = [cp.SliceDocs.of(layout, *_bounds(T, world, r)) for r in range(1, world)]
        assert any(bool((d.continues & (d.head < d.starts.shape[1])).any()) for d in heads)  # continue, then start
        assert any(bool((d.continues & (d.head == d.starts.shape[1])).any()) for d in heads)  # a whole slice
    one_token = layout.starts & torch.cat([layout.starts[:, 1:], torch.ones(B, 1, dtype=torch.bool)], 1)
    assert bool(one_token[:, 1:].any())
    assert bool((POS[:, 0] > 0).any())    # a row starts inside a document


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", [name for name, _, _ in MIXER_CASES])
def test_state_passing_mixer_docs(results, case):
    """Every state-passing kind (each variant: Titans' linear and MLP memories) through
    ``cp_mixer`` with packed documents: outputs, input and parameter gradients equal the
    one-process run."""
    assert_within(results, "mixer_" + case, TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_pipelined_mixer_docs(results):
    """The last state-passing kind pipelined over 2 row groups, each with its own rows' SliceDocs."""
    assert_within(results, "mixer_pipelined_chunks2", TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_no_row_continues(results):
    """Every row restarts at every slice's first token: no rank reads the state handed to it,
    and the zero gradient of that state still goes back to the rank that sent it (else that rank
    waits for it forever); one row group and two."""
    assert_within(results, "mixer_at_slices", TOL)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", ["block", "block_chunks2"])
def test_block_docs(results, name):
    """A block of the last state-passing kind (its state nested in the block's, handed on per
    row), in one row group and in 2; TTT's block with its pre-conv: test_ttt_cp_docs.py."""
    assert_within(results, name, TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_states_handed_on(results):
    """The per-row states a rank hands on equal the one-process state of each row's piece that
    holds the slice's last token (the last rank returns none)."""
    assert_within(results, "handed_on", TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_lm_docs_state_passing(results):
    """``context_parallel_forward`` with document resets on an LM of every state-passing kind,
    pipelined over 2 row groups: loss, logits, gradients."""
    assert_within(results, "lm_chunks2", TOL)


@pytest.mark.dist
@pytest.mark.slow
def test_rank0_docs_checked(results):
    """SliceDocs of a later rank on rank 0 is a ValueError."""
    assert_within(results, "bad_docs", TOL)


def test_docs_shape_checked():
    docs = cp.SliceDocs.of(DocLayout.build(POS), 0, T)
    block = _tiny_lm([LAST]).layers[0]
    with pytest.raises(ValueError, match=r"docs \(SliceDocs\) cover \[B, T_r\] = \[4, 12\]"):
        cp.pass_state_forward(block, torch.zeros(B, T - 1, 16, dtype=torch.float64), docs=docs)
