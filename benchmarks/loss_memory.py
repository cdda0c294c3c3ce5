"""Peak memory of the LM head + cross-entropy: the full-logits loss against the chunked one.

    python benchmarks/loss_memory.py                                  # 125M head, 1024 and 2048 tokens, fp32
    python benchmarks/loss_memory.py --tokens 4096 16384 --dtype bfloat16 --chunk 1024
    python benchmarks/loss_memory.py --record                         # its section of benchmarks/RESULTS.md becomes this run

The head of the 125M presets (D = 768, V = 50280) on hidden states [N, D] with random targets:
forward and backward of

    plain     F.cross_entropy of the float32 copy of the [N, V] logits (``model.loss_chunk_size=0``)
    chunked   ``ttt_lm.model.loss.linear_cross_entropy`` (``model.loss_chunk_size``, default 1024)

Each (variant, N) runs in a fresh process; the figure is the rise of the process's peak resident
memory (``ru_maxrss``) over what it held before the loss (h, W and the targets allocated, one small
warm-up call on a small head done), so it counts everything the loss allocates: logits, their
float32 copy, softmax, the gradients of h (N × D) and W (V × D) and any buffer. On a GPU the same rise is what the caching allocator
would have to hold at once.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D_125M, V_125M = 768, 50280


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def worker(variant: str, n: int, dtype: str, chunk: int, d: int, v: int) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import torch.nn.functional as F
    from ttt_lm.model.loss import linear_cross_entropy
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    # drawn in place: no temporary of W's size raises the peak before the count starts
    h = torch.empty(n, d, dtype=dt).normal_(0.0, 1.0, generator=g).requires_grad_()
    w = torch.empty(v, d, dtype=dt).normal_(0.0, 0.02, generator=g).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)

    def loss_of(hh, ww, yy):
        if variant == "plain":
            return F.cross_entropy((hh @ ww.t()).float(), yy, ignore_index=-100)
        return linear_cross_entropy(hh, ww, yy, chunk_size=chunk)

    # warm-up on a 64-word head: the libraries' own buffers are not the loss's, and nothing of the
    # real head's size (its gradient, the chunked loss's float32 ∂L/∂W) is allocated before the count
    w_small = w[:64].detach().clone().requires_grad_()
    loss_of(h[:16], w_small, y[:16] % 64).backward()
    h.grad = None
    del w_small
    before = _rss_mb()
    t0 = time.perf_counter()
    loss = loss_of(h, w, y)
    loss.backward()
    dt_s = time.perf_counter() - t0
    return {"variant": variant, "tokens": n, "dtype": dtype, "chunk": chunk if variant == "chunked" else None,
            "peak_rise_MB": _rss_mb() - before, "seconds": dt_s, "loss": float(loss)}


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048], help="N = micro-batch × seq_len")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="of h and W (bfloat16 matrix products are very slow on CPUs without bf16 units)")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked loss")
    ap.add_argument("--d-model", type=int, default=D_125M)
    ap.add_argument("--vocab", type=int, default=V_125M)
    ap.add_argument("--record", action="store_true", help="replace its section of benchmarks/RESULTS.md with this run")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]), a.dtype, a.chunk, a.d_model, a.vocab)))
        return 0
    rows = []
    for n in a.tokens:
        for variant in ("plain", "chunked"):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, str(n), "--dtype", a.dtype,
                   "--chunk", str(a.chunk), "--d-model", str(a.d_model), "--vocab", str(a.vocab)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{variant} at {n} tokens failed:\n{r.stderr}", file=sys.stderr)
                return 1
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    nv = 4 * a.vocab / 2 ** 20
    lines = ["| tokens N | variant | peak rise (MB) | N × V float32 (MB) | fwd+bwd wall (s) | loss |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = "plain (full float32 logits)" if r["variant"] == "plain" else f"chunked ({r['chunk']} tokens)"
        lines.append(f"| {r['tokens']} | {name} | {r['peak_rise_MB']:.0f} | {r['tokens'] * nv:.0f} | "
                     f"{r['seconds']:.1f} | {r['loss']:.4f} |")
    table = "\n".join(lines)
    device = f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    print(f"device: {device}; head D={a.d_model}, V={a.vocab}, {a.dtype}\n{table}")
    if a.record:
        cmd = "OMP_NUM_THREADS=%s python benchmarks/loss_memory.py %s" % (
            os.environ.get("OMP_NUM_THREADS", "(unset)"), " ".join(argv if argv is not None else sys.argv[1:]))
        body = (f"- Date: {datetime.date.today().isoformat()}\n- Device: {device}\n"
                f"- Commit: {_commit()}\n- Command: `{cmd}`\n"
                f"- Head of the 125M presets: D = {a.d_model}, V = {a.vocab}, {a.dtype} h and W; forward + backward; "
                "the rise of the process's peak resident memory (ru_maxrss) over what it held before the loss, "
                "one fresh process per row. The wall times come from a CPU shared with other jobs: not a speed "
                "figure.\n\n" + table + "\n")
        sys.path.insert(0, ROOT)
        from benchmarks.results_md import record_section

        record_section("## LM head + cross-entropy memory (`benchmarks/loss_memory.py`)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
