"""Plots of a loss table and its fit (PNG, matplotlib's Agg backend).

* ``loss_vs_flops.png``: validation loss against training compute, log-log, one colour per
  architecture; final losses as filled markers, intermediate ones small and faint; the fitted
  compute-optimal frontier L*(C) = min over N of L(N, C / f(N)) as a line, the fitted law along
  each trained size N as a dotted line; the fitted exponents in the legend (or, for an
  architecture whose points do not determine the law, "no fit, under-determined (2 model size(s))").
* ``isoflop.png``: one panel per architecture, loss against non-embedding parameters at each
  compute budget with the approach-2 parabola and its minimum; the exponents a, b in the title.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List

import numpy as np

from ttt_lm.scaling.fit import FlopsModel, Table, budget_groups, law, optimal_allocation


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _short(why: str) -> str:
    """``under-determined: 2 model size(s), A and alpha need at least 3 (...)`` → ``under-determined
    (2 model size(s))``: the legend's version of the fit's reason."""
    head, _, rest = why.partition(": ")
    counts = [part.split(",")[0].strip() for part in rest.split(" (")[0].split(";")]
    return f"{head} ({', '.join(counts)})" if rest else head


def loss_vs_flops(t: Table, res: Dict, path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    C_all = t.flops if t.flops is not None else 6.0 * t.params * t.tokens
    for i, arch in enumerate(sorted(set(t.arch.tolist()))):
        color = f"C{i}"
        m = t.arch == arch
        fin = t.final[m] if t.final is not None else np.ones(m.sum(), bool)
        C, L = C_all[m], t.loss[m]
        ax.scatter(C[~fin], L[~fin], s=8, color=color, alpha=0.3)
        e = res["archs"].get(arch, {})
        label = arch
        if "alpha" in e:
            label += f": α={e['alpha']:.2f}, β={e['beta']:.2f}, a={e['a']:.2f}, b={e['b']:.2f}"
            fpt = FlopsModel(**{k: e["flops_per_token"][k] for k in ("k", "gamma", "source")})
            Cs = np.logspace(math.log10(C.min()) - 0.3, math.log10(C.max()) + 0.3, 60)
            ax.plot(Cs, [optimal_allocation(e, c, fpt)["loss"] for c in Cs], color=color, lw=1.5)
            # the fitted law along each trained size: L(N, C / f(N)), dotted
            for N in np.unique(t.params[m][fin]):
                ax.plot(Cs, law(e, N, Cs / fpt(N)), color=color, lw=0.6, ls=":")
        elif e.get("underdetermined"):
            label += f": no fit, {_short(e['error'])}"
        ax.scatter(C[fin], L[fin], s=30, color=color, label=label, edgecolor="k", linewidth=0.5, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("validation loss (nats / token)")
    ax.set_title("loss vs compute; solid: fitted compute-optimal frontier, dotted: fit per size", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def isoflop(t: Table, res: Dict, path: str) -> str:
    plt = _plt()
    archs = sorted(set(t.arch.tolist()))
    fig, axes = plt.subplots(1, len(archs), figsize=(5.5 * len(archs), 4.5), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        m = (t.arch == arch) & (t.final if t.final is not None else True)
        iso = res["archs"].get(arch, {}).get("isoflop", {"budgets": [], "a": None})
        ta = t.select(m)
        C_a = ta.budget if ta.budget is not None else (ta.flops if ta.flops is not None else 6.0 * ta.params * ta.tokens)
        for j, g in enumerate(sorted(budget_groups(ta), key=lambda g: C_a[g].mean())):
            color = f"C{j}"
            C = float(np.exp(np.log(C_a[g]).mean()))
            fitted = [b for b in iso["budgets"] if abs(math.log(b["C"] / C)) < math.log(1.1)]
            ax.scatter(ta.params[g], ta.loss[g], color=color, s=25,
                       label=f"C = {C:.2g} FLOPs" + ("" if fitted else " (no parabola with a minimum)"))
            if not fitted:
                continue
            b = fitted[0]
            lx = np.log(ta.params[g])
            x = np.linspace(lx.min() - 0.2, lx.max() + 0.2, 50)
            c0, c1, c2 = b["parabola"]
            ax.plot(np.exp(x), c0 + c1 * x + c2 * x * x, color=color, lw=1)
            if b["inside"]:
                ax.scatter([b["N_opt"]], [b["loss_opt"]], marker="*", s=120, color=color, edgecolor="k", zorder=3)
            else:
                x0 = lx.min()
                ax.annotate(f"minimum outside the sizes (N_opt {b['N_opt']:.2g})", (math.exp(x0), c0 + c1 * x0 + c2 * x0 * x0),
                            fontsize=7, color=color, textcoords="offset points", xytext=(5, -12))
        title = arch
        if iso.get("a") is not None:
            title += f": N_opt ∝ C^{iso['a']:.2f}, D_opt ∝ C^{iso['b']:.2f}"
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("non-embedding parameters N")
        ax.set_ylabel("final validation loss (nats / token)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("isoFLOP profiles (approach 2): parabolas in log N, ★ = minimum")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(t: Table, res: Dict, out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    return [loss_vs_flops(t, res, os.path.join(out_dir, "loss_vs_flops.png")),
            isoflop(t, res, os.path.join(out_dir, "isoflop.png"))]
