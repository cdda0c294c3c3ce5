"""How the cost of each recurrent mixer's PyTorch form grows with the sequence length.

For every recurrent mixer of the registry (the kinds that do not attend, ``Mixer.attends``: TTT-Linear,
TTT-MLP, Titans with linear and with MLP memory, DeltaNet, Gated DeltaNet, Mamba, RG-LRU; a kind's
``variants`` are rows of their own, ``titans_linear`` and ``titans_mlp``), built at d_model 256 with 4 heads and its config's chunk size, forward+backward of
one sequence of T tokens through the mixer's chunked PyTorch form (``kernel_backend="torch"``) is
timed at T = 2k, 4k, 8k on the CPU, and the slope of log(time) against log(T) is fitted by least
squares. A form whose cost is linear in T has slope 1; a chunk loop whose backward allocates a
full-length gradient per chunk (slicing inside the loop) grows quadratically and shows a slope
well above 1. Goal: slope ≤ 1.15 for every mixer.

``lact_op`` times the LaCT op itself (``kernels.lact``, backend "torch": d_model / heads wide
heads, momentum on, chunks of 256 so that the share of tokens in written chunks, all but the
last chunk, stays within 7/8 … 31/32 over the lengths; ``--lact-chunk`` changes it), not the mixer
(whose sliding-window attention, ``ttt_lm.model.window_attention``, is its own O(T·w) path). The op's cost is affine in T (every chunk but the last is written), so
its line is followed by the time per written chunk at each length, which is flat when the cost is
linear, and by the slope the written chunks' count alone gives (1.07 for chunks of 256), then by
the minor page faults of a run at each length (median over the rounds): when glibc's malloc hands
the freed activations back to the OS between runs, the next run faults them in again and its
time grows by the kernel's work, not the op's (the op allocates the same elements per written
chunk at every length: ``tests/kernels/test_lact_op.py``), and by the CPU time of the timing
thread (user and system, ``getrusage``) with its slope: unlike the wall time it does not count
the time the thread waits while other processes hold the cores of a shared machine. The faults
are glibc's: the longest length needs more memory than the others, and malloc returns it to the
OS (heap trim, munmap) after each of its runs. So the benchmark runs itself again with
``MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_MMAP_THRESHOLD_=33554432`` in its environment, which
keeps the heap between runs as a caching allocator (CUDA's, in training) does, and measures the
op rather than the kernel's page faults; ``--system-malloc`` measures with glibc's defaults.

The lengths are timed in interleaved rounds (each round times every length once, a different
length first each round) and each figure is the median over the rounds: a change of the load
during a run then moves every length alike.

    python benchmarks/chunk_scaling.py                       # every mixer, T = 2048 4096 8192
    python benchmarks/chunk_scaling.py --mixers mamba --seq-lens 1024 2048 --reps 1

Figures go to ``benchmarks/RESULTS.md`` with date, device, commit and command. On a shared CPU
the absolute times move with the load; the slope within one run is what the benchmark is for.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

try:
    import resource   # POSIX: the page faults of a run
except ImportError:   # pragma: no cover
    resource = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: glibc malloc settings that keep freed memory in the heap between runs (module docstring)
KEEP_HEAP = {"MALLOC_TRIM_THRESHOLD_": "17179869184", "MALLOC_MMAP_THRESHOLD_": "33554432"}

#: the LaCT op's row: no layer kind, the op's settings
LACT_OP = {"chunk_size": 256}


def mixers() -> dict:
    """Row name → (layer kind, settings of its config section): every built-in kind that does not
    attend (``Mixer.attends``), one row per entry of its ``variants`` (``<kind>_<variant>``) or one
    for the kind as configured; then ``lact_op`` (the LaCT op alone, no kind)."""
    from ttt_lm.model.registry import builtin_kinds, mixer_class
    out = {}
    for kind in builtin_kinds():
        cls = mixer_class(kind)
        if cls.attends:
            continue
        for name, sub in (cls.variants.items() if cls.variants else [(None, {})]):
            out[kind if name is None else f"{kind}_{name}"] = (kind, dict(sub))
    out["lact_op"] = (None, dict(LACT_OP))
    return out


class LaCTOp(torch.nn.Module):
    """The LaCT op on x [B, T, D] cut into heads (q = k = x per head, L2-normalised, v = x),
    per-token learning rates and momentum from x; its initial fast weights are parameters."""

    def __init__(self, d_model: int, n_heads: int, chunk_size: int):
        super().__init__()
        self.h, self.e, self.chunk_size = n_heads, d_model // n_heads, chunk_size
        e = self.e
        self.w0, self.w1, self.w2 = (torch.nn.Parameter(torch.randn(n_heads, e, e) / e ** 0.5) for _ in range(3))
        self.lr = torch.nn.Linear(d_model, 4 * n_heads)

    def forward(self, x):
        from kernels.lact import block_causal_lact_swiglu
        B, T, D = x.shape
        xh = x.view(B, T, self.h, self.e).transpose(1, 2)
        qk = torch.nn.functional.normalize(xh, dim=-1)
        r = self.lr(x).view(B, T, self.h, 4).permute(3, 0, 2, 1)
        lr0, lr1, lr2 = (torch.nn.functional.softplus(r[i] - 6.9) for i in range(3))
        o, _ = block_causal_lact_swiglu(qk, qk, xh, lr0, lr1, lr2, self.w0, self.w1, self.w2,
                                        chunk_size=self.chunk_size, momentum=torch.sigmoid(r[3]))
        return o.transpose(1, 2).reshape(B, T, D), None


def build(name: str, d_model: int, n_heads: int, seed: int = 0, lact_chunk: int = 0):
    if name == "lact_op":
        kind, sub = None, dict(LACT_OP)
    else:
        table = mixers()
        if name not in table:
            raise ValueError(f"chunk_scaling: unknown mixer row {name!r}; known: {list(table)}")
        kind, sub = table[name]
    if kind is None:
        if lact_chunk:
            sub = dict(sub, chunk_size=lact_chunk)
        torch.manual_seed(seed)
        return LaCTOp(d_model, n_heads, **sub)
    from ttt_lm.model.config import ModelConfig   # the mixers only (lact_op needs kernels/ alone)
    from ttt_lm.model.layers import init_weights
    from ttt_lm.model.mixers import build_mixer, mixer_class
    cfg = ModelConfig(vocab_size=64, d_model=d_model, n_layers=1, n_heads=n_heads, layer_pattern=[kind])
    for k, v in sub.items():
        setattr(getattr(cfg, mixer_class(kind).config_section), k, v)
    cfg.validate()
    torch.manual_seed(seed)
    m = build_mixer(kind, cfg, 0)
    init_weights(m, cfg.init_std, 1)
    m.reset_parameters()
    m.impl = "chunked"
    m.kernel_backend = "torch"
    return m


def fwd_bwd(m, T: int, d_model: int):
    """A function running forward + backward of one [1, T, d_model] sequence through ``m``."""
    x = torch.randn(1, T, d_model, requires_grad=True)
    w = torch.randn(1, T, d_model)

    def once():
        m.zero_grad(set_to_none=True)
        x.grad = None
        y, _ = m(x)
        (y * w).sum().backward()
    return once


def _usage():
    """(CPU seconds of this thread, user + system; minor page faults of the process) or None."""
    if resource is None:
        return None
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    t, p = resource.getrusage(who), resource.getrusage(resource.RUSAGE_SELF)
    return t.ru_utime + t.ru_stime, p.ru_minflt


def time_lengths(m, lengths, d_model: int, reps: int, usage: Optional[dict] = None) -> List[float]:
    """Median seconds of forward + backward at each length, over ``reps`` rounds that each time
    every length once (after one warm-up of each): interleaved rounds, so that a change of the
    machine's load during the run moves every length alike instead of one length's figure.
    ``usage``, if given, receives per length the median CPU seconds ("cpu") and minor page faults
    ("faults") of a run."""
    runs = [fwd_bwd(m, T, d_model) for T in lengths]
    for once in runs:
        once()
    out = [[] for _ in lengths]
    use = [[] for _ in lengths]
    for r in range(reps):
        order = list(range(len(lengths)))
        order = order[r % len(order):] + order[:r % len(order)]   # each length leads some round
        for i in order:
            u0, t0 = _usage(), time.perf_counter()
            runs[i]()
            out[i].append(time.perf_counter() - t0)
            u1 = _usage()
            if u0 is not None:
                use[i].append((u1[0] - u0[0], u1[1] - u0[1]))
    if usage is not None and all(use):
        usage["cpu"] = [statistics.median(c for c, _ in u) for u in use]
        usage["faults"] = [statistics.median(f for _, f in u) for u in use]
    return [statistics.median(o) for o in out]


def loglog_slope(lengths, times) -> float:
    """Least-squares slope of log(time) against log(T)."""
    xs = [math.log(t) for t in lengths]
    ys = [math.log(s) for s in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rows = list(mixers())
    p.add_argument("--mixers", nargs="*", default=rows, choices=rows)
    p.add_argument("--seq-lens", nargs="*", type=int, default=[2048, 4096, 8192])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--goal", type=float, default=1.15)
    p.add_argument("--lact-chunk", type=int, default=LACT_OP["chunk_size"],
                   help="the LaCT op's chunk size (lact_op)")
    p.add_argument("--system-malloc", action="store_true",
                   help="keep glibc's malloc defaults (default: run again with the heap kept between runs)")
    a = p.parse_args(argv)
    if len(a.seq_lens) < 2:
        p.error("--seq-lens needs at least two lengths to fit a slope")
    if argv is None and not a.system_malloc and any(os.environ.get(k) != v for k, v in KEEP_HEAP.items()):
        # from the command line only: an in-process caller keeps its own process
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:],
                  dict(os.environ, **KEEP_HEAP))
    heap = "glibc defaults" if not all(os.environ.get(k) == v for k, v in KEEP_HEAP.items()) else "heap kept"

    print(f"# CPU, {torch.get_num_threads()} thread(s), float32, d_model {a.d_model}, heads {a.heads}, "
          f"batch 1; forward+backward seconds (median of {a.reps} interleaved rounds after one warm-up); malloc: {heap}")
    print("| mixer | " + " | ".join(f"T={t}" for t in a.seq_lens) + " | log-log slope | ≤ goal |")
    print("|---|" + "---|" * len(a.seq_lens) + "---|---|")
    worst = 0.0
    for name in a.mixers:
        m = build(name, a.d_model, a.heads, lact_chunk=a.lact_chunk)
        usage: dict = {}
        times = time_lengths(m, a.seq_lens, a.d_model, a.reps, usage)
        s = loglog_slope(a.seq_lens, times)
        worst = max(worst, s)
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in times) + f" | {s:.2f} | "
              f"{'yes' if s <= a.goal else 'no'} |", flush=True)
        if name == "lact_op":   # every chunk but the last is written: the cost is affine in T
            per = [t / max(1, math.ceil(T / a.lact_chunk) - 1) for t, T in zip(times, a.seq_lens)]
            print(f"#   lact_op per written chunk of {a.lact_chunk}: " + ", ".join(f"{x * 1e3:.1f} ms" for x in per)
                  + f" (slope of the written chunks' count alone: "
                  f"{loglog_slope(a.seq_lens, [math.ceil(T / a.lact_chunk) - 1 for T in a.seq_lens]):.2f})")
            if usage:
                print("#   lact_op minor page faults per run: " + ", ".join(f"{f:.0f}" for f in usage["faults"]))
                print("#   lact_op CPU seconds of the timing thread: " + ", ".join(f"{c:.3f}" for c in usage["cpu"])
                      + f" (slope {loglog_slope(a.seq_lens, usage['cpu']):.2f})")
    print(f"# largest slope {worst:.2f} (goal ≤ {a.goal})")


if __name__ == "__main__":
    main()
