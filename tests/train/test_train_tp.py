"""Tensor parallelism in the trainer: real gloo processes on CPU, fp32, the tiny attention-only
model of launch.TINY (2 heads, so tensor_parallel=2 puts one head per rank).

Tolerance. The TP=2 run is the TP=1 computation with the matmuls split across ranks and their
partial sums added by all-reduces (and the softmax of the loss over vocabulary shards), so the
two differ by fp32 summation order only, ~1e-7 relative per step: not bitwise. AdamW amplifies
that: an update is m/(√v + ε), which for a gradient component near zero is nearly its sign. With
optim.lr=1e-3 (weights of scale 2e-2) the losses of 6 steps stay within ~2e-5 of each other
(measured); 1e-4 leaves margin. A wrong split or reduction changes the gradient by O(1), which
the logged gradient norm (clipping is active: norm > optim.grad_clip=1) and the losses show far
above that: 1e-4 relative on the norm.
"""
import json
import os
import re

import pytest
import torch

from ttt_lm.config import ExperimentConfig
from ttt_lm.train.checkpoint import CheckpointError
from ttt_lm.train.engine import ParallelConfigError, check_parallel
from ttt_lm.train.export import export, load_pretrained
from ttt_lm.train.trainer import check_resume, invariants

from launch import losses_by_step, metrics, run

N = 3  # resume point; the runs are 2N steps
COMMON = [f"train.max_steps={2 * N}", "optim.lr=1e-3"]
TP2 = ["parallel.tensor_parallel=2"]
LOSS_ATOL = 1e-4
NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    d = {k: str(base / k) for k in ("ref", "tp2", "sp")}
    run(d["ref"], COMMON, nprocs=1)
    run(d["tp2"], [*COMMON, *TP2, f"checkpoint.every={N}"], nprocs=2)
    # sequence parallelism and ZeRO-3 together: the parameters of each TP slice are ZeRO-3
    # partitioned over the (here single-rank) data-parallel group
    run(d["sp"], [*COMMON, *TP2, "parallel.sequence_parallel=true", "parallel.zero_stage=3"], nprocs=2)
    return d


def _by_step(run_dir, key):
    return {r["step"]: r[key] for r in metrics(run_dir)}


def _assert_matches_reference(run_dir, ref_dir):
    a, b = losses_by_step(run_dir), losses_by_step(ref_dir)
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])
    ga, gb = _by_step(run_dir, "grad_norm"), _by_step(ref_dir, "grad_norm")
    for s in gb:
        assert abs(ga[s] - gb[s]) <= NORM_RTOL * gb[s], (s, ga[s], gb[s])
    assert b[2 * N] < b[1]


@pytest.mark.dist
def test_tp2_matches_single_process(runs):
    _assert_matches_reference(runs["tp2"], runs["ref"])
    # TP peers read the same batches: tokens count the data-parallel ranks (1), not the world (2)
    assert metrics(runs["tp2"])[-1]["tokens"] == metrics(runs["ref"])[-1]["tokens"] == 2 * N * 2 * 16


@pytest.mark.dist
def test_tp2_sequence_parallel_zero3_matches_single_process(runs):
    _assert_matches_reference(runs["sp"], runs["ref"])


@pytest.mark.dist
def test_tp2_exact_resume(runs, tmp_path):
    ckpt = os.path.join(runs["tp2"], "checkpoints", "step_00000003")
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert state["tensor_parallel"] == 2 and state["invariants"]["tensor_parallel"] == 2
    assert state["dp_world"] == 1
    resumed = str(tmp_path / "resumed")
    r = run(resumed, [*COMMON, *TP2, f"train.resume_from={ckpt}"], nprocs=2)
    assert f"resuming from {ckpt} at step {N}" in r.output()
    a, b = losses_by_step(runs["tp2"]), losses_by_step(resumed)
    assert sorted(b) == list(range(N + 1, 2 * N + 1))
    # bit-identical: the same per-TP-rank weights and ZeRO state, data, RNG and gloo reductions
    assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(b)]


@pytest.mark.dist
def test_export_consolidates_tp_slices(runs, tmp_path):
    sds = {}
    for k in ("ref", "tp2", "sp"):
        export(runs[k], str(tmp_path / k))
        sds[k] = load_pretrained(str(tmp_path / k)).state_dict()
    # ZeRO-1 keeps each TP rank's whole fp32 slice in mp_rank_0r_model_states.pt: the export is
    # exactly their concatenation along the recorded partition dimensions
    ck = os.path.join(runs["tp2"], "checkpoints", "step_00000006")
    dims = json.load(open(os.path.join(ck, "trainer_state.json")))["partition_dims"]
    mods = [torch.load(os.path.join(ck, "ds", f"mp_rank_0{r}_model_states.pt"), map_location="cpu",
                       weights_only=False)["module"] for r in range(2)]
    assert dims["layers.0.mixer.q_proj.weight"] == 0 and dims["layers.0.mixer.o_proj.weight"] == 1
    for k, v in sds["tp2"].items():
        want = mods[0][k] if k not in dims else torch.cat([m[k] for m in mods], dims[k])
        assert torch.equal(v, want), k
    # and the consolidated weights are the single-process run's, up to the rounding above
    # (6 AdamW steps of size ≤ lr = 1e-3; measured ≤ 3e-5)
    for k in ("tp2", "sp"):
        assert sds[k].keys() == sds["ref"].keys()
        for name, v in sds["ref"].items():
            torch.testing.assert_close(sds[k][name], v, rtol=0, atol=1e-4, msg=lambda m: f"{k} {name}: {m}")


# ---- configuration checks (in-process) ---------------------------------------------------------

def _attn_cfg(**parallel):
    cfg = ExperimentConfig()
    cfg.model.layer_pattern = ["attention"]
    cfg.model.n_heads, cfg.model.vocab_size = 4, 64
    cfg.data.seq_len = 16
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def test_tp_allowed_for_attention_models_with_any_zero_stage():
    for stage in (1, 2, 3):
        check_parallel(_attn_cfg(tensor_parallel=2, zero_stage=stage), world_size=4)
        check_parallel(_attn_cfg(tensor_parallel=4, sequence_parallel=True, zero_stage=stage), world_size=4)


def test_tp_refuses_layer_kinds_that_are_not_tp_ready(monkeypatch):
    from ttt_lm.model.registry import builtin_kinds, mixer_class
    # every built-in kind declares a plan: the last built-in kind with its plan removed stands for
    # one without, between layers of the first
    first, stub = builtin_kinds()[0], builtin_kinds()[-1]
    monkeypatch.setattr(mixer_class(stub), "tp_plan", classmethod(lambda cls, cfg: None))
    cfg = _attn_cfg(tensor_parallel=2)
    cfg.model.layer_pattern = [first, stub, first, stub]
    with pytest.raises(ParallelConfigError, match=rf"\[{re.escape(repr(stub))}\] \(layers \[1, 3\]\) are not TP-ready"):
        check_parallel(cfg, world_size=2)


def test_tp_layout_refusals():
    with pytest.raises(ParallelConfigError, match="does not divide the world size 3"):
        check_parallel(_attn_cfg(tensor_parallel=2), world_size=3)
    cfg = _attn_cfg(tensor_parallel=2)
    cfg.model.n_heads, cfg.model.vocab_size = 3, 65
    with pytest.raises(ParallelConfigError, match=r"must divide model.n_heads=3, .*model.vocab_size=65"):
        check_parallel(cfg, world_size=2)
    with pytest.raises(ParallelConfigError, match="needs parallel.tensor_parallel > 1"):
        check_parallel(_attn_cfg(sequence_parallel=True), world_size=2)
    cfg = _attn_cfg(tensor_parallel=2, sequence_parallel=True)
    cfg.data.seq_len = 15
    with pytest.raises(ParallelConfigError, match="data.seq_len=15 must be a multiple of it"):
        check_parallel(cfg, world_size=2)
    cfg = _attn_cfg(tensor_parallel=2)
    cfg.model.reset_at_doc_boundaries = True
    check_parallel(cfg, world_size=2)  # document resets run under TP (tests/parallel/test_tp_mixers.py)
    cfg.parallel.sequence_parallel = True
    with pytest.raises(ParallelConfigError, match="reset_at_doc_boundaries=true is not available with "
                                                  "parallel.sequence_parallel=true"):
        check_parallel(cfg, world_size=2)


def test_context_parallel_with_tensor_parallel_but_not_sequence_parallel():
    check_parallel(_attn_cfg(context_parallel=2, tensor_parallel=2), world_size=4)
    check_parallel(_attn_cfg(context_parallel=2, tensor_parallel=2), world_size=8)  # dp 2 × cp 2 × tp 2
    with pytest.raises(ParallelConfigError, match="sequence_parallel=false"):
        check_parallel(_attn_cfg(context_parallel=2, tensor_parallel=2, sequence_parallel=True), world_size=4)


def test_resume_accepts_another_tensor_parallel_size():
    """The weights and optimizer state are joined and cut again for the new size
    (``ttt_lm.train.checkpoint.reshard``); the model's shape must still match."""
    man = {"vocab_size": 64, "tokenizer": "t"}
    cfg = _attn_cfg(tensor_parallel=2)
    saved = {"invariants": invariants(cfg, man), "dp_world": 1}
    check_resume(saved, invariants(cfg, man), "ck", 1)
    check_resume(saved, invariants(_attn_cfg(tensor_parallel=4), man), "ck", 1)
    check_resume(saved, invariants(_attn_cfg(), man), "ck", 1)
    other = _attn_cfg(tensor_parallel=4)
    other.model.n_layers = 3
    with pytest.raises(CheckpointError, match="model.n_layers: 4 -> 3"):
        check_resume(saved, invariants(other, man), "ck", 1)
