"""Convert a built single-rank LM, in place, into its Megatron tensor-parallel form.

Per block (p = tensor-parallel size, r = this rank):

* the mixer: as its own declaration says (``Mixer.tp_plan``, a ``TPPlan``): column- and
  row-parallel projections, depthwise convs and per-head parameters sliced by heads, norms over
  all heads whose statistics span the group (``tp_layer_norm``: two all-reduces of one number per
  token), values shared by all heads whose gradient is all-reduced (f), head counts divided by p.
  Heads are independent, so the mixer's own code then runs unchanged on its n_heads/p heads (its
  decode state holds only the local heads too). attention layers split q, k, v by heads (rank r holds
  query heads r·H/p … and KV heads r·H_kv/p …, so each query head keeps its KV head under GQA);
  TTT-Linear and TTT-MLP split like it, with their per-head inner weights, θ_η, b_η and inner
  LayerNorm sliced, their post-norm spanning the group and τ (shared by all heads) replicated.
  A plan can also name row-parallel layers whose summed output every rank's heads read
  (``row_to_heads``: all-reduced in forward and backward, e.g. an SSM's x_proj producing dt/B/C
  for all channels), modules with parameters shared by every head (``shared_modules``: their
  gradients summed), weights whose split dimension fuses several parts (``fused``: each part split
  by heads, Megatron's partition_stride), and replicated modules after a composite mixer's branch
  sums (``sequence_region``: gradients summed only with sequence parallelism, where each rank sees
  T/p tokens). Plan names may be dotted paths into submodules.
* GatedMLP: gate_proj and up_proj column-parallel, down_proj row-parallel.
* embedding and LM head vocab-parallel (a tied head keeps sharing the embedding's shard); the
  loss is ``vocab_parallel_cross_entropy``, so full logits are never formed in training.
* the norms (mixer_norm, mlp_norm, the final norm) are where activations enter a TP region:
  their output goes through f (copy, all-reduce of the gradient), or with sequence parallelism
  through f̄ (all-gather of the sequence), once for all the column-parallel linears that read it.
  With sequence parallelism the embedding output, the residual stream and the norms hold T/p
  tokens per rank, and the norms' gains get their gradient all-reduced over the group.
* a block's pre-conv (``Mixer.block_pre_conv``) reads the residual stream, so it is replicated;
  it is refused with sequence parallelism (a causal conv over a T/p shard would miss the previous
  shard's last tokens).

Every sharded weight is a slice of the single-rank weight (``partition_dim`` on the parameter
says which dimension, ``partition_stride`` how many fused parts it was cut from one by one), so
``gather_full_state_dict`` rebuilds the single-rank state dict.

TP-ready layer kinds: those whose mixer declares a plan (``TP_READY_KINDS``: every built-in kind;
a model with a layer whose mixer declares none is refused before any change). A plan with
``sequence_parallel=False`` refuses sequence parallelism the same way (no built-in kind's does).
A mixer that reads a row-parallel sum over the whole sequence (``row_full_sequence``: g even with
sequence parallelism) hands this rank's T/p tokens of its output to the block through
``sequence_split`` hooks (split forward, all-gather backward).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from ttt_lm.model.config import ModelConfig
from ttt_lm.model.layers import GatedMLP, RMSNorm, acc
from ttt_lm.model.lm import LM, LMOutput
from ttt_lm.model.mixers import Mixer, mixer_class
from ttt_lm.model.mixers.base import TPPlan
from ttt_lm.model.registry import builtin_kinds
from ttt_lm.parallel.groups import ParallelGroups
from ttt_lm.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding, _all_gather, _mark, _shard,
    join_shards, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region, tp_layer_norm, vocab_parallel_cross_entropy)


def tp_ready_kinds(cfg: Optional[ModelConfig] = None) -> tuple:
    """The layer kinds whose mixer declares a tensor-parallel plan (for ``cfg``; default config
    when None), among every kind registered now."""
    from ttt_lm.model.registry import layer_kinds
    cfg = cfg if cfg is not None else ModelConfig()
    return tuple(k for k in layer_kinds() if mixer_class(k).tp_plan(cfg) is not None)


#: the built-in TP-ready layer kinds
TP_READY_KINDS = tuple(k for k in tp_ready_kinds() if k in builtin_kinds())


class RegionEntryRMSNorm(RMSNorm):
    """RMSNorm whose output enters the tensor-parallel region: f (no sequence parallelism) or
    f̄ (all-gather of the T/p sequence shards). The gain is replicated on every rank."""

    def __init__(self, dim: int, eps: float, ctx: TPContext):
        super().__init__(dim, eps)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, sp = self.ctx.group, self.ctx.sequence_parallel
        # with sequence parallelism this rank sees T/p tokens: the gain's gradient is a partial sum
        w = copy_to_tensor_parallel_region(self.weight, g) if sp else self.weight
        xf = acc(x)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * acc(w)).to(x.dtype)
        return gather_from_sequence_parallel_region(y, g) if sp else copy_to_tensor_parallel_region(y, g)


def _entry_norm(norm: RMSNorm, ctx: TPContext) -> RegionEntryRMSNorm:
    m = RegionEntryRMSNorm(norm.weight.shape[0], norm.eps, ctx)
    m.weight = norm.weight
    m.weight.sequence_parallel = True  # Megatron's marker: replicated, gradient summed over the group
    return m


class GroupLayerNorm(nn.Module):
    """A LayerNorm over features split across the TP group (``TPPlan.group_norms``): this rank's
    slice of the gain and bias, mean and variance over every rank's features (``tp_layer_norm``)."""

    def __init__(self, norm: nn.LayerNorm, ctx: TPContext):
        super().__init__()
        if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
            raise TypeError(f"TPPlan.group_norms: expected an nn.LayerNorm with gain and bias, got {type(norm).__name__}")
        self.ctx = ctx
        self.eps = norm.eps
        self.weight = _shard_param(norm.weight, 0, ctx)
        self.bias = _shard_param(norm.bias, 0, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_layer_norm(x, self.weight, self.bias, self.eps, self.ctx.group)


class SharedAcrossHeads(nn.Module):
    """f on a value every head uses (``TPPlan.shared``): identity forward, its gradient summed
    over the group (each rank's gradient covers its own heads)."""

    def __init__(self, ctx: TPContext):
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tensor_parallel_region(x, self.ctx.group)


class SequenceSplit(nn.Module):
    """A mixer output computed over the whole sequence on every rank (``TPPlan.sequence_split``):
    with sequence parallelism this rank's T/p tokens (the gradient all-gathered back), else as is."""

    def __init__(self, ctx: TPContext):
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence_parallel_region(x, self.ctx.group) if self.ctx.sequence_parallel else x


class SharedParamsModule(nn.Module):
    """A module whose parameters every head uses (``TPPlan.shared_modules``): it runs as before,
    its parameters replicated and passed through f (gradient summed over the group). The
    parameters keep their names (``o_norm.weight``). ``only_sequence_parallel``
    (``TPPlan.sequence_region``): f only when sequence parallelism splits the tokens it sees."""

    def __init__(self, inner: nn.Module, ctx: TPContext, only_sequence_parallel: bool = False):
        super().__init__()
        self.only_sequence_parallel = only_sequence_parallel
        if any(True for _ in inner.children()):
            raise TypeError(f"TPPlan.shared_modules: {type(inner).__name__} has submodules; name a module "
                            "that holds its parameters directly")
        object.__setattr__(self, "inner", inner)  # not a submodule: its parameters are registered here
        self.ctx = ctx
        for n, prm in list(inner.named_parameters(recurse=False)):
            self.register_parameter(n, prm)

    def forward(self, *args, **kw):
        g = self.ctx.group
        if self.only_sequence_parallel and not self.ctx.sequence_parallel:
            return self.inner(*args, **kw)  # replicated activations: every rank's gradient is the full one
        params = {n: copy_to_tensor_parallel_region(prm, g) for n, prm in self.named_parameters(recurse=False)}
        return torch.func.functional_call(self.inner, params, args, kw)


def _shard_param(p: nn.Parameter, dim: int, ctx: TPContext, stride: int = 1) -> nn.Parameter:
    """This rank's slice of ``p`` as a new parameter that keeps ``p``'s own flags (e.g.
    ``_no_weight_decay``, which the optimizer's parameter groups read: a slice that lost it would be
    decayed under TP and not in one process)."""
    q = nn.Parameter(_shard(p, dim, ctx, stride), requires_grad=p.requires_grad)
    for k, v in vars(p).items():
        setattr(q, k, v)
    return _mark(q, dim, stride)


def _shard_conv(conv: nn.Conv1d, ctx: TPContext, stride: int = 1) -> nn.Conv1d:
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels:
        raise TypeError(f"TPPlan.channel_convs: expected a depthwise nn.Conv1d, got {conv!r}")
    c = conv.in_channels // ctx.world_size
    m = nn.Conv1d(c, c, conv.kernel_size[0], groups=c, bias=conv.bias is not None,
                  device=conv.weight.device, dtype=conv.weight.dtype)
    m.weight = _shard_param(conv.weight, 0, ctx, stride)
    if conv.bias is not None:
        m.bias = _shard_param(conv.bias, 0, ctx, stride)
    return m


def _owner(mx: nn.Module, name: str):
    """(the module holding a plan entry, its last name): a dotted name reaches a submodule."""
    *path, last = name.split(".")
    obj = mx
    for n in path:
        obj = getattr(obj, n)
    return obj, last


def _get(mx: nn.Module, name: str):
    obj, last = _owner(mx, name)
    return getattr(obj, last)


def _set(mx: nn.Module, name: str, value) -> None:
    obj, last = _owner(mx, name)
    setattr(obj, last, value)


def _has(mx: nn.Module, name: str) -> bool:
    try:
        _get(mx, name)
    except AttributeError:
        return False
    return True


def _parallelize_mixer(mx: Mixer, plan: TPPlan, ctx: TPContext) -> None:
    """Apply ``plan`` to ``mx`` in place (see ``TPPlan``)."""
    p = ctx.world_size
    stride = dict(plan.fused)
    for name in plan.column:
        _set(mx, name, ColumnParallelLinear.from_linear(_get(mx, name), ctx, stride=stride.get(name, 1),
                                                        input_in_region=True))
    for name in plan.row:
        _set(mx, name, RowParallelLinear.from_linear(_get(mx, name), ctx, input_is_parallel=True))
    for name in plan.row_to_heads:
        _set(mx, name, RowParallelLinear.from_linear(_get(mx, name), ctx, input_is_parallel=True,
                                                     output_to_heads=True))
    for name in plan.row_full_sequence:
        _set(mx, name, RowParallelLinear.from_linear(_get(mx, name), ctx, input_is_parallel=True,
                                                     full_sequence=True))
    for name in plan.channel_convs:
        _set(mx, name, _shard_conv(_get(mx, name), ctx, stride.get(name, 1)))
    for name in plan.head_params:
        _set(mx, name, _shard_param(_get(mx, name), 0, ctx, stride.get(name, 1)))
    for name in plan.group_norms:
        _set(mx, name, GroupLayerNorm(_get(mx, name), ctx))
    for name in plan.shared:
        if not isinstance(_get(mx, name), nn.Identity):
            raise TypeError(f"TPPlan.shared: {type(mx).__name__}.{name} must be an nn.Identity hook")
        _set(mx, name, SharedAcrossHeads(ctx))
    for name in plan.sequence_split:
        if not isinstance(_get(mx, name), nn.Identity):
            raise TypeError(f"TPPlan.sequence_split: {type(mx).__name__}.{name} must be an nn.Identity hook")
        _set(mx, name, SequenceSplit(ctx))
    for name in plan.shared_modules:
        _set(mx, name, SharedParamsModule(_get(mx, name), ctx))
    for name in plan.sequence_region:
        _set(mx, name, SharedParamsModule(_get(mx, name), ctx, only_sequence_parallel=True))
    for name in plan.head_counts:
        _set(mx, name, _get(mx, name) // p)


_PLAN_FIELDS = ("column", "row", "channel_convs", "head_params", "group_norms", "shared", "head_counts",
                "row_to_heads", "shared_modules", "sequence_region", "row_full_sequence", "sequence_split")


def _check_plan(i: int, mx: Mixer, plan: TPPlan, p: int) -> None:
    """Refuse a plan that names what the mixer does not have, or a head count that p does not
    divide, before anything is converted."""
    where = f"layer {i} ({mx.layer_kind}): {type(mx).__name__}.tp_plan"
    missing = [n for f in _PLAN_FIELDS for n in getattr(plan, f) if not _has(mx, n)]
    if missing:
        raise ValueError(f"{where} names attribute(s) the mixer does not have: {missing}")
    splittable = set(plan.column) | set(plan.channel_convs) | set(plan.head_params)
    bad = [n for n, k in plan.fused if n not in splittable or not _part_spec_ok(k)]
    if bad:
        raise ValueError(f"{where}: fused names {bad}, which must be column, channel_convs or head_params "
                         "entries with a positive part count or a tuple of positive part sizes")
    for name, k in plan.fused:
        if not isinstance(k, int):
            bad_parts = [s for s in k if s % p]
            if bad_parts:
                raise ValueError(f"tensor_parallel={p} must divide every fused part {tuple(k)} of {name} "
                                 f"of {where.split(':')[0]}")
    for name in plan.head_counts:
        n = _get(mx, name)
        if not isinstance(n, int) or n % p:
            raise ValueError(f"tensor_parallel={p} must divide {name}={n} of {where.split(':')[0]}")


def _part_spec_ok(k) -> bool:
    """A ``TPPlan.fused`` entry's parts: a positive count, or a tuple of positive sizes."""
    if isinstance(k, int):
        return k >= 1
    return isinstance(k, (tuple, list)) and len(k) >= 1 and all(isinstance(s, int) and s >= 1 for s in k)


def split_errors(cfg: ModelConfig, p: int) -> List[str]:
    """What ``parallelize_tp`` would refuse in the layers' own plans for ``cfg`` at tensor_parallel
    = p (a head count p does not divide, a plan naming what its mixer lacks), found without
    building the model: each kind's mixer is built once on the meta device."""
    errs, seen = [], set()
    for i, kind in enumerate(cfg.layer_kinds()):
        plan = mixer_class(kind).tp_plan(cfg)
        if plan is None or kind in seen:
            continue
        seen.add(kind)
        with torch.device("meta"):
            mx = mixer_class(kind)(cfg, i)
        try:
            _check_plan(i, mx, plan, p)
        except ValueError as e:
            errs.append(str(e))
    return errs


class TPLM(LM):
    """An LM converted by ``parallelize_tp`` (the class is swapped in place, so it is still an LM).

    ``forward`` returns the loss from the vocab-parallel cross-entropy. Its ``logits`` are the
    full logits (all-gathered) when no labels are given or ``tp_gather_logits`` is set, else None
    (training needs only the loss; gathering [B, T, V] would cost memory and bandwidth)."""

    tp_ctx: TPContext
    tp_gather_logits: bool = False

    def _sp_for(self, T: int) -> bool:
        p, sp = self.tp_ctx.world_size, self.tp_ctx.sequence_parallel
        if sp and T % p != 0:
            if torch.is_grad_enabled() and self.training:
                raise ValueError(f"sequence parallelism splits the sequence across tensor_parallel={p} ranks: "
                                 f"the sequence length {T} must be a multiple of it")
            return False  # inference: same numbers without the split
        return sp

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                states=None, output_states: bool = False,
                position_ids: Optional[torch.Tensor] = None) -> LMOutput:
        """As ``LM.forward``; ``position_ids`` reach the blocks as there (document resets with
        ``model.reset_at_doc_boundaries``, segment positions), except that document resets
        inside a row are refused with sequence parallelism (a block's pieces would each be
        split across the ranks)."""
        ctx = self.tp_ctx
        sp0 = ctx.sequence_parallel
        ctx.sequence_parallel = self._sp_for(input_ids.shape[1])
        if ctx.sequence_parallel and position_ids is not None and self.cfg.reset_at_doc_boundaries \
                and bool((position_ids[:, 1:] == 0).any()):
            ctx.sequence_parallel = sp0
            raise ValueError("model.reset_at_doc_boundaries with documents starting inside a row is not "
                             "available with sequence parallelism; set parallel.sequence_parallel=false")
        try:
            h, new_states = self.hidden(input_ids, states, output_states, position_ids)
            logits = self.lm_head(h)  # [B, T, V/p]
        finally:
            ctx.sequence_parallel = sp0
        loss = None
        if labels is not None:
            loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                ctx.group, ignore_index=-100)
        full = gather_from_tensor_parallel_region(logits, ctx.group) \
            if labels is None or self.tp_gather_logits else None
        return LMOutput(logits=full, loss=loss, states=new_states)

    def step(self, token_ids: torch.Tensor, states: List[dict], position_ids: Optional[torch.Tensor] = None):
        ctx = self.tp_ctx
        sp0, ctx.sequence_parallel = ctx.sequence_parallel, False  # one token cannot be split
        try:
            h, new_states = self._step_blocks(token_ids, states, position_ids)
            logits = self.lm_head(h)
        finally:
            ctx.sequence_parallel = sp0
        return gather_from_tensor_parallel_region(logits, ctx.group)[:, 0], new_states


def layout_errors(cfg: ModelConfig, p: int, sequence_parallel: bool = False) -> List[str]:
    """The one place of the tensor-parallel rules on a model config at tensor_parallel = p: every
    layer kind declares a plan, p divides the head counts, the MLP width and the vocabulary, and
    sequence parallelism only with kinds whose plan allows it and without ``model.ttt.pre_conv``.
    Each problem as a message naming the key; [] when the layout fits. ``check_parallel`` (before
    any process group) and ``parallelize_tp`` (before any change to the model) both ask it."""
    kinds = cfg.layer_kinds()
    layers = [i for i, k in enumerate(kinds) if mixer_class(k).tp_plan(cfg) is None]
    if layers:
        bad = sorted({kinds[i] for i in layers})
        return [f"parallel.tensor_parallel={p}: layer kind(s) {bad} (layers {layers}) are not TP-ready; tensor "
                f"parallelism supports {list(tp_ready_kinds(cfg))}. Use parallel.tensor_parallel=1 for this model "
                "(data parallel + ZeRO-3 also shards the parameters)"]
    n_kv = cfg.attention.num_kv_heads or cfg.n_heads
    errs = [f"{name}={v}" for name, v in (("model.n_heads", cfg.n_heads), ("model.attention.num_kv_heads", n_kv),
                                          ("the MLP width d_ff", cfg.ff), ("model.vocab_size", cfg.vocab_size))
            if v % p]
    out = [f"parallel.tensor_parallel={p} must divide {', '.join(errs)}"] if errs else []
    if sequence_parallel and p > 1:
        no_sp = sorted({k for k in kinds if not mixer_class(k).tp_plan(cfg).sequence_parallel})
        if no_sp:
            out.append(f"parallel.sequence_parallel is not available with layer kind(s) {no_sp} (their "
                       "tensor-parallel plan refuses it); set parallel.sequence_parallel=false")
        if any(mixer_class(k).block_pre_conv(cfg) is not None for k in kinds):
            out.append("model.ttt.pre_conv is not available with parallel.sequence_parallel: the causal conv "
                       "would miss the previous rank's last tokens; set parallel.sequence_parallel=false")
    return out


def _check(model: LM, p: int, sequence_parallel: bool) -> None:
    errs = layout_errors(model.cfg, p, sequence_parallel)
    if errs:
        raise ValueError("; ".join(errs))
    for i, block in enumerate(model.layers):
        _check_plan(i, block.mixer, type(block.mixer).tp_plan(model.cfg), p)


def parallelize_tp(model: LM, groups, sequence_parallel: bool = False) -> TPLM:
    """Convert ``model`` in place (every TP rank must hold the same weights, e.g. built from the
    same seed) and return it. ``groups`` is a ParallelGroups or a TPContext's process group.

    A subclass of LM whose class sets ``converts_itself_for_tp = True`` (TTT-E2E) converts itself
    (``model.tensor_parallel_form(ctx)``, which sets ``model.tp_ctx``) and keeps its class; sequence
    parallelism is refused for it.

    A subclass of LM whose class sets ``runs_tp_layers = True`` (the context-parallel LM) keeps its
    class and its own forward: its layers are converted and ``model.tp_ctx`` set, and its forward
    must take the vocab-parallel loss itself (without sequence parallelism)."""
    group = groups.tp_group if isinstance(groups, ParallelGroups) else groups
    ctx = TPContext(group, sequence_parallel)
    p = ctx.world_size
    if getattr(type(model), "converts_itself_for_tp", False):
        # a model variant with its own layout under TP (TTT-E2E: ``tensor_parallel_form``), keeping its class
        if sequence_parallel:
            raise ValueError(f"{type(model).__name__}: parallel.sequence_parallel=true is not built for it (its "
                             "tensor-parallel form splits heads and MLP features only); set "
                             "parallel.sequence_parallel=false")
        model.tensor_parallel_form(ctx)   # refuses, before any change, a layout that p does not divide
        return model
    own_forward = type(model) is not LM and isinstance(model, LM) and getattr(type(model), "runs_tp_layers", False)
    if type(model) is not LM and not own_forward:
        raise TypeError(f"parallelize_tp takes a single-rank LM, got {type(model).__name__}")
    if own_forward and sequence_parallel:
        raise ValueError(f"{type(model).__name__} runs its own forward over the converted layers: sequence "
                         "parallelism is not available with it; set parallel.sequence_parallel=false")
    _check(model, p, sequence_parallel)  # before any change, so a refusal leaves the model intact

    for block in model.layers:
        _parallelize_mixer(block.mixer, type(block.mixer).tp_plan(model.cfg), ctx)
        block.mixer_norm = _entry_norm(block.mixer_norm, ctx)
        if block.mlp is not None:
            mlp: GatedMLP = block.mlp
            mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, ctx, input_in_region=True)
            mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, ctx, input_in_region=True)
            mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, ctx, input_is_parallel=True)
            block.mlp_norm = _entry_norm(block.mlp_norm, ctx)

    tied = model.cfg.tie_embeddings
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, ctx)
    head = ColumnParallelLinear.from_linear(model.lm_head, ctx, input_in_region=True)
    if tied:
        head.weight = model.embed.weight
    model.lm_head = head
    model.norm = _entry_norm(model.norm, ctx)
    if not own_forward:
        model.__class__ = TPLM
    model.tp_ctx = ctx
    return model


def partition_dims(model: nn.Module) -> Dict[str, Optional[object]]:
    """Parameter name → how it is split across the TP group: None (replicated), the dimension,
    or [dimension, stride] for a fused parameter (``TPPlan.fused``; see ``join_shards``)."""
    # remove_duplicate=False: a tied LM head is listed under its own name too (as in state_dict)
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        d, s = getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1)
        out[n] = d if d is None or (isinstance(s, int) and s == 1) else [d, s if isinstance(s, int) else list(s)]
    return out


def split_spec(spec) -> tuple:
    """(dim, stride) of a ``partition_dims`` entry (an int or [dim, stride]; the stride an int or
    the fused parts' sizes, ``fused_parts``); (None, 1) for None."""
    if spec is None or isinstance(spec, int):
        return spec, 1
    d, s = spec
    return int(d), (int(s) if isinstance(s, int) else tuple(int(k) for k in s))


def gather_tp_tensor(t: torch.Tensor, dim, group, stride: int = 1) -> torch.Tensor:
    """The full tensor from this rank's shard of it (no autograd); replicated ones pass through.
    ``dim`` may be a ``partition_dims`` entry ([dim, stride])."""
    if dim is not None and not isinstance(dim, int):
        dim, stride = split_spec(dim)
    if dim is None:
        return t
    if isinstance(stride, int) and stride == 1:
        return _all_gather(t.detach(), dim, group)
    w = torch.distributed.get_world_size(group)
    parts = [torch.empty_like(t.detach().contiguous()) for _ in range(w)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=group)
    return join_shards(parts, dim, stride)


def gather_full_state_dict(model: TPLM) -> Dict[str, torch.Tensor]:
    """The single-rank LM's state dict, gathered from the TP shards (a collective: every TP rank
    must call it). Keys equal those of the unconverted LM. Under ZeRO-3 call it inside
    ``deepspeed.zero.GatheredParameters(model.parameters())``."""
    g = model.tp_ctx.group
    dims = partition_dims(model)
    out = {}
    for name, t in model.state_dict().items():
        out[name] = gather_tp_tensor(t, dims.get(name), g)
    return out


__all__ = ["parallelize_tp", "layout_errors", "TPLM", "TP_READY_KINDS", "tp_ready_kinds", "split_errors", "RegionEntryRMSNorm", "GroupLayerNorm",
           "SharedAcrossHeads", "SharedParamsModule", "partition_dims", "split_spec", "join_shards",
           "gather_tp_tensor", "gather_full_state_dict"]
