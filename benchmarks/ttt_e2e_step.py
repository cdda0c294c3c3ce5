"""Time and memory per token of a TTT-E2E training step (forward + the second-order backward)
against its sliding-window baseline at the same size, each preset in a fresh process.

    OMP_NUM_THREADS=1 python benchmarks/ttt_e2e_step.py                      # the tiny presets, CPU
    python benchmarks/ttt_e2e_step.py --pairs ttt_e2e_125m:ttt_e2e_swa_125m --device cuda --batch 1

Per preset: the model in float32 (bf16 autocast on CUDA), a [batch, data.seq_len] batch of random
tokens, one warm-up step, then ``--steps`` timed steps (``loss.backward()``, no optimizer). Memory:
on CUDA the peak allocated bytes of a step; on the CPU (no allocator statistics) the bytes of the
storages the forward saves for the backward (``saved_tensors_hooks``; under remat the checkpoints'
inputs), not the backward's own peak. ``--record`` writes the table into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(preset: str, device: str, batch: int, steps: int, seq_len: int = 0) -> dict:
    import torch

    from ttt_lm.config import load_config
    from ttt_lm.model.lm import LM

    cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"))
    T = seq_len or cfg.data.seq_len
    torch.manual_seed(0)
    model = LM(cfg.model).to(device).train()
    x = torch.randint(0, cfg.model.vocab_size, (batch, T + 1), device=device)
    inp, lab = x[:, :-1], x[:, 1:]
    amp = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    def step():
        with amp:
            loss = model(inp, labels=lab).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        loss = model(inp, labels=lab).loss        # what the forward keeps for the backward
    kept = sum(saved.values())
    del loss
    step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    mem = torch.cuda.max_memory_allocated() if device == "cuda" else kept
    tokens = batch * T
    return {"preset": preset, "seq_len": T, "batch": batch, "s_per_step": dt, "us_per_token": 1e6 * dt / tokens,
            "mem_bytes": mem, "params": model.num_params()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="tiny_ttt_e2e:tiny_ttt_e2e_swa", help="e2e:baseline preset pairs, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=0, help="0: the preset's data.seq_len")
    ap.add_argument("--one", help="measure this one preset in this process and print its row as JSON")
    ap.add_argument("--json", help="with --one: also write the row to this file")
    ap.add_argument("--record", action="store_true", help="write the table into benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    if a.one:
        row = measure(a.one, a.device, a.batch, a.steps, a.seq_len)
        print(json.dumps(row))
        if a.json:
            Path(a.json).write_text(json.dumps(row))
        return 0
    rows = []
    for pair in a.pairs.split(","):
        e2e, base = pair.split(":")
        res = {}
        for p in (e2e, base):
            out = subprocess.run([sys.executable, __file__, "--one", p, "--device", a.device, "--batch", str(a.batch),
                                  "--steps", str(a.steps), "--seq-len", str(a.seq_len)],
                                 capture_output=True, text=True, check=True, cwd=ROOT)
            res[p] = json.loads(out.stdout.strip().splitlines()[-1])
        r, b = res[e2e], res[base]
        rows.append(f"| {e2e} vs {base} | {r['seq_len']} × {r['batch']} | {r['us_per_token']:.1f} / {b['us_per_token']:.1f} "
                    f"| {r['us_per_token'] / b['us_per_token']:.2f} | {r['mem_bytes'] / 2**20:.0f} / {b['mem_bytes'] / 2**20:.0f} "
                    f"| {r['mem_bytes'] / max(b['mem_bytes'], 1):.2f} |")
    table = ("| presets | T × batch | µs per token (E2E / baseline) | time ratio | memory MiB (E2E / baseline: CUDA peak, CPU saved for backward) "
             "| memory ratio |\n| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    print(table)
    if a.record:
        from benchmarks.results_md import record_section
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        body = (f"A training step (forward and the second-order backward, no optimizer) of TTT-E2E against its "
                f"sliding-window baseline at the same size, each in a fresh process; {a.steps} timed steps after one "
                f"warm-up.\n\n- Date: {time.strftime('%Y-%m-%d')}\n- Device: {a.device} ({os.cpu_count()} CPU cores)\n- Commit: {commit}\n"
                f"- Command: `OMP_NUM_THREADS=1 python benchmarks/ttt_e2e_step.py --pairs {a.pairs} --device {a.device} "
                f"--batch {a.batch} --steps {a.steps} --record`\n\n" + table)
        record_section("## TTT-E2E training step (`benchmarks/ttt_e2e_step.py`)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
