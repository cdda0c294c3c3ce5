"""``benchmarks/inference.py --quick`` on a recurrent and a global-attention tiny preset: the table
has a row per preset with every cell a figure or a stated reason, and the decode state is flat in
the context for the recurrent preset and grows with it for global attention; and, with the
subprocesses stood in for, a length over the memory limit is skipped with its estimate. No timing
is checked."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ttt_lm.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "inference.py"
PRESETS = ["tiny_gated_deltanet", "tiny_transformer"]   # recurrent; global attention
CONTEXTS = [64, 256]

_spec = importlib.util.spec_from_file_location("inference_bench", SCRIPT)
ib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ib)


def _table(text: str):
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    hdr, rows = cells[0], cells[2:]
    assert set(cells[1]) == {"---"}
    return hdr, {r[0]: dict(zip(hdr, r)) for r in rows}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inference") / "table.md"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--presets", *PRESETS,
           "--decode-contexts", *map(str, CONTEXTS), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, out.read_text()


@pytest.mark.slow   # one spawned run of the script, about 15 s on 2 cores
def test_a_row_per_preset_and_every_cell_filled(run):
    stdout, written = run
    head = stdout.splitlines()[0]
    for part in ("torch ", "commit ", "CPU", "command: `", "--quick"):
        assert part in head
    assert written.startswith(head) and _table(written) == _table(stdout)
    hdr, rows = _table(stdout)
    assert list(rows) == PRESETS
    for name in PRESETS:   # the kinds of the preset's pattern, each once, in order
        pattern = load_config(str(ROOT / "configs" / f"{name}.yaml")).model.layer_pattern
        assert rows[name]["kinds"] == "/".join(dict.fromkeys(pattern)), (name, rows[name]["kinds"])
    for c in CONTEXTS:
        assert f"decode ms/tok {c}" in hdr and f"state KiB {c}" in hdr
    for col in ("prefill long/short", "decode large/small", "train long/short"):
        assert col in hdr
    figure = re.compile(r"^(≤ )?\d+(\.\d+)?( \(\S+/\S+\))?$")
    for name, row in rows.items():
        assert len(row) == len(hdr)
        for col, v in row.items():
            if col in ("preset", "kinds"):
                continue
            # a number, or an explicit reason; on these sizes nothing should be skipped or fail
            assert figure.match(v), (name, col, v)


@pytest.mark.slow   # one spawned run of the script, about 15 s on 2 cores
def test_state_is_flat_for_a_recurrent_preset_and_grows_for_global_attention(run):
    _, rows = _table(run[0])
    small, large = (f"state KiB {c}" for c in CONTEXTS)
    rec, att = rows["tiny_gated_deltanet"], rows["tiny_transformer"]
    assert float(rec[small]) == float(rec[large]) > 0
    # keys and values of every earlier token: the cache grows in proportion to the context
    assert float(att[large]) == pytest.approx(float(att[small]) * CONTEXTS[1] / CONTEXTS[0])


def test_the_estimate_is_a_power_law_through_the_two_longest_lengths_below():
    assert ib.estimate([(1024, 1.0)], 4096) is None                                  # too few: run it
    assert ib.estimate([(1024, 9.0), (2048, 2.0), (4096, 4.0)], 8192) == pytest.approx(8.0)
    assert ib.estimate([(1024, 1.0), (2048, 1.0)], 4096) == pytest.approx(2.0)       # at least linear
    assert ib.estimate([(1024, 1.0), (2048, 8.0)], 4096) == pytest.approx(32.0)      # at most quadratic
    assert ib.label(16384) == "16k" and ib.label(512) == "512"


def test_a_length_over_the_memory_limit_is_skipped_with_its_estimate(monkeypatch):
    """With the subprocesses stood in for (a prefill peak of T² bytes), a 125M-class preset at a
    limit of 8 MiB: 1k and 2k run, 4k (est. 16 MiB) and 64k are skipped without being run, the
    decode context 4k is skipped for the same reason, and every other cell holds a figure."""
    calls = []

    def fake(kind, spec, threads, timeout):
        calls.append((kind, spec.get("length"), spec.get("prefill_lens"), spec.get("decode_contexts")))
        if kind == "memory":
            return {"peak_bytes": spec["length"] ** 2, "upper_bound": False, "seconds": 1e-3}
        per = lambda Ls, v: {str(L): v for L in Ls}  # noqa: E731
        return {"kinds": kinds_125m, "params": 1.25e8, "prefill": per(spec["prefill_lens"], 1e-5),
                "decode": per(spec["decode_contexts"], 1e-3), "state": per(spec["decode_contexts"], 4096),
                "kept": per(spec["decode_contexts"], 4096), "train": per(spec["train_lens"], 3e-5), "errors": {}}

    monkeypatch.setattr(ib, "run_worker", fake)
    a = ib.options(["--prefill-lens", "1024", "2048", "4096", "--decode-contexts", "1024", "4096",
                    "--train-lens", "1024", "--device", "cpu"])
    preset = ROOT / "configs" / "ttt_linear_125m.yaml"
    kinds_125m = list(dict.fromkeys(load_config(str(preset)).model.layer_pattern))
    r = ib.measure_preset(str(preset), a, mem_limit=8 * 2 ** 20)
    assert [c[1] for c in calls if c[0] == "memory"] == [1024, 2048]
    assert [c[2:] for c in calls if c[0] == "timing"] == [([1024, 2048], [1024])]
    hdr, rows = ib.table([r], a)
    row = dict(zip(hdr, rows[0]))
    assert row["preset"] == "ttt_linear_125m"
    for col in ("prefill µs/tok 4k", "peak MiB 4k", "decode ms/tok 4k", "state KiB 4k", "kept KiB 4k"):
        assert row[col] == "skipped: est. 16.0 MiB > 8.0 MiB", (col, row[col])
    assert row["prefill µs/tok 64k"] == row["peak MiB 64k"] == "skipped: est. 4.0 GiB > 8.0 MiB"
    assert row["peak MiB 1k"] == "1.0" and row["peak MiB 2k"] == "4.0" and row["prefill µs/tok 2k"] == "10.0"
    assert row["prefill long/short"] == "1.00 (2k/1k)" and row["decode large/small"].startswith("n/a")
