"""Context parallelism against the single-process run, on CPU with gloo.

Each world size (2 and 4) is spawned once (a module fixture); every rank runs every check, both
the full-sequence run and its own slice of the split run, and writes, per check, the largest
difference it saw (outputs, input gradients, parameter gradients; relative to each tensor's
largest entry). The tests read
those numbers. Sequence lengths are not multiples of the world size, and with 4 ranks some
slices are shorter than the convolutions' width − 1, so halos span several ranks.

Everything is float64: the split runs reorder sums (chunk summaries combined across ranks,
exp of summed logs instead of running products), so the two runs agree to rounding, ~1e-14
relative to each tensor's largest entry; TOL = 1e-9 (relative to that entry) leaves room for
the chunked kernels' different summation orders and still fails on a wrong state, halo or
position, which shows up at ≥ 1e-4.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ttt_lm.model import LM
from ttt_lm.model.registry import kinds_with, layer_kinds, mixer_class
from ttt_lm.parallel import cp
from tests.distributed import assert_within, spawn_checks
from tests.model.mixer_checks import short_config

TOL = 1e-9
#: every layer kind of the registry
KINDS = list(layer_kinds())
#: the whole LM's layers: every kind
LM_PATTERN = KINDS
#: the kinds with a parallel form (summary combine or KV exchange), not state passing
PARALLEL_FORM_KINDS = list(kinds_with(lambda c: c.cp_form != "state_passing", KINDS))
#: the kinds whose forms read the loader's segment positions
SEGMENT_POS_KINDS = list(kinds_with(lambda c: c.takes_segment_pos, KINDS))
#: (kind, variant) of every mixer check: each of a kind's ``variants`` (its section's settings
#: changed by it: Titans' linear and MLP memories), or the kind as configured
MIXER_CASES = [(k, v) for k in KINDS for v in (list(mixer_class(k).variants) or [None])]


def _case_id(kind, variant) -> str:
    return kind if variant is None else f"{kind}-{variant}"


def _tiny_lm(pattern, variants=(), **ttt) -> LM:
    """The LM of ``pattern`` at d_model 16, every section at its tiny sizes of 3 tokens
    (``short_config``: chunks and mini-batches of 3, windows of 4); ``variants``: (kind, variant)
    whose settings (the kind's ``variants[variant]``) apply; ``ttt``: TTT's settings of the check
    (its block pre-conv)."""
    torch.manual_seed(0)
    cfg = short_config(list(pattern), 3, vocab_size=61, d_model=16, n_heads=2, tie_embeddings=False)
    for kind, variant in variants:
        cls = mixer_class(kind)
        for k, v in cls.variants[variant].items():
            setattr(getattr(cfg, cls.config_section), k, v)
    for k, v in ttt.items():
        setattr(cfg.ttt, k, v)
    return LM(cfg.validate()).to(torch.float64)


def _bounds(T, world, rank):
    lengths = cp.split_lengths(T, world)
    s = sum(lengths[:rank])
    return s, s + lengths[rank]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _maxdiff(a, b) -> float:
    """max |a − b| relative to max |b| (some outputs and gradients of the tiny models are
    ~1e-6 in size; relative to the tensor's scale the check stays as strict for them)."""
    if not a.numel():
        return 0.0
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-8))


def _sum_grads(params, group=None):
    for p in params:
        if p.grad is None:   # unused on this rank only (see allreduce_gradients)
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


# ---- checks: each returns the largest difference seen on this rank --------------------------

def check_linear_scan(rank, world, T):
    g = torch.Generator().manual_seed(1)
    log_a = -F.softplus(torch.randn(2, T, 5, generator=g, dtype=torch.float64))
    b = torch.randn(2, T, 5, generator=g, dtype=torch.float64)
    w = torch.randn(2, T, 5, generator=g, dtype=torch.float64)
    la, bb = _leaf(log_a), _leaf(b)
    from kernels.linear_scan import linear_scan
    h, hT = linear_scan(la, bb, backend="reference", output_final_state=True)
    (h * w).sum().backward()
    s, e = _bounds(T, world, rank)
    la_r, b_r = _leaf(log_a[:, s:e]), _leaf(b[:, s:e])
    h_r, hT_r = cp.cp_linear_scan(la_r, b_r, backend="torch", chunk_size=2)
    (h_r * w[:, s:e]).sum().backward()
    err = max(_maxdiff(h_r, h[:, s:e]), _maxdiff(la_r.grad, la.grad[:, s:e]), _maxdiff(b_r.grad, bb.grad[:, s:e]),
              _maxdiff(hT_r, h[:, e - 1]))
    return err


def check_delta_rule(rank, world, T):
    g = torch.Generator().manual_seed(2)
    B, H, dk, dv = 1, 2, 4, 3
    q = torch.randn(B, H, T, dk, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64))
    w = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    full = [_leaf(t) for t in (q, k, v, beta)]
    from kernels.delta_rule import delta_rule
    o, _ = delta_rule(*full, backend="reference")
    (o * w).sum().backward()
    s, e = _bounds(T, world, rank)
    loc = [_leaf(t[:, :, s:e]) for t in (q, k, v, beta)]
    o_r, S_r = cp.cp_delta_rule(*loc, backend="torch", chunk_size=2)
    (o_r * w[:, :, s:e]).sum().backward()
    _, S_full_here = delta_rule(q[:, :, :e], k[:, :, :e], v[:, :, :e], beta[:, :, :e], None, True, backend="reference")
    err = max(_maxdiff(o_r, o[:, :, s:e]), _maxdiff(S_r, S_full_here))
    for a, f in zip(loc, full):
        err = max(err, _maxdiff(a.grad, f.grad[:, :, s:e]))
    return err


def check_gated_delta_rule(rank, world, T):
    g = torch.Generator().manual_seed(2)
    B, H, dk, dv = 1, 2, 4, 3
    q = torch.randn(B, H, T, dk, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    lg = -0.3 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=torch.float64))
    w = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    full = [_leaf(t) for t in (q, k, v, lg, beta)]
    from kernels.gated_delta_rule import gated_delta_rule
    o, _ = gated_delta_rule(*full, backend="reference")
    (o * w).sum().backward()
    s, e = _bounds(T, world, rank)
    loc = [_leaf(t[:, :, s:e]) for t in (q, k, v, lg, beta)]
    o_r, S_r = cp.cp_gated_delta_rule(*loc, backend="torch", chunk_size=2)
    (o_r * w[:, :, s:e]).sum().backward()
    _, S_full_here = gated_delta_rule(*(t[:, :, :e] for t in (q, k, v, lg, beta)), None, True, backend="reference")
    err = max(_maxdiff(o_r, o[:, :, s:e]), _maxdiff(S_r, S_full_here))
    for a, f in zip(loc, full):
        err = max(err, _maxdiff(a.grad, f.grad[:, :, s:e]))
    return err


def _packed_positions(T):
    """Segment positions of two packed rows: row 0 starts inside a document and has resets on
    several ranks (a one-token document included), row 1 one reset."""
    row0 = [7, 8, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5][:T]
    row1 = [3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6][:T]
    return torch.tensor([row0, row1])


def check_mixer(kind, rank, world, T, segment_pos=None, variant=None):
    """One mixer (inside a 1-layer LM, for its initialization; ``variant``: one of its kind's
    ``variants``) through ``cp_mixer``: its ``cp_form`` (summary combine, KV gather or state
    passing). ``segment_pos``: packed-row positions, sliced per rank, given as the LM gives them
    (to the mixers that read them, ``takes_segment_pos``)."""
    mixer = _tiny_lm([kind], [(kind, variant)] if variant is not None else ()).layers[0].mixer
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(2, T, 16, generator=g, dtype=torch.float64)
    xf = _leaf(x)
    kw = {} if segment_pos is None or not mixer.takes_segment_pos else {"segment_pos": segment_pos}
    y, _ = mixer(xf, **kw)
    (y * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    xr = _leaf(x[:, s:e])
    y_r = cp.cp_mixer(mixer, xr, cp.split_lengths(T, world), tag=7,
                      position_ids_local=None if segment_pos is None else segment_pos[:, s:e])
    (y_r * w[:, s:e]).sum().backward()
    cp.wait_pending()
    _sum_grads(mixer.parameters())
    err = max(_maxdiff(y_r, y[:, s:e]), _maxdiff(xr.grad, xf.grad[:, s:e]))
    for n, p in mixer.named_parameters():
        if n in ref_grads:
            err = max(err, _maxdiff(p.grad, ref_grads[n]))
    return err


def check_state_passing_block(rank, world, T):
    """``pass_state_forward`` on a whole Block with a pre-conv (nested state: conv cache and
    TTT-MLP state, boundary inside a TTT mini-batch)."""
    block = _tiny_lm(["ttt_mlp"], pre_conv=True).layers[0]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(1, T, 16, generator=g, dtype=torch.float64)
    xf = _leaf(x)
    y, st_full = block(xf, None, True)
    (y * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    xr = _leaf(x[:, s:e])
    y_r, st = cp.pass_state_forward(block, xr, tag=3)
    (y_r * w[:, s:e]).sum().backward()
    cp.wait_pending()
    _sum_grads(block.parameters())
    err = max(_maxdiff(y_r, y[:, s:e]), _maxdiff(xr.grad, xf.grad[:, s:e]))
    err = max([err] + [_maxdiff(p.grad, ref[n]) for n, p in block.named_parameters() if n in ref])
    if rank == world - 1:   # the last rank ends with the full sequence's final state
        err = max(err, _maxdiff(st.mixer.W1, st_full.mixer.W1),
                  _maxdiff(st.pre_conv, st_full.pre_conv))
        if st.mixer.pos != st_full.mixer.pos:
            err = float("inf")
    return err


def _last_variants(pattern):
    """(kind, its last variant) of the kinds of ``pattern`` with variants: Titans' MLP memory, the
    nonlinear state passing (the mixer checks run every variant)."""
    return [(k, list(mixer_class(k).variants)[-1]) for k in dict.fromkeys(pattern) if mixer_class(k).variants]


def check_lm(rank, world, T, pattern=LM_PATTERN, impl="chunked", position_ids=None):
    model = _tiny_lm(pattern, _last_variants(pattern), pre_conv=True).set_impl(impl)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 61, (2, T), generator=g)
    labels = torch.randint(0, 61, (2, T), generator=g)
    labels[0, 1] = labels[1, T - 1] = -100
    logits = model(ids, position_ids=position_ids).logits
    loss = F.cross_entropy(logits.reshape(-1, 61), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    loss_r, logits_r = cp.context_parallel_forward(model, ids[:, s:e], labels[:, s:e],
                                                   position_ids_local=None if position_ids is None
                                                   else position_ids[:, s:e])
    loss_r.backward()
    cp.allreduce_gradients(model)
    mean_loss = loss_r.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    err = max(abs(float(mean_loss - loss.detach())), _maxdiff(logits_r, logits[:, s:e]))
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if missing:
        raise AssertionError(f"no gradient for {missing}")
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in model.named_parameters()])


# T per world size: not multiples of the world size; with 4 ranks slices of 2 < conv width − 1
T_OF = {2: 11, 4: 9}


def _checks(rank, world):
    T = T_OF[world]
    out = {"linear_scan": lambda: check_linear_scan(rank, world, T),
           "delta_rule": lambda: check_delta_rule(rank, world, T),
           "gated_delta_rule": lambda: check_gated_delta_rule(rank, world, T),
           "block_state_passing": lambda: check_state_passing_block(rank, world, T),
           "lm": lambda: check_lm(rank, world, T),
           # the sequential forms (impl="reference") of the mixers with a parallel form
           "lm_reference": lambda: check_lm(rank, world, T, PARALLEL_FORM_KINDS, "reference"),
           # the loader's positions through the whole LM, every kind of the registry: the kinds
           # that read them (the RG-LRU) reset on several ranks
           "lm_positions": lambda: check_lm(rank, world, T, KINDS, position_ids=_packed_positions(T))}
    for kind in SEGMENT_POS_KINDS:
        out["positions_" + kind] = (lambda kk: lambda: check_mixer(kk, rank, world, T, _packed_positions(T)))(kind)
    for kind, variant in MIXER_CASES:
        # packed rows, as the trainer runs them
        out["mixer_" + _case_id(kind, variant)] = (lambda kk, vv: lambda: check_mixer(
            kk, rank, world, T, _packed_positions(T), vv))(kind, variant)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory):
    world = request.param
    # a broken exchange fails the run in 60 s instead of hanging it
    res, err = spawn_checks(world, __name__, tmp_path_factory.mktemp(f"cp{world}"), "_checks",
                            stop_on_failure=True, timeout_s=60)
    return world, res, err


def _assert_check(results, name):
    assert_within(results, name, TOL)


@pytest.mark.dist
def test_linear_scan_summaries(results):
    """RG-LRU's scan: local scans combined by (Π a, local final state): outputs, gradients of
    log a and b, and the state after each slice."""
    _assert_check(results, "linear_scan")


@pytest.mark.dist
def test_delta_rule_summaries(results):
    """Delta rule: (P_r = Π(I − β k kᵀ), S_loc) summaries, exclusive scan, rerun; outputs,
    the state after each slice, gradients of q, k, v, β."""
    _assert_check(results, "delta_rule")


@pytest.mark.dist
def test_gated_delta_rule_summaries(results):
    """Gated delta rule: (P_r = Π α (I − β k kᵀ), S_loc) summaries, exclusive scan, rerun;
    outputs, the state after each slice, gradients of q, k, v, g, β."""
    _assert_check(results, "gated_delta_rule")


@pytest.mark.dist
@pytest.mark.parametrize("case", [_case_id(k, v) for k, v in MIXER_CASES])
def test_mixer(results, case):
    """Every mixer of the registry (each variant of its section) through cp_mixer on packed rows
    (their positions given as the LM gives them): outputs, input and parameter gradients."""
    _assert_check(results, "mixer_" + case)


@pytest.mark.dist
def test_block_state_passing(results):
    """A TTT-MLP block with a pre-conv, its nested state passed rank to rank; the last rank's
    final state is the full sequence's."""
    _assert_check(results, "block_state_passing")


@pytest.mark.dist
def test_lm(results):
    """The whole LM (every layer kind of the registry, TTT pre-convs, untied head, ignored labels): mean of the
    local losses, logits and all-reduced gradients equal the full-sequence run."""
    _assert_check(results, "lm")


def test_split_lengths():
    assert cp.split_lengths(11, 4) == [3, 3, 3, 2]
    assert cp.split_lengths(8, 2) == [4, 4]
    assert sum(cp.split_lengths(5, 8)) == 5


@pytest.mark.dist
@pytest.mark.parametrize("kind", SEGMENT_POS_KINDS)
def test_segment_positions(results, kind):
    """A kind that reads segment positions (the RG-LRU), given packed rows' positions (a row
    starting inside a document, resets on several ranks): the summaries cut at resets, the conv
    halo masked by position; outputs and gradients equal the single-process run."""
    _assert_check(results, "positions_" + kind)


@pytest.mark.dist
def test_lm_position_ids(results):
    """The whole LM with every layer kind of the registry, given packed rows' position_ids (they
    reach the RG-LRU), equals the single-process run."""
    _assert_check(results, "lm_positions")


@pytest.mark.dist
def test_lm_reference_forms(results):
    """The kinds with a parallel form, each in its sequential reference form (impl="reference")."""
    _assert_check(results, "lm_reference")
