"""Training sections of the experiment config: optimizer, loop, parallelism, checkpoints, evals,
logging."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional


#: the learning-rate schedules ``ttt_lm.train.optim`` implements (optim.schedule)
SCHEDULES = ("cosine", "wsd", "constant")

@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1           # AdamW decoupled decay; never on norms, biases, embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0              # global L2 norm; 0 disables
    schedule: str = "cosine"            # cosine | wsd | constant (each after a linear warmup)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1           # final lr = min_lr_ratio · lr (cosine, wsd)
    decay_fraction: float = 0.2         # wsd: the last fraction of the steps decays linearly
    total_steps: Optional[int] = None   # length of the schedule; None = train.max_steps


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    max_steps: int = 200
    micro_batch_size: int = 8           # sequences per rank per micro-step
    grad_accum: int = 1                 # micro-steps per optimizer step
    # sequences per optimizer step over all data-parallel ranks; when set, grad_accum is derived
    # from it (global / (micro_batch_size × data-parallel ranks)), so a recipe's batch does not
    # depend on how many GPUs run it. A resumed run keeps the global batch it started with unless
    # this (or micro_batch_size / grad_accum) changes it (ttt_lm.train.checkpoint.resume)
    global_batch_size: Optional[int] = None
    precision: str = "fp32"             # fp32 | bf16
    seed: int = 0
    activation_checkpointing: bool = False  # recompute each block in the backward pass
    resume_from: Optional[str] = None   # a checkpoint dir (or a run dir); None = the run dir's newest
    init_from: Optional[str] = None     # an exported model dir whose weights start a new run
    stop_after: Optional[int] = None    # end this invocation after this step (schedule unchanged)
    max_nonfinite_steps: int = 5        # stop after this many non-finite losses in a row
    device: str = "auto"                # auto | cpu | cuda


@dataclass
class ParallelConfig:
    zero_stage: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    # groups of batch rows the state-passing blocks are pipelined over with context_parallel = c > 1:
    # rank r runs group i while rank r + 1 runs group i − 1; idle share (c − 1)/(M + c − 1); at most
    # train.micro_batch_size
    cp_pipeline_chunks: int = 1
    deepspeed_config: Optional[str] = None  # a DeepSpeed JSON to start from instead of the generated one


@dataclass
class CheckpointConfig:
    every: int = 100                    # steps between checkpoints (0: only at the end)
    keep_last: int = 3                  # complete checkpoints kept (0 keeps all)
    at_end: bool = True


@dataclass
class EvalConfig:
    every: int = 100                    # steps between validation passes (0: never)
    batches: int = 8                    # validation micro-batches per rank


@dataclass
class LoggingConfig:
    # steps between console lines (metrics.jsonl gets every step); also how often the steps' losses
    # are read from the device (ttt_lm.train.loop): the non-finite-loss stop and a preemption signal
    # are seen at those reads (0: no console lines, losses read every step)
    log_every: int = 10
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "ttt-lm"
    wandb_run_name: Optional[str] = None
    progress: bool = True               # tqdm bar on rank 0
    # per-device peak FLOP/s for MFU; None: looked up from the GPU's name (ttt_lm.train.metrics.PEAK_FLOPS,
    # dense bf16), and MFU is not reported where the device is not listed (CPUs included)
    peak_flops: Optional[float] = None


def check_training_config(cfg) -> None:
    """Refuse values no run can use, naming the key: ValueError("key: must be …, got …"). Called by
    ``ttt_lm.config.load_config`` (so train.py, slurm/submit.py and resumed runs all check) and by
    the trainer for configs built in Python."""
    t, o, c, e, lg = cfg.train, cfg.optim, cfg.checkpoint, cfg.eval, cfg.logging
    rules = [
        ("train.max_steps", t.max_steps, t.max_steps >= 1, ">= 1"),
        ("train.micro_batch_size", t.micro_batch_size, t.micro_batch_size >= 1, ">= 1"),
        ("train.grad_accum", t.grad_accum, t.grad_accum >= 1, ">= 1"),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps, t.max_nonfinite_steps >= 1, ">= 1"),
        ("train.stop_after", t.stop_after, t.stop_after is None or t.stop_after >= 1, ">= 1 (or null)"),
        ("train.precision", t.precision, t.precision in ("fp32", "bf16"), "fp32 or bf16"),
        ("train.device", t.device, t.device in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
        ("optim.lr", o.lr, o.lr > 0 and math.isfinite(o.lr), "a positive number"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
        ("optim.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, ">= 0 (0 disables clipping)"),
        ("optim.schedule", o.schedule, o.schedule in SCHEDULES, f"one of {list(SCHEDULES)}"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("optim.min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
        ("optim.decay_fraction", o.decay_fraction, 0 < o.decay_fraction <= 1, "in (0, 1]"),
        ("optim.total_steps", o.total_steps, o.total_steps is None or o.total_steps >= 1, ">= 1 (or null)"),
        ("checkpoint.every", c.every, c.every >= 0, ">= 0 (0: only at the end)"),
        ("checkpoint.keep_last", c.keep_last, c.keep_last >= 0, ">= 0 (0 keeps all)"),
        ("eval.every", e.every, e.every >= 0, ">= 0 (0: never)"),
        ("eval.batches", e.batches, e.batches >= 1, ">= 1"),
        ("logging.log_every", lg.log_every, lg.log_every >= 0, ">= 0"),
        ("logging.peak_flops", lg.peak_flops, lg.peak_flops is None or lg.peak_flops > 0, "> 0 (or null: detect)"),
    ]
    if cfg.model.compile and (cfg.parallel.tensor_parallel > 1 or cfg.parallel.context_parallel > 1):
        raise ValueError("model.compile=true is supported with parallel.tensor_parallel=1 and "
                         f"parallel.context_parallel=1 only (got {cfg.parallel.tensor_parallel} and "
                         f"{cfg.parallel.context_parallel}): their collectives inside the blocks are not traced; "
                         "set model.compile=false")
    for key, value, ok, want in rules:
        if not ok:
            raise ValueError(f"{key} must be {want}, got {value!r}")
    # model settings that a training run must also satisfy (a section's validate_training)
    for f in dataclasses.fields(cfg.model):
        check = getattr(getattr(cfg.model, f.name), "validate_training", None)
        if callable(check):
            check(cfg)
