"""Chinchilla fits of a loss table: the parametric law (approach 3) and isoFLOP parabolas
(approach 2) of Hoffmann et al. 2022, *Training Compute-Optimal Large Language Models*.

Approach 3, the parametric law. The final loss of a model with N parameters trained on D tokens
is modelled as

    L(N, D) = E + A / N^α + B / D^β

and fitted in log space: with a = log A, b = log B, e = log E,

    minimise over (a, b, e, α, β)   Σ_i Huber_δ( LSE(a − α log N_i, b − β log D_i, e) − log L_i ),

δ = 1e-3, LSE the log-sum-exp, by L-BFGS (scipy's L-BFGS-B with the analytic gradient, no
bounds) from a grid of initialisations — Hoffmann's grid, α, β ∈ {0, 0.5, …, 2},
e ∈ {−1, −0.5, …, 1}, a, b ∈ {0, 5, …, 25} (4500 points) — keeping the best optimum. Where we
differ: Hoffmann start L-BFGS from every grid point; we evaluate the objective at all 4500 and
start from the ``starts`` best of them (default 24; ``starts=None`` runs all 4500, which takes
minutes on a CPU core). On the synthetic tables of the tests the best few starts all reach the
same optimum. Huber_δ(r) = r²/2 for |r| ≤ δ, δ(|r| − δ/2)
beyond. Hoffmann minimise the sum of Huber terms; so do we (the objective's scale matters for the
stopping tolerances, which are set tight here: Besiroglu et al. 2024 traced Hoffmann's
implausibly narrow intervals partly to an optimiser stopped early).

Confidence intervals come from a bootstrap: B resamples of the runs with replacement (all the
points of a run travel together when the table has a ``run`` column, since the intermediate
losses of one run are not independent), each refitted by L-BFGS from the full-data optimum and
the two next-best optima of the full fit (not from the whole grid, to keep B refits cheap); the
interval is the percentile interval of the resampled estimates.
Hoffmann report no intervals for approach 3; this is the procedure of Besiroglu et al. 2024.

Compute-optimal allocation. With training compute C = k·N·D (k = 6 in Hoffmann's convention),
minimising L(N, C/(kN)) gives

    N_opt(C) = G · (C/k)^a,   D_opt(C) = G⁻¹ · (C/k)^b,
    a = β / (α + β),   b = α / (α + β),   G = (αA / (βB))^(1/(α+β)).

With Hoffmann's published coefficients (E 1.69, A 406.4, B 410.7, α 0.34, β 0.28) a ≈ 0.45.
For a given budget we also minimise L(N, C / f(N)) numerically, where f(N) is the table's own
training FLOPs per token as a function of N (a power law k·N^γ fitted to flops / tokens, from
``ttt_lm.model.flops`` through ``collect``; k = 6, γ = 1 when the table has no flops column):
this is what the budget buys for these architectures, attention and inner-loop FLOPs included.
N is the non-embedding parameter count in this project's tables (the ``params_kind`` column);
Hoffmann count embeddings too, Kaplan et al. 2020 do not.

A table whose points hold fewer than 3 distinct sizes (or token counts) per architecture does not
determine the law (two sizes fix one difference of A/N^α, not A and α): such a fit is refused, and
the table and the plot say it is under-determined; bootstrap resamples with fewer than 3 sizes or
token counts are skipped for the same reason.

Approach 2, isoFLOP profiles. Runs are grouped by compute budget (the ``budget`` column a ladder
writes, else training FLOPs that agree within 10%). In each group with at least three model
sizes the final loss is fitted by a parabola in log N, L = c₀ + c₁ log N + c₂ (log N)²; its
minimum is N_opt(C) = exp(−c₁ / 2c₂), and D_opt(C) = C / f(N_opt). Least squares of
log N_opt and log D_opt on log C over the budgets give N_opt ∝ C^a and D_opt ∝ C^b.
"""
from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

HUBER_DELTA = 1e-3
# Hoffmann et al. 2022, Appendix D.2: the initialisation grid of approach 3
GRID_ALPHA = GRID_BETA = tuple(np.arange(0.0, 2.01, 0.5))
GRID_E = tuple(np.arange(-1.0, 1.01, 0.5))
GRID_A = GRID_B = tuple(np.arange(0.0, 25.1, 5.0))
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
HOFFMANN_2022 = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


class FitError(ValueError):
    """A table that cannot be fitted (missing columns, too few points, bad values)."""


# ---------------------------------------------------------------------------- the table
REQUIRED = ("arch", "params", "tokens", "loss")


@dataclass
class Table:
    """Columns of a loss table as arrays; ``flops``, ``run``, ``final`` and ``budget`` optional."""
    arch: np.ndarray
    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    flops: Optional[np.ndarray] = None
    run: Optional[np.ndarray] = None
    final: Optional[np.ndarray] = None
    budget: Optional[np.ndarray] = None

    def select(self, mask: np.ndarray) -> "Table":
        return Table(**{k: (None if v is None else v[mask]) for k, v in self.__dict__.items()})

    def __len__(self) -> int:
        return len(self.loss)


def read_table(path: str) -> Table:
    """Read a CSV with at least the columns arch, params, tokens, loss (flops optional)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise FitError(f"cannot read {path}: {e}") from e
    if not rows:
        raise FitError(f"{path} has no rows")
    cols = rows[0].keys()
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise FitError(f"{path} lacks the column(s) {missing}; it has {list(cols)}")

    def num(col, i, r):
        try:
            v = float(r[col])
        except (TypeError, ValueError):
            raise FitError(f"{path} row {i + 2}: column {col} is not a number: {r[col]!r}") from None
        if not math.isfinite(v) or v <= 0:
            raise FitError(f"{path} row {i + 2}: column {col} must be positive and finite, got {r[col]!r}")
        return v

    out = {"arch": np.array([r["arch"] for r in rows])}
    for c in ("params", "tokens", "loss"):
        out[c] = np.array([num(c, i, r) for i, r in enumerate(rows)])
    if "flops" in cols and all(r["flops"] not in ("", None) for r in rows):
        out["flops"] = np.array([num("flops", i, r) for i, r in enumerate(rows)])
    if "budget" in cols and all(r["budget"] not in ("", None) for r in rows):
        out["budget"] = np.array([num("budget", i, r) for i, r in enumerate(rows)])
    if "run" in cols:
        out["run"] = np.array([r["run"] for r in rows])
    if "final" in cols:
        out["final"] = np.array([str(r["final"]).strip().lower() in ("1", "true", "yes") for r in rows])
    return Table(**out)


# ---------------------------------------------------------------------------- approach 3
def _objective(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray, logL: np.ndarray, delta: float):
    """Σ Huber_δ(LSE(a − α logN, b − β logD, e) − logL) and its gradient in (a, b, e, α, β)."""
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * logN, b - beta * logD, np.full_like(logN, e)])
    m = t.max(0)
    w = np.exp(t - m)
    s = w.sum(0)
    pred = m + np.log(s)
    w /= s                                   # softmax weights: ∂pred/∂(t₁, t₂, t₃)
    r = pred - logL
    ar = np.abs(r)
    f = np.where(ar <= delta, 0.5 * r * r, delta * (ar - 0.5 * delta)).sum()
    psi = np.clip(r, -delta, delta)          # Huber'(r)
    g = np.array([(psi * w[0]).sum(), (psi * w[1]).sum(), (psi * w[2]).sum(),
                  -(psi * w[0] * logN).sum(), -(psi * w[1] * logD).sum()])
    return f, g


def _grid() -> np.ndarray:
    return np.array(list(itertools.product(GRID_A, GRID_B, GRID_E, GRID_ALPHA, GRID_BETA)), dtype=np.float64)


def _grid_values(starts: np.ndarray, logN, logD, logL, delta) -> np.ndarray:
    """The objective at every start, vectorised over starts (for ranking them)."""
    a, b, e, al, be = (starts[:, i:i + 1] for i in range(5))
    t = np.stack([a - al * logN[None], b - be * logD[None], np.broadcast_to(e, (len(starts), len(logN)))])
    m = t.max(0)
    pred = m + np.log(np.exp(t - m).sum(0))
    ar = np.abs(pred - logL[None])
    return np.where(ar <= delta, 0.5 * ar * ar, delta * (ar - 0.5 * delta)).sum(1)


def _lbfgs(theta0, logN, logD, logL, delta):
    from scipy.optimize import minimize
    r = minimize(_objective, theta0, args=(logN, logD, logL, delta), jac=True, method="L-BFGS-B",
                 options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-10})
    return r.x, float(r.fun)


def _params(theta: np.ndarray) -> Dict[str, float]:
    a, b, e, alpha, beta = (float(x) for x in theta)
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": alpha, "beta": beta}


DEFAULT_STARTS = 24
#: distinct model sizes (and token counts) the law needs: the points fix E + A/N^α + B/D^β only up to
#: its values there, so the N term's two parameters (A, α) need the differences between at least 3
#: sizes, and (B, β) those between at least 3 token counts
MIN_DISTINCT = 3


def underdetermined(N, D) -> Optional[str]:
    """Why the parametric law is not determined by points at sizes ``N`` and token counts ``D``
    (fewer than 3 distinct values of either), or None when it is."""
    nN, nD = len(np.unique(np.asarray(N, float))), len(np.unique(np.asarray(D, float)))
    why = ([f"{nN} model size(s), A and alpha need at least {MIN_DISTINCT}"] if nN < MIN_DISTINCT else []) + \
          ([f"{nD} token count(s), B and beta need at least {MIN_DISTINCT}"] if nD < MIN_DISTINCT else [])
    if not why:
        return None
    return "under-determined: " + "; ".join(why) + " (the law E + A/N^alpha + B/D^beta has 5 parameters)"


def fit_parametric(N, D, L, delta: float = HUBER_DELTA, starts=DEFAULT_STARTS, return_ranked: bool = False):
    """Approach 3 on arrays of (N, D, L): the best L-BFGS optimum over the starts. ``starts``: an
    int k (the k points of Hoffmann's grid with the lowest objective), None (the whole grid) or an
    array of (a, b, e, α, β) rows. Returns (params, objective[, optima ranked by objective])."""
    logN, logD, logL = np.log(np.asarray(N, float)), np.log(np.asarray(D, float)), np.log(np.asarray(L, float))
    if len(logL) < 5:
        raise FitError(f"the law has 5 parameters: {len(logL)} points are too few")
    why = underdetermined(N, D)
    if why is not None:
        raise FitError(f"approach 3 is {why}")
    if starts is None:
        starts = _grid()
    elif isinstance(starts, (int, np.integer)):
        g = _grid()
        starts = g[np.argsort(_grid_values(g, logN, logD, logL, delta))[:int(starts)]]
    else:
        starts = np.atleast_2d(starts)
    results = [_lbfgs(s, logN, logD, logL, delta) for s in starts]
    order = np.argsort([f for _, f in results])
    theta, fun = results[order[0]]
    if return_ranked:
        return _params(theta), fun, np.array([results[i][0] for i in order])
    return _params(theta), fun


def compute_optimal_exponents(p: Dict[str, float]) -> Dict[str, float]:
    """a = β/(α+β), b = α/(α+β): N_opt ∝ C^a and D_opt ∝ C^b when C ∝ N·D."""
    s = p["alpha"] + p["beta"]
    return {"a": p["beta"] / s, "b": p["alpha"] / s}


def law(p: Dict[str, float], N, D):
    return p["E"] + p["A"] / np.power(N, p["alpha"]) + p["B"] / np.power(D, p["beta"])


@dataclass
class FlopsModel:
    """Training FLOPs per token as k·N^γ (fitted to a table's flops / tokens; 6·N without flops)."""
    k: float = 6.0
    gamma: float = 1.0
    source: str = "6N (no flops column)"

    def __call__(self, N):
        return self.k * np.power(N, self.gamma)

    @classmethod
    def from_table(cls, t: Table) -> "FlopsModel":
        if t.flops is None:
            return cls()
        x, y = np.log(t.params), np.log(t.flops / t.tokens)
        if np.ptp(x) < 1e-9:
            return cls(k=float(np.exp(np.mean(y - x))), gamma=1.0, source="flops/tokens at one size, γ = 1")
        gamma, logk = np.polyfit(x, y, 1)
        return cls(k=float(np.exp(logk)), gamma=float(gamma), source="least squares of log(flops/tokens) on log N")

    def as_dict(self):
        return {"k": self.k, "gamma": self.gamma, "source": self.source}


def optimal_allocation(p: Dict[str, float], C: float, fpt: FlopsModel = FlopsModel()) -> Dict[str, float]:
    """N_opt, D_opt and the loss there for a training budget of C FLOPs: argmin over N of
    L(N, C / f(N)), with f the FLOPs per token (k·N^γ)."""
    from scipy.optimize import minimize_scalar

    def loss_at(x):  # x = log N
        N = math.exp(x)
        return float(law(p, N, C / fpt(N)))

    lo, hi = math.log(1e2), math.log(max(1e3, (C / fpt.k) ** (1.0 / (1.0 + fpt.gamma)) * 1e6))
    r = minimize_scalar(loss_at, bounds=(lo, hi), method="bounded", options={"xatol": 1e-9})
    N = math.exp(r.x)
    # a minimum on the edge of the search range means the fitted law has none inside it
    at_bound = min(r.x - lo, hi - r.x) < 1e-3
    return {"N": N, "D": C / float(fpt(N)), "loss": float(r.fun), "at_bound": bool(at_bound)}


def closed_form_allocation(p: Dict[str, float], C: float, k: float = 6.0) -> Dict[str, float]:
    """Hoffmann's closed form for C = k·N·D: N_opt = G (C/k)^a, D_opt = G⁻¹ (C/k)^b."""
    ab = compute_optimal_exponents(p)
    G = (p["alpha"] * p["A"] / (p["beta"] * p["B"])) ** (1.0 / (p["alpha"] + p["beta"]))
    return {"N": G * (C / k) ** ab["a"], "D": (C / k) ** ab["b"] / G}


def bootstrap(t: Table, best_theta: np.ndarray, ranked_starts: np.ndarray, n: int, seed: int = 0,
              n_starts: int = 2, delta: float = HUBER_DELTA) -> List[Dict[str, float]]:
    """n refits on resampled runs (or points, without a run column)."""
    rng = np.random.default_rng(seed)
    groups = t.run if t.run is not None else np.arange(len(t)).astype(str)
    keys = np.unique(groups)
    members = {k: np.flatnonzero(groups == k) for k in keys}
    starts = np.vstack([best_theta[None], ranked_starts[1:n_starts + 1]])  # ranked_starts[0] is best_theta
    out = []
    for _ in range(n):
        idx = np.concatenate([members[k] for k in rng.choice(keys, size=len(keys), replace=True)])
        N, D, L = t.params[idx], t.tokens[idx], t.loss[idx]
        if len(idx) < 5 or underdetermined(N, D) is not None:
            continue  # a resample with fewer than 3 sizes or token counts does not determine α or β
        p, _ = fit_parametric(N, D, L, delta, starts=starts)
        out.append(p)
    return out


# ---------------------------------------------------------------------------- approach 2
def budget_groups(t: Table) -> List[np.ndarray]:
    """Indices of the runs of each compute budget: the ladder's budget column, else flops within 10%."""
    if t.budget is not None:
        return [np.flatnonzero(t.budget == c) for c in np.unique(t.budget)]
    C = t.flops if t.flops is not None else 6.0 * t.params * t.tokens
    order = np.argsort(C)
    groups, cur = [], [order[0]]
    for i in order[1:]:
        if C[i] <= C[cur[0]] * 1.1:
            cur.append(i)
        else:
            groups.append(np.array(cur))
            cur = [i]
    groups.append(np.array(cur))
    return groups


def fit_isoflop(t: Table, fpt: FlopsModel) -> Dict:
    """Approach 2 on the final points of one architecture."""
    C_all = t.flops if t.flops is not None else 6.0 * t.params * t.tokens
    budgets, notes = [], []
    for g in budget_groups(t):
        C = float(np.exp(np.mean(np.log(C_all[g])))) if t.budget is None else float(t.budget[g[0]])
        x, y = np.log(t.params[g]), t.loss[g]
        if len(np.unique(x)) < 3:
            notes.append(f"budget {C:.3g}: {len(np.unique(x))} size(s), a parabola needs 3")
            continue
        c2, c1, c0 = np.polyfit(x, y, 2)
        if c2 <= 0:
            notes.append(f"budget {C:.3g}: the losses do not curve upwards in log N (no minimum)")
            continue
        xo = -c1 / (2 * c2)
        N = math.exp(xo)
        budgets.append({"C": C, "N_opt": N, "D_opt": C / float(fpt(N)), "loss_opt": float(c0 + c1 * xo + c2 * xo * xo),
                        "parabola": [float(c0), float(c1), float(c2)], "sizes": int(len(np.unique(x))),
                        "inside": bool(x.min() <= xo <= x.max())})
    out: Dict = {"budgets": budgets, "notes": notes, "a": None, "b": None}
    if len({b["C"] for b in budgets}) >= 2:
        lc = np.log([b["C"] for b in budgets])
        a, na = np.polyfit(lc, np.log([b["N_opt"] for b in budgets]), 1)
        b_, nb = np.polyfit(lc, np.log([b["D_opt"] for b in budgets]), 1)
        out.update(a=float(a), b=float(b_), N_coef=float(math.exp(na)), D_coef=float(math.exp(nb)))
    else:
        notes.append("exponents a, b need parabolas at 2 or more budgets")
    return out


# ---------------------------------------------------------------------------- per architecture
def _interval(samples: Sequence[float], level: float):
    if not samples:
        return None
    q = (1 - level) / 2
    lo, hi = np.quantile(np.asarray(samples), [q, 1 - q])
    return [float(lo), float(hi)]


def fit_table(t: Table, points: str = "final", n_bootstrap: int = 100, level: float = 0.95,
              budgets: Sequence[float] = (), seed: int = 0, delta: float = HUBER_DELTA,
              starts=DEFAULT_STARTS) -> Dict:
    """Both approaches for every architecture of the table; the JSON-ready result."""
    if points not in ("final", "all"):
        raise FitError(f"points must be 'final' or 'all', got {points!r}")
    result: Dict = {"method": {"law": "L(N, D) = E + A/N^alpha + B/D^beta",
                               "approach3": f"Huber (delta {delta}) in log space, L-BFGS from "
                                            + ("all 4500 points of Hoffmann's grid" if starts is None else
                                               f"the {starts} best of the 4500 points of Hoffmann's grid"),
                               "bootstrap": f"{n_bootstrap} resamples of runs, percentile intervals at {level:g}",
                               "points": points, "N": "non-embedding parameters"}, "archs": {}}
    for arch in sorted(set(t.arch.tolist())):
        ta = t.select(t.arch == arch)
        fpt = FlopsModel.from_table(ta)
        tf = ta.select(ta.final) if (points == "final" and ta.final is not None) else ta
        entry: Dict = {"points": int(len(tf)), "runs": int(len(np.unique(tf.run))) if tf.run is not None else None,
                       "flops_per_token": fpt.as_dict()}
        why = underdetermined(tf.params, tf.tokens)
        if len(tf) < 5:
            entry["error"] = f"{len(tf)} points: approach 3 needs at least 5"
        elif why is not None:
            entry["error"], entry["underdetermined"] = why, True
        else:
            p, fun, ranked = fit_parametric(tf.params, tf.tokens, tf.loss, delta, starts=starts, return_ranked=True)
            entry.update(p)
            entry.update(compute_optimal_exponents(p))
            entry["objective"] = fun
            entry["residual_rms"] = float(np.sqrt(np.mean((np.log(law(p, tf.params, tf.tokens)) - np.log(tf.loss)) ** 2)))
            boots = bootstrap(tf, ranked[0], ranked, n_bootstrap, seed=seed, delta=delta) if n_bootstrap else []
            entry["bootstrap_samples"] = len(boots)
            for k in PARAM_NAMES:
                entry[f"{k}_ci"] = _interval([b[k] for b in boots], level)
            ex = [compute_optimal_exponents(b) for b in boots]
            entry["a_ci"] = _interval([e["a"] for e in ex], level)
            entry["b_ci"] = _interval([e["b"] for e in ex], level)
            entry["compute_optimal"] = []
            for C in budgets:
                opt = optimal_allocation(p, C, fpt)
                bs = [optimal_allocation(b, C, fpt) for b in boots]
                opt.update(C=float(C), N_ci=_interval([x["N"] for x in bs], level),
                           D_ci=_interval([x["D"] for x in bs], level))
                entry["compute_optimal"].append(opt)
        ti = ta.select(ta.final) if ta.final is not None else ta
        entry["isoflop"] = fit_isoflop(ti, fpt)
        result["archs"][arch] = entry
    return result


def _fmt_ci(v, ci, f="{:.3g}"):
    return f.format(v) + ("" if ci is None else f" [{f.format(ci[0])}, {f.format(ci[1])}]")


def format_table(res: Dict) -> str:
    """The printed summary: one block per architecture."""
    lines = []
    for arch, e in res["archs"].items():
        lines.append(f"== {arch}: {e['points']} points" + (f" from {e['runs']} runs" if e.get("runs") else ""))
        if "error" in e:
            lines.append(f"  approach 3: not fitted, {e['error']}")
        else:
            lines.append("  approach 3 (parametric):  " + "  ".join(
                f"{k} {_fmt_ci(e[k], e[k + '_ci'])}" for k in PARAM_NAMES))
            lines.append(f"  compute-optimal exponents: a {_fmt_ci(e['a'], e['a_ci'])} (N_opt ∝ C^a), "
                         f"b {_fmt_ci(e['b'], e['b_ci'])} (D_opt ∝ C^b); residual rms {e['residual_rms']:.3g} (log loss)")
            for o in e.get("compute_optimal", []):
                lines.append(f"  budget {o['C']:.3g} FLOPs: N_opt {_fmt_ci(o['N'], o['N_ci'])}, "
                             f"D_opt {_fmt_ci(o['D'], o['D_ci'])} tokens, loss {o['loss']:.4g}"
                             + (" (at the edge of the search range: the fitted law has no optimum)"
                                if o.get("at_bound") else ""))
        iso = e["isoflop"]
        if iso["a"] is not None:
            lines.append(f"  approach 2 (isoFLOP, {len(iso['budgets'])} budgets): a {iso['a']:.3g}, b {iso['b']:.3g}")
        for b in iso["budgets"]:
            lines.append(f"    C {b['C']:.3g}: N_opt {b['N_opt']:.3g}, D_opt {b['D_opt']:.3g}, loss {b['loss_opt']:.4g}"
                         + ("" if b["inside"] else " (minimum outside the sizes trained)"))
        for n in iso["notes"]:
            lines.append(f"  approach 2: {n}")
    return "\n".join(lines)
