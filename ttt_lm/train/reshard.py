"""Resume a DeepSpeed ZeRO checkpoint on another number of data-parallel ranks.

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

Nothing is approximated: the values are copied, so a resumed run continues from bit-identical
weights and optimizer state; only the reduction order of the gradients differs with the rank
count (see ``docs/training.md``, "On another number of data-parallel ranks").
"""
from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Dict, List

import torch

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


def load_resharded(engine, ckpt: str, mp_rank: int) -> Dict[str, Any]:
    """Collective: restore the engine from a checkpoint written on another number of
    data-parallel ranks and return the trainer state. RNG states are not restored (they are per
    rank): the caller seeds them."""
    state = read_state(ckpt)
    apply(engine, consolidate(os.path.join(ckpt, DS_TAG), mp_rank), ckpt)
    return state
