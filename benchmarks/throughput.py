"""Training throughput (tokens/s) and MFU of model presets.

    python benchmarks/throughput.py                         # configs/tiny.yaml on this machine
    python benchmarks/throughput.py configs/a.yaml configs/b.yaml --steps 20 --set train.micro_batch_size=4
    python benchmarks/throughput.py --record                # append the figures to benchmarks/RESULTS.md

Each preset runs forward + backward + AdamW on random tokens of [micro_batch_size, seq_len] in
one process (no DeepSpeed: this measures the model), after warm-up steps. MFU divides the
achieved training FLOPs (ttt_lm.model.flops, 3 × forward) by --peak-flops (default: the preset's
logging.peak_flops, else the GPU's dense bf16 peak from ttt_lm.train.metrics.PEAK_FLOPS); on a CPU
(no peak known: MFU is nan) pass the CPU's own peak if MFU should mean anything.
"""
from __future__ import annotations

import argparse
import datetime
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


def measure(path: str, overrides, steps: int, warmup: int, peak_flops=None, device=None) -> dict:
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
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = time.perf_counter() - t0
    tps = B * T * steps / dt
    fpt = flops_per_token(cfg.model, T)["train"]
    # --peak-flops, else logging.peak_flops, else the device's entry in the table (nan where unknown)
    peak = resolve_peak_flops(peak_flops or cfg.logging.peak_flops, dev)[0] or float("nan")
    return {"preset": os.path.relpath(path, ROOT), "params_M": model.num_params() / 1e6, "batch": f"{B}x{T}",
            "precision": cfg.train.precision, "tokens_per_s": tps, "train_GFLOP_per_token": fpt / 1e9,
            "achieved_GFLOP_s": tps * fpt / 1e9, "peak_TFLOP_s": peak / 1e12, "mfu": tps * fpt / peak,
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
    ap.add_argument("--record", action="store_true", help="append a section to benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    rows = [measure(p, a.set, a.steps, a.warmup, a.peak_flops, a.device) for p in a.presets]
    cols = ["preset", "params_M", "batch", "precision", "tokens_per_s", "achieved_GFLOP_s", "peak_TFLOP_s", "mfu"]
    fmt = {"params_M": "{:.2f}", "tokens_per_s": "{:.0f}", "achieved_GFLOP_s": "{:.2f}", "peak_TFLOP_s": "{:.1f}",
           "mfu": "{:.2e}"}
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(fmt.get(c, "{}").format(r[c]) for c in cols) + " |")
    table = "\n".join(lines)
    print(f"device: {rows[0]['device']}\n{table}")
    if a.record:
        cmd = "OMP_NUM_THREADS=%s python benchmarks/throughput.py %s" % (
            os.environ.get("OMP_NUM_THREADS", "(unset)"), " ".join(argv if argv is not None else sys.argv[1:]))
        sec = (f"\n## Training throughput (`benchmarks/throughput.py`)\n\n"
               f"- Date: {datetime.date.today().isoformat()}\n- Device: {rows[0]['device']}, {platform.machine()}\n"
               f"- Commit: {_commit()}\n- Command: `{cmd}`\n\n{table}\n")
        with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
            f.write(sec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
