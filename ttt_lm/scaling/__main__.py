"""Command line of the scaling-law suite: ``python -m ttt_lm.scaling <command> --help``."""
from __future__ import annotations

import os

# the fits are many small L-BFGS problems: BLAS threads only add contention (10x slower on 2 cores)
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def _amounts(s: str):
    from ttt_lm.scaling.ladder import parse_amount
    return [parse_amount(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    from ttt_lm.scaling.ladder import TOKENS_PER_PARAM
    p = argparse.ArgumentParser(prog="python -m ttt_lm.scaling",
                                description="Scaling laws: ladders, sweeps, loss tables, Chinchilla fits, plots.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ladder", help="one config per run from architecture families and sizes or FLOP budgets")
    s.add_argument("families", nargs="+", help="preset or arch YAMLs, then optional key=value overrides for every run")
    s.add_argument("--sizes", type=_amounts, help="target parameter counts, e.g. 125M,350M,760M,1.3B")
    s.add_argument("--flops", type=_amounts, help="isoFLOP mode: training budgets in FLOPs, e.g. 1e18,3e18,1e19 "
                   "(with --sizes: every size at every budget; without: --per-budget sizes around √(C/120))")
    s.add_argument("--per-budget", type=int, default=5, help="isoFLOP: sizes per budget (default 5)")
    s.add_argument("--span", type=float, default=4.0,
                   help="isoFLOP: sizes from centre/span to centre*span, log-spaced (default 4)")
    s.add_argument("--tokens-per-param", type=float, default=TOKENS_PER_PARAM, help="default 20 (Chinchilla)")
    s.add_argument("--count", choices=("total", "non_embedding"), default="total",
                   help="which parameter count the sizes and the token budgets refer to (default total)")
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument("--aspect", type=float, default=64.0, help="d_model / n_layers (default 64)")
    s.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default 256 sequences of data.seq_len, the TTT paper's)")
    s.add_argument("--min-steps", type=int, default=1)
    s.add_argument("--lr", type=float, default=None, help="one peak lr for every run (default: the size rule)")
    s.add_argument("--evals", type=int, default=10, help="validation passes per run (intermediate losses)")
    s.add_argument("--runs-root", default=None, help="where the runs train (default DIR/runs)")
    s.add_argument("--out", required=True, help="the ladder directory to write")

    s = sub.add_parser("run", help="train a ladder's runs here one after another, or as a Slurm job array")
    s.add_argument("ladder")
    s.add_argument("--slurm", action="store_true",
                   help="submit through slurm/submit.py sweep; options after -- go to submit.py")
    s.add_argument("--only", default="", help="comma-separated run names")

    s = sub.add_parser("collect", help="every run's validation losses into one CSV")
    s.add_argument("sources", nargs="+", help="ladder directories or run directories")
    s.add_argument("--out", required=True)

    s = sub.add_parser("fit", help="Chinchilla fits (approaches 2 and 3) per architecture")
    s.add_argument("csv")
    s.add_argument("--out", default=None, help="write the fit as JSON")
    s.add_argument("--budget", type=_amounts, default=[], help="budgets (FLOPs) for the compute-optimal N and D")
    s.add_argument("--points", choices=("final", "all"), default="final",
                   help="final losses only (default) or intermediate ones too (approach 3)")
    s.add_argument("--bootstrap", type=int, default=100, help="resamples for the intervals (0: none)")
    s.add_argument("--level", type=float, default=0.95)
    s.add_argument("--starts", type=int, default=None,
                   help="L-BFGS starts: the k best points of Hoffmann's grid (default 24); 0 = all 4500")
    s.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("plot", help="loss vs FLOPs with the fitted frontier, and isoFLOP curves (PNG)")
    s.add_argument("csv")
    s.add_argument("--fit", required=True, help="the JSON written by fit --out")
    s.add_argument("--out", required=True, help="directory for the PNGs")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:  # run --slurm: what follows -- goes to slurm/submit.py
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a, unknown = parser.parse_known_args(argv)
    a.submit_args = extra
    if extra and not (a.command == "run" and a.slurm):
        parser.error(f"{' '.join(extra)}: options after -- go to slurm/submit.py, with `run --slurm` only")
    # key=value overrides of a ladder may follow its options
    if a.command == "ladder":
        a.families += [u for u in unknown if "=" in u and not u.startswith("-")]
        unknown = [u for u in unknown if not ("=" in u and not u.startswith("-"))]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from ttt_lm.scaling.fit import FitError
    from ttt_lm.scaling.ladder import LadderError
    try:
        return _dispatch(a)
    except (LadderError, FitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _dispatch(a) -> int:
    if a.command == "ladder":
        from ttt_lm.scaling.ladder import format_plan, plan
        fams = [x for x in a.families if "=" not in x]
        ovs = [x for x in a.families if "=" in x]
        runs = plan(fams, a.out, sizes=a.sizes or (), budgets=a.flops or (), per_budget=a.per_budget, span=a.span,
                    tokens_per_param=a.tokens_per_param, count=a.count, head_dim=a.head_dim, aspect=a.aspect,
                    batch_tokens=a.batch_tokens, min_steps=a.min_steps, runs_root=a.runs_root, overrides=ovs,
                    lr=a.lr, eval_points=a.evals)
        print(format_plan(runs))
        print(f"\n{len(runs)} configs in {os.path.join(a.out, 'configs')}; plan: {os.path.join(a.out, 'ladder.csv')}; "
              f"sweep list: {os.path.join(a.out, 'sweep.txt')}")
        return 0
    if a.command == "run":
        from ttt_lm.scaling.sweep import run_local, submit_slurm
        if a.slurm:
            return submit_slurm(a.ladder, a.submit_args)
        failed = run_local(a.ladder, only=[x for x in a.only.split(",") if x])
        return 1 if failed else 0
    if a.command == "collect":
        from ttt_lm.scaling.sweep import collect
        rows = collect(a.sources, a.out)
        print(f"{len(rows)} losses from {len({r['run'] for r in rows})} runs -> {a.out}")
        return 0
    if a.command == "fit":
        from ttt_lm.scaling.fit import DEFAULT_STARTS, fit_table, format_table, read_table
        starts = DEFAULT_STARTS if a.starts is None else (None if a.starts == 0 else a.starts)
        res = fit_table(read_table(a.csv), points=a.points, n_bootstrap=a.bootstrap, level=a.level,
                        budgets=a.budget, seed=a.seed, starts=starts)
        print(format_table(res))
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
            print(f"fit -> {a.out}")
        return 0
    if a.command == "plot":
        from ttt_lm.scaling.fit import FitError, read_table
        from ttt_lm.scaling.plot import plot_all
        try:
            with open(a.fit) as f:
                res = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise FitError(f"cannot read the fit {a.fit}: {e}") from e
        for p in plot_all(read_table(a.csv), res, a.out):
            print(p)
        return 0
    raise AssertionError(a.command)


if __name__ == "__main__":
    sys.exit(main())
