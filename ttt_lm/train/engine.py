"""The DeepSpeed engine: its JSON config generated from ours (or read from
``parallel.deepspeed_config``), and ``deepspeed.initialize`` with torch's AdamW and our schedule."""
from __future__ import annotations

import json
from typing import Any, Dict

import torch

from ttt_lm.train.optim import build_optimizer, lr_multiplier, param_groups

#: keys of the DeepSpeed JSON that our config decides (a given file may not contradict them)
OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


class ParallelConfigError(ValueError):
    """A parallel layout this trainer cannot run."""


def check_parallel(cfg) -> None:
    p = cfg.parallel
    if p.tensor_parallel != 1:
        raise ParallelConfigError(
            f"parallel.tensor_parallel={p.tensor_parallel}: tensor parallelism is not available in the trainer "
            "yet; run with parallel.tensor_parallel=1 (data parallel + ZeRO shards the optimizer state, "
            "gradients and, with zero_stage=3, the parameters)")
    if p.context_parallel != 1 or p.sequence_parallel:
        raise ParallelConfigError(
            "parallel.context_parallel / parallel.sequence_parallel are not available in the trainer yet; "
            "set parallel.context_parallel=1 parallel.sequence_parallel=false")
    if p.zero_stage not in (1, 2, 3):
        raise ParallelConfigError(f"parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}")
    if cfg.train.precision not in ("fp32", "bf16"):
        raise ParallelConfigError(f"train.precision must be fp32 or bf16, got {cfg.train.precision!r}")


def deepspeed_config(cfg, dp_world: int) -> Dict[str, Any]:
    t, p = cfg.train, cfg.parallel
    ours: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * dp_world,
    }
    if p.deepspeed_config:
        with open(p.deepspeed_config) as f:
            ds = json.load(f)
        for k in OWNED_KEYS:
            if k in ds and ds[k] not in ("auto", ours[k]):
                raise ParallelConfigError(
                    f"{p.deepspeed_config}: {k}={ds[k]} contradicts the experiment config ({ours[k]}); "
                    "set it to \"auto\" or remove it, and use train.micro_batch_size / train.grad_accum")
        ds.update(ours)
        ds.setdefault("zero_allow_untested_optimizer", True)
        return ds
    ds = dict(ours)
    ds.update({
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        # torch's AdamW is not one of DeepSpeed's own optimizers; ZeRO shards it all the same.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    })
    if t.precision == "bf16":
        # check_grad_overflow: a non-finite gradient norm skips the step under bf16 too (as it
        # does in fp32), which is how the trainer skips non-finite losses.
        ds["bf16"] = {"enabled": True, "check_grad_overflow": True}
    if p.zero_stage == 3:
        ds["zero_optimization"].update({"stage3_gather_16bit_weights_on_model_save": False})
    return ds


def build_engine(model: torch.nn.Module, cfg, dp_world: int):
    """deepspeed.initialize → (engine, lr_scheduler). An mpu is passed only when the data-parallel
    group is not the whole world (tensor/context parallel), which check_parallel refuses for now."""
    import deepspeed

    check_parallel(cfg)
    total = cfg.optim.total_steps or cfg.train.max_steps
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    mult = lr_multiplier(cfg.optim, total)
    engine, _, _, sched = deepspeed.initialize(
        model=model, optimizer=opt, config=deepspeed_config(cfg, dp_world),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, mult))
    return engine, sched


__all__ = ["build_engine", "deepspeed_config", "check_parallel", "ParallelConfigError", "build_optimizer"]
