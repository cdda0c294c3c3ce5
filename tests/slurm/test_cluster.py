"""The real sbatch scripts and train.py on a real local Slurm cluster.

Four submissions run side by side (the machine has 2 cores, so overlapping their start-up
keeps the tier short):

* ``requeued``: a 2-task CPU training job; at its first checkpoint the test runs
  ``scontrol requeue``. Slurm sends SIGTERM, the ranks save, and Slurm requeues it.
* ``usr1``: the same job; at its first checkpoint the test sends USR1 to the batch shell only
  (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@<s>`` does before the time limit).
  The script forwards it, the ranks save and exit with the preempted code, the script requeues.
* ``sweep``: a 2-entry job array of single-task runs that finish without interruption.
* ``eval``: ``python -m ttt_lm.eval perplexity`` on the first sweep entry, queued behind the
  array with ``--dependency=afterok``.

Each preempted run must come back (SLURM_RESTART_COUNT=1 in its log), resume from the step at
which it stopped, log every step exactly once, finish, and not be requeued again.
"""
import json
import os
import re
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slurm

# a step takes ~10-100 ms here (more when other tests share the CPU): enough steps after the first
# checkpoint that the interrupt lands mid-run even when slurmctld is slow to deliver it
MAX_STEPS = 1500
CKPT_EVERY = 50
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.layer_pattern=[attention]",
        "data.seq_len=32", "train.micro_batch_size=2", "eval.every=0",
        "logging.progress=false", "logging.tensorboard=false", "logging.log_every=0", "checkpoint.keep_last=2"]
TIMEOUT = 420  # seconds for all four submissions together


def _submit(cluster, kind, args, tasks):
    cmd = [sys.executable, os.path.join(ROOT, "slurm", "submit.py"), kind, *args, "--gpus-per-node", "0",
           "--tasks-per-node", str(tasks), "--cpus-per-task", "1", "--time", "10"]
    out = cluster.run(cmd).stdout.strip()
    assert re.fullmatch(r"\d+", out), f"submit.py should print only the job id, printed {out!r}"
    return out


def _steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r["step"] for r in recs if r.get("kind", "train") == "train"]


def _read(path):
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="module")
def runs(slurm_cluster, tiny_corpus, tmp_path_factory):
    c = slurm_cluster
    tmp = tmp_path_factory.mktemp("runs")
    with open(os.path.join(tiny_corpus, "manifest.json")) as f:
        vocab = json.load(f)["vocab_size"]
    common = [os.path.join(ROOT, "configs", "tiny.yaml"), *TINY, f"model.vocab_size={vocab}", f"data.path={tiny_corpus}"]
    jobs = {}
    # at its first complete checkpoint each training job is interrupted, by a thread that watches
    # from its submission on: submitting the other jobs and querying their states take seconds
    # each on a loaded machine, long enough for a whole run to finish unwatched
    pending = {}    # job name -> the command that interrupts it
    lock, stop, errors = threading.Lock(), threading.Event(), []

    def fire():
        with lock:
            for name in list(pending):
                if os.path.exists(os.path.join(jobs[name]["run_dir"], "checkpoints", "latest")):
                    c.run(pending.pop(name))

    def watch():
        while not stop.is_set():
            try:
                fire()
            except Exception as e:  # noqa: BLE001 - re-raised by the fixture below
                errors.append(e)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for name in ("requeued", "usr1"):
            run_dir = str(tmp / name)
            jid = _submit(c, "train", [*common, f"train.run_dir={run_dir}", f"train.max_steps={MAX_STEPS}",
                                       f"checkpoint.every={CKPT_EVERY}"], tasks=2)
            with lock:
                jobs[name] = {"id": jid, "run_dir": run_dir, "log": os.path.join(run_dir, f"slurm-{jid}.out")}
                pending[name] = (["scontrol", "requeue", jid] if name == "requeued"
                                 else ["scancel", "--signal=USR1", "--batch", jid])
        lst = tmp / "sweep.txt"
        lst.write_text("# two small runs\n" + "".join(
            " ".join([*common, f"train.run_dir={tmp}/sweep{i}", "train.max_steps=4"]) + "\n" for i in range(2)))
        sid = _submit(c, "sweep", [str(lst), "--log-dir", str(tmp / "sweep_logs")], tasks=1)
        jobs["sweep"] = {"id": sid, "run_dirs": [str(tmp / f"sweep{i}") for i in range(2)],
                         "logs": [str(tmp / "sweep_logs" / f"slurm-{sid}_{i}.out") for i in range(2)]}
        # an eval of the first sweep entry, queued behind the whole array (afterok)
        eid = _submit(c, "eval", [*common, f"train.run_dir={tmp}/sweep0", "--task", "perplexity", "--after", sid,
                                  "--eval-args=--max-batches 2 --device cpu --no-progress"], tasks=1)
        jobs["eval"] = {"id": eid, "run_dir": str(tmp / "sweep0"),
                        "log": str(tmp / "sweep0" / f"slurm-eval-{eid}.out")}

        # then wait for every job to finish
        ids = [jobs["requeued"]["id"], jobs["usr1"]["id"], f"{sid}_0", f"{sid}_1", eid]
        deadline = time.time() + TIMEOUT
        while True:
            time.sleep(1.0)
            if errors:
                raise errors[0]
            infos = {j: c.job(j) for j in ids}
            states = {j: i.get("JobState") for j, i in infos.items()}
            with lock:
                left = list(pending)
            if not left and all(s == "COMPLETED" for s in states.values()):
                break
            bad = {j: s for j, s in states.items() if s in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")}
            bad.update({jobs[n]["id"]: "COMPLETED before it could be interrupted" for n in left
                        if states[jobs[n]["id"]] == "COMPLETED"})
            if bad or time.time() > deadline:
                logs = {n: _read(j["log"]) for n, j in jobs.items() if "log" in j and os.path.exists(j["log"])}
                pytest.fail(f"jobs {bad or states} (pending actions {left}); logs:\n" +
                            "\n".join(f"--- {n}\n{t[-3000:]}" for n, t in logs.items()))
    finally:
        stop.set()
        watcher.join(timeout=60)
    for name in ("requeued", "usr1", "eval"):
        jobs[name]["info"] = infos[jobs[name]["id"]]
    jobs["sweep"]["infos"] = [infos[f"{sid}_{i}"] for i in range(2)]
    return jobs


def _check_resumed_once(job):
    log = _read(job["log"])
    assert job["info"]["Restarts"] == "1", job["info"]
    # SLURM_RESTART_COUNT as the batch script logged it: one first run, one restart
    assert re.findall(r"job \d+ restart (\d+) on", log) == ["0", "1"], log
    stopped = re.findall(r"preempted at step (\d+)", log)
    resumed = re.findall(r"resuming from \S+ at step (\d+)", log)
    assert len(stopped) == 1 and resumed == stopped, log  # resumed exactly where the signal stopped it
    assert CKPT_EVERY <= int(stopped[0]) < MAX_STEPS
    # every step logged once: no gap (lost steps) and no repeat (steps redone after the restart)
    assert _steps(job["run_dir"]) == list(range(1, MAX_STEPS + 1))
    exits = re.findall(r"step exited with status (\d+)", log)
    assert exits == ["75", "0"], log
    # the finished run is not requeued
    assert "requeueing" not in log.split("restart 1 on", 1)[1]
    return log


def test_scontrol_requeue_resumes(runs):
    log = _check_resumed_once(runs["requeued"])
    # Slurm's SIGTERM reached the script, which forwarded it but left the requeue to Slurm
    assert "TERM: forwarding" in log and "requeueing" not in log


def test_usr1_checkpoints_and_requeues(runs):
    log = _check_resumed_once(runs["usr1"])
    first = log.split("restart 1 on", 1)[0]
    assert "USR1: asking the training processes" in first
    assert re.search(r"checkpoint saved; requeueing job \d+", first), first


def test_sweep_array_runs_each_entry(runs):
    sweep = runs["sweep"]
    for i, (info, run_dir, log) in enumerate(zip(sweep["infos"], sweep["run_dirs"], sweep["logs"])):
        assert info["Restarts"] == "0" and info["ExitCode"] == "0:0", info
        assert _steps(run_dir) == [1, 2, 3, 4]
        text = _read(log)
        assert f"sweep entry {i}: " in text and f"train.run_dir={run_dir}" in text


def test_eval_job_after_sweep(runs):
    ev, sweep = runs["eval"], runs["sweep"]
    assert ev["info"]["ExitCode"] == "0:0", _read(ev["log"])
    # afterok: the eval started only after the last array task had ended
    def t(info, key):
        return time.mktime(time.strptime(info[key], "%Y-%m-%dT%H:%M:%S"))
    assert t(ev["info"], "StartTime") >= max(t(i, "EndTime") for i in sweep["infos"])
    with open(os.path.join(ev["run_dir"], "eval", "perplexity.json")) as f:
        assert json.load(f)
