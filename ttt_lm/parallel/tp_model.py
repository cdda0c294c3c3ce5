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
says which dimension), so ``gather_full_state_dict`` rebuilds the single-rank state dict.

TP-ready layer kinds: those whose mixer declares a plan (``TP_READY_KINDS``: attention,
local_attention, ttt_linear, ttt_mlp). The other kinds (titans*, deltanet, rglru, mamba) declare
none, and a model with one is refused before any change.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from ttt_lm.model.config import LAYER_KINDS, ModelConfig
from ttt_lm.model.layers import GatedMLP, RMSNorm, acc
from ttt_lm.model.lm import LM, LMOutput
from ttt_lm.model.mixers import Mixer, mixer_class
from ttt_lm.model.mixers.base import TPPlan
from ttt_lm.parallel.groups import ParallelGroups
from ttt_lm.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding, _all_gather, _mark, _shard,
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    tp_layer_norm, vocab_parallel_cross_entropy)


def tp_ready_kinds(cfg: Optional[ModelConfig] = None) -> tuple:
    """The layer kinds whose mixer declares a tensor-parallel plan (for ``cfg``; default config
    when None), among every kind registered now."""
    from ttt_lm.model.registry import layer_kinds
    cfg = cfg if cfg is not None else ModelConfig()
    return tuple(k for k in layer_kinds() if mixer_class(k).tp_plan(cfg) is not None)


#: the built-in TP-ready layer kinds
TP_READY_KINDS = tuple(k for k in tp_ready_kinds() if k in LAYER_KINDS)


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


def _shard_param(p: nn.Parameter, dim: int, ctx: TPContext) -> nn.Parameter:
    return _mark(nn.Parameter(_shard(p, dim, ctx), requires_grad=p.requires_grad), dim)


def _shard_conv(conv: nn.Conv1d, ctx: TPContext) -> nn.Conv1d:
    c = conv.in_channels // ctx.world_size
    m = nn.Conv1d(c, c, conv.kernel_size[0], groups=c, bias=conv.bias is not None,
                  device=conv.weight.device, dtype=conv.weight.dtype)
    m.weight = _shard_param(conv.weight, 0, ctx)
    if conv.bias is not None:
        m.bias = _shard_param(conv.bias, 0, ctx)
    return m


def _parallelize_mixer(mx: Mixer, plan: TPPlan, ctx: TPContext) -> None:
    """Apply ``plan`` to ``mx`` in place (see ``TPPlan``)."""
    p = ctx.world_size
    for name in plan.column:
        setattr(mx, name, ColumnParallelLinear.from_linear(getattr(mx, name), ctx, input_in_region=True))
    for name in plan.row:
        setattr(mx, name, RowParallelLinear.from_linear(getattr(mx, name), ctx, input_is_parallel=True))
    for name in plan.channel_convs:
        setattr(mx, name, _shard_conv(getattr(mx, name), ctx))
    for name in plan.head_params:
        setattr(mx, name, _shard_param(getattr(mx, name), 0, ctx))
    for name in plan.group_norms:
        setattr(mx, name, GroupLayerNorm(getattr(mx, name), ctx))
    for name in plan.shared:
        if not isinstance(getattr(mx, name), nn.Identity):
            raise TypeError(f"TPPlan.shared: {type(mx).__name__}.{name} must be an nn.Identity hook")
        setattr(mx, name, SharedAcrossHeads(ctx))
    for name in plan.head_counts:
        setattr(mx, name, getattr(mx, name) // p)


def _check_plan(i: int, mx: Mixer, plan: TPPlan, p: int) -> None:
    """Refuse a plan that names what the mixer does not have, or a head count that p does not
    divide, before anything is converted."""
    where = f"layer {i} ({mx.layer_kind}): {type(mx).__name__}.tp_plan"
    fields = ("column", "row", "channel_convs", "head_params", "group_norms", "shared", "head_counts")
    missing = [n for f in fields for n in getattr(plan, f) if not hasattr(mx, n)]
    if missing:
        raise ValueError(f"{where} names attribute(s) the mixer does not have: {missing}")
    for name in plan.head_counts:
        n = getattr(mx, name)
        if not isinstance(n, int) or n % p:
            raise ValueError(f"tensor_parallel={p} must divide {name}={n} of {where.split(':')[0]}")


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
            x = self.embed(token_ids[:, None])
            pos = None if position_ids is None else position_ids.reshape(-1, 1)
            new_states = []
            for block, st in zip(self.layers, states):
                x, ns = block.step(x, st, pos)
                new_states.append(ns)
            logits = self.lm_head(self.norm(x))
        finally:
            ctx.sequence_parallel = sp0
        return gather_from_tensor_parallel_region(logits, ctx.group)[:, 0], new_states


def _check(model: LM, p: int, sequence_parallel: bool) -> None:
    cfg = model.cfg
    kinds = cfg.layer_kinds()
    bad = [(i, k) for i, k in enumerate(kinds) if mixer_class(k).tp_plan(cfg) is None]
    if bad:
        kinds = sorted({k for _, k in bad})
        raise ValueError(
            f"tensor parallelism does not support layer kind(s) {kinds} (layers {[i for i, _ in bad]}): their "
            f"mixers declare no tensor-parallel plan; TP-ready kinds: {list(tp_ready_kinds(cfg))}. Run these "
            "models with parallel.tensor_parallel=1")
    n_kv = cfg.attention.num_kv_heads or cfg.n_heads
    errs = []
    if cfg.n_heads % p:
        errs.append(f"model.n_heads={cfg.n_heads}")
    if n_kv % p:
        errs.append(f"model.attention.num_kv_heads={n_kv}")
    if cfg.ff % p:
        errs.append(f"the MLP width d_ff={cfg.ff}")
    if cfg.vocab_size % p:
        errs.append(f"model.vocab_size={cfg.vocab_size}")
    if errs:
        raise ValueError(f"tensor_parallel={p} must divide {', '.join(errs)}")
    for i, block in enumerate(model.layers):
        _check_plan(i, block.mixer, type(block.mixer).tp_plan(cfg), p)
    if sequence_parallel and p > 1 and any(mixer_class(k).block_pre_conv(cfg) is not None for k in kinds):
        raise ValueError("model.ttt.pre_conv (a causal conv over the residual stream) is not supported with "
                         "sequence parallelism, which splits that stream along the sequence; set "
                         "parallel.sequence_parallel=false or model.ttt.pre_conv=false")


def parallelize_tp(model: LM, groups, sequence_parallel: bool = False) -> TPLM:
    """Convert ``model`` in place (every TP rank must hold the same weights, e.g. built from the
    same seed) and return it. ``groups`` is a ParallelGroups or a TPContext's process group."""
    group = groups.tp_group if isinstance(groups, ParallelGroups) else groups
    ctx = TPContext(group, sequence_parallel)
    p = ctx.world_size
    if type(model) is not LM:
        raise TypeError(f"parallelize_tp takes a single-rank LM, got {type(model).__name__}")
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
    model.__class__ = TPLM
    model.tp_ctx = ctx
    return model


def partition_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """Parameter name → the dimension it is split along across the TP group (None: replicated)."""
    # remove_duplicate=False: a tied LM head is listed under its own name too (as in state_dict)
    return {n: getattr(p, "partition_dim", None) for n, p in model.named_parameters(remove_duplicate=False)}


def gather_tp_tensor(t: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    """The full tensor from this rank's shard of it (no autograd); replicated ones pass through."""
    return t if dim is None else _all_gather(t.detach(), dim, group)


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


__all__ = ["parallelize_tp", "TPLM", "TP_READY_KINDS", "tp_ready_kinds", "RegionEntryRMSNorm", "GroupLayerNorm",
           "SharedAcrossHeads", "partition_dims",
           "gather_tp_tensor", "gather_full_state_dict"]
