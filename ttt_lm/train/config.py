"""Training sections of the experiment config: optimizer, loop, parallelism, checkpoints, evals,
logging."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: str = "cosine"            # cosine | wsd | constant
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    max_steps: int = 200
    micro_batch_size: int = 8
    grad_accum: int = 1
    precision: str = "fp32"             # fp32 | bf16
    seed: int = 0


@dataclass
class ParallelConfig:
    zero_stage: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    deepspeed_config: Optional[str] = None


@dataclass
class CheckpointConfig:
    every: int = 100
    keep_last: int = 3


@dataclass
class EvalConfig:
    every: int = 100
    batches: int = 8


@dataclass
class LoggingConfig:
    log_every: int = 10
    tensorboard: bool = True
    wandb: bool = False
    peak_flops: float = 989e12          # per device, for MFU (H100 SXM dense bf16)
