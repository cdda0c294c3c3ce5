"""AdamW parameter groups and learning-rate schedules.

Schedules are multipliers of ``optim.lr`` as a function of the optimizer step s (0-based), with a
linear warmup over W = ``warmup_steps`` steps and S = ``total_steps`` (default ``train.max_steps``):

    warmup            m(s) = (s + 1) / W                                      for s < W
    cosine            m(s) = r + (1 − r) · ½(1 + cos(π · (s − W) / (S − W)))
    wsd               m(s) = 1 until the last D = ⌈decay_fraction · S⌉ steps,
                      then linear from 1 to r            (warmup-stable-decay, Hu et al. 2024)
    constant          m(s) = 1

with r = ``min_lr_ratio``. The schedule is a ``LambdaLR`` that DeepSpeed steps after every applied
optimizer step, so its position is saved and restored with the engine's checkpoint.

On resume the checkpoint restores, besides that position, the optimizer's hyperparameters and
the schedule's base rates: ``optim.lr`` given anew would be recorded but not used.
``changed_hyperparameters`` lists what the new config changes and ``apply_hyperparameters`` puts
it in force from the resumed step on: base rate lr, so step s trains at lr · m(s) of the new m
(the schedule's shape always comes from the running config: its multiplier is a function, which
LambdaLR does not save), betas, eps and weight decay on the optimizer's parameter groups. The
optimizer's moments are kept.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from ttt_lm.train.config import SCHEDULES, OptimConfig  # noqa: F401 - SCHEDULES re-exported


def lr_multiplier(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    W, S, r = max(0, cfg.warmup_steps), max(1, total_steps), cfg.min_lr_ratio
    D = max(1, math.ceil(cfg.decay_fraction * S))

    def m(s: int) -> float:
        if s < W:
            return (s + 1) / W
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "cosine":
            p = min(1.0, (s - W) / max(1, S - W))
            return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
        start = max(W, S - D)  # wsd
        if s < start:
            return 1.0
        p = min(1.0, (s - start) / max(1, S - start))
        return 1.0 + (r - 1.0) * p

    return m


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: decayed matrices, and undecayed norms, biases, embeddings and any parameter
    marked ``_no_weight_decay`` (mixer decay rates, gates) — decaying those pulls them toward 0,
    which is not the prior they were initialized with. A model with ``weight_decay_every_parameter``
    (TTT-E2E, whose official AdamW decays every parameter) gets one decayed group."""
    if getattr(model, "weight_decay_every_parameter", False):   # a model whose official recipe decays all
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": params, "weight_decay": weight_decay}] if params else []
    no_decay = set()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            no_decay.update(id(p) for p in m.parameters(recurse=False))
    decay, keep = [], []
    for p in model.parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        if p.ndim < 2 or id(p) in no_decay or getattr(p, "_no_weight_decay", False):
            keep.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw_kwargs(device: Union[str, torch.device, None], offload: bool = False) -> dict:
    """How torch's AdamW runs for parameters on ``device``: ``{"fused": True}`` on a CUDA device
    (one fused kernel for every parameter's update instead of a launch per tensor op), ``{}``
    elsewhere (the default foreach/for-loop form) and when the optimizer state is offloaded to the
    host (``offload``: DeepSpeed ZeRO-Offload steps it on CPU tensors). Same update either way;
    the fused kernel rounds differently at float32's last bits."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return {"fused": True} if dev.type == "cuda" and not offload else {}


def param_device(model: nn.Module) -> Optional[torch.device]:
    """The device of the model's first trainable parameter (None without one)."""
    return next((p.device for p in model.parameters() if p.requires_grad), None)


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int):
    """torch AdamW (no CUDA extension needed; fused on CUDA, ``adamw_kwargs``) and its LambdaLR
    schedule."""
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            eps=cfg.eps, **adamw_kwargs(param_device(model)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(cfg, total_steps))
    return opt, sched


#: optim keys a resumed run takes from its config: every one (the checkpoint's only seed them)
RESUMABLE_KEYS = ("lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "schedule", "warmup_steps",
                  "min_lr_ratio", "decay_fraction", "total_steps")


def changed_hyperparameters(old: dict, new: OptimConfig, old_total: int, new_total: int) -> List[str]:
    """``["optim.lr: 0.003 -> 1e-05", ...]``: the optim keys whose value differs between a
    checkpoint's config (``old``, its ``optim`` section as a dict) and the running one, and the
    schedule's length (``optim.total_steps`` or ``train.max_steps``)."""
    out = [f"optim.{k}: {old[k]!r} -> {getattr(new, k)!r}" for k in RESUMABLE_KEYS
           if k in old and old[k] != getattr(new, k)]
    if old_total != new_total:
        out.append(f"schedule length (optim.total_steps or train.max_steps): {old_total} -> {new_total}")
    return out


def apply_hyperparameters(sched, cfg: OptimConfig, group_weight_decay: List[float]) -> None:
    """Put ``cfg``'s lr, betas, eps and weight decay in force on a restored optimizer and its
    LambdaLR (``sched``) at the schedule's current step: group i gets base rate ``cfg.lr``, lr
    ``cfg.lr · m_i(last_epoch)`` and weight decay ``group_weight_decay[i]`` (the groups of
    ``param_groups``, in order)."""
    opt = sched.optimizer
    if len(opt.param_groups) != len(group_weight_decay):
        raise ValueError(f"the optimizer has {len(opt.param_groups)} parameter groups, expected "
                         f"{len(group_weight_decay)}")
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)
    lrs = []
    for g, wd, m in zip(opt.param_groups, group_weight_decay, sched.lr_lambdas):
        g["initial_lr"] = cfg.lr
        g["lr"] = cfg.lr * m(sched.last_epoch)
        g["betas"] = (cfg.beta1, cfg.beta2)
        g["eps"] = cfg.eps
        g["weight_decay"] = wd
        lrs.append(g["lr"])
    sched._last_lr = lrs
