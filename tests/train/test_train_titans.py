"""The trainer with Titans layers: model.kernel_backend=triton with a layer no Triton kernel covers
(Titans' MLP memory) stops before training, naming the layer kind; MAC and MAL under tensor and
sequence parallelism (real gloo processes on CPU, fp32, TP=2) against the single-process run, with
the tolerances of test_train_tp_mixers.py; sequence parallelism with every Titans variant, and its
refusal for a kind whose plan refuses it."""
import dataclasses
import os

import pytest

from ttt_lm.config import ExperimentConfig
from ttt_lm.model.registry import builtin_kinds, mixer_class
from ttt_lm.train.engine import ParallelConfigError, check_parallel

from launch import losses_by_step, metrics, run

TP2 = ["parallel.tensor_parallel=2"]
LOSS_ATOL, NORM_RTOL = 1e-4, 5e-4
FIRST_RTOL = 1e-5


@pytest.mark.dist
def test_triton_refused_for_titans_mlp_memory(tmp_path):
    r = run(str(tmp_path / "bad"), ["train.max_steps=1", "model.layer_pattern=[titans]", "model.titans.memory=mlp",
                                    "model.kernel_backend=triton"], expect=2)
    out = r.output()
    assert "error: layer kind 'titans' (layer 0): model.kernel_backend=triton" in out and "linear memory" in out
    assert not os.path.exists(str(tmp_path / "bad" / "metrics.jsonl"))   # stopped before any step


def _by_step(run_dir, key):
    return {r["step"]: r[key] for r in metrics(run_dir)}


#: Titans MAC (segments of 8 over 16 tokens, persistent tokens, the memory read beside the segment)
#: and MAL (persistent tokens dropped after the attention)
TITANS = ["model.layer_pattern=[titans_mac,titans_mal]", "model.n_layers=2", "model.titans.segment_len=8",
          "model.titans.persistent_tokens=2", "train.max_steps=2", "optim.lr=1e-3"]


@pytest.mark.dist
def test_titans_mac_mal_tp2_sequence_parallel_matches_single_process(tmp_path):
    ref_dir, tp_dir = str(tmp_path / "titans_ref"), str(tmp_path / "titans_tp2_sp")
    run(ref_dir, TITANS, nprocs=1)
    run(tp_dir, [*TITANS, *TP2, "parallel.sequence_parallel=true"], nprocs=2)
    a, b = losses_by_step(tp_dir), losses_by_step(ref_dir)
    ga, gb = _by_step(tp_dir, "grad_norm"), _by_step(ref_dir, "grad_norm")
    assert sorted(a) == sorted(b) == [1, 2]
    assert abs(a[1] - b[1]) <= FIRST_RTOL * b[1] and abs(ga[1] - gb[1]) <= FIRST_RTOL * gb[1], (a[1], b[1], ga[1], gb[1])
    assert abs(a[2] - b[2]) <= LOSS_ATOL and abs(ga[2] - gb[2]) <= NORM_RTOL * gb[2], (a, b, ga, gb)


def test_sequence_parallel_with_every_titans_variant_and_its_refusal(monkeypatch):
    """Sequence parallelism is checked for each Titans variant beside the first built-in kind; a
    kind whose plan refuses it (no built-in kind does: titans_mal's plan with
    ``sequence_parallel=False`` stands for one) stops the run in the config check, naming it."""
    cfg = ExperimentConfig()
    cfg.model.layer_pattern, cfg.model.n_layers = [builtin_kinds()[0], "titans_mal", "titans_mac", "titans_mag"], 4
    cfg.model.n_heads, cfg.model.vocab_size, cfg.model.d_model = 4, 64, 32
    cfg.data.seq_len = 16
    cfg.parallel.tensor_parallel = 4
    cfg.parallel.sequence_parallel = True
    check_parallel(cfg, world_size=4)  # every Titans variant takes sequence parallelism
    mal = mixer_class("titans_mal")
    plan = mal.tp_plan
    monkeypatch.setattr(mal, "tp_plan", classmethod(lambda cls, c: dataclasses.replace(plan(c), sequence_parallel=False)))
    with pytest.raises(ParallelConfigError, match=r"sequence_parallel is not available with layer kind\(s\) \['titans_mal'\]"):
        check_parallel(cfg, world_size=4)
    cfg.parallel.sequence_parallel = False
    check_parallel(cfg, world_size=4)  # such a kind splits without sequence parallelism
