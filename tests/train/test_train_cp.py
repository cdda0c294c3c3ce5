"""Context parallelism in the trainer: real gloo processes on CPU, fp32, tiny models of launch.TINY
(d_model 32, 16-token rows, 2 rows per micro-batch): 2 processes with context_parallel=2 (each
computes 8 tokens of every row) against the 1-process run.

Two models: attention + RG-LRU (the gather and chunk-summary schemes, with the RG-LRU's conv
halo) and TTT-Linear with mini-batches of 6 tokens (state passing: the split at token 8 falls
inside the second mini-batch, and the initial inner weights W_0, b_0 are used on rank 0 only).

Tolerance. The CP run is the 1-process computation with sums reordered (attention over the
gathered keys, exp of summed log-gates for the scan's carried state, the loss as two partial
sums), ~1e-7 relative per step in fp32: not bitwise. AdamW makes a near-zero gradient component's
update nearly its sign, so those differences grow over steps; with optim.lr=1e-3 the losses of 4
steps stay within ~1e-6 and the gradient norms within ~2e-6 (measured); LOSS_ATOL = NORM_RTOL =
1e-4 leaves margin. A wrong carried state, position or halo moves the loss by ≥ 1e-2; a wrong
gradient scale (e.g. the loss shares summed instead of averaged) does not show in the losses,
because clipping (optim.grad_clip=1, norms here ≈ 1.5–3) normalizes the update, but it doubles the
logged gradient norm, which the norm check catches.
"""
import json
import os

import pytest

from ttt_lm.config import ExperimentConfig
from ttt_lm.train.checkpoint import CheckpointError
from ttt_lm.train.engine import ParallelConfigError, check_parallel, deepspeed_config
from ttt_lm.train.export import export, load_pretrained
from ttt_lm.train.trainer import check_resume, invariants

from launch import attention_and_scan, losses_by_step, metrics, model_overrides, run

N = 2  # resume point; the runs are 2N steps
COMMON = [f"train.max_steps={2 * N}", "optim.lr=1e-3"]
#: the gather and chunk-summary schemes (attention_and_scan: two layers, their sections as
#: configured), and TTT-Linear alone with its mini-batches of 6 tokens (short_sections(6))
MODELS = {"attn_rglru": model_overrides(attention_and_scan()),
          "ttt": [*model_overrides(["ttt_linear"], 6), f"eval.every={N}"]}
CP2 = ["parallel.context_parallel=2"]
LOSS_ATOL = 1e-4
NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp")
    d = {}
    for name, model in MODELS.items():
        d[name + "/ref"], d[name + "/cp2"] = str(base / name / "ref"), str(base / name / "cp2")
        run(d[name + "/ref"], [*COMMON, *model], nprocs=1)
        run(d[name + "/cp2"], [*COMMON, *model, *CP2, f"checkpoint.every={N}"], nprocs=2)
    return d


def _by_step(run_dir, key, kind="train"):
    return {r["step"]: r[key] for r in metrics(run_dir, kind)}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cp2_matches_single_process(runs, name):
    ref, cp2 = runs[name + "/ref"], runs[name + "/cp2"]
    a, b = losses_by_step(cp2), losses_by_step(ref)
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])
    ga, gb = _by_step(cp2, "grad_norm"), _by_step(ref, "grad_norm")
    for s in gb:
        assert abs(ga[s] - gb[s]) <= NORM_RTOL * gb[s], (s, ga[s], gb[s])
    assert b[2 * N] < b[1]
    # the CP peers read the same rows: tokens count full rows × data-parallel ranks (1), not × cp
    assert metrics(cp2)[-1]["tokens"] == metrics(ref)[-1]["tokens"] == 2 * N * 2 * 16


@pytest.mark.dist
def test_cp2_validation_loss_matches_single_process(runs):
    a, b = _by_step(runs["ttt/cp2"], "loss", "val"), _by_step(runs["ttt/ref"], "loss", "val")
    assert sorted(a) == sorted(b) == [N, 2 * N]
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])


@pytest.mark.dist
def test_cp2_exact_resume(runs, tmp_path):
    done = runs["ttt/cp2"]
    ckpt = os.path.join(done, "checkpoints", f"step_{N:08d}")
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert state["context_parallel"] == 2 and state["invariants"]["context_parallel"] == 2
    assert state["dp_world"] == 1
    resumed = str(tmp_path / "resumed")
    r = run(resumed, [*COMMON, *MODELS["ttt"], *CP2, f"train.resume_from={ckpt}"], nprocs=2)
    assert f"resuming from {ckpt} at step {N}" in r.output()
    a, b = losses_by_step(done), losses_by_step(resumed)
    assert sorted(b) == list(range(N + 1, 2 * N + 1))
    # bit-identical: the same weights and ZeRO shards, data, RNG and gloo reductions
    assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(b)]


@pytest.mark.dist
def test_export_of_a_cp_checkpoint_is_the_plain_lm(runs, tmp_path):
    # ZeRO-1 shards the optimizer state over both CP ranks; the export consolidates it into the
    # single-process LM's state dict, equal to the 1-process run's weights up to the rounding above
    # (4 AdamW steps of size ≤ lr = 1e-3)
    sds = {}
    for k in ("ttt/ref", "ttt/cp2"):
        out = str(tmp_path / k.replace("/", "_"))
        export(runs[k], out)
        sds[k] = load_pretrained(out).state_dict()
    assert sds["ttt/cp2"].keys() == sds["ttt/ref"].keys()
    for name, v in sds["ttt/ref"].items():
        assert (sds["ttt/cp2"][name] - v).abs().max() <= 1e-4, name


@pytest.mark.dist
@pytest.mark.parametrize("name,extra", [("ttt", ["parallel.cp_pipeline_chunks=2"]),
                                        ("ttt", ["parallel.zero_stage=2"]),
                                        ("attn_rglru", ["parallel.zero_stage=2"])],
                         ids=["ttt-pipelined", "ttt-zero2", "attn_rglru-zero2"])
def test_cp2_variants_match_single_process(runs, tmp_path, name, extra):
    """parallel.cp_pipeline_chunks=2 (the TTT layer's state passing pipelined over the micro-batch's
    2 rows, one group each), and ZeRO-2 (gradients reduced in buckets as the backward accumulates
    them: the gated parameters make that order the same on both ranks): the TTT model trains as the
    1-process ZeRO-1 run does (same tolerances)."""
    piped = str(tmp_path / "piped")
    run(piped, [*COMMON, *MODELS[name], *CP2, *extra], nprocs=2)
    a, b = losses_by_step(piped), losses_by_step(runs[name + "/ref"])
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])
    ga, gb = _by_step(piped, "grad_norm"), _by_step(runs[name + "/ref"], "grad_norm")
    for s in gb:
        assert abs(ga[s] - gb[s]) <= NORM_RTOL * gb[s], (s, ga[s], gb[s])


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cp2_zero3_matches_single_process(runs, tmp_path, name):
    """ZeRO-3 with every parameter partitioned (stage3_param_persistence_threshold 0: by default
    parameters this small stay whole): the context-parallel LM gathers them all at the start of the
    forward and partitions them again after the backward, so each rank makes the same collectives
    in the same order; the losses and gradient norms are the 1-process run's (same tolerances), the
    checkpoint holds the partitions (empty module tensors: ZeRO-3 keeps the shards elsewhere), and
    the TTT model resumes from it bit-exactly."""
    import torch
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    d = str(tmp_path / "zero3")
    run(d, [*COMMON, *MODELS[name], *CP2, "parallel.zero_stage=3", f"parallel.deepspeed_config={ds}",
            f"checkpoint.every={N}"], nprocs=2)
    a, b = losses_by_step(d), losses_by_step(runs[name + "/ref"])
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    ga, gb = _by_step(d, "grad_norm"), _by_step(runs[name + "/ref"], "grad_norm")
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_ATOL, (s, a[s], b[s])
        assert abs(ga[s] - gb[s]) <= NORM_RTOL * gb[s], (s, ga[s], gb[s])
    ck = os.path.join(d, "checkpoints", f"step_{N:08d}", "ds", "zero_pp_rank_1_mp_rank_00_model_states.pt")
    module = torch.load(ck, map_location="cpu", weights_only=False)["module"]
    assert module and all(v.numel() == 0 for v in module.values()), {k: v.shape for k, v in module.items()}
    if name == "ttt":  # its validation loss (a forward without autograd) too, and an exact resume
        va, vb = _by_step(d, "loss", "val"), _by_step(runs[name + "/ref"], "loss", "val")
        assert sorted(va) == sorted(vb) == [N, 2 * N] and all(abs(va[s] - vb[s]) <= LOSS_ATOL for s in vb), (va, vb)
        resumed = str(tmp_path / "resumed")
        run(resumed, [*COMMON, *MODELS[name], *CP2, "parallel.zero_stage=3", f"parallel.deepspeed_config={ds}",
                      f"train.resume_from={os.path.dirname(os.path.dirname(ck))}"], nprocs=2)
        r = losses_by_step(resumed)
        assert sorted(r) == list(range(N + 1, 2 * N + 1)) and all(r[s] == a[s] for s in r), (r, a)


# ---- configuration checks (in-process) ---------------------------------------------------------

def _cfg(**parallel):
    cfg = ExperimentConfig()
    cfg.model.layer_pattern = attention_and_scan()
    cfg.model.vocab_size = 64
    cfg.data.seq_len = 16
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def test_cp_allowed_when_it_divides_the_world():
    check_parallel(_cfg(context_parallel=2), world_size=2)
    check_parallel(_cfg(context_parallel=2), world_size=6)
    check_parallel(_cfg(context_parallel=4), world_size=8)


def test_cp_refusals():
    with pytest.raises(ParallelConfigError, match="context_parallel must be >= 1"):
        check_parallel(_cfg(context_parallel=0))
    with pytest.raises(ParallelConfigError, match="context_parallel=2 does not divide the world size 3"):
        check_parallel(_cfg(context_parallel=2), world_size=3)
    cfg = _cfg(context_parallel=2, tensor_parallel=2)
    cfg.model.layer_pattern = attention_and_scan()[:1]
    check_parallel(cfg, world_size=4)  # CP × TP
    with pytest.raises(ParallelConfigError, match=r"context_parallel=2 × parallel.tensor_parallel=2 does not divide "
                                                  "the world size 6"):
        check_parallel(cfg, world_size=6)
    cfg.parallel.sequence_parallel = True
    with pytest.raises(ParallelConfigError, match="context_parallel=2 with parallel.sequence_parallel=true"):
        check_parallel(cfg, world_size=4)
    check_parallel(_cfg(context_parallel=2, zero_stage=3), world_size=2)
    check_parallel(_cfg(context_parallel=2, zero_stage=2), world_size=2)
    cfg = _cfg(context_parallel=4)
    cfg.data.seq_len = 3
    with pytest.raises(ParallelConfigError, match="data.seq_len=3 must be at least that"):
        check_parallel(cfg, world_size=4)
    cfg = _cfg(context_parallel=2)
    cfg.model.reset_at_doc_boundaries = True
    check_parallel(cfg, world_size=2)   # document resets under CP (tests/train/test_train_tp_docs.py)
    cfg = _cfg(context_parallel=2)
    cfg.train.activation_checkpointing = True
    with pytest.raises(ParallelConfigError, match="activation_checkpointing"):
        check_parallel(cfg, world_size=2)


def test_cp_pipeline_chunks_checked():
    check_parallel(_cfg(context_parallel=2, cp_pipeline_chunks=4), world_size=2)   # micro_batch_size 8
    for bad, cp in ((0, 2), (9, 2), (2, 1)):
        with pytest.raises(ParallelConfigError, match=f"parallel.cp_pipeline_chunks={bad}: must be >= 1"):
            check_parallel(_cfg(context_parallel=cp, cp_pipeline_chunks=bad), world_size=2)


def test_cp_refuses_a_deepspeed_file_with_overlapped_reduction(tmp_path):
    for zo in ({"stage": 3, "overlap_comm": True}, {"stage": 2, "overlap_comm": True}, {"stage": 0}):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps({"zero_optimization": zo}))
        cfg = _cfg(context_parallel=2, deepspeed_config=str(path))
        with pytest.raises(ParallelConfigError, match="needs zero_optimization stage 1, 2 or 3 without overlap_comm"):
            deepspeed_config(cfg, dp_world=2)
        cfg.parallel.context_parallel = 1
        deepspeed_config(cfg, dp_world=2)
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    ds = deepspeed_config(_cfg(context_parallel=2, deepspeed_config=str(path)), dp_world=2)
    assert ds["zero_optimization"] == {"stage": 3, "overlap_comm": False}  # ZeRO-3 alone would overlap
    ds = deepspeed_config(_cfg(context_parallel=2, zero_stage=3), dp_world=2)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["overlap_comm"] is False


def test_resume_refuses_another_context_parallel_size():
    man = {"vocab_size": 64, "tokenizer": "t"}
    cfg = _cfg(context_parallel=2)
    saved = {"invariants": invariants(cfg, man), "dp_world": 1}
    check_resume(saved, invariants(cfg, man), "ck", 1)
    with pytest.raises(CheckpointError, match="context_parallel=2 and this run has 1"):
        check_resume(saved, invariants(_cfg(), man), "ck", 1)
    # a checkpoint from before the key existed was written with context_parallel=1
    del saved["invariants"]["context_parallel"]
    check_resume(saved, invariants(_cfg(), man), "ck", 1)
    with pytest.raises(CheckpointError, match="context_parallel=1 and this run has 2"):
        check_resume(saved, invariants(cfg, man), "ck", 1)
