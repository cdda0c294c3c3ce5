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


def mfu(tokens_per_s: float, train_flops_per_token: float, peak_flops_per_device: Optional[float],
        n_devices: int) -> Optional[float]:
    """Model FLOPs utilization: achieved training FLOPs / (peak FLOPs of all devices); None when
    the peak is unknown."""
    if not peak_flops_per_device:
        return None
    return tokens_per_s * train_flops_per_token / (peak_flops_per_device * n_devices)


#: Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per device, matched against
#: ``torch.cuda.get_device_name`` in order (the first pattern that matches wins). Vendor datasheets
#: quote the sparse figure first; these are half of it. Sources:
#:   H100 SXM / PCIe / NVL, H800: NVIDIA H100 datasheet (1979 / 1513 / 1671 TFLOPS sparse);
#:   H200 SXM / NVL, GH200: NVIDIA H200 datasheet (1979 / 1671 sparse), GH200 datasheet;
#:   B200: NVIDIA Blackwell datasheet (4.5 PFLOPS sparse, as torchtitan's get_peak_flops);
#:   A100 (SXM and PCIe), A800: NVIDIA A100 datasheet (624 sparse);
#:   A10: NVIDIA A10 datasheet (250 sparse); A10G (AWS G5; NVIDIA publishes no sheet): 70 TFLOPS,
#:   as baseten.co's "NVIDIA A10 vs A10G" comparison gives it;
#:   L4 / L40S / L40: NVIDIA L4, L40S and L40 datasheets (242 / 733 / 362 sparse);
#:   A40: NVIDIA A40 datasheet (299.4 sparse); RTX 4090: NVIDIA Ada (AD102) whitepaper, BF16 with
#:   FP32 accumulate 165.2; RTX 3090: NVIDIA Ampere GA102 whitepaper, FP32 accumulate 71;
#:   V100 (no bf16: the fp16 tensor-core peak): V100 datasheet, SXM2 125, PCIe 112, V100S 130.
PEAK_FLOPS = (
    (r"\bH100\b.*\bNVL\b", 835e12), (r"\bH100\b.*\bPCIe\b", 756e12), (r"\bH100\b", 989e12), (r"\bH800\b", 989e12),
    (r"\bH200\b.*\bNVL\b", 835e12), (r"\b(GH200|H200)\b", 989e12), (r"\bB200\b", 2250e12),
    (r"\b(A100|A800)\b", 312e12), (r"\bA10G\b", 70e12), (r"\bA10\b", 125e12),
    (r"\bL40S\b", 362e12), (r"\bL40\b", 181e12), (r"\bL4\b", 121e12), (r"\bA40\b", 149.7e12),
    (r"\bRTX 4090\b", 165.2e12), (r"\bRTX 3090\b", 71e12),
    (r"\bV100S\b", 130e12), (r"\bV100\b.*\bPCIE\b", 112e12), (r"\bV100\b", 125e12),
)


def peak_flops_for(device_name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of the device called ``device_name`` (see PEAK_FLOPS), or None."""
    import re
    for pattern, flops in PEAK_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


def resolve_peak_flops(configured: Optional[float], device) -> Tuple[Optional[float], str]:
    """The per-device peak for MFU and where it came from: ``logging.peak_flops`` when set, else the
    table for the CUDA device's name; None (MFU not reported) on a CPU or an unlisted device."""
    if configured:
        return float(configured), "logging.peak_flops"
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no peak FLOP/s known for {device.type}; set logging.peak_flops to report MFU"
    name = torch.cuda.get_device_name(device)
    peak = peak_flops_for(name)
    if peak is None:
        return None, f"no peak FLOP/s known for {name!r}; set logging.peak_flops to report MFU"
    return peak, f"{name} (dense bf16)"


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


def git_commit(path: Optional[str] = None) -> Optional[str]:
    """The commit of the git checkout holding ``path`` (default: this package), with "-dirty" when
    tracked files differ from it; None outside a checkout or without git."""
    import subprocess
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def hparams_of(container: Dict[str, Any]) -> Dict[str, Any]:
    """A nested config flattened to ``{"model.d_model": 256, ...}`` with values TensorBoard's
    hparams accept (numbers, strings, bools); lists become their text, None is "None"."""
    out: Dict[str, Any] = {}
    for k, v in container.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in hparams_of(v).items()})
        elif isinstance(v, (bool, int, float, str)):
            out[k] = v
        else:
            out[k] = str(v)
    return out


class MetricsWriter:
    def __init__(self, run_dir: str, cfg, enabled: bool, start_step: int = 0,
                 restart: Optional[Dict[str, Any]] = None, run_info: Optional[Dict[str, Any]] = None):
        """``start_step``: the step this attempt continues from (see the module docstring);
        ``restart``: extra fields for the restart record (the checkpoint, changed settings);
        ``run_info``: what describes the run beyond its config (git commit, parameters, devices),
        logged with the resolved config to TensorBoard (text and hparams, at ``start_step``) and
        into the W&B run's config."""
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
            self._describe_run(cfg, run_info or {}, start_step)
        if cfg.logging.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logging.wandb=true needs the wandb package: pip install 'ttt-lm[wandb]'") from e
            from omegaconf import OmegaConf
            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_run_name,
                                    dir=run_dir, id=wandb_run_id(run_dir), resume="allow",
                                    config={**OmegaConf.to_container(OmegaConf.structured(cfg)),
                                            "run": dict(run_info or {})})

    def _describe_run(self, cfg, run_info: Dict[str, Any], step: int) -> None:
        """TensorBoard: the resolved config as YAML text, the run info as text, and both as hparams
        (HPARAMS tab; val/loss and train/loss are its metrics), in the run's own event file."""
        from omegaconf import OmegaConf
        from torch.utils.tensorboard.summary import hparams
        container = OmegaConf.to_container(OmegaConf.structured(cfg))
        indent = lambda text: "\n".join("    " + line for line in text.splitlines())  # noqa: E731 - markdown code
        self.tb.add_text("run/config", indent(OmegaConf.to_yaml(container)), step)
        self.tb.add_text("run/info", indent("\n".join(f"{k}: {v}" for k, v in run_info.items())), step)
        hp = {**hparams_of(container), **hparams_of({"run": dict(run_info)})}
        for summary in hparams(hp, {"val/loss": 0.0, "train/loss": 0.0}):
            self.tb.file_writer.add_summary(summary, step)
        self.tb.flush()

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
