"""Integrity of real training runs (spawned processes, gloo, CPU): optimizer overrides on resume,
damaged checkpoints, leftovers of killed saves, a full disk, two runs on one directory, non-finite
losses and checkpoints, signals during startup, metrics after a restart, data moved elsewhere."""
import os
import signal
import time
from pathlib import Path

import pytest

from ttt_lm.train import PREEMPTED_EXIT_CODE
from ttt_lm.train import checkpoint as ck
from ttt_lm.train.config import OptimConfig
from ttt_lm.train.optim import lr_multiplier

from launch import metrics, run, spawn

pytestmark = pytest.mark.dist


def _theta(path):
    """Σ|θ| before each training forward, as the runner records it (TTT_TEST_CHECKSUMS)."""
    return {int(a): float(b) for a, b in (line.split() for line in open(path))}


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_with_a_new_lr_trains_at_the_new_lr(tmp_path, stage):
    """optim.lr=1e-5 on a resumed run used to train at the checkpoint's rate (the schedule's base
    rates came back with the checkpoint) while config.yaml said 1e-5."""
    full = str(tmp_path / "full")
    zs = f"parallel.zero_stage={stage}"
    run(full, [zs, "train.max_steps=4", "checkpoint.every=2"], env={"TTT_TEST_CHECKSUMS": str(tmp_path / "a")})
    resumed = str(tmp_path / "resumed")
    r = run(resumed, [zs, "train.max_steps=4", f"train.resume_from={full}/checkpoints/step_00000002",
                      "optim.lr=1e-5"], env={"TTT_TEST_CHECKSUMS": str(tmp_path / "b")})
    assert "resumed with changed optimizer settings, in force from step 3: optim.lr: 0.01 -> 1e-05" in r.output()
    m = lr_multiplier(OptimConfig(lr=1e-5, warmup_steps=2), 4)
    lrs = {rec["step"]: rec["lr"] for rec in metrics(resumed)}
    assert lrs == {3: pytest.approx(1e-5 * m(2), rel=1e-12), 4: pytest.approx(1e-5 * m(3), rel=1e-12)}
    # the weights move ~1000× less than with the old rate (Adam's step is proportional to lr)
    a, b = _theta(str(tmp_path / "a")), _theta(str(tmp_path / "b"))
    moved_old, moved_new = abs(a[4] - a[3]), abs(b[2] - b[1])  # the runner counts forwards from 1 per process
    assert b[1] == a[3] and moved_new < 0.01 * moved_old
    assert "lr: 1.0e-05" in open(os.path.join(resumed, "checkpoints", "step_00000004", "config.yaml")).read()


def test_damaged_checkpoint_falls_back_and_stale_leftovers_are_removed(tmp_path):
    d = str(tmp_path / "run")
    run(d, ["train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=0"])
    root = os.path.join(d, "checkpoints")
    shard = next(f for f in os.listdir(os.path.join(root, "step_00000004", "ds")) if "optim_states" in f)
    bad = os.path.join(root, "step_00000004", "ds", shard)
    with open(bad, "r+b") as f:  # one flipped bit in the optimizer state
        f.seek(os.path.getsize(bad) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(bad) // 2)
        f.write(bytes([b[0] ^ 0x04]))
    # leftovers of a killed save and a killed clean-up, filling the disk
    os.makedirs(os.path.join(root, ".tmp-step_00000006", "ds"))
    with open(os.path.join(root, ".tmp-step_00000006", "ds", "x.pt"), "wb") as f:
        f.write(b"\0" * 100000)
    os.makedirs(os.path.join(root, ".trash-step_00000001"))
    # named explicitly, the damaged checkpoint is refused, naming the file
    r = run(str(tmp_path / "other"), ["train.max_steps=6", f"train.resume_from={root}/step_00000004"], expect=1)
    assert f"error: checkpoint {root}/step_00000004 does not verify: {bad}: sha256 differs" in r.output()
    # the run directory's own restart passes over it to the newest checkpoint that verifies
    r = run(d, ["train.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=0"], tag="again")
    out = r.output()
    assert f"passing over {root}/step_00000004: {bad}: sha256 differs" in out
    assert f"resuming from {root}/step_00000002 at step 2" in out
    assert f"removed {root}/.tmp-step_00000006 (100000 bytes)" in out and ".trash-step_00000001" in out
    assert f"renamed to {root}/rejected-step_00000004" in out
    assert sorted(os.listdir(root)) == ["latest", "rejected-step_00000004", "step_00000002", "step_00000004",
                                        "step_00000006"]
    assert [m["step"] for m in metrics(d)] == [1, 2, 3, 4, 5, 6]  # steps 3, 4 once: the retrained ones


def test_disk_full_before_a_save_is_named(tmp_path):
    d = str(tmp_path / "run")
    r = run(d, ["train.max_steps=3", "checkpoint.every=1"], env={"TTT_TEST_DISK_FREE": "1000"}, expect=1)
    # the first save has no estimate; the second knows the size of the first
    assert f"error: no space left on {d}/checkpoints: need ~" in r.output() and "have 1000 B" in r.output()
    assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ["latest", "step_00000001"]


def test_two_runs_on_one_run_dir(tmp_path):
    d = str(tmp_path / "run")
    a = spawn(d, ["train.max_steps=1000"], env={"TTT_TEST_STEP_SLEEP": "0.2"}, tag="a")
    end = time.time() + 120
    while not (os.path.exists(os.path.join(d, "metrics.jsonl")) and metrics(d)):
        assert time.time() < end and a.procs[0].poll() is None, a.output()
        time.sleep(0.1)
    b = run(d, ["train.max_steps=1000"], tag="b", expect=1)
    assert f"error: run directory {d} is in use by another run (pid {a.procs[0].pid} on" in b.output()
    assert a.procs[0].poll() is None  # the first run goes on undisturbed
    a.signal(signal.SIGTERM)
    assert a.wait() == [PREEMPTED_EXIT_CODE], a.output()
    steps = [m["step"] for m in metrics(d)]
    assert steps == list(range(1, len(steps) + 1))
    assert ck.find_latest(os.path.join(d, "checkpoints")).endswith(f"step_{steps[-1]:08d}")
    assert not os.path.exists(os.path.join(d, "run.lock"))  # released at the end


def test_nonfinite_losses_are_never_checkpointed_and_resume_uses_the_last_good_one(tmp_path):
    d = str(tmp_path / "nan")
    r = run(d, ["train.max_steps=8", "train.max_nonfinite_steps=3", "checkpoint.every=1", "checkpoint.keep_last=0"],
            env={"TTT_TEST_NAN_STEPS": "3,4,5"}, expect=1)
    root = os.path.join(d, "checkpoints")
    assert [s for s, _ in ck.list_checkpoints(root)] == [1, 2]
    assert "no checkpoint at step 3: its loss was non-finite" in r.output()
    assert f"The last good checkpoint is {root}/step_00000002" in r.output()
    # the same command resumes from it; the data under another path is the same data (same checksum)
    r = run(d, ["train.max_steps=4", "checkpoint.every=1", "checkpoint.keep_last=0", "data.path=/scratch/elsewhere"],
            tag="again")
    assert f"resuming from {root}/step_00000002 at step 2" in r.output()
    assert [m["step"] for m in metrics(d)] == [1, 2, 3, 4]


def _caught(pid, sig):
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(x for x in f if x.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_during_startup_exits_for_requeue(tmp_path, sig):
    """The handler is in place before torch is imported, and a signal before the first step ends
    the run with PREEMPTED_EXIT_CODE (which the Slurm scripts requeue), not -15/-10."""
    d = str(tmp_path / "run")
    r = spawn(d, ["train.max_steps=3"], fresh=True)
    pid = r.procs[0].pid
    end = time.time() + 60
    while not _caught(pid, sig):
        assert time.time() < end and r.procs[0].poll() is None, r.output()
        time.sleep(0.005)
    with open(f"/proc/{pid}/maps") as f:
        assert "libtorch" not in f.read()  # still importing
    r.signal(sig)
    assert r.wait() == [PREEMPTED_EXIT_CODE], r.output()
    assert "preempted during startup" in r.output() and "nothing to save" in r.output()
    assert not os.path.exists(os.path.join(d, "checkpoints"))


def test_full_disk_on_a_tmpfs_is_named_and_no_crash_loop(tmp_path, small_disk):
    """A real full disk: DeepSpeed's torch.save failing mid-write says "no space left", and a
    killed save's leftover that keeps the disk full no longer stops the next start."""
    import subprocess
    mnt = Path(small_disk("8m"))
    # the run directory lives on the small disk; the runner's logs (beside it) do not
    (mnt / "run").mkdir()
    (tmp_path / "runs").mkdir()
    os.symlink(mnt / "run", tmp_path / "runs" / "run")
    d = str(tmp_path / "runs" / "run")
    run(d, ["train.max_steps=1", "checkpoint.every=1"], tag="size")  # how big is one checkpoint?
    size = ck.checkpoint_bytes(ck.find_latest(os.path.join(d, "checkpoints")))
    subprocess.run(f"rm -rf {d}/* {d}/.[!.]*", shell=True, check=True)
    # a disk with less room than one checkpoint: DeepSpeed's torch.save fails mid-write
    filler = mnt / "filler"
    filler.write_bytes(b"\0" * (ck.free_bytes(str(mnt)) - size // 2))
    r = run(d, ["train.max_steps=2", "checkpoint.every=1", "logging.tensorboard=true"], tag="full", expect=1)
    assert f"error: no space left on {d}/checkpoints" in r.output(), r.output()[-3000:]
    assert "Traceback" not in r.output() and os.listdir(os.path.join(d, "checkpoints")) == []
    # a killed save's leftover that fills the disk is removed at the next start, which then works
    os.remove(filler)
    os.makedirs(os.path.join(d, "checkpoints", ".tmp-step_00000009"))
    with open(os.path.join(d, "checkpoints", ".tmp-step_00000009", "big"), "wb", buffering=0) as f:
        with pytest.raises(OSError, match="No space left"):
            while True:  # to the last byte: not even a lock file fits
                f.write(b"\0" * 4096)
    r = run(d, ["train.max_steps=2", "checkpoint.every=1", "logging.tensorboard=true"], tag="after")
    assert f"removed {d}/checkpoints/.tmp-step_00000009" in r.output()
    assert [s for s, _ in ck.list_checkpoints(os.path.join(d, "checkpoints"))] == [1, 2]
