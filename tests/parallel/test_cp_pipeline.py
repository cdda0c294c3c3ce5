"""State passing pipelined over groups of batch rows (``pass_state_forward(..., chunks=M)``)
against the single-process run, on CPU with gloo, with 2 and 4 ranks.

Every rank runs every check (as in ``test_context_parallel``) and writes the largest difference
it saw; float64 throughout and the same TOL = 1e-9 relative to each tensor's largest entry: the
row groups are the same arithmetic as the whole batch, so a wrong state (a group's state sent to
another group, a gradient received under the wrong tag) shows up at ≥ 1e-4. Row counts are not
multiples of M, so the groups are uneven.

The overlap check runs a module that sleeps a fixed time per call and records when each call
started and ended: with M groups, rank 1 starts its first group before rank 0 ends its last, and
the whole forward spans about (M + c − 1) calls, not c·M; in the backward pass rank c − 2 starts
before rank c − 1 ends.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ttt_lm.model.registry import builtin_kinds, mixer_class
from ttt_lm.parallel import cp
from tests.distributed import assert_within, spawn_checks
from tests.parallel.test_context_parallel import _bounds, _leaf, _maxdiff, _sum_grads, _tiny_lm

TOL = 1e-9
#: every built-in kind that runs split across ranks by handing its state on (the registry's cp_form)
STATE_PASSING_KINDS = [k for k in builtin_kinds() if mixer_class(k).cp_form == "state_passing"]
#: the hybrid LM's layers: every built-in kind (the parallel forms and the pipelined ones)
HYBRID = list(builtin_kinds())
T_OF = {2: 11, 4: 9}


def check_mixer(kind, rank, world, T, B, chunks):
    mixer = _tiny_lm([kind]).layers[0].mixer
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    xf = _leaf(x)
    y, _ = mixer(xf)
    (y * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    xr = _leaf(x[:, s:e])
    y_r = cp.cp_mixer(mixer, xr, cp.split_lengths(T, world), tag=5, chunks=chunks)
    (y_r * w[:, s:e]).sum().backward()
    cp.wait_pending()
    _sum_grads(mixer.parameters())
    err = max(_maxdiff(y_r, y[:, s:e]), _maxdiff(xr.grad, xf.grad[:, s:e]))
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in mixer.named_parameters() if n in ref])


def check_block(rank, world, T, chunks):
    """A TTT-MLP block with a pre-conv (nested state); the last rank's final state, the row
    groups' states put together, is the full sequence's."""
    block = _tiny_lm(["ttt_mlp"], pre_conv=True).layers[0]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(3, T, 16, generator=g, dtype=torch.float64)
    xf = _leaf(x)
    y, st_full = block(xf, None, True)
    (y * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    xr = _leaf(x[:, s:e])
    y_r, st = cp.pass_state_forward(block, xr, tag=2, chunks=chunks)
    (y_r * w[:, s:e]).sum().backward()
    cp.wait_pending()
    _sum_grads(block.parameters())
    err = max(_maxdiff(y_r, y[:, s:e]), _maxdiff(xr.grad, xf.grad[:, s:e]))
    err = max([err] + [_maxdiff(p.grad, ref[n]) for n, p in block.named_parameters() if n in ref])
    if rank == world - 1:
        err = max(err, _maxdiff(st.mixer.W2, st_full.mixer.W2),
                  _maxdiff(st.pre_conv, st_full.pre_conv))
        if st.mixer.pos != st_full.mixer.pos:
            err = float("inf")
    return err


def check_lm(rank, world, T, B, chunks):
    """A hybrid LM of every built-in kind (the parallel forms split, the state-passing ones pipelined)."""
    model = _tiny_lm(HYBRID, pre_conv=True)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 61, (B, T), generator=g)
    labels = torch.randint(0, 61, (B, T), generator=g)
    labels[0, 1] = -100
    logits = model(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, 61), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    s, e = _bounds(T, world, rank)
    loss_r, logits_r = cp.context_parallel_forward(model, ids[:, s:e], labels[:, s:e], chunks=chunks)
    loss_r.backward()
    cp.allreduce_gradients(model)
    mean_loss = loss_r.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    err = max(abs(float(mean_loss - loss.detach())), _maxdiff(logits_r, logits[:, s:e]))
    return max([err] + [_maxdiff(p.grad, ref[n]) for n, p in model.named_parameters()])


class _SleepBack(torch.autograd.Function):
    """(y, h) unchanged; the backward (of both at once, as a layer's is) sleeps and logs."""

    @staticmethod
    def forward(ctx, owner, y, h):
        ctx.owner = owner
        return y.clone(), h.clone()

    @staticmethod
    def backward(ctx, gy, gh):
        t0 = time.time()
        time.sleep(ctx.owner.dt)
        ctx.owner.back_log.append((t0, time.time()))
        return None, gy, gh


class _Sleepy(torch.nn.Module):
    """A prefix sum: y_t = x_t + h_in + Σ_{τ<t} x_τ, h_out = h_in + Σ_t x_t; each call sleeps
    ``dt`` (forward and backward) and logs (start, end)."""

    def __init__(self, dt):
        super().__init__()
        self.dt, self.log, self.back_log = dt, [], []

    def forward(self, x, state=None, output_state=False):
        t0 = time.time()
        time.sleep(self.dt)
        h = x.new_zeros(x.shape[0], x.shape[2]) if state is None else state["h"]
        self.log.append((t0, time.time()))
        y, h = _SleepBack.apply(self, x + h[:, None] + x.cumsum(1) - x, h + x.sum(1))
        return y, {"h": h}


def check_overlap(rank, world, chunks=4, dt=0.15):
    """Returns 0.0 when the ranks overlapped as the pipeline promises, else a message."""
    m = _Sleepy(dt)
    x = torch.ones(chunks, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.arange(chunks * 2 * world * 3, dtype=torch.float64).reshape(chunks, 2 * world, 3)
    dist.barrier()
    y, _ = cp.pass_state_forward(m, x, tag=9, chunks=chunks)
    (y * w[:, 2 * rank:2 * rank + 2]).sum().backward()
    cp.wait_pending()
    logs = [None] * world
    dist.all_gather_object(logs, (m.log, m.back_log))
    xf = torch.ones(chunks, 2 * world, 3, dtype=torch.float64, requires_grad=True)
    ref, _ = _Sleepy(0.0)(xf)   # one process
    (ref * w).sum().backward()
    if not torch.equal(y, ref[:, 2 * rank:2 * rank + 2]) or not torch.equal(x.grad, xf.grad[:, 2 * rank:2 * rank + 2]):
        return f"wrong outputs or gradients on rank {rank}: {y.flatten().tolist()}, {x.grad.flatten().tolist()}"
    fwd, bwd = [f for f, _ in logs], [b for _, b in logs]
    if not fwd[1][0][0] < fwd[0][-1][1]:
        return f"rank 1 started its first group after rank 0 ended its last: {fwd}"
    # backward: the last rank goes first; the one before it starts while it is still busy
    if not bwd[-2][0][0] < bwd[-1][-1][1]:
        return f"backward: rank {world - 2} started after rank {world - 1} ended: {bwd}"
    span = fwd[-1][-1][1] - fwd[0][0][0]
    piped, serial = (chunks + world - 1) * dt, chunks * world * dt
    if span > (piped + serial) / 2:
        return f"forward spanned {span:.2f} s: pipelined {piped:.2f} s expected, serial would be {serial:.2f} s"
    return 0.0


def check_wavefront(rank, world, layers=3, chunks=2, dt=0.25):
    """Consecutive state-passing layers pipeline across layers too: rank 0 goes on to the next
    layer without waiting, so the run spans about (K·M + c − 1) calls, not K·(M + c − 1)."""
    mods = [_Sleepy(dt) for _ in range(layers)]
    x = torch.ones(chunks, 2, 3, dtype=torch.float64)
    dist.barrier()
    for i, m in enumerate(mods):
        x, _ = cp.pass_state_forward(m, x, tag=20 + i, chunks=chunks)
    cp.wait_pending()
    logs = [None] * world
    dist.all_gather_object(logs, [m.log for m in mods])
    ref = torch.ones(chunks, 2 * world, 3, dtype=torch.float64)   # the whole sequence in one process
    for _ in range(layers):
        ref, _ = _Sleepy(0.0)(ref)
    if not torch.equal(x, ref[:, 2 * rank:2 * rank + 2]):
        return f"wrong outputs on rank {rank}: {x.flatten().tolist()}"
    span = logs[-1][-1][-1][1] - logs[0][0][0][0]
    wave, per_layer = (layers * chunks + world - 1) * dt, layers * (chunks + world - 1) * dt
    if span > (wave + per_layer) / 2:
        return f"{layers} layers spanned {span:.2f} s: {wave:.2f} s expected, layer after layer {per_layer:.2f} s"
    return 0.0


def _checks(rank, world):
    T = T_OF[world]
    out = {}
    for kind in STATE_PASSING_KINDS:
        out[f"mixer_{kind}"] = (lambda k: lambda: max(check_mixer(k, rank, world, T, 3, 2),
                                                      check_mixer(k, rank, world, T, 3, 3)))(kind)
    out["block"] = lambda: check_block(rank, world, T, 2)
    out["lm"] = lambda: max(check_lm(rank, world, T, 3, 2), check_lm(rank, world, T, 4, 4))
    out["overlap"] = lambda: check_overlap(rank, world)
    out["wavefront"] = lambda: check_wavefront(rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory):
    world = request.param
    # a broken exchange fails the run in 60 s instead of hanging it
    res, err = spawn_checks(world, __name__, tmp_path_factory.mktemp(f"cppipe{world}"), "_checks",
                            stop_on_failure=True, timeout_s=60)
    return world, res, err


def _assert_check(results, name):
    assert_within(results, name, TOL)


@pytest.mark.dist
@pytest.mark.parametrize("kind", STATE_PASSING_KINDS)
def test_pipelined_mixer(results, kind):
    """A state-passing mixer pipelined over 2 and over 3 groups of 3 rows: outputs, input and
    parameter gradients equal the single-process run."""
    _assert_check(results, "mixer_" + kind)


@pytest.mark.dist
def test_pipelined_block(results):
    """A TTT-MLP block with a pre-conv over 2 row groups, and the last rank's final state."""
    _assert_check(results, "block")


@pytest.mark.dist
def test_pipelined_hybrid_lm(results):
    """A hybrid LM of every built-in kind with its state-passing blocks pipelined (3 rows in 2 groups, 4 rows in 4): loss, logits, gradients."""
    _assert_check(results, "lm")


@pytest.mark.dist
def test_pipeline_overlaps(results):
    """The ranks run at the same time: rank 1 starts before rank 0 ends, and the forward spans
    about (M + c − 1) calls rather than c·M; backward, rank c − 2 starts before rank c − 1 ends
    (outputs and input gradients of the stand-in layer checked too)."""
    _assert_check(results, "overlap")


@pytest.mark.dist
def test_pipeline_wavefront_across_layers(results):
    """Three consecutive state-passing layers over 2 row groups overlap across layers as well."""
    _assert_check(results, "wavefront")


def test_chunks_checked():
    m = _Sleepy(0.0)
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="3 pipeline chunks need at least 3 batch rows"):
        cp.pass_state_forward(m, x, chunks=3)
    with pytest.raises(ValueError, match="integer >= 1"):
        cp.pass_state_forward(m, x, chunks=0)
