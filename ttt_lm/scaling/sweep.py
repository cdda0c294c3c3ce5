"""Running a ladder and collecting its losses.

``run_local`` trains the runs one after another, each as ``python train.py CONFIG`` in its own
process, exactly as a person would start it: a run whose directory already holds its final
checkpoint is skipped, and an interrupted one resumes from its newest checkpoint (the trainer's
own resume). ``submit_slurm`` hands the ladder's ``sweep.txt`` to ``slurm/submit.py sweep``: a job
array with one task per run, each preemptible and requeued on its own.

``collect`` reads each run directory — its ``config.yaml`` (the config the trainer used) and
``metrics.jsonl`` (a ``val`` record per evaluation, a ``train`` record per step with the tokens
seen so far) — and writes one row per validation loss: the final one and every intermediate one,
with the tokens and training FLOPs (``ttt_lm.model.flops``) spent up to that step. ``params`` is
the non-embedding parameter count (``params_kind`` says so; ``params_total`` has the rest).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from ttt_lm.config import load_config
from ttt_lm.scaling.ladder import LadderError, Run, counts, read_plan, train_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = ["arch", "params", "params_kind", "params_total", "tokens", "flops", "loss", "step", "final", "budget",
           "run", "seq_len"]


def _records(run_dir: str) -> List[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    # a run killed mid-write leaves a partial last line; anything else is damage
                    continue
    return out


def finished(run: Run) -> bool:
    """True when the run's metrics reach its last step (it will not train again)."""
    path = os.path.join(run.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return False
    steps = [r["step"] for r in _records(run.run_dir) if r.get("kind", "train") == "train"]
    return bool(steps) and max(steps) >= run.steps


def run_local(ladder_dir: str, python: str = sys.executable, only: Sequence[str] = (), env: Optional[Dict] = None,
              log=print) -> List[str]:
    """Train every run of the ladder one after another; returns the names of runs that failed."""
    runs = [r for r in read_plan(ladder_dir) if not only or r.name in only]
    failed = []
    for i, r in enumerate(runs):
        if finished(r):
            log(f"[scaling] {i + 1}/{len(runs)} {r.name}: finished earlier, skipped")
            continue
        log(f"[scaling] {i + 1}/{len(runs)} {r.name}: {r.steps} steps, {r.tokens:.3g} tokens")
        p = subprocess.run([python, os.path.join(ROOT, "train.py"), r.config], cwd=ROOT,
                           env=dict(os.environ, **(env or {})))
        if p.returncode != 0:
            log(f"[scaling] {r.name} exited with {p.returncode}; run the same command again to resume it")
            failed.append(r.name)
    return failed


def slurm_command(ladder_dir: str, submit_args: Sequence[str]) -> List[str]:
    """The argv of ``slurm/submit.py sweep`` for this ladder."""
    read_plan(ladder_dir)  # a clear error for a directory that is not a ladder
    sweep = os.path.join(os.path.abspath(ladder_dir), "sweep.txt")
    return [os.path.join(ROOT, "slurm", "submit.py"), "sweep", sweep,
            "--log-dir", os.path.join(os.path.abspath(ladder_dir), "slurm"), *submit_args]


def submit_slurm(ladder_dir: str, submit_args: Sequence[str], python: str = sys.executable) -> int:
    return subprocess.run([python, *slurm_command(ladder_dir, submit_args)], cwd=ROOT).returncode


def _run_dirs(sources: Sequence[str]):
    """(run dir, arch, budget) for ladder directories and plain run directories."""
    out = []
    for s in sources:
        if os.path.exists(os.path.join(s, "ladder.json")):
            out += [(r.run_dir, r.arch, r.budget) for r in read_plan(s)]
        elif os.path.exists(os.path.join(s, "metrics.jsonl")):
            out.append((s, None, None))
        else:
            raise LadderError(f"{s} is neither a ladder directory (ladder.json) nor a run directory (metrics.jsonl)")
    return out


def collect_rows(sources: Sequence[str], log=print) -> List[Dict]:
    rows = []
    for run_dir, arch, budget in _run_dirs(sources):
        if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            log(f"[scaling] {run_dir}: not started, left out")
            continue
        cfg = load_config(os.path.join(run_dir, "config.yaml"))
        recs = _records(run_dir)
        # a resumed run may log a step twice if it was stopped between metrics and checkpoint: keep the last
        tokens_at = {r["step"]: r["tokens"] for r in recs if r.get("kind", "train") == "train"}
        vals = {r["step"]: r["loss"] for r in recs if r.get("kind") == "val"}
        if not vals:
            log(f"[scaling] {run_dir}: no validation loss yet, left out")
            continue
        c = counts(cfg.model)
        fpt = train_flops_per_token(cfg.model, cfg.data.seq_len)
        label = arch or "+".join(cfg.model.layer_pattern)
        done = max(tokens_at) >= cfg.train.max_steps if tokens_at else False
        for step in sorted(vals):
            if step not in tokens_at:
                continue
            rows.append({"arch": label, "params": c["non_embedding"], "params_kind": "non_embedding",
                         "params_total": c["total"], "tokens": tokens_at[step], "flops": fpt * tokens_at[step],
                         "loss": vals[step], "step": step, "final": int(done and step == cfg.train.max_steps),
                         "budget": "" if budget is None else budget, "run": os.path.basename(os.path.normpath(run_dir)),
                         "seq_len": cfg.data.seq_len})
        if not done:
            log(f"[scaling] {run_dir}: stopped at step {max(tokens_at) if tokens_at else 0} of "
                f"{cfg.train.max_steps}; its losses are intermediate (final=0)")
    return rows


def collect(sources: Sequence[str], out: str, log=print) -> List[Dict]:
    rows = collect_rows(sources, log)
    if not rows:
        raise LadderError(f"no validation losses in {list(sources)}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return rows
