"""Resume a DeepSpeed ZeRO checkpoint on another number of data-parallel ranks or another
tensor-parallel size.

DeepSpeed saves the optimizer as one file per ZeRO rank, each holding that rank's slice of the
fp32 master weights and of AdamW's moments: ZeRO 1/2 cut each parameter group's flat buffer into
equal contiguous partitions (``param_slice_mappings`` in each file says where each parameter's
piece lies), ZeRO-3 cuts every parameter into ``ceil(numel / world)`` pieces (the last padded),
laid out in ``param_shapes`` order. Its own loader needs the same partition count, and its
universal-checkpoint route (``ds_to_universal`` + ``load_universal``) refuses these checkpoints
(they lack the ``universal_checkpoint_info`` it asks for).

So the resharding is ours, in two steps:

- ``consolidate(ds_dir)`` reads every rank's file and rebuilds, per parameter name, the full fp32
  weight, ``exp_avg`` and ``exp_avg_sq`` (the same layout rules as DeepSpeed's ``zero_to_fp32``),
  plus AdamW's step count and the hyperparameters of each parameter group, the lr schedule and
  the engine's counters;
- ``apply(engine, state)`` writes them into a freshly built engine on the new world size: each
  rank copies the piece it now owns (``deepspeed.utils.safe_set_full_*`` under ZeRO 1/2, the
  partition of each parameter under ZeRO-3), then the working (module) weights are refreshed
  from the fp32 masters, as after an optimizer step.

A checkpoint of a tensor-parallel run (p > 1) holds p such sets of files, one per TP rank
(``…mp_rank_0r…``), each for that rank's slice of the model. ``consolidate_all`` consolidates each
and joins the slices along the dimension the checkpoint's ``partition_dims`` records for each
parameter (``ttt_lm.parallel.tensor_parallel.join_shards``; replicated ones, the norms' gains, from
TP rank 0): the single-rank model's full tensors, the AdamW moments joined alike (AdamW is
elementwise). ``tp_slice`` cuts them again for a run of another TP size, each parameter along the
dimension its ``partition_dim`` says, as ``parallelize_tp`` cut the weights.

Nothing is approximated: the values are copied, so a resumed run continues from bit-identical
weights and optimizer state; only the reduction order of the gradients differs with the rank
count (see ``docs/training.md``, "On another layout").
"""
from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Dict, List

import torch

from ttt_lm.parallel.tensor_parallel import join_shards
from ttt_lm.parallel.tp_model import split_spec
from ttt_lm.train.checkpoint import DS_TAG, CheckpointError, read_state

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - zip and pickle errors alike
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e


def optim_files(ds_dir: str, mp_rank: int = 0) -> List[str]:
    """The ZeRO optimizer files of one tensor-parallel rank, in data-parallel rank order."""
    found = {}
    for p in glob.glob(os.path.join(ds_dir, "*_optim_states.pt")):
        m = _OPTIM_RE.match(os.path.basename(p))
        if m and int(m.group(2)) == mp_rank:
            found[int(m.group(1))] = p
    if not found:
        raise CheckpointError(f"{ds_dir} holds no ZeRO optimizer file for tensor-parallel rank {mp_rank}")
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{ds_dir}: the ZeRO optimizer files of tensor-parallel rank {mp_rank} are for data-"
                              f"parallel ranks {sorted(found)}; some are missing")
    return [found[r] for r in range(len(found))]


def model_file(ds_dir: str, mp_rank: int = 0) -> str:
    for name in (f"mp_rank_{mp_rank:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"):
        if os.path.isfile(os.path.join(ds_dir, name)):
            return os.path.join(ds_dir, name)
    raise CheckpointError(f"{ds_dir} holds no model-states file for tensor-parallel rank {mp_rank}")


def _step_value(states: List[dict], where: str) -> torch.Tensor:
    steps = {float(s["step"]) for s in states if "step" in s}
    if len(steps) != 1:
        raise CheckpointError(f"{where}: the optimizer's parameter groups disagree on AdamW's step count ({steps})")
    return torch.tensor(steps.pop(), dtype=torch.float32)


def consolidate(ds_dir: str, mp_rank: int = 0) -> Dict[str, Any]:
    """Full per-parameter fp32 weights and AdamW moments from every rank's ZeRO file (see the
    module docstring): ``{"params": {name: {"fp32", "exp_avg", "exp_avg_sq"}}, "step",
    "param_groups", "lr_scheduler", "global_steps", "global_samples", "skipped_steps",
    "zero_stage", "dp_world", "buffers"}``."""
    files = optim_files(ds_dir, mp_rank)
    ms = _load(model_file(ds_dir, mp_rank))
    shapes = ms.get("param_shapes")
    if not shapes:
        raise CheckpointError(f"{ds_dir}: the model-states file records no parameter shapes")
    if ms.get("frozen_param_shapes"):
        raise CheckpointError(f"{ds_dir}: frozen parameters are not supported when changing the data-parallel size")
    sds = [_load(f)["optimizer_state_dict"] for f in files]
    world = len(sds)
    stage = int(sds[0]["zero_stage"])
    params: Dict[str, Dict[str, torch.Tensor]] = {}
    if stage == 3:
        base = [sd["optimizer_state_dict"] for sd in sds]
        for g, group_shapes in enumerate(shapes):
            flats = {"fp32": [sd["fp32_flat_groups"][g] for sd in sds],
                     **{k: [b["state"][g][k] for b in base] for k in OPTIM_KEYS}}
            offset = 0
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / world)
                params[name] = {k: torch.cat([f[offset:offset + part] for f in flat])[:numel].view(shape).clone()
                                for k, flat in flats.items()}
                offset += part
            if offset != flats["fp32"][0].numel():
                raise CheckpointError(f"{ds_dir}: ZeRO-3 group {g} holds {flats['fp32'][0].numel()} values per rank, "
                                      f"its parameters account for {offset}")
        step = _step_value([s for b in base for s in b["state"].values()], ds_dir)
        groups = base[0]["param_groups"]
    elif stage in (1, 2):
        base = [sd["base_optimizer_state"] for sd in sds]
        for g, group_shapes in enumerate(shapes):
            flats = {"fp32": [sd["single_partition_of_fp32_groups"][g] for sd in sds],
                     **{k: [b["state"][g][k] for b in base] for k in OPTIM_KEYS}}
            maps = [sd["param_slice_mappings"][g] for sd in sds]
            for name, shape in group_shapes.items():
                pieces = {k: [] for k in flats}
                for r in range(world):
                    a = maps[r].get(name)
                    if a is not None:
                        for k, flat in flats.items():
                            pieces[k].append(flat[r][a.start:a.start + a.numel])
                numel = math.prod(shape)
                got = sum(p.numel() for p in pieces["fp32"])
                if got != numel:
                    raise CheckpointError(f"{ds_dir}: the ZeRO shards hold {got} values of {name}, which has {numel}")
                params[name] = {k: torch.cat(v).view(shape).clone() for k, v in pieces.items()}
        step = _step_value([s for b in base for s in b["state"].values()], ds_dir)
        groups = base[0]["param_groups"]
    else:
        raise CheckpointError(f"{ds_dir}: ZeRO stage {stage} optimizer files cannot be resharded")
    buffers = {k: v for k, v in (ms.get("module") or {}).items() if k in set(ms.get("buffer_names") or [])}
    return {"params": params, "step": step, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                             for g in groups],
            "lr_scheduler": ms.get("lr_scheduler"), "global_steps": ms.get("global_steps", 0),
            "global_samples": ms.get("global_samples", 0), "skipped_steps": ms.get("skipped_steps", 0),
            "zero_stage": stage, "dp_world": world, "buffers": buffers}


def consolidate_all(ckpt: str) -> Dict[str, Any]:
    """``consolidate`` of every tensor-parallel rank of ``ckpt``, joined into the single-rank
    model's parameters (a checkpoint of tensor_parallel=1 is ``consolidate`` of its one rank)."""
    state = read_state(ckpt)
    tp = int(state.get("tensor_parallel", 1))
    ds_dir = os.path.join(ckpt, DS_TAG)
    if tp == 1:
        return consolidate(ds_dir, 0)
    dims = state.get("partition_dims")
    if dims is None:
        raise CheckpointError(f"{ckpt} was written with tensor_parallel={tp} but records no partition_dims: its "
                              "slices cannot be joined")
    parts = [consolidate(ds_dir, r) for r in range(tp)]
    params = {}
    for name, v in parts[0]["params"].items():
        if any(name not in p["params"] for p in parts):
            raise CheckpointError(f"{ckpt}: parameter {name} is missing from some tensor-parallel ranks' files")
        d, stride = split_spec(dims.get(name))
        params[name] = v if d is None else {
            k: join_shards([p["params"][name][k] for p in parts], d, stride).contiguous() for k in v}
    return dict(parts[0], params=params)


def tp_slice(full: torch.Tensor, dim, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """TP rank ``rank``'s slice of ``full`` (of ``size`` ranks) along ``dim`` (None: replicated),
    as ``parallelize_tp`` cuts a weight: chunks rank, rank + size, … of size × stride."""
    if dim is None or size == 1:
        return full
    n = full.shape[dim]
    if not isinstance(stride, int):     # fused parts of these sizes: each split in size chunks
        from ttt_lm.parallel.tensor_parallel import fused_parts
        parts = fused_parts(n, stride)
        if any(k % size for k in parts):
            raise CheckpointError(f"dimension {dim} of fused parts {parts} is not divisible by "
                                  f"tensor_parallel={size} part by part")
        return torch.cat([t.chunk(size, dim=dim)[rank] for t in full.split(parts, dim=dim)], dim=dim).clone()
    if n % (size * stride):
        raise CheckpointError(f"dimension {dim} of size {n} is not divisible by tensor_parallel={size}"
                              + (f" × {stride} fused parts" if stride > 1 else ""))
    return torch.cat(full.chunk(size * stride, dim=dim)[rank::size], dim=dim).clone()


def for_tp_rank(state: Dict[str, Any], module: torch.nn.Module, rank: int, size: int) -> Dict[str, Any]:
    """``consolidate_all``'s output with each parameter cut to TP rank ``rank``'s slice, by the
    ``partition_dim`` / ``partition_stride`` its parameter in ``module`` carries."""
    if size == 1:
        return state
    params = {}
    for name, p in module.named_parameters():
        v = state["params"].get(name)
        if v is None:
            continue  # apply() names what is missing
        d, stride = getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1)
        params[name] = {k: tp_slice(t, d, rank, size, stride) for k, t in v.items()}
    extra = {k: v for k, v in state["params"].items() if k not in params}
    return dict(state, params={**params, **extra})


def _named(engine) -> Dict[str, torch.nn.Parameter]:
    return {n: p for n, p in engine.module.named_parameters() if p.requires_grad}


@torch.no_grad()
def apply(engine, state: Dict[str, Any], ckpt: str) -> None:
    """Load ``consolidate``'s output into ``engine`` (built for the new world size). Collective."""
    opt = engine.optimizer
    named = _named(engine)
    missing, extra = sorted(set(named) - set(state["params"])), sorted(set(state["params"]) - set(named))
    if missing or extra:
        raise CheckpointError(f"cannot reshard {ckpt}: parameters missing from it {missing[:5]}, "
                              f"in it but not in the model {extra[:5]}")
    for name, p in named.items():
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        if tuple(state["params"][name]["fp32"].shape) != shape:
            raise CheckpointError(f"cannot reshard {ckpt}: {name} has shape "
                                  f"{tuple(state['params'][name]['fp32'].shape)} there and {shape} here")
    stage = engine.zero_optimization_stage()
    # the optimizer internals used below (DeepSpeed has no public setter for them)
    needs = (("_get_fp32_opt_state_partition", "_get_param_partition_rank", "fp32_partitioned_groups_flat",
              "fp16_partitioned_groups_flat", "fp16_partitioned_groups", "unflatten") if stage == 3 else
             ("single_partition_of_fp32_groups", "bit16_groups", "update_lp_params"))
    lacking = [a for a in needs if not hasattr(opt, a)]
    if lacking:
        import deepspeed
        raise CheckpointError(f"cannot reshard {ckpt}: DeepSpeed {deepspeed.__version__}'s ZeRO-{stage} optimizer "
                              f"({type(opt).__name__}) lacks {lacking}, which the resharding writes through")
    if stage == 3:
        _apply_stage3(opt, named, state)
    elif stage in (1, 2):
        from deepspeed.utils import (lazy_init_hp_params_optimizer_state, safe_set_full_fp32_param,
                                     safe_set_full_optimizer_state)
        # AdamW creates its state at its first step: create it here, with the checkpoint's step
        # count, and point each parameter's fragment map at it (as DeepSpeed does at that step)
        for g, flat in enumerate(opt.single_partition_of_fp32_groups):
            _init_state(opt.optimizer, flat, state["step"])
            lazy_init_hp_params_optimizer_state(opt.bit16_groups[g], flat, opt.optimizer.state)
        for name, p in named.items():
            v = state["params"][name]
            safe_set_full_fp32_param(p, v["fp32"].to(p.device))
            for k in OPTIM_KEYS:
                safe_set_full_optimizer_state(p, v[k].to(p.device), k)
        opt.update_lp_params()
    else:
        raise CheckpointError(f"cannot reshard {ckpt} into a ZeRO stage {stage} engine")
    _set_groups(opt.optimizer, state["param_groups"], ckpt)
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]
    if state["buffers"]:
        own = dict(engine.module.named_buffers())
        for k, v in state["buffers"].items():
            if k not in own or own[k].shape != v.shape:
                raise CheckpointError(f"cannot reshard {ckpt}: its buffer {k} {tuple(v.shape)} has no match in the "
                                      "model here")
            own[k].copy_(v.to(own[k].device))


def _init_state(optimizer, flat: torch.Tensor, step: torch.Tensor) -> None:
    st = optimizer.state[flat]
    for k in OPTIM_KEYS:
        st[k] = torch.zeros_like(flat)
    st["step"] = step.clone()


def _set_groups(optimizer, saved: List[dict], ckpt: str) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"cannot reshard {ckpt}: it has {len(saved)} optimizer parameter groups, the "
                              f"optimizer here {len(optimizer.param_groups)}")
    for g, s in zip(optimizer.param_groups, saved):
        for k, v in s.items():
            g[k] = v


def _apply_stage3(opt, named: Dict[str, torch.nn.Parameter], state: Dict[str, Any]) -> None:
    for fp32 in opt.fp32_partitioned_groups_flat:
        _init_state(opt.optimizer, fp32, state["step"])
    for name, p in named.items():
        v = state["params"][name]
        for key in (None, *OPTIM_KEYS):
            part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=True, optim_state_key=key)
            rank = opt._get_param_partition_rank(p)
            full = v["fp32" if key is None else key].flatten()
            piece = full[rank * part.numel():(rank + 1) * part.numel()]
            part.zero_()
            part[:piece.numel()].copy_(piece.to(part.device))
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            opt.fp16_partitioned_groups_flat[i].data.copy_(fp32.data)
    for i in range(len(opt.fp16_partitioned_groups_flat)):
        updated = opt.unflatten(opt.fp16_partitioned_groups_flat[i], opt.fp16_partitioned_groups[i])
        for partitioned, q in zip(opt.fp16_partitioned_groups[i], updated):
            partitioned.data = q.data


def load_resharded(engine, ckpt: str, tp_rank: int, tp_size: int = 1) -> Dict[str, Any]:
    """Collective: restore the engine from a checkpoint written on another number of
    data-parallel ranks or another tensor-parallel size, as TP rank ``tp_rank`` of ``tp_size``,
    and return the trainer state. RNG states are not restored (they are per rank): the caller
    seeds them."""
    state = read_state(ckpt)
    if int(state.get("tensor_parallel", 1)) == tp_size:  # the same slices: this rank's own files
        full = consolidate(os.path.join(ckpt, DS_TAG), tp_rank)
    else:
        full = for_tp_rank(consolidate_all(ckpt), engine.module, tp_rank, tp_size)
    apply(engine, full, ckpt)
    return state
