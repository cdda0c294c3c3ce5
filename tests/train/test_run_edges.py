"""Edges of a run's start and end, on real processes (gloo, CPU): what a run stopped by
train.stop_after says, what a run refused at startup leaves behind, the data order on another
number of ranks, and the global batch of a run resumed on another number of ranks."""
import os

import pytest

from launch import run

pytestmark = pytest.mark.dist


def test_stop_after_says_where_the_run_stopped(tmp_path):
    d = str(tmp_path / "run")
    out = run(d, ["train.max_steps=4", "train.stop_after=2"]).output()
    line = next((ln for ln in out.splitlines() if ln.startswith("[train] stopped after step 2 of 4")), None)
    assert line is not None, out[-2000:]
    assert "train.stop_after=2" in line and "checkpoint saved" in line
    assert os.path.isdir(os.path.join(d, "checkpoints", "step_00000002"))
    # a run that reaches train.max_steps at train.stop_after has nothing left: no such line
    out = run(str(tmp_path / "whole"), ["train.max_steps=2", "train.stop_after=2"]).output()
    assert "stopped after step" not in out


def test_a_run_refused_at_startup_leaves_no_run_directory(tmp_path):
    d = str(tmp_path / "new" / "run")
    missing = str(tmp_path / "no-such-data")
    # the last train.run_dir wins: the spawner's own folder is not the run's
    r = run(str(tmp_path / "spawn"), [f"train.run_dir={d}", f"data.path={missing}", "train.max_steps=1"],
            env={"TTT_TEST_REAL_DATA": "1"}, expect=None)
    assert r.wait() != [0], r.output()
    assert missing in r.output()
    assert not os.path.exists(d), os.listdir(d)
    # a run directory that existed before is kept, with what it held
    os.makedirs(d)
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("mine\n")
    r = run(str(tmp_path / "spawn2"), [f"train.run_dir={d}", f"data.path={missing}", "train.max_steps=1"],
            env={"TTT_TEST_REAL_DATA": "1"}, expect=None)
    assert r.wait() != [0]
    assert os.listdir(d) == ["notes.txt"]
