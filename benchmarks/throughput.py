"""Training throughput (tokens/s) and MFU of model presets.

    python benchmarks/throughput.py                         # configs/tiny.yaml on this machine
    python benchmarks/throughput.py configs/a.yaml configs/b.yaml --steps 20 --set train.micro_batch_size=4
    python benchmarks/throughput.py --record                # its section of benchmarks/RESULTS.md becomes this run

Each preset runs forward + backward + AdamW on random tokens of [micro_batch_size, seq_len] in
one process (no DeepSpeed: this measures the model), after warm-up steps. MFU divides the
achieved training FLOPs (ttt_lm.model.flops, 3 × forward) by --peak-flops (default: the preset's
logging.peak_flops, else the GPU's dense bf16 peak from ttt_lm.train.metrics.PEAK_FLOPS); on a CPU
(no peak known: MFU is nan) pass the CPU's own peak if MFU should mean anything. On CUDA it also
reports the peak memory allocated (GiB), the warm-up's seconds (with ``--set model.compile=true``
the compilation is in them), and with ``--profile-top N`` the N CUDA kernels that take the most
time in one more step (torch.profiler). ``--json FILE`` writes every figure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from ttt_lm.config import load_config  # noqa: E402
from ttt_lm.model import LM  # noqa: E402
from ttt_lm.model.flops import flops_per_token  # noqa: E402
from ttt_lm.train.metrics import resolve_peak_flops  # noqa: E402
from ttt_lm.train.optim import adamw_kwargs, param_groups  # noqa: E402


def profile_step(step, dev, top: int) -> dict:
    """The ``top`` CUDA kernels by their own time in one call of ``step`` (torch.profiler): name,
    calls, milliseconds, share of all CUDA kernel time in the step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(dev)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t and str(getattr(e, "device_type", "")).endswith("CUDA"):
            rows.append({"name": e.key, "calls": e.count, "ms": t / 1e3})
    total = sum(r["ms"] for r in rows)
    rows.sort(key=lambda r: -r["ms"])
    for r in rows:
        r["pct"] = 100 * r["ms"] / total if total else 0.0
    return {"total_ms": total, "kernels": rows[:top]}


def measure(path: str, overrides, steps: int, warmup: int, peak_flops=None, device=None, profile_top: int = 0) -> dict:
    cfg = load_config(path, overrides)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model = LM(cfg.model).to(dev).train()
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if cfg.model.compile:  # --set model.compile=true: the warm-up steps include the compilation
        model.compile_blocks(cfg.model.compile_backend)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr, **adamw_kwargs(dev))
    B, T = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]
    bf16 = cfg.train.precision == "bf16"

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    tw = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - tw   # with model.compile=true: the compilation is in here
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = time.perf_counter() - t0
    peak_mem = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else float("nan")
    prof = profile_step(step, dev, profile_top) if profile_top and dev.type == "cuda" else None
    tps = B * T * steps / dt
    fpt = flops_per_token(cfg.model, T)["train"]
    # --peak-flops, else logging.peak_flops, else the device's entry in the table (nan where unknown)
    peak = resolve_peak_flops(peak_flops or cfg.logging.peak_flops, dev)[0] or float("nan")
    return {"preset": os.path.relpath(path, ROOT), "params_M": model.num_params() / 1e6, "batch": f"{B}x{T}",
            "precision": cfg.train.precision, "tokens_per_s": tps, "train_GFLOP_per_token": fpt / 1e9,
            "achieved_GFLOP_s": tps * fpt / 1e9, "peak_TFLOP_s": peak / 1e12, "mfu": tps * fpt / peak,
            "peak_GiB": peak_mem, "warmup_s": warmup_s, "compile": bool(cfg.model.compile), "profile": prof,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
            f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"}


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets", nargs="*", default=[os.path.join(ROOT, "configs", "tiny.yaml")])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-flops", type=float, default=None, help="per-device peak FLOP/s for MFU")
    ap.add_argument("--device", default=None)
    ap.add_argument("--record", action="store_true", help="replace its section of benchmarks/RESULTS.md with this run")
    ap.add_argument("--json", default=None, help="write the rows (and the profile) to this JSON file")
    ap.add_argument("--profile-top", type=int, default=0,
                    help="after the timed steps, profile one more step and report its N slowest CUDA kernels")
    a = ap.parse_args(argv)
    rows = [measure(p, a.set, a.steps, a.warmup, a.peak_flops, a.device, a.profile_top) for p in a.presets]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, default=str)
    cols = ["preset", "params_M", "batch", "precision", "tokens_per_s", "achieved_GFLOP_s", "peak_TFLOP_s", "mfu",
            "peak_GiB"]
    fmt = {"params_M": "{:.2f}", "tokens_per_s": "{:.0f}", "achieved_GFLOP_s": "{:.2f}", "peak_TFLOP_s": "{:.1f}",
           "mfu": "{:.2e}", "peak_GiB": "{:.2f}"}
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(fmt.get(c, "{}").format(r[c]) for c in cols) + " |")
    table = "\n".join(lines)
    print(f"device: {rows[0]['device']}\n{table}")
    for r in rows:
        if r["profile"]:
            print(f"\n{r['preset']}: the {len(r['profile']['kernels'])} CUDA kernels taking the most time in one step "
                  f"(of {r['profile']['total_ms']:.1f} ms)")
            for k in r["profile"]["kernels"]:
                print(f"  {k['ms']:8.2f} ms {k['pct']:5.1f}% {k['calls']:5d}x  {k['name'][:120]}")
    if a.record:
        cmd = "OMP_NUM_THREADS=%s python benchmarks/throughput.py %s" % (
            os.environ.get("OMP_NUM_THREADS", "(unset)"), " ".join(argv if argv is not None else sys.argv[1:]))
        from benchmarks.results_md import record_section

        record_section("## Training throughput (`benchmarks/throughput.py`)",
                       f"- Date: {datetime.date.today().isoformat()}\n- Device: {rows[0]['device']}, {platform.machine()}\n"
                       f"- Commit: {_commit()}\n- Command: `{cmd}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
