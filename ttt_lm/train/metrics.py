"""Where training metrics go: ``metrics.jsonl`` (one JSON object a line, every step and every
validation pass), TensorBoard events under ``tb/``, and optionally Weights & Biases. Rank 0 only.

A run that starts at step s (resumed from a checkpoint of step s, or fresh with s = 0) first
drops the records of steps after s that an earlier attempt wrote after its last checkpoint, and
appends a ``{"kind": "restart", "step": s, ...}`` record when anything came before: every step
appears once in metrics.jsonl, with the values of the attempt that the checkpoints continue.
TensorBoard's writer purges its events from step s + 1 on likewise. The W&B run id is kept in
``<run_dir>/wandb_run_id``, so every attempt of a run logs into the same W&B run."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
from typing import Any, Dict, Optional, Tuple

import torch


def memory_mb(device: str) -> Dict[str, float]:
    """Peak memory: max allocated on CUDA; on CPU the resident set size (now and peak)."""
    if device == "cuda":
        return {"mem_max_alloc_mb": torch.cuda.max_memory_allocated() / 2**20}
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["mem_rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["mem_peak_rss_mb"] = peak / (2**20 if sys.platform == "darwin" else 2**10)
    return out


def mfu(tokens_per_s: float, train_flops_per_token: float, peak_flops_per_device: float, n_devices: int) -> float:
    """Model FLOPs utilization: achieved training FLOPs / (peak FLOPs of all devices)."""
    return tokens_per_s * train_flops_per_token / (peak_flops_per_device * n_devices)


WANDB_ID_FILE = "wandb_run_id"


def truncate_metrics(path: str, step: int) -> Tuple[int, int]:
    """Drop the records of steps after ``step`` from a metrics.jsonl (atomically); returns
    (records kept, records dropped). Records without a step, and unreadable lines, are kept."""
    if not os.path.isfile(path):
        return 0, 0
    keep, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
                late = isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step
            except ValueError:
                late = False
            if late:
                dropped += 1
            elif line.strip():
                keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return len(keep), dropped


def wandb_run_id(run_dir: str) -> str:
    """The W&B run id of this run directory, created on first use."""
    p = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.isfile(p):
        with open(p) as f:
            rid = f.read().strip()
        if rid:
            return rid
    rid = uuid.uuid4().hex[:16]
    tmp = p + ".tmp"
    with open(tmp, "w") as f:
        f.write(rid + "\n")
    os.replace(tmp, p)
    return rid


class MetricsWriter:
    def __init__(self, run_dir: str, cfg, enabled: bool, start_step: int = 0,
                 restart: Optional[Dict[str, Any]] = None):
        """``start_step``: the step this attempt continues from (see the module docstring);
        ``restart``: extra fields for the restart record (the checkpoint, changed settings)."""
        self.enabled = enabled
        self.tb = self.wandb = None
        self.f = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        kept, dropped = truncate_metrics(self.path, start_step)
        self.f = open(self.path, "a", buffering=1)
        if kept or dropped or restart:
            self.f.write(json.dumps({"kind": "restart", "step": start_step, "dropped_records": dropped,
                                     "time": time.time(), **(restart or {})}) + "\n")
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1 if start_step else None)
        if cfg.logging.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb=true needs the wandb package: pip install 'ttt-lm[wandb]'") from e
            from omegaconf import OmegaConf
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_run_name,
                                    dir=run_dir, id=wandb_run_id(run_dir), resume="allow",
                                    config=OmegaConf.to_container(OmegaConf.structured(cfg)))

    def log(self, record: Dict[str, Any], step: Optional[int] = None) -> None:
        if not self.enabled:
            return
        self.f.write(json.dumps(record) + "\n")
        step = record.get("step", step)
        for k, v in record.items():
            if k in ("step", "kind") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            tag = f"{record.get('kind', 'train')}/{k}"
            if self.tb is not None:
                self.tb.add_scalar(tag, v, step)
        if self.wandb is not None:
            self.wandb.log({f"{record.get('kind', 'train')}/{k}": v for k, v in record.items()
                            if k not in ("step", "kind")}, step=step)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
