"""Running and collecting a ladder without training: the Slurm submission (dry run through
slurm/submit.py), `collect` on run directories, and the CLI's errors."""
import csv
import importlib.util
import json
import os
import shlex

import pytest

from ttt_lm.config import load_config, save_config
from ttt_lm.scaling import ladder as Lm
from ttt_lm.scaling import sweep as S
from ttt_lm.scaling.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.vocab_size=512", "data.seq_len=64", "train.micro_batch_size=4"]


@pytest.fixture
def ladder(tmp_path):
    d = str(tmp_path / "ladder")
    Lm.plan([os.path.join(ROOT, "configs", "tiny_transformer.yaml")], d, sizes=[30e3, 100e3], tokens_per_param=2,
            count="non_embedding", head_dim=16, aspect=16, batch_tokens=512, overrides=TINY)
    return d


def _submit_module():
    spec = importlib.util.spec_from_file_location("slurm_submit", os.path.join(ROOT, "slurm", "submit.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slurm_array_through_submit_py(ladder, capsys):
    argv = S.slurm_command(ladder, ["--gpus-per-node", "4", "--max-running", "1", "--dry-run"])
    assert argv[0] == os.path.join(ROOT, "slurm", "submit.py") and argv[1] == "sweep"
    assert _submit_module().main(argv[1:]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    opts = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
    assert opts["array"] == "0-1%1" and opts["gpus-per-node"] == "4" and opts["signal"] == "B:USR1@300"
    assert cmd[-2:] == [os.path.join(ROOT, "slurm", "sweep.sbatch"), os.path.join(os.path.abspath(ladder), "sweep.txt")]
    assert opts["output"] == os.path.join(os.path.abspath(ladder), "slurm", "slurm-%A_%a.out")


def _fake_run(run_dir, config, vals, tokens_per_step, steps_done):
    """A run directory as the trainer leaves it: config.yaml and metrics.jsonl."""
    os.makedirs(run_dir, exist_ok=True)
    cfg = load_config(config)
    save_config(cfg, os.path.join(run_dir, "config.yaml"))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for s in range(1, steps_done + 1):
            f.write(json.dumps({"kind": "train", "step": s, "loss": 9.0, "tokens": s * tokens_per_step}) + "\n")
            if s in vals:
                f.write(json.dumps({"kind": "val", "step": s, "loss": vals[s]}) + "\n")
        f.write('{"kind": "train", "st')  # a line cut off by a kill is ignored
    return cfg


def test_collect_reads_final_and_intermediate_losses(ladder, tmp_path):
    runs = Lm.read_plan(ladder)
    a, b = runs
    _fake_run(a.run_dir, a.config, {a.steps // 2: 5.0, a.steps: 4.0}, 512, a.steps)
    _fake_run(b.run_dir, b.config, {1: 6.0}, 512, 3)  # stopped early: intermediate only
    out = str(tmp_path / "losses.csv")
    logs = []
    rows = S.collect([ladder], out, log=logs.append)
    with open(out) as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) == 3
    assert set(got[0]) >= {"arch", "params", "params_kind", "tokens", "flops", "loss"}
    fin = [r for r in got if r["final"] == "1"]
    assert len(fin) == 1 and fin[0]["run"] == a.name and float(fin[0]["loss"]) == 4.0
    assert int(fin[0]["params"]) == a.params_non_embedding and fin[0]["params_kind"] == "non_embedding"
    assert int(fin[0]["tokens"]) == a.tokens and float(fin[0]["flops"]) == pytest.approx(a.flops, rel=1e-12)
    assert all(r["arch"] == "tiny_transformer" for r in got)
    assert any("stopped at step 3" in m for m in logs)
    assert S.finished(a) and not S.finished(b)
    # a plain run directory is labelled by its layer pattern
    assert S.collect_rows([a.run_dir])[0]["arch"] == "attention"


def test_run_skips_finished_runs(ladder):
    a, b = Lm.read_plan(ladder)
    for r in (a, b):
        _fake_run(r.run_dir, r.config, {r.steps: 4.0}, 512, r.steps)
    logs = []
    assert S.run_local(ladder, python="/nonexistent/python", log=logs.append) == []  # nothing started
    assert all("finished earlier, skipped" in m for m in logs) and len(logs) == 2


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert main(["collect", str(tmp_path), "--out", str(tmp_path / "x.csv")]) == 2
    assert "neither a ladder directory" in capsys.readouterr().err
    assert main(["run", str(tmp_path)]) == 2
    assert "not a ladder directory" in capsys.readouterr().err
    (tmp_path / "t.csv").write_text("arch,params\nx,1\n")
    assert main(["fit", str(tmp_path / "t.csv")]) == 2
    assert "lacks the column" in capsys.readouterr().err
    assert main(["ladder", os.path.join(ROOT, "configs", "tiny.yaml"), "--sizes", "1M", "--out", str(tmp_path / "l"),
                 "model.nope=1"]) == 2
    assert "model.nope" in capsys.readouterr().err


def test_cli_passes_options_after_dashes_to_submit_py(ladder, monkeypatch):
    got = {}
    monkeypatch.setattr(S, "submit_slurm", lambda d, args: got.update(d=d, args=args) or 0)
    assert main(["run", ladder, "--slurm", "--", "--gpus-per-node", "8", "--max-running", "4"]) == 0
    assert got == {"d": ladder, "args": ["--gpus-per-node", "8", "--max-running", "4"]}
    with pytest.raises(SystemExit):  # submit.py options without --slurm are refused
        main(["run", ladder, "--", "--gpus-per-node", "8"])
