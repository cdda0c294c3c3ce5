"""Checkpoint and run-directory integrity, in-process: digests and fallback, stale leftovers,
free space, the run-directory lock, the config check, metrics after a restart, W&B run ids,
export/eval of damaged checkpoints, optimizer settings on resume."""
import errno
import json
import os
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from ttt_lm.config import ConfigError, load_config
from ttt_lm.train import checkpoint as ck
from ttt_lm.train.lock import LOCK_FILE, RunDirInUse, RunDirLock
from ttt_lm.train.metrics import MetricsWriter, truncate_metrics


class FakeEngine:
    """Writes what engine.save_checkpoint would (two files), or fails as a full disk does."""

    def __init__(self, fail=None):
        self.fail = fail

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag))
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            with open(os.path.join(save_dir, tag, name), "wb") as f:
                f.write(os.urandom(4096))
        if self.fail is not None:
            raise self.fail


def _save(root, step, keep=0, **kw):
    return ck.save(kw.pop("engine", FakeEngine()), root, step, {"step": step}, {"loader": {}}, "a: 1\n", rank=0,
                   keep_last=keep, **kw)


def _flip(path, offset=100):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


OPTIM = os.path.join("ds", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


# ---- item 4: digests, verification, fallback ------------------------------------------------------

def test_digests_are_recorded_and_a_flipped_bit_or_missing_file_is_named(tmp_path):
    root = str(tmp_path / "checkpoints")
    for s in (1, 2, 3):
        _save(root, s)
    files = ck.read_state(os.path.join(root, "step_00000003"))["files"]
    assert set(files) == {OPTIM, os.path.join("ds", "mp_rank_00_model_states.pt"), "rank_00000.pt", "config.yaml"}
    assert all(ck.verify(c) == [] for _, c in ck.list_checkpoints(root))
    _flip(os.path.join(root, "step_00000003", OPTIM))
    os.remove(os.path.join(root, "step_00000002", "rank_00000.pt"))
    bad = os.path.join(root, "step_00000003", OPTIM)
    assert ck.verify(os.path.join(root, "step_00000003")) == [
        f"{bad}: sha256 differs from the one recorded at save (the file is corrupt)"]
    assert ck.verify(os.path.join(root, "step_00000002")) == [
        f"{os.path.join(root, 'step_00000002', 'rank_00000.pt')} is missing"]
    # from a run directory: the newest checkpoint that verifies, saying what was passed over
    notes = []
    got, passed = ck.select(str(tmp_path), note=notes.append)
    assert got.endswith("step_00000001") and [os.path.basename(c) for c, _ in passed] == ["step_00000003",
                                                                                          "step_00000002"]
    assert "passing over" in notes[0] and "sha256 differs" in notes[0] and "is missing" in notes[1]
    assert "using" in notes[2] and notes[2].endswith("step_00000001, the newest checkpoint that verifies")
    # a step directory named explicitly must verify itself
    with pytest.raises(ck.CheckpointError, match=r"step_00000003 does not verify: .*optim_states.pt: sha256 differs"):
        ck.resolve(os.path.join(root, "step_00000003"))
    # nothing verifies: one message naming each
    os.remove(os.path.join(root, "step_00000001", "config.yaml"))
    with pytest.raises(ck.CheckpointError, match=r"no checkpoint under .* verifies: .*step_00000003.*step_00000002"
                                                 r".*step_00000001: .*config.yaml is missing"):
        ck.resolve(str(tmp_path))
    # a size change is named as such
    with open(os.path.join(root, "step_00000003", "config.yaml"), "a") as f:
        f.write("b: 2\n")
    assert any("config.yaml is 10 bytes, 5 were written" in p for p in ck.verify(os.path.join(root, "step_00000003")))


def test_fallback_names_the_checkpoint_used_once(tmp_path, capsys):
    """export/eval of a run directory whose newest checkpoint fails verification: one line per
    checkpoint passed over, then one line naming the one used and its step."""
    root = str(tmp_path / "checkpoints")
    for s in (1, 2):
        _save(root, s)
    _flip(os.path.join(root, "step_00000002", OPTIM))
    capsys.readouterr()
    got = ck.resolve(str(tmp_path))
    lines = capsys.readouterr().err.splitlines()
    assert got.endswith("step_00000001")
    assert [ln for ln in lines if "using" in ln] == [f"[checkpoint] using {got} (step 1), the newest checkpoint "
                                                     "that verifies"]
    assert len(lines) == 2 and "passing over" in lines[0]
    notes = []  # a caller's own console gets both lines
    ck.resolve(str(tmp_path), say=notes.append)
    assert len(notes) == 2 and notes[1].startswith("using") and capsys.readouterr().err == ""


def test_damaged_state_file_and_old_checkpoints(tmp_path):
    root = str(tmp_path / "checkpoints")
    c = _save(root, 1)
    with open(os.path.join(c, ck.STATE_FILE), "w") as f:
        f.write("{not json")
    assert "trainer_state.json is damaged" in ck.verify(c)[0]
    c2 = _save(root, 2)
    st = ck.read_state(c2)
    del st["files"]  # written before digests were recorded: accepted, with a note
    with open(os.path.join(c2, ck.STATE_FILE), "w") as f:
        json.dump(st, f)
    assert ck.verify(c2) == []


@pytest.mark.slow
def test_export_and_eval_of_missing_or_damaged_checkpoints_end_in_a_message(tmp_path, capsys):
    from ttt_lm.eval.checkpoint import load_checkpoint
    from ttt_lm.eval.common import EvalError
    from ttt_lm.train.export import main as export_main
    root = str(tmp_path / "run" / "checkpoints")
    c = _save(root, 1)
    _flip(os.path.join(c, OPTIM))
    assert export_main([c, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "optim_states.pt: sha256 differs" in err and "Traceback" not in err
    assert export_main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "error: no complete checkpoint at" in capsys.readouterr().err
    with pytest.raises(EvalError, match="no checkpoint under .* verifies: .*sha256 differs"):
        load_checkpoint(str(tmp_path / "run"))
    # the eval command line prints it and returns 2, no traceback
    r = subprocess.run([sys.executable, "-m", "ttt_lm.eval", "perplexity", "--checkpoint", str(tmp_path / "run"),
                        "--out", str(tmp_path / "ev")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 2 and "sha256 differs" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# ---- items 5 and 10: leftovers, `latest`, free space ---------------------------------------------

def test_latest_is_derived_from_the_directories(tmp_path):
    root = str(tmp_path / "checkpoints")
    _save(root, 1)
    _save(root, 2)
    # killed between the rename of step 2 and the update of `latest`
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_00000001\n")
    assert ck.find_latest(root).endswith("step_00000002")


def test_stale_tmp_and_trash_are_cleaned(tmp_path):
    root = tmp_path / "checkpoints"
    for d in (".tmp-step_00000005/ds", ".trash-step_00000001/ds", "step_00000002"):
        (root / d).mkdir(parents=True)
    (root / ".tmp-step_00000005" / "ds" / "x.pt").write_bytes(b"x" * 1000)
    (root / "latest.tmp").write_text("step")
    removed = ck.clean_stale(str(root))
    assert removed == [(".tmp-step_00000005", 1000), (".trash-step_00000001", 0), ("latest.tmp", 4)]
    assert sorted(os.listdir(root)) == ["step_00000002"]


def test_no_space_before_a_save_is_named(tmp_path, monkeypatch):
    root = str(tmp_path / "checkpoints")
    c = _save(root, 1)
    size = ck.checkpoint_bytes(c)
    assert size > 4 * 4096
    monkeypatch.setattr(ck, "free_bytes", lambda p: 5000)
    with pytest.raises(ck.CheckpointError, match=rf"no space left on {root}: need ~[\d.]+ KiB for a checkpoint, "
                                                 r"have 4.9 KiB"):
        _save(root, 2, need_bytes=size)
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]  # nothing half-written


@pytest.mark.parametrize("fail", [OSError(errno.ENOSPC, "No space left on device"),
                                  RuntimeError("basic_ios::clear: iostream error")])
def test_disk_filling_during_a_save_is_named_and_cleaned_up(tmp_path, monkeypatch, fail):
    root = str(tmp_path / "checkpoints")
    _save(root, 1)
    monkeypatch.setattr(ck, "free_bytes", lambda p: 0)
    with pytest.raises(ck.CheckpointError, match=rf"no space left on {root}: need ~.*, have 0 B"):
        _save(root, 2, engine=FakeEngine(fail))
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]
    # any other failure is named with its cause, and cleaned up as well
    monkeypatch.setattr(ck, "free_bytes", lambda p: 1 << 40)
    with pytest.raises(ck.CheckpointError, match="saving checkpoint .*step_00000002 failed on rank 0: "
                                                 "PermissionError: denied"):
        _save(root, 2, engine=FakeEngine(PermissionError("denied")))
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]


def test_real_full_disk_on_a_tmpfs(small_disk):
    mnt = small_disk("1m")
    root = os.path.join(mnt, "checkpoints")
    c = _save(root, 1)
    with open(os.path.join(mnt, "filler"), "wb") as f:  # leave less than one checkpoint free
        f.write(b"\0" * (ck.free_bytes(root) - 6000))
    # a save of unknown size (no estimate) runs into the full disk: named, and cleaned up
    with pytest.raises(ck.CheckpointError, match=rf"no space left on {root}"):
        _save(root, 2)
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]
    # with the estimate from the last checkpoint it stops before writing anything
    with pytest.raises(ck.CheckpointError, match=rf"no space left on {root}: need ~.*, have"):
        _save(root, 2, need_bytes=ck.checkpoint_bytes(c))


# ---- item 6: the run-directory lock -------------------------------------------------------------

def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    d = str(tmp_path / "run")
    a = RunDirLock(d, heartbeat_s=0.05)
    assert a.acquire() is None
    with pytest.raises(RunDirInUse, match=rf"run directory {d} is in use by another run \(pid {os.getpid()} on "
                                          rf"{socket.gethostname()}"):
        RunDirLock(d).acquire()
    mtime = os.path.getmtime(os.path.join(d, LOCK_FILE))
    time.sleep(0.3)
    assert os.path.getmtime(os.path.join(d, LOCK_FILE)) > mtime  # the heartbeat
    a.release()
    assert not os.path.exists(os.path.join(d, LOCK_FILE))
    # a lock left by a process that is gone (kill -9) on this host
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with open(os.path.join(d, LOCK_FILE), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": p.pid, "token": "x", "started": time.time()}, f)
    b = RunDirLock(d)
    assert f"process {p.pid} on this host" in b.acquire()
    b.release()


def test_lock_of_another_node(tmp_path, monkeypatch):
    d = str(tmp_path / "run")
    os.makedirs(d)
    lock = os.path.join(d, LOCK_FILE)

    def held_by(**kw):
        with open(lock, "w") as f:
            json.dump({"host": "node-b", "pid": 1, "token": "x", "started": time.time(), **kw}, f)

    held_by(slurm_job_id="77", slurm_restart_count=0)
    with pytest.raises(RunDirInUse, match="pid 1 on node-b, Slurm job 77"):
        RunDirLock(d).acquire()
    # a requeued attempt of the same Slurm job on another node takes over at once
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    a = RunDirLock(d)
    assert "attempt 0 of this Slurm job 77" in a.acquire()
    a.release()
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    # a dead node's lock: stale once its heartbeat is older than stale_s
    held_by()
    old = time.time() - 100
    os.utime(lock, (old, old))
    with pytest.raises(RunDirInUse):
        RunDirLock(d, stale_s=1000).acquire()
    a = RunDirLock(d, stale_s=50)
    assert "heartbeat is 100 s old" in a.acquire()
    a.release()


# ---- item 10: config check, metrics, W&B ---------------------------------------------------------

@pytest.mark.parametrize("override,key", [("train.max_steps=-5", "train.max_steps must be >= 1, got -5"),
                                          ("checkpoint.every=-1", "checkpoint.every must be >= 0"),
                                          ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1, got 0"),
                                          ("optim.lr=-1", "optim.lr must be a positive number, got -1.0"),
                                          ("optim.beta2=1.0", "optim.beta2 must be in [0, 1)"),
                                          ("optim.schedule=linear", "optim.schedule must be one of")])
def test_config_check_rejects_unusable_values(override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_wandb_without_the_package_fails_at_config_time(monkeypatch, tmp_path):
    import importlib.util

    from ttt_lm.train import trainer
    cfg = load_config(None, ["logging.wandb=true", f"train.run_dir={tmp_path}", "train.device=cpu"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    monkeypatch.setattr(trainer, "check_parallel", lambda *a: (_ for _ in ()).throw(AssertionError("got past the check")))
    with pytest.raises(ConfigError, match="logging.wandb=true needs the wandb package, which is not installed"):
        trainer.train(cfg)


def test_metrics_after_a_restart_have_each_step_once(tmp_path):
    cfg = load_config(None, ["logging.tensorboard=false"])
    d = str(tmp_path)
    w = MetricsWriter(d, cfg, enabled=True)
    for s in (1, 2, 3):
        w.log({"kind": "train", "step": s, "loss": float(s)})
    w.log({"kind": "val", "step": 2, "loss": 0.5})
    w.close()
    # resumed from the checkpoint of step 2: step 3 is trained again
    w = MetricsWriter(d, cfg, enabled=True, start_step=2, restart={"checkpoint": "ck2"})
    w.log({"kind": "train", "step": 3, "loss": 33.0})
    w.close()
    recs = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
    assert [(r["kind"], r["step"]) for r in recs] == [("train", 1), ("train", 2), ("val", 2), ("restart", 2),
                                                      ("train", 3)]
    assert recs[-1]["loss"] == 33.0 and recs[-2]["checkpoint"] == "ck2" and recs[-2]["dropped_records"] == 1
    assert truncate_metrics(os.path.join(d, "metrics.jsonl"), 10) == (5, 0)


def test_wandb_run_id_is_kept_across_restarts(tmp_path, monkeypatch):
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(None, ["logging.tensorboard=false", "logging.wandb=true"])
    for start in (0, 5):
        MetricsWriter(str(tmp_path), cfg, enabled=True, start_step=start).close()
    assert calls[0]["id"] == calls[1]["id"] and calls[0]["resume"] == "allow"
    assert open(tmp_path / "wandb_run_id").read().strip() == calls[0]["id"]


# ---- item 1: optimizer settings on resume ----------------------------------------------------------

def test_apply_hyperparameters_puts_the_new_rate_in_force():
    from ttt_lm.train.config import OptimConfig
    from ttt_lm.train.optim import apply_hyperparameters, build_optimizer, changed_hyperparameters, param_groups
    from ttt_lm.model import LM
    from ttt_lm.model.config import ModelConfig
    model = LM(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, layer_pattern=["attention"]))
    old = OptimConfig(lr=1e-2, warmup_steps=2)
    opt, sched = build_optimizer(model, old, 10)
    for _ in range(4):
        opt.step()
        sched.step()
    sd_opt, sd_sched = opt.state_dict(), sched.state_dict()
    new = OptimConfig(lr=1e-5, warmup_steps=2, weight_decay=0.0, beta2=0.99)
    opt2, sched2 = build_optimizer(model, new, 10)
    opt2.load_state_dict(sd_opt)
    sched2.load_state_dict(sd_sched)  # what a resume does: the old rate comes back
    assert sched2.get_last_lr()[0] == pytest.approx(1e-2 * sched2.lr_lambdas[0](4))
    assert changed_hyperparameters(vars(old), new, 10, 12) == [
        "optim.lr: 0.01 -> 1e-05", "optim.weight_decay: 0.1 -> 0.0", "optim.beta2: 0.95 -> 0.99",
        "schedule length (optim.total_steps or train.max_steps): 10 -> 12"]
    apply_hyperparameters(sched2, new, [g["weight_decay"] for g in param_groups(model, new.weight_decay)])
    m = sched2.lr_lambdas[0]
    assert [g["lr"] for g in opt2.param_groups] == [1e-5 * m(4)] * 2 and sched2.get_last_lr() == [1e-5 * m(4)] * 2
    assert all(g["betas"] == (0.9, 0.99) and g["weight_decay"] == 0.0 for g in opt2.param_groups)
    sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [1e-5 * m(5)] * 2
