"""The sbatch scripts and the submit helper, without a cluster (unit tier)."""
import importlib.util
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM = os.path.join(ROOT, "slurm")
SCRIPTS = ["train.sbatch", "eval.sbatch", "sweep.sbatch", "common.sh"]


def _submit_module():
    spec = importlib.util.spec_from_file_location("slurm_submit", os.path.join(SLURM, "submit.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


submit = _submit_module()


def _headers(name):
    with open(os.path.join(SLURM, name)) as f:
        return [line.split(None, 1)[1].strip() for line in f if line.startswith("#SBATCH")]


@pytest.mark.parametrize("name", SCRIPTS)
def test_bash_syntax(name):
    r = subprocess.run(["bash", "-n", os.path.join(SLURM, name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_preempted_code_matches_trainer():
    from ttt_lm.train import PREEMPTED_EXIT_CODE
    with open(os.path.join(SLURM, "common.sh")) as f:
        m = re.search(r"^PREEMPTED_EXIT_CODE=(\d+)$", f.read(), re.M)
    assert m and int(m.group(1)) == PREEMPTED_EXIT_CODE


@pytest.mark.parametrize("name", ["train.sbatch", "sweep.sbatch"])
def test_preemptible_headers(name):
    h = _headers(name)
    assert "--requeue" in h and "--open-mode=append" in h
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", x) for x in h), h


def _cmd(argv):
    own, extra = submit._split(argv)
    return submit.sbatch_command(submit.build_parser().parse_args(own), extra)


def _opts(cmd):
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_submit_train_fills_from_config(tmp_path):
    run_dir = tmp_path / "run_a"
    cmd = _cmd(["train", "configs/tiny.yaml", f"train.run_dir={run_dir}", "optim.lr=1e-3",
                "--nodes", "2", "--gpus-per-node", "4", "--cpus-per-task", "6", "--time", "1:00:00",
                "--partition", "gpu", "--account", "lm", "--signal-seconds", "120", "--", "--qos=high"])
    o = _opts(cmd)
    assert o["nodes"] == "2" and o["ntasks-per-node"] == "4" and o["gpus-per-node"] == "4"
    assert o["cpus-per-task"] == "6" and o["time"] == "1:00:00"
    assert o["partition"] == "gpu" and o["account"] == "lm" and o["qos"] == "high"
    assert o["signal"] == "B:USR1@120" and o["open-mode"] == "append"
    assert o["job-name"] == "train-run_a" and o["output"] == f"{run_dir}/slurm-%j.out"
    assert run_dir.is_dir()  # sbatch cannot open a log in a missing directory
    i = cmd.index(os.path.join(SLURM, "train.sbatch"))
    assert cmd[i + 1:] == [os.path.join(ROOT, "configs", "tiny.yaml"), f"train.run_dir={run_dir}", "optim.lr=1e-3"]


def test_submit_cpu_only_and_eval_dependency(tmp_path):
    cmd = _cmd(["eval", "configs/tiny.yaml", f"train.run_dir={tmp_path}", "--gpus-per-node", "0", "--after", "123",
                "--task", "perplexity", "--eval-args", "--max-batches 2"])
    o = _opts(cmd)
    assert "gpus-per-node" not in o and o["ntasks-per-node"] == "1" and "signal" not in o
    assert o["dependency"] == "afterok:123" and o["output"] == f"{tmp_path}/slurm-eval-%j.out"
    i = cmd.index(os.path.join(SLURM, "eval.sbatch"))
    assert cmd[i + 1:] == ["perplexity", "--checkpoint", str(tmp_path), "--out", f"{tmp_path}/eval", "--max-batches", "2"]


@pytest.mark.parametrize("argv,match", [
    (["train", "configs/tiny.yaml", "optim.lrr=1"], "optim.lrr"),                       # typo fails before queueing
    (["train", "configs/tiny.yaml", "parallel.tensor_parallel=3", "--gpus-per-node", "4"], "divisible"),
])
def test_submit_rejects_bad_config(argv, match):
    with pytest.raises(submit.SubmitError, match=match):
        _cmd(argv)


def test_submit_sweep(tmp_path):
    lst = tmp_path / "sizes.txt"
    lst.write_text("# d_model sweep\n\n"
                   f"configs/tiny.yaml model.d_model=64 train.run_dir={tmp_path}/a\n"
                   f"configs/tiny.yaml model.d_model=128 train.run_dir={tmp_path}/b\n"
                   f"configs/tiny.yaml model.d_model=256 train.run_dir={tmp_path}/c\n")
    cmd = _cmd(["sweep", str(lst), "--max-running", "2", "--log-dir", str(tmp_path / "logs")])
    o = _opts(cmd)
    assert o["array"] == "0-2%2" and o["output"] == f"{tmp_path}/logs/slurm-%A_%a.out"
    assert cmd[-2:] == [os.path.join(SLURM, "sweep.sbatch"), str(lst)]
    lst.write_text(f"configs/tiny.yaml train.run_dir={tmp_path}/a\nconfigs/tiny.yaml train.run_dir={tmp_path}/a\n")
    with pytest.raises(submit.SubmitError, match="both train into"):
        _cmd(["sweep", str(lst)])


def test_sweep_job_names(tmp_path):
    """A list file names its job; a ladder's sweep.txt is named by its ladder's folder, not
    sweep-sweep, and so is its default log folder."""
    entry = f"configs/tiny.yaml train.run_dir={tmp_path}/runs/a\n"
    (tmp_path / "sizes.txt").write_text(entry)
    (tmp_path / "ttt_ladder").mkdir()
    (tmp_path / "ttt_ladder" / "sweep.txt").write_text(entry)
    assert _opts(_cmd(["sweep", str(tmp_path / "sizes.txt"), "--log-dir", str(tmp_path)]))["job-name"] == "sweep-sizes"
    o = _opts(_cmd(["sweep", str(tmp_path / "ttt_ladder" / "sweep.txt"), "--log-dir", str(tmp_path)]))
    assert o["job-name"] == "sweep-ttt_ladder"
    assert submit.sweep_name(str(tmp_path / "ttt_ladder" / "sweep.txt")) == "ttt_ladder"
    assert submit.sweep_name("sweeps/ttt_paper_sizes.txt") == "ttt_paper_sizes"


def test_dry_run_prints_command(capsys, tmp_path):
    assert submit.main(["train", "configs/tiny.yaml", f"train.run_dir={tmp_path}", "--dry-run"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert printed[0] == "sbatch" and printed[-2] == os.path.join(ROOT, "configs", "tiny.yaml")


def _sweep_entry(lst, task):
    """The entry sweep.sbatch's own selection line picks for an array task."""
    with open(os.path.join(SLURM, "sweep.sbatch")) as f:
        line = next(x for x in f if x.startswith("ENTRY="))
    script = f"LIST={shlex.quote(str(lst))}; TASK={task}; {line.strip()}; printf %s \"$ENTRY\""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout


def test_sweep_script_and_submit_count_entries_alike(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_text("# header\nA x=1\n\n  # indented comment\nB y=2\nC\n")
    entries = submit.sweep_entries(str(lst))
    assert [e[0] for e in entries] == ["A", "B", "C"]
    assert [_sweep_entry(lst, i) for i in range(4)] == ["A x=1", "B y=2", "C", ""]


@pytest.mark.parametrize("ci", ["", "true"])
def test_uninstallable_slurm_skips_with_reason_or_fails_in_ci(monkeypatch, ci):
    from tests.slurm import cluster
    monkeypatch.setattr(cluster, "_which", lambda name: None)   # nothing installed, no apt-get
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.SlurmUnavailable, match="needs root") as e:
        cluster.ensure_installed()
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(expected, match="needs root"):
        cluster.unavailable(str(e.value))


def test_bundled_sweep_list_is_valid(tmp_path):
    lst = os.path.join(SLURM, "sweeps", "ttt_paper_sizes.txt")
    cmd = _cmd(["sweep", lst, "--log-dir", str(tmp_path)])  # every entry loads, no two share a run_dir
    assert _opts(cmd)["array"] == f"0-{len(submit.sweep_entries(lst)) - 1}"


def _flaky_client(tmp_path, fail_with):
    """A client that fails once (killed by SIGPIPE, or exiting 1 with a message) and then succeeds."""
    state, script = tmp_path / "calls", tmp_path / "client.sh"
    script.write_text(f"""#!/bin/bash
n=$(cat {state} 2>/dev/null || echo 0); echo $((n + 1)) > {state}
if [ "$n" = 0 ]; then {fail_with}; fi
echo JobState=RUNNING Restarts=0
""")
    script.chmod(0o755)
    return str(script), state


def _client_side(tmp_path):
    """A LocalSlurm with no daemons: only its client-side methods are used."""
    import shutil
    from tests.slurm.cluster import LocalSlurm
    c = LocalSlurm(str(tmp_path / "slurm"))
    shutil.rmtree(c.munge_dir)
    return c


def test_query_repeats_a_client_killed_by_a_signal(tmp_path):
    c = _client_side(tmp_path)
    script, state = _flaky_client(tmp_path, "kill -PIPE $$")
    r = c.query([script], delay=0.01)
    assert "JobState=RUNNING" in r.stdout and state.read_text().strip() == "2"
    state.unlink()
    script, state = _flaky_client(tmp_path, "echo 'slurm_load_jobs error: Socket timed out on send/recv' >&2; exit 1")
    assert c.query([script], delay=0.01).returncode == 0 and state.read_text().strip() == "2"


def test_query_raises_at_once_on_a_lasting_error(tmp_path):
    c = _client_side(tmp_path)
    script, state = _flaky_client(tmp_path, "echo 'Invalid job id specified' >&2; exit 1")
    with pytest.raises(RuntimeError, match=r"return codes \[1\]\): Invalid job id"):
        c.query([script], delay=0.01)
    assert state.read_text().strip() == "1"
    always = tmp_path / "dead.sh"
    always.write_text("#!/bin/bash\nkill -PIPE $$\n")
    always.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"return codes \[-13, -13, -13\]"):
        c.query([str(always)], attempts=3, delay=0.01)
