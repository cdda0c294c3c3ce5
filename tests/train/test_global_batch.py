"""train.global_batch_size on 2 real ranks: the trainer derives grad_accum from it, trains exactly
as with that grad_accum given by hand, records the value it used, and refuses a batch the layout
does not divide."""
import os

import pytest
import yaml

from launch import losses_by_step, metrics, run

pytestmark = pytest.mark.dist


def test_global_batch_size_derives_grad_accum(tmp_path):
    steps = ["train.max_steps=3"]
    by_hand = run(str(tmp_path / "hand"), [*steps, "train.grad_accum=2"], nprocs=2).run_dir
    derived = run(str(tmp_path / "global"), [*steps, "train.global_batch_size=8"], nprocs=2).run_dir
    # micro-batch 2 x 2 ranks x 2 accumulation steps = 8 sequences of 16 tokens per step, same losses
    assert losses_by_step(derived) == losses_by_step(by_hand)
    assert [m["tokens"] for m in metrics(derived)] == [128, 256, 384]
    with open(os.path.join(derived, "config.yaml")) as f:
        saved = yaml.safe_load(f)["train"]
    assert saved["grad_accum"] == 2 and saved["global_batch_size"] == 8


def test_global_batch_size_not_divisible_is_refused(tmp_path):
    r = run(str(tmp_path / "bad"), ["train.max_steps=1", "train.global_batch_size=6"], nprocs=2, expect=2)
    assert "train.global_batch_size=6 is not a multiple of train.micro_batch_size=2 x 2" in r.output()
