#!/usr/bin/env python3
"""Submit a training run, an eval or a scaling-law sweep to Slurm; prints the job id.

    python slurm/submit.py train CONFIG [key=value ...] [--nodes 2 --gpus-per-node 8 --time 24:00:00]
    python slurm/submit.py eval  CONFIG [key=value ...] --task perplexity [--after <train job id>]
    python slurm/submit.py sweep LIST_FILE [--max-running 4]   # job name sweep-<list file name>; for a
                                                               # ladder's sweep.txt, sweep-<its folder>

The config (with its overrides) is loaded and validated before anything is queued, so a typo
fails here, not hours later on the cluster. From it come the job name (the basename of
train.run_dir), the log file (``<run_dir>/slurm-<job id>.out``, appended to across restarts),
for an eval the checkpoint and output directories (``<run_dir>``, ``<run_dir>/eval``), and a check that tensor_parallel x context_parallel divides the number of processes.
Resources come from the options; partition and account default to the environment variables
sbatch itself reads (SBATCH_PARTITION, SBATCH_ACCOUNT). Everything after ``--`` is passed to
sbatch unchanged. ``--dry-run`` prints the sbatch command instead of running it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM_DIR = os.path.join(ROOT, "slurm")


class SubmitError(RuntimeError):
    pass


def load(config: str, overrides: Sequence[str]):
    """The validated ExperimentConfig; ConfigError names a bad key."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from ttt_lm.config import ConfigError, load_config
    try:
        return load_config(config, list(overrides))
    except ConfigError as e:
        raise SubmitError(f"{config}: {e}") from e


def _abs(path: str) -> str:
    """Paths in configs are relative to the repository root, where every job runs."""
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def _split(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python slurm/submit.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="kind", required=True)
    for kind in ("train", "eval", "sweep"):
        s = sub.add_parser(kind)
        if kind == "sweep":
            s.add_argument("list_file", help="one entry per line: CONFIG [key=value ...]")
            s.add_argument("--max-running", type=int, default=None, help="array tasks running at once")
            s.add_argument("--log-dir", default=None, help="default: runs/sweeps/<list file name>")
        else:
            s.add_argument("config")
            s.add_argument("overrides", nargs="*", metavar="key=value")
        default_gpus = 1 if kind == "eval" else 8
        s.add_argument("--nodes", type=int, default=1)
        s.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("TTT_GPUS_PER_NODE", default_gpus)),
                       help=f"GPUs per node (env TTT_GPUS_PER_NODE, default {default_gpus}); 0 for CPU-only")
        s.add_argument("--tasks-per-node", type=int, default=None,
                       help="processes per node (default: one per GPU, or 1 without GPUs)")
        s.add_argument("--cpus-per-task", type=int, default=None)
        s.add_argument("--time", default=os.environ.get("SBATCH_TIMELIMIT"), help="e.g. 24:00:00 (env SBATCH_TIMELIMIT)")
        s.add_argument("--partition", default=os.environ.get("SBATCH_PARTITION"))
        s.add_argument("--account", default=os.environ.get("SBATCH_ACCOUNT"))
        s.add_argument("--job-name", default=None)
        s.add_argument("--python", default=os.environ.get("PYTHON", sys.executable),
                       help="interpreter on the compute nodes (default: this one)")
        if kind != "eval":
            s.add_argument("--signal-seconds", type=int, default=300,
                           help="USR1 this long before the time limit: checkpoint, then requeue")
        else:
            s.add_argument("--task", default="perplexity", help="the `python -m ttt_lm.eval` task")
            s.add_argument("--eval-args", default="", help="more options of that task, as one string")
            s.add_argument("--after", default=None, help="start after this job id completed successfully")
        s.add_argument("--dry-run", action="store_true", help="print the sbatch command, queue nothing")
    return p


def _check_world(cfg, nodes: int, tasks_per_node: int, what: str) -> None:
    world = nodes * tasks_per_node
    mp = cfg.parallel.tensor_parallel * cfg.parallel.context_parallel
    if world % mp:
        raise SubmitError(f"{what}: {world} processes ({nodes} nodes x {tasks_per_node}) are not divisible by "
                          f"parallel.tensor_parallel x parallel.context_parallel = {mp}")


def sweep_entries(list_file: str) -> List[List[str]]:
    """The entries of a sweep list, as sweep.sbatch counts them (blank and # lines skipped)."""
    out = []
    with open(list_file) as f:
        for line in f:
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.split())
    return out


def sweep_name(list_file: str) -> str:
    """What names a sweep's job (``sweep-<name>``) and its default log folder: the list file's name
    without its extension, or, for a file named ``sweep.*`` (what ``python -m ttt_lm.scaling ladder``
    writes into each ladder's folder), the name of the folder that holds it."""
    path = os.path.abspath(list_file)
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem.lower() == "sweep":
        stem = os.path.basename(os.path.dirname(path)) or stem
    return stem


def sbatch_command(args, extra: Sequence[str]) -> List[str]:
    tasks = args.tasks_per_node if args.tasks_per_node is not None else max(args.gpus_per_node, 1)
    if args.gpus_per_node and tasks != args.gpus_per_node:
        print(f"note: {tasks} processes per node with {args.gpus_per_node} GPUs per node", file=sys.stderr)
    cmd = ["sbatch", "--parsable", f"--chdir={ROOT}", f"--nodes={args.nodes}", f"--ntasks-per-node={tasks}",
           f"--export=ALL,TTT_LM_ROOT={ROOT},PYTHON={args.python}"]
    if args.gpus_per_node:
        cmd.append(f"--gpus-per-node={args.gpus_per_node}")
    if args.cpus_per_task:
        cmd.append(f"--cpus-per-task={args.cpus_per_task}")
    for opt in ("time", "partition", "account"):
        if getattr(args, opt):
            cmd.append(f"--{opt}={getattr(args, opt)}")
    if getattr(args, "signal_seconds", None) is not None:
        cmd.append(f"--signal=B:USR1@{args.signal_seconds}")

    if args.kind in ("train", "eval"):
        cfg = load(args.config, args.overrides)
        _check_world(cfg, args.nodes, tasks, args.config)
        run_dir = _abs(cfg.train.run_dir)
        name = args.job_name or f"{args.kind}-{os.path.basename(os.path.normpath(run_dir))}"
        log = os.path.join(run_dir, f"slurm-{'eval-' if args.kind == 'eval' else ''}%j.out")
        os.makedirs(run_dir, exist_ok=True)
        if args.kind == "eval" and args.after:
            cmd.append(f"--dependency=afterok:{args.after}")
        script = os.path.join(SLURM_DIR, f"{args.kind}.sbatch")
        if args.kind == "train":
            tail = [os.path.abspath(args.config), *args.overrides]
        else:
            tail = [args.task, "--checkpoint", run_dir, "--out", os.path.join(run_dir, "eval"),
                    *shlex.split(args.eval_args)]
    else:
        entries = sweep_entries(args.list_file)
        if not entries:
            raise SubmitError(f"{args.list_file} has no entries")
        seen = {}
        for i, (config, *overrides) in enumerate(entries):
            cfg = load(_abs(config), overrides)
            _check_world(cfg, args.nodes, tasks, f"entry {i} ({config})")
            rd = os.path.normpath(_abs(cfg.train.run_dir))
            if rd in seen:
                raise SubmitError(f"entries {seen[rd]} and {i} both train into {rd}: give each its own train.run_dir")
            seen[rd] = i
        stem = sweep_name(args.list_file)
        log_dir = _abs(args.log_dir or os.path.join("runs", "sweeps", stem))
        os.makedirs(log_dir, exist_ok=True)
        name = args.job_name or f"sweep-{stem}"
        log = os.path.join(log_dir, "slurm-%A_%a.out")
        array = f"0-{len(entries) - 1}" + (f"%{args.max_running}" if args.max_running else "")
        cmd.append(f"--array={array}")
        script = os.path.join(SLURM_DIR, "sweep.sbatch")
        tail = [os.path.abspath(args.list_file)]
    cmd += [f"--job-name={name}", f"--output={log}", "--open-mode=append", *extra, script, *tail]
    return cmd


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, extra = _split(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    try:
        cmd = sbatch_command(args, extra)
    except (SubmitError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print(f"error: sbatch failed ({r.returncode}): {r.stderr.strip()}", file=sys.stderr)
        return r.returncode
    # --parsable prints "<job id>[;<cluster>]"
    print(r.stdout.strip().split(";")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
