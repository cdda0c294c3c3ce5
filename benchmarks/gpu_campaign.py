"""The GPU campaign: everything that can only be measured on a CUDA machine, in parts that each fit
in a few minutes and run on their own.

    python benchmarks/gpu_campaign.py all                  # every part, one after another (≤ 20 min)
    python benchmarks/gpu_campaign.py tests kernels        # some parts
    python benchmarks/gpu_campaign.py record --from DIR    # put DIR's tables into benchmarks/RESULTS.md

Parts (each writes ``<out>/<part>.md``, a dated section with device, commit and commands, and
prints it; ``--out`` defaults to ``benchmarks/gpu_results``):

- ``tests``: the ``gpu`` test tier, one test file at a time in its own process under a time limit
  (a kernel whose compile does not return stalls one file, not the campaign); per file the counts,
  the failing tests and the error line of each (printed as each test fails, so a file stopped at
  its time limit still says why); each file's whole pytest output in ``<out>/logs/``.
- ``kernels`` / ``kernels128``: ``benchmarks/kernels.py`` for every registered op at T = 2k, 8k, 32k
  with B·T = 64k, H = 12, D = 64 (``kernels128``: H = 16, D = 128), bf16: forward and
  forward+backward time and peak memory of each op's Triton kernel, its PyTorch form, causal flash
  SDPA, and flash-linear-attention's kernels where that package imports. One process per op.
- ``train`` / ``train8k``: end-to-end training tokens/s and MFU (``benchmarks/throughput.py``: forward,
  backward, AdamW on random tokens, one GPU) of the 125M and 350M presets of every architecture at
  seq_len 2048 in bf16 (``train8k``: the recurrent ones at 8192). One process per preset.

Each part stops starting new items when its budget (``--part-budget``, default 450 s) is spent and
marks what it did not run. Run ``make gpu-bench`` for all of it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

KERNEL_OPS = ["linear_scan", "delta_rule", "gated_delta_rule", "titans_linear", "ttt_linear", "ttt_mlp", "selective_scan"]
ARCHS = ["transformer", "ttt_linear", "ttt_mlp", "hybrid", "griffin", "deltanet", "gated_deltanet", "gdn_hybrid",
         "mamba", "titans_lmm"]
RECURRENT = ["ttt_linear", "ttt_mlp", "hybrid", "griffin", "deltanet", "gated_deltanet", "gdn_hybrid", "mamba",
             "titans_lmm"]


def _presets(archs: Sequence[str]) -> List[Path]:
    """The 125M- and 350M-class preset of each architecture (Mamba's are 130m/370m, Titans' 125m/350m)."""
    out = []
    for a in archs:
        for size in ("125m", "130m", "350m", "370m"):
            p = ROOT / "configs" / f"{a}_{size}.yaml"
            if p.exists():
                out.append(p)
    return out


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            import triton

            return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, Triton {triton.__version__})"
    except Exception:
        pass
    return "no CUDA device"


def _run(cmd: List[str], timeout: float, **env_extra: str) -> Tuple[int, str, float]:
    """(exit status, stdout+stderr, seconds); status 124 when the time limit ended it."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return 124, out.decode(errors="replace") if isinstance(out, bytes) else out, time.perf_counter() - t0


class Part:
    def __init__(self, name: str, budget: float):
        self.name, self.budget, self.t0 = name, budget, time.perf_counter()
        self.lines: List[str] = []
        self.commands: List[str] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def section(self, title: str) -> str:
        head = [f"### {title}", "", f"- Date: {datetime.date.today().isoformat()}", f"- Device: {_device()}",
                f"- Commit: {_commit()}",
                f"- Command: `python benchmarks/gpu_campaign.py {' '.join(sys.argv[1:]) or self.name}`, which ran:"]
        head += [f"  `{c}`" for c in self.commands[:3]] + (["  … (one per item)"] if len(self.commands) > 3 else [])
        return "\n".join(head + [""] + self.lines) + "\n"


def part_tests(a) -> str:
    part = Part("tests", a.part_budget)
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    files = [f for f in files if "pytest.mark.gpu" in f.read_text()]
    part.lines += ["| file | passed | failed | errors | seconds | failures (first error line) |", "|---|---|---|---|---|---|"]
    for f in files:
        rel = f.relative_to(ROOT)
        if part.left() < 30:
            part.lines.append(f"| `{rel}` | not run (part budget spent) | | | | |")
            continue
        cmd = [PY, "-m", "pytest", str(rel), "-m", "gpu", "-v", "--tb=short", "-p", "no:cacheprovider"]
        part.commands.append(" ".join(cmd[1:]))
        rc, out, dt = _run(cmd, min(a.file_timeout, part.left()), TTT_LM_INSTANT_FAILURES="1")
        log = a.out / "logs" / f"{rel.with_suffix('').as_posix().replace('/', '__')}.txt"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(" ".join(cmd[1:]) + "\n\n" + out)
        passed = len(re.findall(r" PASSED", out))
        failed = re.findall(r"^(\S+::\S+) FAILED", out, re.M)
        errors = len(re.findall(r" ERROR", out))
        # the error line of each failure, printed when it failed (tests/conftest.py), else the first one
        instant = dict(re.findall(r"^E\s+(\S+::\S+): (.*)$", out, re.M))
        first_err = re.findall(r"^E\s+(\S.*)$", out, re.M)
        notes = [f"`{t.split('::', 1)[1]}`" + (f": {instant[t][:160]}" if t in instant else "") for t in failed]
        notes += [f"`{t.split('::', 1)[1]}`: {e[:160]}" for t, e in instant.items() if t not in failed]
        note = "; ".join(notes).replace("|", "/")
        if first_err and not instant:
            note += (": " if note else "") + first_err[0][:160].replace("|", "/")
        if rc == 124:
            note = (note + "; " if note else "") + f"stopped at its {a.file_timeout:.0f} s limit"
        part.lines.append(f"| `{rel}` | {passed} | {len(failed)} | {errors} | {dt:.0f} | {note} |")
    return part.section("`gpu` test tier")


def part_kernels(a, heads: int, head_dim: int, name: str) -> str:
    part = Part(name, a.part_budget)
    header = None
    rows: List[str] = []
    for op in KERNEL_OPS:
        if part.left() < 20:
            rows.append(f"| {op} | | | not run (part budget spent) | | | | | | |")
            continue
        cmd = [PY, "benchmarks/kernels.py", "--ops", op, "--seq-lens", *map(str, a.seq_lens),
               "--heads", str(heads), "--head-dim", str(head_dim), "--reps", str(a.reps), "--warmup", "3"]
        part.commands.append(" ".join(cmd[1:]))
        rc, out, dt = _run(cmd, min(a.op_timeout, part.left()))
        if "unknown ops" in out:
            continue  # an op this checkout does not register
        table = [ln for ln in out.splitlines() if ln.startswith("|")]
        if header is None and len(table) >= 2:
            header = table[:2]
        body = [ln for ln in table[2:] if not ln.startswith("| sdpa") or op == KERNEL_OPS[0]]
        rows += body
        if rc != 0:
            why = "stopped at its time limit" if rc == 124 else f"exit status {rc}"
            err = [ln for ln in out.splitlines() if ln.startswith("#") and "Error" in ln]
            rows.append(f"| {op} | | | {why} after {dt:.0f} s{(': ' + err[-1][2:120]) if err else ''} | | | | | | |")
    part.lines += (header or ["| op | T | B | form | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd GB/s | fwd+bwd GB/s |",
                              "|---|---|---|---|---|---|---|---|---|---|"]) + rows
    return part.section(f"Kernels, bf16, H = {heads}, D = {head_dim}, B·T = 65536")


def part_train(a, seq_len: int, archs: Sequence[str], name: str) -> str:
    part = Part(name, a.part_budget)
    part.lines += ["| preset | params_M | batch | precision | tokens_per_s | achieved_GFLOP_s | peak_TFLOP_s | mfu |",
                   "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    mb = max(1, 16384 // seq_len)
    for p in _presets(archs):
        rel = p.relative_to(ROOT)
        if part.left() < 20:
            part.lines.append(f"| {rel} | not run (part budget spent) | | | | | | |")
            continue
        cmd = [PY, "benchmarks/throughput.py", str(rel), "--steps", "10", "--warmup", "3",
               "--set", "train.precision=bf16", "--set", f"data.seq_len={seq_len}",
               "--set", f"model.max_seq_len={max(seq_len, 2048)}", "--set", f"train.micro_batch_size={mb}"]
        part.commands.append(" ".join(cmd[1:]))
        rc, out, dt = _run(cmd, min(a.preset_timeout, part.left()))
        row = [ln for ln in out.splitlines() if ln.startswith("| configs/")]
        if rc == 0 and row:
            part.lines.append(row[0])
        else:
            why = "stopped at its time limit" if rc == 124 else f"exit status {rc}"
            last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [""]
            part.lines.append(f"| {rel} | {why} after {dt:.0f} s: {last[0][:140].replace('|', '/')} | | | | | | |")
    return part.section(f"End-to-end training throughput, seq_len {seq_len}, bf16, micro-batch {mb}")


def record(src: Path) -> None:
    """Insert the parts found in ``src`` into RESULTS.md under "## GPU campaign", newest first."""
    parts = [src / f"{n}.md" for n in ("tests", "kernels", "kernels128", "train", "train8k")]
    body = "\n".join(p.read_text() for p in parts if p.exists())
    if not body:
        sys.exit(f"gpu_campaign record: no part results in {src}")
    res = ROOT / "benchmarks" / "RESULTS.md"
    text = res.read_text()
    marker = "## GPU campaign (`benchmarks/gpu_campaign.py`, `make gpu-bench`)\n"
    if marker not in text:
        text += "\n" + marker + "\n"
    i = text.index(marker) + len(marker)
    res.write_text(text[:i] + "\n" + body + text[i:])
    print(f"recorded {sum(p.exists() for p in parts)} part(s) into {res}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="+",
                    choices=["all", "tests", "kernels", "kernels128", "train", "train8k", "record"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu_results")
    ap.add_argument("--from", dest="src", type=Path, default=None, help="record: the folder of part results")
    ap.add_argument("--part-budget", type=float, default=450.0, help="seconds each part may take")
    ap.add_argument("--file-timeout", type=float, default=150.0)
    ap.add_argument("--op-timeout", type=float, default=120.0)
    ap.add_argument("--preset-timeout", type=float, default=90.0)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if a.parts == ["record"]:
        record(a.src or a.out)
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_campaign: no CUDA device here; this campaign measures a GPU")
    todo = ["tests", "kernels", "kernels128", "train", "train8k"] if "all" in a.parts else a.parts
    a.out.mkdir(parents=True, exist_ok=True)
    for name in todo:
        if name == "tests":
            text = part_tests(a)
        elif name == "kernels":
            text = part_kernels(a, 12, 64, name)
        elif name == "kernels128":
            text = part_kernels(a, 16, 128, name)
        elif name == "train":
            text = part_train(a, 2048, ARCHS, name)
        elif name == "train8k":
            text = part_train(a, 8192, RECURRENT, name)
        else:
            continue
        (a.out / f"{name}.md").write_text(text)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
