"""Context parallelism × tensor parallelism in the trainer: 4 real gloo processes on CPU, fp32,
context_parallel=2 × tensor_parallel=2 (each rank computes 8 of the 16 tokens of every row, on half
the heads), against the 1-process run, with ZeRO-1 and ZeRO-3, and an exact resume.

The model is a hybrid of the three context-parallel schemes: attention (keys and values gathered
from the earlier CP rank), DeltaNet (chunk summaries combined across CP ranks, with its conv halo)
and TTT-Linear (its state passed from CP rank 0 to 1, here TP-split by heads: each TP rank sends
its own heads' state to its CP peer).

Tolerance: as in test_train_cp.py and test_train_tp_mixers.py. The CP × TP run is the 1-process
computation with sums reordered (the row-parallel all-reduces, the gathered keys, the summaries'
combine, the loss as partial sums), ~1e-7 relative per step in fp32; over 4 AdamW steps at
optim.lr=1e-3 the losses stay within ~3e-6 and the gradient norms within ~1.3e-4 relative
(measured); LOSS_ATOL = 1e-4 and NORM_RTOL = 5e-4 leave margin. A wrong carried state, a head
sent to the wrong peer or a mis-sliced weight moves the loss by ≥ 1e-2; a wrong gradient scale
(clipping hides it in the losses) changes the logged gradient norm by a factor ≥ √2.
"""
import json
import os

import pytest

from launch import losses_by_step, metrics, model_overrides, run

pytestmark = pytest.mark.dist

N = 2  # resume point; the runs are 2N steps


def _pattern():
    """The registry's first global-attention kind (kv_exchange), its first chunk-summary kind without
    segment positions (summary) and TTT-Linear (state passing), every one TP-ready."""
    from ttt_lm.model.registry import builtin_kinds, kinds_with
    from ttt_lm.parallel.tp_model import tp_ready_kinds
    kinds = [k for k in builtin_kinds() if k in tp_ready_kinds()]
    return [kinds_with(lambda c: c.global_attention and c.cp_form == "kv_exchange", kinds)[0],
            kinds_with(lambda c: c.cp_form == "summary" and not c.takes_segment_pos, kinds)[0], "ttt_linear"]


#: chunks and mini-batches of 6 tokens (short_sections(6)): the CP split at token 8 falls inside
#: the second of each
HYBRID = [*model_overrides(_pattern(), 6), f"train.max_steps={2 * N}", "optim.lr=1e-3"]
CP2_TP2 = ["parallel.context_parallel=2", "parallel.tensor_parallel=2"]
LOSS_ATOL, NORM_RTOL = 1e-4, 5e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp_tp")
    d = {"ref": str(base / "ref"), "cp2tp2": str(base / "cp2tp2")}
    run(d["ref"], HYBRID, nprocs=1)
    run(d["cp2tp2"], [*HYBRID, *CP2_TP2, f"checkpoint.every={N}"], nprocs=4)
    return d


def _by_step(run_dir, key):
    return {r["step"]: r[key] for r in metrics(run_dir)}


def test_cp2_tp2_matches_single_process(runs):
    a, b = losses_by_step(runs["cp2tp2"]), losses_by_step(runs["ref"])
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    ga, gb = _by_step(runs["cp2tp2"], "grad_norm"), _by_step(runs["ref"], "grad_norm")
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])
        assert abs(ga[s] - gb[s]) <= NORM_RTOL * gb[s], (s, ga[s], gb[s])
    assert b[2 * N] < b[1]
    # the 4 ranks are one data-parallel replica: they read the same rows
    assert metrics(runs["cp2tp2"])[-1]["tokens"] == metrics(runs["ref"])[-1]["tokens"]


def test_cp2_tp2_zero3_matches_single_process(runs, tmp_path):
    """ZeRO-3 with every parameter partitioned (persistence threshold 0) over the dp × cp = 2 ranks
    holding each TP slice: the CP LM's own gathering of its (TP-sliced) parameters."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    d = str(tmp_path / "zero3")
    run(d, [*HYBRID, *CP2_TP2, "parallel.zero_stage=3", f"parallel.deepspeed_config={ds}"], nprocs=4)
    a, b = losses_by_step(d), losses_by_step(runs["ref"])
    ga, gb = _by_step(d, "grad_norm"), _by_step(runs["ref"], "grad_norm")
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])
        assert abs(ga[s] - gb[s]) <= NORM_RTOL * gb[s], (s, ga[s], gb[s])


def test_cp2_tp2_exact_resume(runs, tmp_path):
    done = runs["cp2tp2"]
    ckpt = os.path.join(done, "checkpoints", f"step_{N:08d}")
    resumed = str(tmp_path / "resumed")
    r = run(resumed, [*HYBRID, *CP2_TP2, f"train.resume_from={ckpt}"], nprocs=4)
    assert f"resuming from {ckpt} at step {N}" in r.output()
    a, b = losses_by_step(done), losses_by_step(resumed)
    assert sorted(b) == list(range(N + 1, 2 * N + 1))
    # bit-identical: the same per-rank weights and ZeRO shards, data, RNG and gloo reductions
    assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(b)]
