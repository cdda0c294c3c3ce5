"""Tensor and sequence parallelism against the single-process computation, with real gloo
processes on CPU.

Each world size is spawned once (a module fixture); the workers run every check and report, per
check, None or the failure's traceback, so each test below asserts one check.

Tolerance: float64 throughout, and the TP computation differs from the single-process one only
in the order of summation (partial products summed across ranks by the all-reduce), so the
differences are rounding, ~1e-15 relative. rtol = 1e-9, atol = 1e-12 leaves margin for that
and still fails on any missing, duplicated or mis-sliced term (an O(1) relative error).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tests.parallel.tp_common import tp_lm_vs_single
from tests.distributed import assert_all_passed, spawn_checks

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-9, atol=1e-12)


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{msg}: {m}")


# ---- process launch ----------------------------------------------------------------------------


def _launch(world, suite, out_dir):
    return spawn_checks(world, __name__, out_dir, "SUITES", suite=suite)


def _assert_ok(results, name):
    assert_all_passed(results[0], name, results[1])


# ---- checks (run inside the workers) -----------------------------------------------------------
_GROUPS = {}


def _tp_group(tp):
    # new_group is collective and not free: build each layout once per worker
    from ttt_lm.parallel.groups import build_groups
    if tp not in _GROUPS:
        _GROUPS[tp] = build_groups(tp_size=tp)
    return _GROUPS[tp]


def _ctx(sp, tp=None):
    from ttt_lm.parallel.tensor_parallel import TPContext
    g = _tp_group(tp or dist.get_world_size())
    return TPContext(g.tp_group, sp), g


def _rand(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def check_column(sp=False):
    from ttt_lm.parallel.tensor_parallel import ColumnParallelLinear
    ctx, _ = _ctx(sp)
    p, r = ctx.world_size, ctx.rank
    B, T, Din, Dout = 2, 4, 6, 8
    torch.manual_seed(0)
    full = nn.Linear(Din, Dout, bias=True).double()
    x, gy = _rand(B, T, Din, seed=1), _rand(B, T, Dout, seed=2)
    xr = x.clone().requires_grad_()
    (full(xr) * gy).sum().backward()
    for gather in (False, True):
        m = ColumnParallelLinear.from_linear(full, ctx, gather_output=gather)
        close(m.weight, full.weight.detach().chunk(p, 0)[r], "weight is a row slice")
        xin = (x.chunk(p, 1)[r] if sp else x).clone().requires_grad_()
        y = m(xin)
        gy_mine = gy if gather else gy.chunk(p, -1)[r]
        close(y, full(x).detach() if gather else full(x).detach().chunk(p, -1)[r], f"forward gather={gather}")
        (y * gy_mine).sum().backward()
        close(xin.grad, xr.grad.chunk(p, 1)[r] if sp else xr.grad, f"input grad gather={gather}")
        close(m.weight.grad, full.weight.grad.chunk(p, 0)[r], "weight grad")
        close(m.bias.grad, full.bias.grad.chunk(p, 0)[r], "bias grad")


def check_row(sp=False):
    from ttt_lm.parallel.tensor_parallel import RowParallelLinear
    ctx, _ = _ctx(sp)
    p, r = ctx.world_size, ctx.rank
    B, T, Din, Dout = 2, 4, 8, 6
    torch.manual_seed(0)
    full = nn.Linear(Din, Dout, bias=True).double()
    x, gy = _rand(B, T, Din, seed=1), _rand(B, T, Dout, seed=2)
    xr = x.clone().requires_grad_()
    (full(xr) * gy).sum().backward()
    for parallel_in in (True, False):
        m = RowParallelLinear.from_linear(full, ctx, input_is_parallel=parallel_in)
        close(m.weight, full.weight.detach().chunk(p, 1)[r], "weight is a column slice")
        xin = (x.chunk(p, -1)[r] if parallel_in else x).clone().requires_grad_()
        y = m(xin)
        want = full(x).detach()
        close(y, want.chunk(p, 1)[r] if sp else want, f"forward input_is_parallel={parallel_in}")
        (y * (gy.chunk(p, 1)[r] if sp else gy)).sum().backward()
        close(xin.grad, xr.grad.chunk(p, -1)[r] if parallel_in else xr.grad, "input grad")
        close(m.weight.grad, full.weight.grad.chunk(p, 1)[r], "weight grad")
        close(m.bias.grad, full.bias.grad, "bias grad (summed over the sequence shards)")


def check_embedding(sp=False):
    from ttt_lm.parallel.tensor_parallel import VocabParallelEmbedding
    ctx, _ = _ctx(sp)
    p, r = ctx.world_size, ctx.rank
    V, D, B, T = 16, 5, 2, 4
    torch.manual_seed(0)
    full = nn.Embedding(V, D).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    gy = _rand(B, T, D, seed=4)
    (full(ids) * gy).sum().backward()
    m = VocabParallelEmbedding.from_embedding(full, ctx)
    y = m(ids)
    want = full(ids).detach()
    close(y, want.chunk(p, 1)[r] if sp else want, "forward")
    (y * (gy.chunk(p, 1)[r] if sp else gy)).sum().backward()
    close(m.weight.grad, full.weight.grad.chunk(p, 0)[r], "weight grad")


def check_cross_entropy():
    from ttt_lm.parallel.tensor_parallel import vocab_parallel_cross_entropy
    ctx, _ = _ctx(False)
    p, r = ctx.world_size, ctx.rank
    N, V = 12, 16
    z = _rand(N, V, seed=5) * 3
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(6))
    t[1] = t[7] = -100  # ignored
    t[0], t[2] = 0, V - 1  # first and last shard
    for red in ("mean", "sum", "none"):
        zr = z.clone().requires_grad_()
        want = F.cross_entropy(zr, t, ignore_index=-100, reduction=red)
        g = _rand(*want.shape, seed=7) if red == "none" else torch.tensor(1.7, dtype=torch.float64)
        (want * g).sum().backward()
        zl = z.chunk(p, -1)[r].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(zl, t, ctx.group, reduction=red)
        close(got, want.detach(), f"loss {red}")
        (got * g).sum().backward()
        close(zl.grad, zr.grad.chunk(p, -1)[r], f"grad {red}")
    # all targets ignored: nan, as F.cross_entropy
    allign = torch.full((N,), -100)
    assert torch.isnan(vocab_parallel_cross_entropy(z.chunk(p, -1)[r], allign, ctx.group))
    # bf16 logits: computed in float32, gradient back in bf16
    zb = z.to(torch.bfloat16)
    got = vocab_parallel_cross_entropy(zb.chunk(p, -1)[r], t, ctx.group)
    want = F.cross_entropy(zb.float(), t, ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # both float32 from the same bf16 inputs


def check_sequence_collectives():
    from ttt_lm.parallel import tensor_parallel as tpl
    ctx, _ = _ctx(True)
    p, r, g = ctx.world_size, ctx.rank, ctx.group
    x = _rand(2, 4, 6, seed=8)
    gy = _rand(2, 4, 6, seed=9)
    # scatter then gather (split backward) is the identity, gradient included
    xr = x.clone().requires_grad_()
    y = tpl.gather_from_sequence_parallel_region(tpl.scatter_to_sequence_parallel_region(xr, g), g,
                                                 grad_is_partial=False)
    close(y, x, "scatter∘gather")
    (y * gy).sum().backward()
    close(xr.grad, gy, "its gradient")
    # the same along the features
    xr = x.clone().requires_grad_()
    y = tpl.gather_from_tensor_parallel_region(tpl.scatter_to_tensor_parallel_region(xr, g), g)
    close(y, x, "feature scatter∘gather")
    (y * gy).sum().backward()
    close(xr.grad, gy, "its gradient")
    # reduce-scatter of per-rank partial terms = the slice of their sum
    part = x * (r + 1)
    rs = tpl.reduce_scatter_to_sequence_parallel_region(part, g)
    close(rs, (x * sum(range(1, p + 1))).chunk(p, 1)[r], "reduce-scatter")


def _tiny_cfg(d_ff, tie=True, n_layers=2):
    """The default preset's hybrid (configs/tiny.yaml's pattern) at the tests' tiny sizes (n = 2:
    windows of 3): the LM's own parallel pieces (embedding, tied or untied head, MLP, sequence
    regions) are what is checked here; each kind's TP is test_tp_mixers.py's."""
    from tests.model.mixer_checks import preset_config
    return preset_config("tiny", 2, vocab_size=32, d_model=16, n_layers=n_layers, n_heads=4, d_ff=d_ff,
                         tie_embeddings=tie, max_seq_len=64)


def _lm_vs_single(cfg, sp, tp, data_seed=0, checkpointing=False):
    # the structured init as it is: tied/untied heads are what is checked here
    tp_lm_vs_single(cfg, _tp_group(tp), sp, close, T=8, n_masked=3, data_seed=data_seed, perturb=False,
                    checkpointing=checkpointing, nonzero_grads=False)


def check_lm_no_mlp(sp):
    tie = not sp  # cover untied heads in one of the two runs
    _lm_vs_single(_tiny_cfg(d_ff=0, tie=tie), sp, dist.get_world_size())


def check_lm_hybrid(sp):
    _lm_vs_single(_tiny_cfg(d_ff=24), sp, dist.get_world_size(), checkpointing=sp)


def check_refuses_other_mixers():
    """A layer whose kind has no plan (the last built-in kind with its plan removed: every
    built-in kind declares one) is refused, naming the kind and the TP-ready ones, and the model
    is left as it was."""
    from unittest import mock
    from tests.model.mixer_checks import short_config
    from ttt_lm.model.lm import LM
    from ttt_lm.model.registry import builtin_kinds, mixer_class
    from ttt_lm.parallel.tp_model import parallelize_tp
    groups = _tp_group(dist.get_world_size())
    first, last = builtin_kinds()[0], builtin_kinds()[-1]
    m = LM(short_config([first, last], 2, vocab_size=32, n_heads=4, d_ff=0))
    before = [(n, type(x)) for n, x in m.named_modules()]
    try:
        with mock.patch.object(mixer_class(last), "tp_plan", classmethod(lambda cls, cfg: None)):
            parallelize_tp(m, groups)
    except ValueError as e:
        assert f"[{last!r}]" in str(e) and repr(first) in str(e), str(e)
    else:
        raise AssertionError(f"a {last} layer without a plan must be refused")
    assert type(m) is LM and [(n, type(x)) for n, x in m.named_modules()] == before, \
        "refusal must leave the model as it was"


def check_groups_world4():
    """tp=2 on 4 ranks: TP peers consecutive, DP groups strided, and the mpu reports them."""
    g = _tp_group(2)
    r = dist.get_rank()
    assert g.tp_ranks == [r - r % 2, r - r % 2 + 1] and g.dp_ranks == [r % 2, r % 2 + 2], g
    mpu = g.mpu()
    assert mpu.get_model_parallel_world_size() == 2 and mpu.get_model_parallel_rank() == r % 2
    assert mpu.get_data_parallel_world_size() == 2 and mpu.get_data_parallel_rank() == r // 2
    assert mpu.get_data_parallel_group_ranks() == g.dp_ranks
    # the groups really are those ranks: sum the global ranks over each
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mpu.get_model_parallel_group())
    assert t.item() == sum(g.tp_ranks), t
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mpu.get_data_parallel_group())
    assert t.item() == sum(g.dp_ranks), t


def check_lm_tp2_dp2():
    """Two TP=2 replicas on 4 ranks, each with its own data: every replica equals its own single-rank run."""
    dp_rank = dist.get_rank() // 2
    _lm_vs_single(_tiny_cfg(d_ff=24), True, 2, data_seed=dp_rank)


SUITES = {
    "tp2": [
        ("column", check_column), ("column_sp", lambda: check_column(True)),
        ("row", check_row), ("row_sp", lambda: check_row(True)),
        ("embedding", check_embedding), ("embedding_sp", lambda: check_embedding(True)),
        ("cross_entropy", check_cross_entropy), ("sequence_collectives", check_sequence_collectives),
        ("lm_no_mlp", lambda: check_lm_no_mlp(False)), ("lm_no_mlp_sp", lambda: check_lm_no_mlp(True)),
        ("lm_hybrid", lambda: check_lm_hybrid(False)), ("lm_hybrid_sp", lambda: check_lm_hybrid(True)),
        ("refuses", check_refuses_other_mixers),
    ],
    "w4": [
        ("groups", check_groups_world4), ("lm_tp2_dp2", check_lm_tp2_dp2),
        ("column_sp", lambda: check_column(True)), ("row_sp", lambda: check_row(True)),
        ("embedding_sp", lambda: check_embedding(True)), ("cross_entropy", check_cross_entropy),
        ("lm_hybrid_sp", lambda: check_lm_hybrid(True)),
    ],
}


# ---- tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _launch(2, "tp2", tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    return _launch(4, "w4", tmp_path_factory.mktemp("w4"))


@pytest.mark.parametrize("check", [n for n, _ in SUITES["tp2"]])
def test_tp2(tp2, check):
    _assert_ok(tp2, check)


@pytest.mark.parametrize("check", [n for n, _ in SUITES["w4"]])
def test_world4(w4, check):
    _assert_ok(w4, check)


def test_rank_layout():
    from ttt_lm.parallel.groups import rank_layout
    lay = rank_layout(8, tp_size=2, cp_size=2)
    assert lay["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(lay["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="not divisible"):
        rank_layout(6, tp_size=4)
