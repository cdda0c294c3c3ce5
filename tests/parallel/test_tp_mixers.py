"""Tensor (and sequence) parallelism of every TP-ready layer kind of the registry, alone and all in
one model, against the single-process model, with two real gloo processes on CPU (and one check
of TP=2 × DP=2 on four). Both models read packed rows (several documents per row, their
position_ids given as the trainer gives the loader's): the RG-LRU's segment positions, and with
``model.reset_at_doc_boundaries`` every layer's restart at each document start.

The workers are spawned once per module fixture, run every check and report, per check, None or
the failure's traceback; each test asserts one check.

Tolerance: float64 throughout. The TP computation differs from the single-process one only in
the order of summation (the row-parallel partial products summed by all-reduces: o_proj,
out_proj, linear_out, and Mamba's x_proj whose dt/B/C every channel reads; the gradients of
shared parameters summed across ranks), so the differences are rounding, ~1e-15 relative.
rtol = 1e-9, atol = 1e-12 leaves margin for that and still fails on any missing, duplicated or
mis-sliced term (an O(1) relative error; the parameters are perturbed away from their structured
init so that no slice is all zeros or all ones, and a fused [q | k | v] or [x | z] split the wrong
way moves channels between heads).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from tests.parallel.tp_common import tp_lm_vs_single
from tests.distributed import assert_all_passed, spawn_checks

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-9, atol=1e-12)
TP = 2


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{msg}: {m}")


#: the sections' tiny sizes (see _cfg), and those of the document-reset checks (see _checks)
N = 4
RESET_N = 2


def _cfg(pattern, d_ff=0, n=N):
    """The LM of ``pattern`` with every section at its tiny sizes for ``n`` = 4 (short_config:
    chunks and mini-batches of 4, windows of 5, MAC segments of 6): over T = 10 tokens (even, for
    sequence parallelism's two slices) every chunked form has full chunks and a partial one, MAC
    a full segment and a partial one, and LaCT two writes, so the momentum (zero before the
    first) reaches the output."""
    from tests.model.mixer_checks import short_config
    return short_config(pattern, n, vocab_size=32, n_heads=4, d_ff=d_ff, tie_embeddings=True, max_seq_len=64)


#: tokens per row of the checks (see _cfg)
T = 10


_GROUPS = {}


def _groups():
    from ttt_lm.parallel.groups import build_groups
    if "g" not in _GROUPS:
        _GROUPS["g"] = build_groups(tp_size=TP)
    return _GROUPS["g"]


def _lm_vs_single(cfg, sp, dp_rank=0, decode=True):
    """TP model = single-process model (``tp_lm_vs_single``) on packed rows (their position_ids given
    to both); ``dp_rank`` picks the data-parallel replica's batch (each replica checks its own);
    ``decode=False`` leaves out decoding."""
    # heads or channels (dim 1) split by p; attention's k/v cache is checked by the decode itself
    tp_lm_vs_single(cfg, _groups(), sp, close, T=T, data_seed=dp_rank, decode=decode,
                    state_split=lambda blk, k, v: v.dim() >= 2 and k.split(".")[-1] not in ("k", "v"))


def check_fused_shards():
    """A fused dimension ([x | z]) splits part by part (rank r: chunks r and r + p of 2p), and
    join_shards inverts it."""
    from ttt_lm.parallel.tensor_parallel import TPContext, _shard, join_shards
    ctx = TPContext(_groups().tp_group)
    w = torch.arange(8.0)[:, None]
    r = ctx.rank
    assert _shard(w, 0, ctx, stride=2).flatten().tolist() == [2.0 * r, 2.0 * r + 1, 4 + 2.0 * r, 5 + 2.0 * r]
    shards = [torch.cat([w.chunk(4)[q], w.chunk(4)[q + 2]]) for q in range(2)]
    assert torch.equal(join_shards(shards, 0, 2), w)
    assert not torch.equal(torch.cat(shards), w), "a plain concatenation would be wrong: the check needs it to be"


def _resets(cfg):
    """``cfg`` with ``model.reset_at_doc_boundaries``: every layer restarts at each document start
    of the packed rows (the LM's per-document path, through the TP layers)."""
    return dataclasses.replace(cfg, reset_at_doc_boundaries=True)


def _checks():
    """Per TP-ready kind of the registry (``tp_ready_kinds``), one case per entry of its class's
    ``variants`` (Titans' linear and MLP memories): the packed rows' positions with and without
    sequence parallelism, and with document resets (no sequence parallelism, which refuses them);
    every kind in one model. With resets the documents are 1 to 5 tokens long, so those checks
    take the sizes for n = 2 (RESET_N): chunks of 2, and a 5-token document gives LaCT the two
    writes that reach its momentum. Each kind's own settings are checked in test_<kind>_tp.py."""
    from tests.model.mixer_checks import short_cases
    kw = dict(vocab_size=32, n_heads=4, d_ff=24, tie_embeddings=True, max_seq_len=64)
    out = [("fused_shards", check_fused_shards)]
    for (kind, variant, cfg), (_, _, short) in zip(short_cases(N, **kw), short_cases(RESET_N, **kw)):
        if kind not in KINDS:
            continue
        name = kind if variant is None else f"{kind}_{variant}"
        for sp in (False, True):
            out.append((f"{name}{'_sp' if sp else ''}", lambda c=cfg, s=sp: _lm_vs_single(c, s)))
        # decoding has no document layout: checked above
        out.append((f"{name}_resets", lambda c=short: _lm_vs_single(_resets(c), False, decode=False)))
    out.append(("hybrid", lambda: _lm_vs_single(_cfg(HYBRID, d_ff=24), False)))
    out.append(("hybrid_sp", lambda: _lm_vs_single(_cfg(HYBRID, d_ff=24), True)))
    out.append(("hybrid_resets",
                lambda: _lm_vs_single(_resets(_cfg(HYBRID, d_ff=24, n=RESET_N)), False, decode=False)))
    return out


def _tp_ready_kinds():
    from ttt_lm.parallel.tp_model import tp_ready_kinds
    return list(tp_ready_kinds())


#: every TP-ready kind of the registry (the built-in ones: all of them declare a plan)
KINDS = _tp_ready_kinds()
#: every TP-ready kind in one model
HYBRID = KINDS


def _cp_pattern():
    """The first TP-ready kind of each context-parallel form, then those that read segment
    positions: one model holding every way the CP ranks pass state."""
    from ttt_lm.model.registry import kinds_with, mixer_class
    first = {}
    for k in KINDS:
        first.setdefault(mixer_class(k).cp_form, k)
    return list(first.values()) + [k for k in kinds_with(lambda c: c.takes_segment_pos, KINDS)
                                   if k not in first.values()]


#: the CP=2 × TP=2 model
CP_PATTERN = _cp_pattern()


def check_hybrid_tp2_dp2():
    """4 ranks: two TP=2 replicas, each with its own batch, each equal to its single-rank run."""
    assert dist.get_world_size() == 4
    # decoding is checked on TP=2 alone ("hybrid"); here it would only add time on 2 cores
    _lm_vs_single(_cfg(HYBRID, d_ff=24), True, dp_rank=dist.get_rank() // TP, decode=False)


def check_cp2_tp2_positions():
    """4 ranks as CP=2 × TP=2: the context-parallel LM with its layers TP-split, given packed rows'
    position_ids (it slices them per CP rank; the RG-LRU resets on both halves), equals the
    single-process LM: the loss (mean over the CP ranks) and every gradient (averaged over the CP
    ranks, gathered over the TP ranks). The trainer hands it the loader's positions the same way."""
    import torch.nn.functional as F
    from tests.parallel.tp_common import packed_positions
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.cp import allreduce_gradients
    from ttt_lm.parallel.cp_model import ContextParallelLM
    from ttt_lm.parallel.groups import build_groups
    from ttt_lm.parallel.tp_model import gather_tp_tensor, parallelize_tp
    assert dist.get_world_size() == 4
    groups = build_groups(tp_size=TP, cp_size=2)
    cfg = _cfg(CP_PATTERN, d_ff=24)
    torch.manual_seed(0)
    ref = LM(cfg).double()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for prm in ref.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=gen, dtype=prm.dtype))
    cpm = ContextParallelLM(cfg, groups.cp_group).double()
    cpm.load_state_dict(ref.state_dict())
    parallelize_tp(cpm, groups)
    B, T = 2, 10
    gen = torch.Generator().manual_seed(100)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels[0, :2] = -100
    pos = packed_positions(B, T)
    assert bool((pos[:, 1:T // 2] == 0).any()) and bool((pos[:, T // 2:] == 0).any()), pos
    want = F.cross_entropy(ref(ids, position_ids=pos).logits.view(-1, cfg.vocab_size), labels.view(-1),
                           ignore_index=-100)
    want.backward()
    cpm.train()
    loss = cpm(ids, labels=labels, position_ids=pos).loss
    loss.backward()
    allreduce_gradients(cpm, groups.cp_group)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=groups.cp_group)
    close(mean / 2, want.detach(), "loss")
    refp = dict(ref.named_parameters())
    for name, prm in cpm.named_parameters():
        gfull = gather_tp_tensor(prm.grad, getattr(prm, "partition_dim", None), groups.tp_group,
                                 getattr(prm, "partition_stride", 1))
        close(gfull, refp[name].grad, f"grad {name}")


CHECKS = _checks() + [("hybrid_tp2_dp2", check_hybrid_tp2_dp2), ("cp2_tp2_positions", check_cp2_tp2_positions)]


def _spawn(tmp_path_factory, world, names):
    return spawn_checks(world, __name__, tmp_path_factory.mktemp("tp_mixers"), names=names)


FOUR_RANK_CHECKS = ["hybrid_tp2_dp2", "cp2_tp2_positions"]
TP2_CHECKS = [n for n, _ in CHECKS if n not in FOUR_RANK_CHECKS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _spawn(tmp_path_factory, TP, TP2_CHECKS)


def _assert_ok(results, check):
    assert_all_passed(results[0], check, results[1])


@pytest.mark.parametrize("check", TP2_CHECKS)
def test_tp_mixer(results, check):
    _assert_ok(results, check)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory, 2 * TP, FOUR_RANK_CHECKS)


@pytest.mark.parametrize("check", FOUR_RANK_CHECKS)
def test_four_ranks(four_ranks, check):
    """TP=2 × DP=2, and CP=2 × TP=2 with packed rows' positions."""
    _assert_ok(four_ranks, check)
