"""lm-evaluation-harness's own command line (through ``python -m ttt_lm.eval.lm_eval_cli``, which
registers the model and calls lm_eval's CLI) on the task shipped in ttt_lm/eval/tasks, offline,
against a tiny self-contained export: results with standard errors and per-sample logs."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.eval.conftest import export_model, preset_pattern, tiny_model

# slow: each test runs lm_eval's command line in a new process
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_DOCS = 12  # lines of ttt_lm/eval/tasks/ttt_tiny.jsonl


def _harness(args, cwd=ROOT):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "ttt_lm.eval.lm_eval_cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def export_dir(prepared, tokenizer, tmp_path_factory):
    d = export_model(tiny_model(preset_pattern()), str(tmp_path_factory.mktemp("cli")))
    shutil.copyfile(tokenizer.path, os.path.join(d, "tokenizer.model"))  # as python -m ttt_lm.train.export does
    return d


def test_harness_cli_on_the_shipped_local_task(export_dir, tmp_path):
    out = tmp_path / "results"
    r = _harness(["--model", "ttt_lm", "--model_args", f"checkpoint={export_dir},chunk_len=16", "--device", "cpu",
                  "--include_path", "ttt_lm/eval/tasks", "--tasks", "ttt_tiny", "--batch_size", "4",
                  "--log_samples", "--output_path", str(out)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (results_file,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    with open(results_file) as f:
        res = json.load(f)
    cloze, choice = res["results"]["ttt_tiny_cloze"], res["results"]["ttt_tiny_choice"]
    # perplexity: standard error from lm_eval's bootstrap (its CLI always resamples 100000 times);
    # accuracies: its closed form for a mean
    assert cloze["perplexity,none"] > 1 and cloze["perplexity_stderr,none"] > 0
    assert 0 <= cloze["acc,none"] <= 1 and isinstance(cloze["acc_stderr,none"], float)
    assert 0 <= choice["acc,none"] <= 1 and isinstance(choice["acc_stderr,none"], float)
    assert res["config"]["model"] == "ttt_lm" and res["config"]["batch_size"] in (4, "4")
    assert res["n-samples"]["ttt_tiny_cloze"]["effective"] == N_DOCS
    for task in ("ttt_tiny_cloze", "ttt_tiny_choice"):
        (samples_file,) = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        with open(samples_file) as f:
            samples = [json.loads(line) for line in f]
        assert len(samples) == N_DOCS and all("doc" in s and s["resps"] for s in samples)
    # per sample: the cloze accuracy is the mean of the logged greedy flags
    with open(glob.glob(str(out / "**" / "samples_ttt_tiny_cloze_*.jsonl"), recursive=True)[0]) as f:
        flags = [json.loads(line)["acc"] for line in f]
    assert cloze["acc,none"] == pytest.approx(sum(flags) / N_DOCS)


def test_a_dataset_that_cannot_be_loaded_is_one_line(export_dir, tmp_path):
    r = _harness(["--model", "ttt_lm", "--model_args", f"checkpoint={export_dir}",
                  "--tasks", "lambada_openai", "--limit", "2"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task lambada_openai: its dataset 'EleutherAI/lambada_openai' could not be loaded")
    assert "HF_DATASETS_OFFLINE" in last and "--include_path ttt_lm/eval/tasks" in last
    # the local task from another working directory: its data file is named, relative to the cwd
    r = _harness(["--model", "ttt_lm", "--model_args", f"checkpoint={export_dir}",
                  "--include_path", os.path.join(ROOT, "ttt_lm/eval/tasks"), "--tasks", "ttt_tiny_cloze"],
                 cwd=str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: task ttt_tiny_cloze: its dataset 'json'")


def test_project_cli_writes_standard_errors_and_samples(export_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "ttt_lm.eval", "lm_eval", "--checkpoint", export_dir, "--device", "cpu",
                        "--include-path", "ttt_lm/eval/tasks", "--tasks", "ttt_tiny_cloze", "--batch-size", "5",
                        "--bootstrap-iters", "300", "--log-samples", "--chunk-len", "16", "--out", str(tmp_path),
                        "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "lm_eval.json") as f:
        res = json.load(f)["results"]["ttt_tiny_cloze"]
    assert res["perplexity,none"] > 1 and res["perplexity_stderr,none"] > 0 and res["acc_stderr,none"] >= 0
    with open(tmp_path / "lm_eval_samples" / "ttt_tiny_cloze.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == N_DOCS and sum(s["acc"] for s in samples) / N_DOCS == pytest.approx(res["acc,none"])
