"""TTT-E2E through the real trainer: a process of ``tests/train/runner.py`` (train.py's ``main`` on the
synthetic counting corpus) trains a tiny E2E model for twelve optimizer steps under DeepSpeed's
ZeRO-1 engine, the inner lr warm-up read from the step, and writes its checkpoint; and ZeRO-2 runs
the same steps to the same losses."""
from __future__ import annotations

import math
import os

import pytest

from tests.train.launch import losses_by_step, run

pytestmark = pytest.mark.slow

E2E = ["model.ttt_e2e.enabled=true", "model.ttt_e2e.suffix_len=1", "model.ttt_e2e.inner_batch=4",
       "model.ttt_e2e.window=6", "model.ttt_e2e.ilr_warmup_steps=2", "model.d_ff=64", "train.max_steps=12",
       "logging.log_every=1"]


def test_a_tiny_e2e_model_trains_through_the_trainer(tmp_path):
    one = str(tmp_path / "zero1")
    r = run(one, E2E, timeout=300)
    out = r.output(0)
    assert "e2e_ttt_blocks attention:math" in out, out[-2000:]
    losses = losses_by_step(one)
    assert sorted(losses) == list(range(1, 13)), losses
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[12] < losses[1] - 0.1, losses    # lr 1e-2 on a counting task: twelve steps lower the loss
    ckpts = os.listdir(os.path.join(one, "checkpoints"))
    assert any(c.startswith("step_00000012") for c in ckpts), ckpts
    two = str(tmp_path / "zero2")
    run(two, [*E2E, "parallel.zero_stage=2"], timeout=300)
    other = losses_by_step(two)
    assert all(abs(other[s] - losses[s]) < 1e-5 for s in losses), (losses, other)


def test_zero3_is_refused_naming_the_value(tmp_path):
    r = run(str(tmp_path / "z3"), [*E2E, "parallel.zero_stage=3"], expect=None, timeout=120)
    assert r.wait() != [0]
    assert "parallel.zero_stage=3 is not built yet for TTT-E2E" in r.output(0)
