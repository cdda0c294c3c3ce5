"""Model ladders: from an architecture family and target sizes (or FLOP budgets), one training
config per run, with its shape, exact parameter counts, token budget, schedule and training FLOPs.

The recipe follows the TTT paper (Sun et al. 2024, Appendix "Experiment details"; the scripts of
its official JAX code, ttt-lm-jax), which takes its ladder from Mamba (Gu & Dao 2023) and GPT-3:

    size   layers  d_model  heads  peak lr   steps    tokens (0.5M-token batches)
    125M   12      768      12     3e-3      4,800    2.5B
    350M   24      1024     16     1.5e-3    13,500   7.1B
    760M   24      1536     16     1.25e-3   29,000   15.2B
    1.3B   24      2048     32     1e-3      50,000   26.2B

≈ 20 tokens per parameter (Chinchilla-optimal, Hoffmann et al. 2022), a batch of 256 sequences ×
2048 tokens, AdamW (β 0.9/0.95, weight decay 0.1, clip 1.0), linear warmup over the first 10% of
the steps, then cosine decay. The official scripts decay to an absolute 1e-5; we decay to 10% of
the peak (``optim.min_lr_ratio=0.1``, as Hoffmann et al.); set ``optim.min_lr_ratio`` to 1e-5/lr to
follow the scripts instead. The scripts keep fp32 parameters; we train in bf16 mixed precision.

Rules for a size that is not in the table:

* shape: n_layers a multiple of the layer pattern's length; d_model = head_dim × round(aspect ×
  n_layers / head_dim) (aspect = d_model / n_layers, 64 by default as at 125M and 760M; head_dim
  64 by default); n_heads = d_model / head_dim. The depth whose exact parameter count (counted on
  the meta device) is nearest the target in log space is chosen. The MLP width keeps the family's
  ratio d_ff / d_model (rounded up to a multiple of 16; d_ff = 0 stays 0), grouped-query
  attention keeps its ratio n_heads / num_kv_heads, an explicit RG-LRU width keeps its ratio to
  d_model.
* peak lr: interpolated log-linearly in the parameter count between the table's points, held at
  the end values outside them (3e-3 below 125M, 1e-3 above 1.3B).
* tokens: ``tokens_per_param`` × parameters, rounded to whole batches (``--count`` chooses total
  or non-embedding parameters for both the size target and the budget); in isoFLOP mode, for each
  budget C several sizes spaced evenly in log N around the Chinchilla-optimal N ≈ √(C/120) (C = 6N
  · 20N), or the given sizes at every budget, each trained on D = C / f(N) tokens, f the training
  FLOPs per token of ``ttt_lm.model.flops.flops_per_token``.
* warmup 10% of the steps, cosine to 10%.
* validation: every steps/evals steps, the last pass at the final step (the largest divisor of
  the step count at most steps/evals; where that would mean more than 4 × evals passes, the step
  count is rounded to a multiple of evals instead, a change of at most evals/2 batches).
"""
from __future__ import annotations

import copy
import csv
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ttt_lm.config import ConfigError, load_config, save_config

# (name, nominal parameters, n_layers, d_model, n_heads, optimizer steps, peak lr): Sun et al. 2024
TTT_PAPER_LADDER = (
    ("125m", 125e6, 12, 768, 12, 4800, 3e-3),
    ("350m", 350e6, 24, 1024, 16, 13500, 1.5e-3),
    ("760m", 760e6, 24, 1536, 16, 29000, 1.25e-3),
    ("1.3b", 1.3e9, 24, 2048, 32, 50000, 1e-3),
)
TTT_PAPER_BATCH_SEQUENCES = 256
TTT_PAPER_SEQ_LEN = 2048
WARMUP_FRACTION = 0.1
MIN_LR_RATIO = 0.1
TOKENS_PER_PARAM = 20.0


class LadderError(ValueError):
    """A ladder that cannot be built (bad sizes, budgets or family)."""


def peak_lr(n_params: float) -> float:
    """The TTT paper's peak learning rate, log-linear in log N between its four sizes."""
    pts = [(n, lr) for _, n, *_, lr in TTT_PAPER_LADDER]
    if n_params <= pts[0][0]:
        return pts[0][1]
    for (n0, lr0), (n1, lr1) in zip(pts, pts[1:]):
        if n_params <= n1:
            w = math.log(n_params / n0) / math.log(n1 / n0)
            return lr1 if w == 1.0 else math.exp((1 - w) * math.log(lr0) + w * math.log(lr1))
    return pts[-1][1]


def parse_amount(s: str) -> float:
    """'125M', '1.3B', '20k', '3e18' -> float."""
    s = s.strip()
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    try:
        if s and s[-1].lower() in mult:
            return float(s[:-1]) * mult[s[-1].lower()]
        return float(s)
    except ValueError:
        raise LadderError(f"cannot read {s!r} as a number (e.g. 125M, 1.3B, 3e18)") from None


def _round_up(x: float, m: int) -> int:
    return int(m * math.ceil(x / m))


def _linear_in_depth(fn, model_cfg):
    """fn(model_cfg) for a model of any depth from two shallow ones: every quantity here (parameter
    counts, FLOPs per token) is a constant plus one term per repetition of the layer pattern, so
    with P = the pattern's length, fn(L) = fn(P) + (L/P − 1)·(fn(2P) − fn(P)) exactly, and the
    models built are at most 2P layers deep."""
    P = len(model_cfg.layer_pattern)
    reps = model_cfg.n_layers // P
    if reps <= 2:
        return fn(model_cfg)
    one, two = copy.deepcopy(model_cfg), copy.deepcopy(model_cfg)
    one.n_layers, two.n_layers = P, 2 * P
    f1, f2 = fn(one), fn(two)
    return {k: f1[k] + (reps - 1) * (f2[k] - f1[k]) for k in f1}


def counts(model_cfg) -> Dict[str, int]:
    """Exact total and non-embedding parameter counts (``ttt_lm.info.param_counts``)."""
    from ttt_lm.info import param_counts
    return {k: int(v) for k, v in _linear_in_depth(param_counts, model_cfg).items()}


def train_flops_per_token(model_cfg, seq_len: int) -> float:
    """Training FLOPs per token from ``ttt_lm.model.flops.flops_per_token``."""
    from ttt_lm.model.flops import flops_per_token
    return float(_linear_in_depth(lambda m: flops_per_token(m, seq_len), model_cfg)["train"])


def shaped(family_model, n_layers: int, head_dim: int, aspect: float):
    """The family's model config at depth n_layers with the width rule above."""
    m = copy.deepcopy(family_model)
    d = head_dim * max(1, round(aspect * n_layers / head_dim))
    f_d = family_model.d_model
    m.d_model, m.n_layers, m.n_heads, m.head_dim = d, n_layers, d // head_dim, None
    if family_model.d_ff not in (0,):
        m.d_ff = _round_up(family_model.ff * d / f_d, 16)
    # each mixer section that depends on the width says how it scales (``scaled``, in its file)
    for name, section in family_model.sections().items():
        if callable(getattr(section, "scaled", None)):
            setattr(m, name, section.scaled(family_model, m))
    return m.validate()


def shape_for(family_model, target: float, count: str = "total", head_dim: int = 64, aspect: float = 64.0,
              max_layers: int = 256):
    """The (model config, counts) of the depth whose parameter count is nearest ``target``."""
    P = len(family_model.layer_pattern)
    key = "total" if count == "total" else "non_embedding"
    cache: Dict[int, tuple] = {}

    def at(L):
        if L not in cache:
            m = shaped(family_model, L, head_dim, aspect)
            cache[L] = (m, counts(m))
        return cache[L]

    # the count grows with depth: bisect on multiples of P for the first depth at or above target
    lo, hi = 1, max_layers // P
    if at(lo * P)[1][key] >= target:
        best = lo
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid * P)[1][key] >= target:
                hi = mid
            else:
                lo = mid
        best = min((lo, hi), key=lambda k: abs(math.log(at(k * P)[1][key] / target)))
    m, c = at(best * P)
    if abs(math.log(c[key] / target)) > math.log(2):
        raise LadderError(f"no shape of this family has about {target:.3g} {key} parameters with head_dim "
                          f"{head_dim} and aspect {aspect:g} (nearest: {c[key]:.3g} at {best * P} layers)")
    return m, c


@dataclass
class Run:
    name: str
    arch: str
    config: str                   # path of the written config
    run_dir: str
    d_model: int
    n_layers: int
    n_heads: int
    params_total: int
    params_non_embedding: int
    seq_len: int
    batch_sequences: int
    steps: int
    tokens: int
    flops_per_token: float        # training (forward + backward), ttt_lm.model.flops
    flops: float                  # flops_per_token × tokens
    lr: float
    warmup_steps: int
    budget: Optional[float] = None  # isoFLOP mode: the nominal budget of this run's group
    extra: Dict = field(default_factory=dict)


def _eval_every(steps: int, evals: int) -> int:
    """Steps between validation passes: the largest divisor of steps at most steps / evals, so
    that the last pass falls on the final step (``collect`` needs the final loss)."""
    e = max(1, steps // max(1, evals))
    while steps % e:
        e -= 1
    return e


def arch_name(path: str) -> str:
    """A family's label: the YAML's name without a size suffix (transformer_125m -> transformer)."""
    import re
    stem = os.path.splitext(os.path.basename(path))[0]
    return re.sub(r"_(\d+(\.\d+)?[mb])$", "", stem)


def _label(n: float) -> str:
    for div, suf in ((1e9, "b"), (1e6, "m"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suf}"
    return f"{n:.0f}"


def plan(families: Sequence[str], out_dir: str, sizes: Sequence[float] = (), budgets: Sequence[float] = (),
         per_budget: int = 5, span: float = 4.0, tokens_per_param: float = TOKENS_PER_PARAM,
         count: str = "total", head_dim: int = 64, aspect: float = 64.0, batch_tokens: Optional[int] = None,
         min_steps: int = 1, runs_root: Optional[str] = None, overrides: Sequence[str] = (),
         lr: Optional[float] = None, eval_points: int = 10) -> List[Run]:
    """Write one config per run under ``out_dir/configs`` and the plan (``ladder.json``,
    ``ladder.csv``, ``sweep.txt``); return the runs."""
    if not sizes and not budgets:
        raise LadderError("give target sizes, FLOP budgets (isoFLOP), or both (every size at every budget)")
    if count not in ("total", "non_embedding"):
        raise LadderError(f"count must be 'total' or 'non_embedding', got {count!r}")
    if any(x <= 0 for x in (*sizes, *budgets)) or tokens_per_param <= 0:
        raise LadderError("sizes, budgets and tokens per parameter must be positive")
    if budgets and per_budget < 1:
        raise LadderError("--per-budget must be at least 1")
    key = "total" if count == "total" else "non_embedding"
    runs_root = runs_root or os.path.join(out_dir, "runs")
    os.makedirs(os.path.join(out_dir, "configs"), exist_ok=True)
    runs: List[Run] = []
    names = set()
    for fam in families:
        try:
            base = load_config(fam, list(overrides))
        except ConfigError as e:
            raise LadderError(f"{fam}: {e}") from e
        arch = arch_name(fam)
        T = base.data.seq_len
        bt = batch_tokens or TTT_PAPER_BATCH_SEQUENCES * T
        if bt % T:
            raise LadderError(f"batch of {bt} tokens is not a whole number of {T}-token sequences (data.seq_len)")
        B = bt // T
        if B % base.train.micro_batch_size:
            raise LadderError(f"batch of {B} sequences is not a multiple of train.micro_batch_size="
                              f"{base.train.micro_batch_size}")
        targets = []  # (size target, tokens or None, budget or None)
        if sizes and budgets:
            targets = [(n, C, C) for C in budgets for n in sizes]
        elif sizes:
            targets = [(n, None, None) for n in sizes]
        else:
            for C in budgets:
                centre = math.sqrt(C / (6.0 * TOKENS_PER_PARAM))
                for i in range(per_budget):
                    f = 0.0 if per_budget == 1 else -1.0 + 2.0 * i / (per_budget - 1)
                    targets.append((centre * span ** f, C, C))
        for target, C, budget in targets:
            m, c = shape_for(base.model, target, count, head_dim, aspect)
            fpt = train_flops_per_token(m, T)
            if C is None:
                want = tokens_per_param * c[key]
            else:
                want = C / fpt
            steps = max(min_steps, int(round(want / bt)))
            every = _eval_every(steps, eval_points)
            if every < steps // (4 * max(1, eval_points)):
                # a step count with no divisor near steps / evals (e.g. 2 × a prime) would validate
                # far more often than asked: round it to a multiple of evals instead
                steps = max(eval_points, eval_points * int(round(steps / eval_points)))
                every = steps // eval_points
            tokens = steps * bt
            name = f"{arch}_{_label(c[key])}" + (f"_C{budget:.2g}".replace("+", "") if budget else "")
            while name in names:
                name += "_"
            names.add(name)
            cfg = copy.deepcopy(base)
            cfg.model = m
            run_lr = lr if lr is not None else peak_lr(c["total"])
            cfg.optim.lr = run_lr
            cfg.optim.schedule = "cosine"
            cfg.optim.warmup_steps = max(1, int(round(WARMUP_FRACTION * steps)))
            cfg.optim.min_lr_ratio = MIN_LR_RATIO
            cfg.optim.total_steps = None
            cfg.train.max_steps = steps
            cfg.train.global_batch_size = B
            cfg.train.grad_accum = 1
            cfg.train.run_dir = os.path.join(runs_root, name)
            cfg.eval.every = every
            path = os.path.join(out_dir, "configs", f"{name}.yaml")
            save_config(cfg, path)
            runs.append(Run(name=name, arch=arch, config=path, run_dir=cfg.train.run_dir, d_model=m.d_model,
                            n_layers=m.n_layers, n_heads=m.n_heads, params_total=c["total"],
                            params_non_embedding=c["non_embedding"], seq_len=T, batch_sequences=B, steps=steps,
                            tokens=tokens, flops_per_token=fpt, flops=fpt * tokens, lr=run_lr,
                            warmup_steps=cfg.optim.warmup_steps, budget=budget))
    write_plan(runs, out_dir, {"families": list(families), "sizes": list(sizes), "budgets": list(budgets),
                               "per_budget": per_budget, "span": span, "tokens_per_param": tokens_per_param,
                               "count": count, "head_dim": head_dim, "aspect": aspect, "batch_tokens": batch_tokens,
                               "overrides": list(overrides)})
    return runs


def write_plan(runs: List[Run], out_dir: str, args: Dict) -> None:
    rows = [r.__dict__ for r in runs]
    with open(os.path.join(out_dir, "ladder.json"), "w") as f:
        json.dump({"args": args, "runs": rows}, f, indent=1)
    cols = [k for k in rows[0] if k != "extra"]
    with open(os.path.join(out_dir, "ladder.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "sweep.txt"), "w") as f:
        f.write("# written by `python -m ttt_lm.scaling ladder`; one run per line (slurm/submit.py sweep)\n")
        for r in runs:
            f.write(os.path.abspath(r.config) + "\n")


def read_plan(ladder_dir: str) -> List[Run]:
    path = os.path.join(ladder_dir, "ladder.json")
    if not os.path.exists(path):
        raise LadderError(f"{ladder_dir} is not a ladder directory (no ladder.json); "
                          "write one with `python -m ttt_lm.scaling ladder`")
    with open(path) as f:
        return [Run(**r) for r in json.load(f)["runs"]]


def format_plan(runs: Sequence[Run]) -> str:
    head = f"{'run':<28} {'layers':>6} {'d_model':>7} {'heads':>5} {'params':>9} {'non-emb':>9} " \
           f"{'tokens':>9} {'tok/param':>9} {'steps':>7} {'lr':>8} {'FLOPs':>9}"
    lines = [head]
    for r in runs:
        lines.append(f"{r.name:<28} {r.n_layers:>6} {r.d_model:>7} {r.n_heads:>5} {r.params_total:>9.3g} "
                     f"{r.params_non_embedding:>9.3g} {r.tokens:>9.3g} {r.tokens / r.params_total:>9.1f} "
                     f"{r.steps:>7} {r.lr:>8.2e} {r.flops:>9.3g}")
    return "\n".join(lines)
