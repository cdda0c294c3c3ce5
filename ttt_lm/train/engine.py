"""The DeepSpeed engine: its JSON config generated from ours (or read from
``parallel.deepspeed_config``), and ``deepspeed.initialize`` with torch's AdamW and our schedule.

Parallel layouts (``check_parallel``): data parallel with ZeRO 1/2/3, optionally combined with
Megatron tensor parallelism (``parallel.tensor_parallel`` = p ranks per model replica, for models
whose mixers all declare a ``tp_plan``: ``ttt_lm.parallel.tp_model.tp_ready_kinds``) and its
sequence parallelism. With p > 1
the batch size counts the data-parallel ranks (world / p) and DeepSpeed gets the ``mpu`` of
``ttt_lm.parallel.groups``, so ZeRO reduces and shards over the data-parallel group only.
Context parallelism (``parallel.context_parallel`` = c > 1): each row's tokens split across c
ranks (``ttt_lm.parallel.cp_model``); the loaders are split over world / (c · p) data-parallel
ranks and DeepSpeed's gradient-averaging group (the mpu's) is the dp × c ranks holding the same TP
slice; ZeRO-1, 2 or 3 (ZeRO-3's module hooks removed: the CP LM gathers its parameters itself,
``ttt_lm.parallel.cp_model``). With TP as well (p > 1, no sequence parallelism) world = dp × c × p.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

import torch

from ttt_lm.parallel.tp_model import layout_errors, split_errors
from ttt_lm.train.optim import adamw_kwargs, build_optimizer, lr_multiplier, param_device, param_groups

#: keys of the DeepSpeed JSON that our config decides (a given file may not contradict them)
OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


class ParallelConfigError(ValueError):
    """A parallel layout this trainer cannot run."""


def check_parallel(cfg, world_size: Optional[int] = None) -> None:
    """Refuse, before any process group exists, a parallel layout this trainer cannot run.
    ``world_size`` (when known) must be a multiple of ``parallel.tensor_parallel``."""
    p = cfg.parallel
    tp = p.tensor_parallel
    if tp < 1:
        raise ParallelConfigError(f"parallel.tensor_parallel must be >= 1, got {tp}")
    cp = p.context_parallel
    if cp < 1:
        raise ParallelConfigError(f"parallel.context_parallel must be >= 1, got {cp}")
    M = p.cp_pipeline_chunks
    if M < 1 or (M > 1 and cp == 1) or M > cfg.train.micro_batch_size:
        raise ParallelConfigError(
            f"parallel.cp_pipeline_chunks={M}: must be >= 1, at most train.micro_batch_size="
            f"{cfg.train.micro_batch_size} (it splits each micro-batch's rows into that many groups), and 1 "
            f"unless parallel.context_parallel > 1 (got {cp})")
    if cp > 1:
        if p.sequence_parallel:
            raise ParallelConfigError(
                f"parallel.context_parallel={cp} with parallel.sequence_parallel=true: the context-parallel forward "
                "does not split its slice again along the tensor-parallel group; set parallel.sequence_parallel=false "
                "(tensor parallelism itself combines with context parallelism)")
        if world_size is not None and world_size % (cp * tp):
            raise ParallelConfigError(
                f"parallel.context_parallel={cp}" + (f" × parallel.tensor_parallel={tp}" if tp > 1 else "")
                + f" does not divide the world size {world_size}")
        if cfg.data.seq_len < cp:
            raise ParallelConfigError(
                f"parallel.context_parallel={cp} splits each row across {cp} ranks: data.seq_len={cfg.data.seq_len} "
                "must be at least that (every rank needs a token)")
        if cfg.train.activation_checkpointing:
            raise ParallelConfigError(
                "train.activation_checkpointing=true is not available with parallel.context_parallel > 1 (the "
                "context-parallel forward does not recompute blocks: its collectives would run twice); set "
                "train.activation_checkpointing=false (each rank holds only 1/context_parallel of the activations)")
    if p.sequence_parallel and tp == 1:
        raise ParallelConfigError(
            "parallel.sequence_parallel=true needs parallel.tensor_parallel > 1: it splits the sequence across "
            "the tensor-parallel group between its regions")
    if tp > 1:
        m = cfg.model
        if world_size is not None and world_size % tp:
            raise ParallelConfigError(
                f"parallel.tensor_parallel={tp} does not divide the world size {world_size}")
        # the model's own rules (TP-ready kinds, head counts, …) live with the TP model; each
        # kind's split counts (RG-LRU gate blocks, Mamba's d_inner, …) with its plan
        errs = layout_errors(m, tp, p.sequence_parallel) or split_errors(m, tp)
        if errs:
            raise ParallelConfigError("; ".join(errs))
        if p.sequence_parallel and cfg.data.seq_len % tp:
            raise ParallelConfigError(
                f"parallel.sequence_parallel splits each sequence across tensor_parallel={tp} ranks: "
                f"data.seq_len={cfg.data.seq_len} must be a multiple of it")
        if m.reset_at_doc_boundaries and p.sequence_parallel:
            raise ParallelConfigError(
                "model.reset_at_doc_boundaries=true is not available with parallel.sequence_parallel=true (each "
                "document piece would be split across the tensor-parallel ranks); set parallel.sequence_parallel=false "
                "(tensor parallelism itself runs with document resets)")
    if p.zero_stage not in (1, 2, 3):
        raise ParallelConfigError(f"parallel.zero_stage must be 1, 2 or 3, got {p.zero_stage}")


def _micro_batches_that_fit(G: int, dp_world: int) -> list:
    """The micro-batch sizes with which ``dp_world`` ranks make a global batch of ``G``, largest first."""
    if G < 1 or G % dp_world:
        return []
    per_rank = G // dp_world
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def resolve_grad_accum(t, dp_world: int) -> int:
    """``train.grad_accum``, or, with ``train.global_batch_size`` = G set, G / (micro × dp_world),
    which must be a whole number (a given grad_accum other than 1 must equal it)."""
    if t.global_batch_size is None:
        return t.grad_accum
    G, per_step = t.global_batch_size, t.micro_batch_size * dp_world
    if G < 1 or G % per_step:
        fits = [m for m in _micro_batches_that_fit(G, dp_world) if m <= t.micro_batch_size][:1]
        raise ParallelConfigError(
            f"train.global_batch_size={G} is not a multiple of train.micro_batch_size={t.micro_batch_size} x "
            f"{dp_world} data-parallel rank(s) = {per_step}; "
            + (f"train.micro_batch_size={fits[0]} works (grad_accum {G // dp_world // fits[0]}), or change the "
               "number of GPUs" if fits else
               f"set train.global_batch_size to a multiple of {dp_world} (the data-parallel ranks), or change the "
               "number of GPUs"))
    if t.grad_accum not in (1, G // per_step):
        raise ParallelConfigError(
            f"train.grad_accum={t.grad_accum} contradicts train.global_batch_size={G} (which needs grad_accum "
            f"{G // per_step} with micro_batch_size {t.micro_batch_size} on {dp_world} data-parallel rank(s)); "
            "set one of them")
    return G // per_step


def keep_global_batch(t, dp_world: int, G: int) -> Optional[str]:
    """A resumed run keeps its global batch ``G`` on ``dp_world`` data-parallel ranks (Megatron's
    global batch): ``train.grad_accum`` becomes G / (micro × dp_world), and where the micro-batch
    does not divide G / dp_world, the micro-batch shrinks to the largest size that does. Sets
    ``t.global_batch_size``, ``t.micro_batch_size`` and ``t.grad_accum`` (saved with the config: the
    values used); returns the line that says a changed micro-batch, else None. ParallelConfigError
    (one line, naming an override that works) where ``dp_world`` does not divide G."""
    fits = _micro_batches_that_fit(G, dp_world)
    if not fits:
        near = max(dp_world, G // dp_world * dp_world)
        raise ParallelConfigError(
            f"the run's global batch of {G} sequences cannot be split over {dp_world} data-parallel rank(s) "
            f"({G} is not a multiple of {dp_world}): run it on a number of ranks that divides {G}, or set "
            f"train.global_batch_size={near} to change it")
    micro = next(m for m in fits if m <= t.micro_batch_size)
    note = None
    if micro != t.micro_batch_size:
        note = (f"keeping the run's global batch of {G} sequences on {dp_world} data-parallel rank(s): "
                f"train.micro_batch_size {t.micro_batch_size} -> {micro}, grad_accum {G // dp_world // micro} "
                "(set train.global_batch_size to change the global batch)")
    t.global_batch_size, t.micro_batch_size, t.grad_accum = G, micro, G // dp_world // micro
    return note


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
        zo = ds.get("zero_optimization", {})
        if p.context_parallel > 1 and (zo.get("stage", 0) not in (1, 2, 3) or zo.get("overlap_comm", False)):
            raise ParallelConfigError(
                f"{p.deepspeed_config}: parallel.context_parallel={p.context_parallel} needs zero_optimization "
                f"stage 1, 2 or 3 without overlap_comm (got {zo}): overlapped reduction is not tested with it")
        if p.context_parallel > 1:
            zo.setdefault("overlap_comm", False)  # ZeRO-3 would default to True
            ds["zero_optimization"] = zo
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
        if p.context_parallel > 1:
            ds["zero_optimization"]["overlap_comm"] = False  # as with ZeRO-1/2 (ZeRO-3 defaults to True)
    return ds


def gathers_zero3_parameters(model) -> bool:
    """Whether a model gathers its own parameters under ZeRO-3 (its class attribute
    ``gathers_zero3_parameters``, with ``release_parameters`` called after each backward): TTT-E2E,
    whose inner step reads and differentiates parameters outside their modules' forward."""
    return bool(getattr(model, "gathers_zero3_parameters", False))


def _explicit_zero3_gathering(engine) -> None:
    """ZeRO-3 with context parallelism: remove the engine's module hooks, which gather and release
    each module's parameters around its forward and backward (collectives that the CP ranks would
    reach at different times: a state-passing rank waits for its predecessor's state while that one
    waits in the gather). The context-parallel LM gathers every parameter itself, once per forward
    (``ContextParallelLM.forward``); gradients still reach ZeRO-3's reduce-scatter through its
    gradient hooks, in the fixed order of the gated parameters. The same for a model that gathers its
    own parameters (``gathers_zero3_parameters``: TTT-E2E)."""
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None:
        raise ParallelConfigError(
            f"ZeRO-3 with context parallelism or TTT-E2E: the DeepSpeed optimizer {type(engine.optimizer).__name__} has no "
            "parameter_offload whose module hooks could be removed; use parallel.zero_stage 1 or 2")
    offload.destroy()


def offloads_optimizer(ds: Dict[str, Any]) -> bool:
    """Whether a DeepSpeed config moves the optimizer state off the GPU (ZeRO-Offload)."""
    off = ds.get("zero_optimization", {}).get("offload_optimizer") or {}
    return str(off.get("device", "none")).lower() not in ("none", "")


def build_engine(model: torch.nn.Module, cfg, dp_world: int, mpu=None):
    """deepspeed.initialize → (engine, lr_scheduler). The optimizer is torch's AdamW, fused when
    the parameters are on a CUDA device and the optimizer is not offloaded (``adamw_kwargs``):
    DeepSpeed's ZeRO wraps it as it does any client optimizer, and its own FusedAdam (a CUDA
    extension built at first use) is not needed. ``dp_world`` is DeepSpeed's data-parallel size,
    the ranks that average gradients: world / tensor_parallel (= data parallel × context parallel);
    ``mpu`` (``ParallelGroups.mpu()``) is given when tensor_parallel or context_parallel > 1, so
    DeepSpeed reduces gradients and shards ZeRO state over that group only and counts TP-sharded
    parameters once per shard in the clipping norm. The layout was checked before any process
    group existed (``check_parallel``, called by the trainer)."""
    import deepspeed

    total = cfg.optim.total_steps or cfg.train.max_steps
    ds = deepspeed_config(cfg, dp_world)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                            **adamw_kwargs(param_device(model), offload=offloads_optimizer(ds)))
    mult = lr_multiplier(cfg.optim, total)
    engine, _, _, sched = deepspeed.initialize(
        model=model, optimizer=opt, config=ds, mpu=mpu,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, mult))
    if cfg.parallel.zero_stage == 3 and (cfg.parallel.context_parallel > 1 or gathers_zero3_parameters(model)):
        _explicit_zero3_gathering(engine)
    return engine, sched


__all__ = ["build_engine", "deepspeed_config", "gathers_zero3_parameters", "check_parallel", "ParallelConfigError", "build_optimizer"]
