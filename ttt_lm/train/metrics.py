"""Where training metrics go: ``metrics.jsonl`` (one JSON object a line, every step and every
validation pass), TensorBoard events under ``tb/``, and optionally Weights & Biases. Rank 0 only."""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Dict, Optional

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


class MetricsWriter:
    def __init__(self, run_dir: str, cfg, enabled: bool):
        self.enabled = enabled
        self.tb = self.wandb = None
        self.f = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.f = open(self.path, "a", buffering=1)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
        if cfg.logging.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb=true needs the wandb package: pip install 'ttt-lm[wandb]'") from e
            from omegaconf import OmegaConf
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_run_name,
                                    dir=run_dir, resume="allow",
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
