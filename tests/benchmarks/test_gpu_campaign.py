"""The GPU campaign's bookkeeping, checked without a GPU: which files and presets it picks, how it
reads the outputs of the processes it starts, and how it records a campaign into RESULTS.md."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_campaign", ROOT / "benchmarks" / "gpu_campaign.py")
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)


def _args(**kw):
    base = dict(part_budget=450.0, file_timeout=150.0, op_timeout=120.0, preset_timeout=90.0,
                seq_lens=[2048], reps=5, out=Path("/nonexistent"))
    base.update(kw)
    return SimpleNamespace(**base)


def test_presets_cover_every_architecture_at_two_sizes():
    names = [p.name for p in gc._presets(gc.ARCHS)]
    assert len(names) == 2 * len(gc.ARCHS)
    assert "mamba_130m.yaml" in names and "titans_lmm_350m.yaml" in names


def test_tests_part_reads_pytest_output(monkeypatch, tmp_path):
    out = ("tests/kernels/test_delta_rule_triton.py::test_gpu_a PASSED [ 50%]\n"
           "tests/kernels/test_delta_rule_triton.py::test_gpu_b FAILED [100%]\n"
           "E   triton.runtime.errors.OutOfResources: out of resource: shared memory\n")
    # a file stopped at its limit: its failure's error line was printed when the test failed
    killed = ("tests/kernels/test_titans_triton.py::test_gpu_c[2-4] FAILED [ 33%]\n"
              "E   tests/kernels/test_titans_triton.py::test_gpu_c[2-4]: AssertionError: dk: Tensor-likes are not close!\n")
    calls, envs = [], []

    def fake_run(cmd, timeout, **env):
        calls.append(cmd)
        envs.append(env)
        if "delta_rule" in cmd[3]:
            return 1, out, 3.0
        return (124, killed, 150.0) if "titans" in cmd[3] else (124, "", 150.0)

    monkeypatch.setattr(gc, "_run", fake_run)
    text = gc.part_tests(_args(out=tmp_path))
    assert all(e == {"TTT_LM_INSTANT_FAILURES": "1"} for e in envs)
    titans = [ln for ln in text.splitlines() if ln.startswith("| `tests/kernels/test_titans_triton")][0]
    assert "`test_gpu_c[2-4]`: AssertionError: dk: Tensor-likes are not close!" in titans
    assert "stopped at its 150 s limit" in titans
    log = tmp_path / "logs" / "tests__kernels__test_titans_triton.txt"
    assert log.read_text().endswith(killed) and "-m gpu" in log.read_text()
    files = [c[3] for c in calls]
    assert "tests/kernels/test_delta_rule_triton.py" in files and all("-m" in c and "gpu" in c for c in calls)
    row = [ln for ln in text.splitlines() if ln.startswith("| `tests/kernels/test_delta_rule_triton")][0]
    assert "| 1 | 1 | 0 |" in row and "`test_gpu_b`" in row and "OutOfResources" in row
    assert any("stopped at its 150 s limit" in ln for ln in text.splitlines())


def test_kernels_part_keeps_rows_and_reports_timeouts(monkeypatch):
    table = ("| op | T | B | form | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd GB/s | fwd+bwd GB/s |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n"
             "| sdpa (flash, causal) | 2048 | 32 | sdpa | 0.8 | 3.5 | 99 | 870 | - | - |\n")

    def fake_run(cmd, timeout, **env):
        op = cmd[cmd.index("--ops") + 1]
        if op == "ttt_mlp":
            return 124, table, 120.0
        if op == "selective_scan":
            return 2, "benchmarks/kernels.py: unknown ops ['selective_scan']", 1.0
        return 0, table + f"| {op} | 2048 | 32 | triton | 1.0 | 2.0 | 1 | 2 | 3 | 4 |\n", 5.0

    monkeypatch.setattr(gc, "_run", fake_run)
    text = gc.part_kernels(_args(), 12, 64, "kernels")
    lines = text.splitlines()
    assert sum(ln.startswith("| sdpa") for ln in lines) == 1          # flash attention once, not per op
    assert any(ln.startswith("| delta_rule | 2048") for ln in lines)
    assert any(ln.startswith("| ttt_mlp |") and "time limit" in ln for ln in lines)
    assert not any("selective_scan" in ln for ln in lines if ln.startswith("|"))


def test_budget_marks_what_did_not_run(monkeypatch):
    monkeypatch.setattr(gc, "_run", lambda cmd, timeout: (0, "", 1.0))
    text = gc.part_train(_args(part_budget=0.0), 2048, ["transformer"], "train")
    assert text.count("not run (part budget spent)") == 2


def test_record_inserts_sections(tmp_path, monkeypatch):
    res_dir = tmp_path / "benchmarks"
    res_dir.mkdir()
    (res_dir / "RESULTS.md").write_text("# Benchmark results\n")
    monkeypatch.setattr(gc, "ROOT", tmp_path)
    src = tmp_path / "parts"
    src.mkdir()
    with pytest.raises(SystemExit, match="no part results"):
        gc.record(src)
    (src / "tests.md").write_text("### `gpu` test tier\n\nrow\n")
    gc.record(src)
    text = (res_dir / "RESULTS.md").read_text()
    assert "## GPU campaign" in text and "### `gpu` test tier" in text


@pytest.mark.slow
def test_failures_are_printed_as_they_happen(tmp_path):
    """tests/conftest.py prints ``E   <id>: <error>`` when a test fails (with the campaign's
    environment variable), before the later tests run and before the summary."""
    (tmp_path / "test_two.py").write_text(
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n\n"
        "def test_later():\n    print('LATER-TEST-RAN')\n")
    env = dict(os.environ, TTT_LM_INSTANT_FAILURES="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-v", "-s", "-p", "no:cacheprovider",
                        str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = p.stdout.splitlines()
    instant = [i for i, ln in enumerate(lines) if ln.startswith("E   ") and "test_two.py::test_fails: " in ln]
    assert p.returncode == 1 and len(instant) == 1, p.stdout
    assert "AssertionError: one is not two" in lines[instant[0]]
    assert instant[0] < next(i for i, ln in enumerate(lines) if "LATER-TEST-RAN" in ln)
    env.pop("TTT_LM_INSTANT_FAILURES")
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-v", "-p", "no:cacheprovider",
                        str(tmp_path / "test_two.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert not any(ln.startswith("E   ") and "::test_fails: " in ln for ln in p.stdout.splitlines())
