"""The GPU campaign's bookkeeping, checked without a GPU: what it discovers (presets, ops, gpu test
files), its budgets and the marking of what did not fit, how it reads its items' outputs (a crash
or a timeout is a row with its error), the commit it reports, and how it records a campaign into
RESULTS.md. The warm-up's coverage is proved in test_launch_warmup.py."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ttt_lm.config import load_config
from ttt_lm.model.lm import model_class
from ttt_lm.model.registry import builtin_kinds, kinds_with, mixer_class

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_campaign", ROOT / "benchmarks" / "gpu_campaign.py")
gc = importlib.util.module_from_spec(spec)
sys.modules["gpu_campaign"] = gc
spec.loader.exec_module(gc)

#: the 125M-class presets besides the transformer, as the campaign discovers them in configs/ (this
#: file names none: they are its test subjects A, B, C, D in the order discovered)
RECURRENT = [p for p in gc.discover_presets("125m") if p.recurrent]
A, B, C, D = RECURRENT[:4]


class FakeTime:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _args(tmp_path, **kw):
    # the profile's architectures given out of their discovered order (B before A)
    base = dict(out=tmp_path, reps=5, seq_len_kernels=8192, compile_archs=["transformer", A.arch],
                profile_archs=["transformer", B.arch, A.arch], record_jobs=2, test_workers=4,
                test_timeout=60.0, jobs=2)
    base.update(kw)
    return SimpleNamespace(**base)


def _step(name, allowance, now=None):
    title, cols = gc.STEP_TITLES[name]
    s = gc.Step(name, title, list(cols), budget=allowance)
    if now is not None:
        s.now = now
    return s.start(allowance)


def _log(*_):
    pass


# ---- discovery ------------------------------------------------------------------------------------
def test_presets_are_discovered_by_size_class(tmp_path):
    p125 = gc.discover_presets("125m")
    archs = [p.arch for p in p125]
    assert len(archs) == len(set(archs))                 # one preset per architecture and size class
    assert {"transformer", "hybrid", "griffin", "titans_lmm"} <= set(archs)
    # every preset file named <arch>_<size> of the 125M class (120M-179M: mamba_130m, titans_mac_170m)
    # is discovered, as the arch its name gives; a model variant whose presets take a paper's size
    # names for other parameter counts (LM.size_names_count_params) is no size class of the ladder
    by_name = {f"configs/{f.name}": re.sub(r"_1[2-7]\dm$", "", f.stem)
               for f in (ROOT / "configs").glob("*.yaml") if re.search(r"_1[2-7]\dm$", f.stem)
               and model_class(load_config(str(f)).model).size_names_count_params}
    assert len(by_name) >= 11 and {p.path: p.arch for p in p125} == by_name
    assert {p.path for p in p125} >= {"configs/mamba_130m.yaml", "configs/titans_mac_170m.yaml"}
    assert all(p.size == "125m" for p in p125) and not [p for p in p125 if "350m" in p.path]
    assert "configs/titans_mag_510m.yaml" in {p.path for p in gc.discover_presets("350m")}
    # a preset that lands later is picked up from the configs folder, with no list to edit
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "newarch_125m.yaml").write_text("_base_: [sizes/125m.yaml, arch/newarch.yaml]\n")
    (tmp_path / "configs" / "tiny_newarch.yaml").write_text("model:\n  d_model: 64\n")
    assert [(p.path, p.arch, p.recurrent) for p in gc.discover_presets("125m", tmp_path)] == \
        [("configs/newarch_125m.yaml", "newarch", True)]


def test_training_order_puts_the_transformer_first(tmp_path):
    a = _args(tmp_path)
    items = gc.train_items("train", a)
    assert items[0][0].arch == "transformer" and not items[0][2]
    compiled = [p.arch for p, _, c in items if c]
    assert compiled == ["transformer", A.arch]
    assert {p.arch for p, T, _ in gc.train_items("train8k", a)} >= {"transformer", *(p.arch for p in RECURRENT)}
    assert all(T == 8192 for _, T, _ in gc.train_items("train8k", a))
    assert [p.arch for p, _, _ in gc.train_items("profile", a)] == ["transformer", A.arch, B.arch]


def test_ops_and_uncovered_folders(monkeypatch, tmp_path):
    ops, uncovered = gc.discover_ops()
    # every op a mixer runs through Triton (its triton_custom_op, kernels::<op>_fwd) is benchmarked
    triton_ops = {mixer_class(k).triton_custom_op.split("::")[1].removesuffix("_fwd")
                  for k in kinds_with(lambda c: c.triton_custom_op is not None, builtin_kinds())}
    assert len(triton_ops) >= 6 and triton_ops <= set(ops), sorted(triton_ops - set(ops))
    assert uncovered == []
    kb = gc._kernels_module()
    fake = tmp_path / "kernels"
    for name in ("linear_scan", "ttt", "new_op"):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text("")
    monkeypatch.setattr(kb, "KERNELS_DIR", fake)
    assert kb.folders_without_bench() == ["new_op"]


def test_gpu_test_files_are_those_marked_gpu():
    files = gc.gpu_test_files()
    assert "tests/kernels/test_delta_rule_triton.py" in files
    assert all("pytest.mark.gpu" in (ROOT / f).read_text() for f in files)


# ---- budgets and marking ---------------------------------------------------------------------------
def test_clock_passes_unused_seconds_on_within_the_total():
    t = FakeTime()
    c = gc.Clock(100.0, now=t)
    a1 = c.allowance(30.0)
    assert a1 == 30.0
    t.t += 10.0
    c.settle(a1, 10.0)                 # 20 s unused: the next step gets them
    a2 = c.allowance(30.0)
    assert a2 == 50.0
    t.t += 60.0                        # the second step overran its allowance
    c.settle(a2, 60.0)
    assert c.carry == 0.0
    assert c.allowance(50.0) == 30.0   # 100 − 70 s left in the total, not 50


def test_spent_budget_marks_every_item(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(gc, "run_cmd", lambda cmd, timeout, env=None: calls.append(cmd))
    s = _step("train", 0.0)
    gc.step_train(s, _args(tmp_path), _log)
    n = len(gc.train_items("train", _args(tmp_path)))
    assert not calls and len(s.rows) == n
    assert all(r[2] == "not run (step budget spent)" for r in s.rows)
    assert sum(r[1] == "yes" for r in s.rows) == 2      # the compiled variants are marked too
    s = _step("kernels", 3.0)
    monkeypatch.setattr(gc, "discover_ops", lambda: (["delta_rule"], ["new_op"]))
    gc.step_kernels(s, _args(tmp_path), 12, 64, _log)
    assert [r[:2] for r in s.rows[:2]] == [["sdpa", "not run (step budget spent)"],
                                          ["delta_rule", "not run (step budget spent)"]]
    assert s.rows[2][0] == "kernels/new_op" and "no benchmark registered" in s.rows[2][3]


def test_items_stop_when_the_step_runs_out(monkeypatch, tmp_path):
    t = FakeTime()
    limits = []

    def fake_run(cmd, timeout, env=None):
        limits.append(timeout)
        t.t += 25.0
        return gc.ItemResult(124, "", 25.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    s = _step("profile", 55.0, now=t)
    gc.step_profile(s, _args(tmp_path), _log)
    assert limits == [40.0, 30.0]                  # each item within what the step has left
    assert [r[2].split(" after")[0] for r in s.rows] == ["stopped at its time limit"] * 2 + \
        ["not run (step budget spent)"]


# ---- reading the items -----------------------------------------------------------------------------
def _train_json(cmd, tokens_per_s, params=124.0):
    path = Path(cmd[cmd.index("--json") + 1])
    path.write_text(json.dumps({"rows": [{"params_M": params, "batch": "8x2048", "tokens_per_s": tokens_per_s,
                                          "mfu": 0.2, "peak_GiB": 12.5, "warmup_s": 3.0, "profile": None}]}))


def test_train_rows_crashes_and_ratios(monkeypatch, tmp_path):
    def fake_run(cmd, timeout, env=None):
        assert env == {"TTT_LM_PIN_LAUNCH_CONFIGS": "1"}
        preset = cmd[2]
        if preset == C.path:      # crashes
            return gc.ItemResult(1, "Traceback...\ntorch.OutOfMemoryError: CUDA out of memory. Tried 3 GiB\n", 4.0)
        if preset == D.path:      # runs past its limit
            return gc.ItemResult(124, "step 1\n", 45.0)
        _train_json(cmd, 400000.0 if "transformer" in preset else 100000.0)
        return gc.ItemResult(0, "", 5.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    s = _step("train", 1e6)
    gc.step_train(s, _args(tmp_path), _log)
    rows = {(r[0], r[1]): r for r in s.rows}
    assert rows[("configs/transformer_125m.yaml", "no")][5] == "1.00"
    assert rows[(A.path, "no")][5] == "0.25"
    assert rows[(A.path, "yes")][4] == "100000"
    assert "exit 1" in rows[(C.path, "no")][2]
    assert "torch.OutOfMemoryError: CUDA out of memory" in rows[(C.path, "no")][2]
    assert rows[(D.path, "no")][2].startswith("stopped at its time limit after 45 s")
    assert len(s.rows) == len(gc.train_items("train", _args(tmp_path)))   # every item is a row


def test_kernel_rows_keep_what_a_crashed_op_wrote(monkeypatch, tmp_path):
    def fake_run(cmd, timeout, env=None):
        op = cmd[cmd.index("--ops") + 1]
        jf = Path(cmd[cmd.index("--json") + 1])
        row = {"op": op, "T": 8192, "B": 8, "form": "triton", "fwd_ms": "1.000", "fwd_bwd_ms": "2.000",
               "fwd_mib": "1", "fwd_bwd_mib": "2", "fwd_rate": "900 GB/s (27%)", "fwd_bwd_rate": "800 GB/s"}
        jf.write_text(json.dumps(row) + "\n")
        if op == "linear_scan":
            return gc.ItemResult(1, "RuntimeError: CUDA error: an illegal memory access was encountered\n", 3.0)
        return gc.ItemResult(0, "", 2.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    monkeypatch.setattr(gc, "discover_ops", lambda: (["delta_rule", "linear_scan"], []))
    s = _step("kernels", 1e6)
    gc.step_kernels(s, _args(tmp_path), 12, 64, _log)
    assert [r[0] for r in s.rows] == ["sdpa", "delta_rule", "linear_scan", "linear_scan"]
    assert s.rows[2][4] == "1.000"                     # the rows it printed before the crash stay
    assert "exit 1" in s.rows[3][3] and "illegal memory access" in s.rows[3][3]


XDIST_OUT = """\
[gw0] [ 25%] PASSED tests/kernels/test_delta_rule_triton.py::test_gpu_a
[gw1] [ 50%] FAILED tests/kernels/test_titans_triton.py::test_gpu_float32_matches_reference[2-4-1000-64-64]
E   tests/kernels/test_titans_triton.py::test_gpu_float32_matches_reference[2-4-1000-64-64]: AssertionError: dk: Tensor-likes are not close!
[gw0] [ 75%] SKIPPED tests/kernels/test_delta_rule_triton.py::test_gpu_b
[gw1] [100%] FAILED tests/kernels/test_selective_scan_triton.py::test_gpu_mamba_mixer_triton_equals_torch
=========================== short test summary info ============================
FAILED tests/kernels/test_titans_triton.py::test_gpu_float32_matches_reference[2-4-1000-64-64] - AssertionError: dk: Tensor-likes are not close!
FAILED tests/kernels/test_selective_scan_triton.py::test_gpu_mamba_mixer_triton_equals_torch - AssertionError: Tensor-likes are not close! Mismatched elements: 3 / 4096
"""


def test_parse_pytest_reads_xdist_and_plain_output():
    t = gc.parse_pytest(XDIST_OUT)
    assert t["tests/kernels/test_delta_rule_triton.py::test_gpu_a"]["outcome"] == "PASSED"
    assert t["tests/kernels/test_delta_rule_triton.py::test_gpu_b"]["outcome"] == "SKIPPED"
    tit = t["tests/kernels/test_titans_triton.py::test_gpu_float32_matches_reference[2-4-1000-64-64]"]
    assert tit == {"outcome": "FAILED", "error": "AssertionError: dk: Tensor-likes are not close!"}
    assert "Mismatched elements: 3 / 4096" in t["tests/kernels/test_selective_scan_triton.py::"
                                                "test_gpu_mamba_mixer_triton_equals_torch"]["error"]
    plain = gc.parse_pytest("tests/a_test.py::test_x PASSED  [ 50%]\ntests/a_test.py::test_y FAILED  [100%]\n")
    assert {k: v["outcome"] for k, v in plain.items()} == {"tests/a_test.py::test_x": "PASSED",
                                                          "tests/a_test.py::test_y": "FAILED"}


def test_tests_step_one_parallel_run_and_a_row_per_file(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, timeout, env=None):
        seen.append((cmd, env))
        return gc.ItemResult(124, XDIST_OUT, 60.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: object() if name == "xdist" else None)
    files = ["tests/kernels/test_delta_rule_triton.py", "tests/kernels/test_titans_triton.py",
             "tests/kernels/test_selective_scan_triton.py", "tests/kernels/test_ttt_triton.py"]
    s = _step("tests", 100.0)
    gc.step_tests(s, _args(tmp_path), files, _log)
    (cmd, env), = seen
    assert cmd[cmd.index("-n") + 1] == "4" and all(f in cmd for f in files)
    assert env["TTT_LM_INSTANT_FAILURES"] == "1"
    rows = {r[0]: r for r in s.rows}
    assert rows["`tests/kernels/test_delta_rule_triton.py`"][1:5] == ["1", "0", "0", "1"]
    titans = rows["`tests/kernels/test_titans_triton.py`"]
    assert titans[2] == "1" and "dk: Tensor-likes are not close!" in titans[5]
    assert "stopped at the step's limit" in rows["`tests/kernels/test_ttt_triton.py`"][5]


def test_tests_step_without_xdist_runs_files_side_by_side(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, timeout, env=None):
        seen.append(cmd)
        return gc.ItemResult(0, f"{cmd[3]}::test_gpu_a PASSED  [100%]\n", 1.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: None)
    files = ["tests/kernels/test_delta_rule_triton.py", "tests/kernels/test_titans_triton.py"]
    s = _step("tests", 100.0)
    gc.step_tests(s, _args(tmp_path), files, _log)
    assert sorted(c[3] for c in seen) == files and not any("-n" in c for c in seen)
    assert [r[1] for r in s.rows] == ["1", "1"] and "pytest-xdist is not installed" in s.notes[0]


def test_last_error_picks_the_error_line():
    out = "Traceback (most recent call last):\n  File x\ntriton.runtime.errors.OutOfResources: out of resource: " \
          "shared memory\n\nsome later chatter\n"
    assert gc.last_error(out).startswith("triton.runtime.errors.OutOfResources: out of resource")
    assert gc.last_error("") == "(no output)"


def test_run_cmd_kills_the_whole_group_at_its_limit():
    r = gc.run_cmd([sys.executable, "-c", "import subprocess, sys, time; print('started', flush=True); "
                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"], 3.0)
    assert r.timed_out and r.seconds < 20 and "started" in r.out


# ---- the campaign as a whole ------------------------------------------------------------------------
@pytest.mark.slow   # two campaign processes, each importing every op
def test_no_cuda_device_is_one_line_and_exit_2():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    for command in ("run", "more"):
        p = subprocess.run([sys.executable, "benchmarks/gpu_campaign.py", command], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip() and "Warning" not in ln
                 and "warn" not in ln]
        assert p.returncode == 2 and len(lines) == 1 and "no CUDA device" in lines[0], p.stdout + p.stderr


def test_a_crashing_step_is_a_row_and_the_campaign_goes_on(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gc, "device_info", lambda: {k: "x" for k in ("gpu", "sms", "memory_GiB", "driver", "cuda",
                                                                      "torch", "triton", "python", "fla", "cpus")})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    ran = []

    def boom(step, a, *rest):
        ran.append(step.name)
        raise RuntimeError("CUDA error: device-side assert triggered")

    def fine(step, a, *rest):
        ran.append(step.name)
        step.rows.append(["configs/transformer_125m.yaml", "no"] + ["1"] * 8)

    def fine_checks_progress(step, a, *rest):
        fine(step, a)
        # the steps done so far are on disk before the next one starts
        so_far = json.loads((a.out / "campaign.json").read_text())
        assert [s["name"] for s in so_far["steps"]] == ["kernels"] and so_far["complete"] is False
        assert "Still to run after" in (a.out / "campaign.md").read_text()

    monkeypatch.setattr(gc, "step_kernels", boom)
    monkeypatch.setattr(gc, "step_train", fine_checks_progress)
    monkeypatch.setattr(gc, "read_commit", lambda: "abc123")
    a = _args(tmp_path / "out", budget=100.0, steps=["kernels", "train"])
    assert gc.run_campaign(a, "run") == 0
    assert ran == ["kernels", "train"]
    res = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert [s["name"] for s in res["steps"]] == ["kernels", "train"] and res["complete"] is True
    assert res["steps"][0]["rows"][0][:2] == ["step kernels crashed", "RuntimeError: CUDA error: device-side assert triggered"]
    md = (tmp_path / "out" / "campaign.md").read_text()
    assert "- Commit: abc123" in md and "step kernels crashed" in md and "configs/transformer_125m.yaml" in md


def test_steps_left_without_total_budget_are_marked(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gc, "device_info", lambda: {k: "x" for k in ("gpu", "sms", "memory_GiB", "driver", "cuda",
                                                                      "torch", "triton", "python", "fla", "cpus")})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gc, "step_train", lambda *a: pytest.fail("a step ran without budget"))
    a = _args(tmp_path / "out", budget=1.0, steps=["train", "profile"])
    gc.run_campaign(a, "run")
    res = json.loads((tmp_path / "out" / "campaign.json").read_text())
    assert all(s["notes"] == ["Not run: the campaign's total budget was spent."] for s in res["steps"])
    assert "Not run: the campaign's total budget was spent." in (tmp_path / "out" / "campaign.md").read_text()


# ---- provenance and recording -------------------------------------------------------------------------
def test_prepare_writes_the_commit_that_the_campaign_reads_first(tmp_path, monkeypatch):
    f = tmp_path / ".campaign_commit"
    text = gc.prepare(f)
    head = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    assert text.startswith(head) and gc.read_commit(f) == text
    f.write_text(json.dumps({"commit": "0123abc (sent)"}))
    assert gc.read_commit(f) == "0123abc (sent)"       # the file wins over the tree's git metadata
    missing = gc.read_commit(tmp_path / "absent")
    assert missing.startswith(head) and "make gpu-bench-prepare" in missing


def _campaign_dir(tmp_path, date="2026-12-01", command="run", commit="0123abc", copy=""):
    src = tmp_path / f"out-{date}-{command}{copy}"
    src.mkdir()
    head = f"## GPU campaign `{command}`, {date}\n\n- Device: NVIDIA H100 80GB HBM3, driver 580\n- Commit: {commit}\n" \
           f"- Command: `python benchmarks/gpu_campaign.py {command} --out /out`\n"
    (src / "campaign.md").write_text(head + "\n### Training\n\n| preset | tokens/s |\n|---|---|\n| t | 1 |\n")
    (src / "campaign.json").write_text(json.dumps({"date": date, "command": command, "commit": commit,
                                                   "device_line": "NVIDIA H100 80GB HBM3", "argv": f"{command} --out /out"}))
    (src / "logs.txt").write_text("log\n")
    return src


def test_record_keeps_the_latest_campaign_of_each_command_and_the_files(tmp_path):
    res = tmp_path / "RESULTS.md"
    tail = "\n## LM head memory\n\nkept\n"
    res.write_text("# Benchmark results\n\n## Training throughput\n\nold\n\n" + gc.RESULTS_MARKER
                   + "\n### `gpu` test tier\n\nan earlier format\n" + tail)
    dest_root = tmp_path / "gpu_results"
    with pytest.raises(SystemExit, match="no campaign.json"):
        gc.record(tmp_path, res, dest_root)
    d1 = gc.record(_campaign_dir(tmp_path), res, dest_root)
    assert sorted(p.name for p in d1.iterdir()) == ["campaign.json", "campaign.md", "logs.txt"]
    text = res.read_text()
    assert "### GPU campaign `run`, 2026-12-01" in text and "#### Training" in text
    assert "- Commit: 0123abc" in text and "- Device: NVIDIA H100" in text and "- Command: `python" in text
    with pytest.raises(SystemExit, match="already"):
        gc.record(_campaign_dir(tmp_path, copy="-again"), res, dest_root)
    gc.record(_campaign_dir(tmp_path, date="2026-12-01", command="more", commit="0123abc"), res, dest_root)
    gc.record(_campaign_dir(tmp_path, date="2026-12-02", commit="4567def"), res, dest_root)
    text = res.read_text()
    assert text.count(gc.RESULTS_MARKER) == 1 and text.startswith("# Benchmark results\n\n## Training throughput")
    assert "`run`, 2026-12-01" not in text and text.count("### GPU campaign `run`") == 1     # replaced
    m, new, more = (text.index(gc.RESULTS_MARKER), text.index("### GPU campaign `run`, 2026-12-02"),
                    text.index("### GPU campaign `more`, 2026-12-01"))
    assert m < new < more < text.index("### `gpu` test tier")                 # the latest command first
    assert text.endswith(tail) and "an earlier format" in text              # other sections untouched
    assert (dest_root / "2026-12-01-run" / "campaign.md").exists()           # the older files stay
    with pytest.raises(SystemExit, match="later"):
        gc.record(_campaign_dir(tmp_path, date="2026-11-30", copy="-old"), res, dest_root)


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


def test_the_plans_fit_their_windows():
    """`run` fits 9 minutes (540 s) with room for starting Python and installing the wheels, `more`
    6 minutes; each step's budget adds up to the command's total."""
    assert sum(b for _, b in gc.PLANS["run"]) == gc.BUDGETS["run"] <= 540 - 25
    assert sum(b for _, b in gc.PLANS["more"]) == gc.BUDGETS["more"] <= 360 - 10
    assert [n for n, _ in gc.PLANS["run"]] == ["warmup", "tests", "kernels", "train", "profile"]
    assert gc.PLANS["more"][0][0] == "warmup"


# ---- TTT-E2E's step ------------------------------------------------------------------------------------
def test_e2e_pairs_are_found_beside_their_baselines(tmp_path):
    assert ("ttt_e2e_125m", "ttt_e2e_swa_125m") in gc.e2e_pairs()
    (tmp_path / "configs").mkdir()
    for name in ("ttt_e2e_9m", "ttt_e2e_swa_9m", "ttt_e2e_swa_7m", "x_swa_9m"):
        (tmp_path / "configs" / f"{name}.yaml").write_text("model: {}\n")
    assert gc.e2e_pairs("9m", tmp_path) == [("ttt_e2e_9m", "ttt_e2e_swa_9m")]   # x_swa_9m has no x_9m
    assert gc.e2e_pairs("7m", tmp_path) == []                                    # a baseline alone is no pair
    # the warm-up compiles nothing for this step: no captured launch is TTT-E2E's
    launches = json.loads((ROOT / "kernels" / "captured_launches.json").read_text())["launches"]
    e2e = {p for pair in gc.e2e_pairs() for p in pair}
    assert e2e and not [w for x in launches for w in x["where"] if w.split(":")[0] in e2e]


def test_e2e_rows_ratios_crashes_and_budget(monkeypatch, tmp_path):
    def fake_run(cmd, timeout, env=None):
        preset = cmd[cmd.index("--one") + 1]
        assert cmd[1] == "benchmarks/ttt_e2e_step.py" and cmd[cmd.index("--device") + 1] == "cuda"
        if preset == "crashes":
            return gc.ItemResult(1, "Traceback...\ntorch.OutOfMemoryError: CUDA out of memory.\n", 3.0)
        us, mem = (300.0, 6 * 2**30) if "swa" not in preset else (100.0, 2 * 2**30)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(
            {"preset": preset, "seq_len": 8192, "batch": 1, "us_per_token": us, "mem_bytes": mem}))
        return gc.ItemResult(0, "", 5.0)

    monkeypatch.setattr(gc, "run_cmd", fake_run)
    monkeypatch.setattr(gc, "e2e_pairs", lambda: [("ttt_e2e_125m", "ttt_e2e_swa_125m"), ("crashes", "ttt_e2e_swa_x")])
    s = _step("e2e", 1e6)
    gc.step_e2e(s, _args(tmp_path), _log)
    assert s.rows[0] == ["ttt_e2e_125m", "ttt_e2e_swa_125m", "8192 × 1", "300.0", "100.0", "3.00", "6.00", "2.00",
                         "3.00"]
    assert s.rows[1][:2] == ["crashes", "ttt_e2e_swa_x"] and "exit 1" in s.rows[1][2]
    assert "torch.OutOfMemoryError" in s.rows[1][2] and len(s.rows[1]) == len(gc.E2E_COLUMNS)
    s = _step("e2e", 0.0)
    gc.step_e2e(s, _args(tmp_path), _log)
    assert [r[2] for r in s.rows] == ["not run (step budget spent)"] * 2


def test_e2e_step_script_writes_its_row(tmp_path):
    out = tmp_path / "row.json"
    p = subprocess.run([sys.executable, "benchmarks/ttt_e2e_step.py", "--one", "tiny_ttt_e2e", "--device", "cpu",
                        "--batch", "1", "--steps", "1", "--seq-len", "64", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    row = json.loads(out.read_text())
    assert row == json.loads(p.stdout.strip().splitlines()[-1])
    assert row["preset"] == "tiny_ttt_e2e" and row["seq_len"] == 64 and row["us_per_token"] > 0 and row["mem_bytes"] > 0
