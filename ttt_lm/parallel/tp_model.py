"""Convert a built single-rank LM, in place, into its Megatron tensor-parallel form.

Per block (p = tensor-parallel size, r = this rank):

* attention / local_attention: q_proj, k_proj, v_proj column-parallel by heads (rank r holds
  query heads r·H/p … and KV heads r·H_kv/p …, so each query head keeps its KV head under GQA);
  o_proj row-parallel. Heads are independent, so the attention itself runs unchanged on the
  local heads (the KV cache holds only the local heads too).
* GatedMLP: gate_proj and up_proj column-parallel, down_proj row-parallel.
* embedding and LM head vocab-parallel (a tied head keeps sharing the embedding's shard); the
  loss is ``vocab_parallel_cross_entropy``, so full logits are never formed in training.
* the norms (mixer_norm, mlp_norm, the final norm) are where activations enter a TP region:
  their output goes through f (copy, all-reduce of the gradient), or with sequence parallelism
  through f̄ (all-gather of the sequence), once for all the column-parallel linears that read it.
  With sequence parallelism the embedding output, the residual stream and the norms hold T/p
  tokens per rank, and the norms' gains get their gradient all-reduced over the group.
* ttt_linear / ttt_mlp: heads are independent, so they split like attention: q_proj, k_proj,
  v_proj and g_proj (use_gate) column-parallel by heads; the share_qk depthwise convs conv_q,
  conv_k sliced by channels (= by heads); the per-head parameters θ_η and b_η
  (learnable_ttt_lr_weight/bias), the inner LayerNorm γ, β (ttt_norm_weight/bias) and the inner
  model W1, b1 (W2, b2) sliced along their head dimension; o_proj row-parallel. The inner states
  (and a decode state's W, gradient sums and conv caches) hold only the local heads, so the dual
  form's FLOPs and the state shrink by p. ``post_norm`` is a LayerNorm over all heads: its γ, β
  are sliced and its mean and variance come from ``tp_layer_norm`` (two all-reduces of one
  number per token). learnable_token_idx (τ, shared by all heads) is replicated: each rank's
  gradient for it covers its heads only, so it is all-reduced (f on τ). The block's optional
  pre_conv reads the residual stream, so it is replicated; it is refused with sequence
  parallelism (a causal conv over a T/p shard would miss the previous shard's last tokens).

Every sharded weight is a slice of the single-rank weight (``partition_dim`` on the parameter
says which dimension), so ``gather_full_state_dict`` rebuilds the single-rank state dict.

TP-ready layer kinds: ``TP_READY_KINDS`` (attention, local_attention, ttt_linear, ttt_mlp). The
other recurrent mixers (Titans, DeltaNet, RG-LRU, Mamba) are refused.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ttt import ttt_linear, ttt_mlp
from ttt_lm.model.layers import GatedMLP, RMSNorm, acc
from ttt_lm.model.lm import LM, LMOutput
from ttt_lm.model.mixers import mixer_class
from ttt_lm.model.mixers.attention import Attention
from ttt_lm.model.mixers.ttt import TTTLinear, TTTMLP, _TTTBase
from ttt_lm.parallel.groups import ParallelGroups
from ttt_lm.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding, _all_gather, _mark, _shard,
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
    tp_layer_norm, vocab_parallel_cross_entropy)

TP_READY_KINDS = ("attention", "local_attention", "ttt_linear", "ttt_mlp")


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


class _TPTTT:
    """The TTT mixer on this rank's n_heads/p heads (see the module docstring); the layer's math
    is _TTTBase's, only post_norm spans the group."""

    tp_ctx: TPContext

    def _tau(self) -> torch.Tensor:
        # τ is shared by the heads of every rank: its gradient here is this rank's heads' part
        return copy_to_tensor_parallel_region(super()._tau(), self.tp_ctx.group)

    def _run(self, x: torch.Tensor, state, output_state: bool, backend: str):
        XQ, XK, XV, caches = self._qkv(x, state)
        op_state = None if state is None else {k: v for k, v in state.items() if not k.startswith("conv_")}
        op = ttt_linear if self.kind == "linear" else ttt_mlp
        z, new = op(XQ, XK, XV, self._eta(x), self._tau(), self.ttt_norm_weight, self.ttt_norm_bias,
                    *self._inner_weights(), mini_batch_size=self.mini_batch_size,
                    initial_state=op_state, output_final_state=output_state, backend=backend)
        B, H, T, d = z.shape
        zf = acc(z.transpose(1, 2).reshape(B, T, H * d))
        y = tp_layer_norm(zf, self.post_norm.weight, self.post_norm.bias, self.post_norm.eps, self.tp_ctx.group)
        if self.use_gate:
            y = F.gelu(acc(self.g_proj(x)), approximate="tanh") * y
        out = self.o_proj(y.to(x.dtype))
        if output_state:
            new.update(caches)
        return out, (new if output_state else None)


class TPTTTLinear(_TPTTT, TTTLinear):
    """TTT-Linear converted by ``parallelize_tp``."""


class TPTTTMLP(_TPTTT, TTTMLP):
    """TTT-MLP converted by ``parallelize_tp``."""


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


def _parallelize_ttt(mx: _TTTBase, ctx: TPContext) -> None:
    p = ctx.world_size
    names = ["q_proj", "v_proj"] + ([] if mx.share_qk else ["k_proj"]) + (["g_proj"] if mx.use_gate else [])
    for name in names:
        setattr(mx, name, ColumnParallelLinear.from_linear(getattr(mx, name), ctx, input_in_region=True))
    mx.o_proj = RowParallelLinear.from_linear(mx.o_proj, ctx, input_is_parallel=True)
    if mx.share_qk:
        mx.conv_q, mx.conv_k = _shard_conv(mx.conv_q, ctx), _shard_conv(mx.conv_k, ctx)
    for name in ("learnable_ttt_lr_weight", "learnable_ttt_lr_bias", "ttt_norm_weight", "ttt_norm_bias",
                 *mx.inner_keys):
        setattr(mx, name, _shard_param(getattr(mx, name), 0, ctx))
    pn = mx.post_norm
    pn.weight, pn.bias = _shard_param(pn.weight, 0, ctx), _shard_param(pn.bias, 0, ctx)
    pn.normalized_shape = (pn.weight.shape[0],)
    mx.n_heads //= p
    mx.width //= p
    mx.__class__ = TPTTTLinear if isinstance(mx, TTTLinear) else TPTTTMLP
    mx.tp_ctx = ctx


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
                states=None, output_states: bool = False) -> LMOutput:
        ctx = self.tp_ctx
        sp0 = ctx.sequence_parallel
        ctx.sequence_parallel = self._sp_for(input_ids.shape[1])
        try:
            h, new_states = self.hidden(input_ids, states, output_states)
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

    def step(self, token_ids: torch.Tensor, states: List[dict]):
        ctx = self.tp_ctx
        sp0, ctx.sequence_parallel = ctx.sequence_parallel, False  # one token cannot be split
        try:
            x = self.embed(token_ids[:, None])
            new_states = []
            for block, st in zip(self.layers, states):
                x, ns = block.step(x, st)
                new_states.append(ns)
            logits = self.lm_head(self.norm(x))
        finally:
            ctx.sequence_parallel = sp0
        return gather_from_tensor_parallel_region(logits, ctx.group)[:, 0], new_states


def _check(model: LM, p: int, sequence_parallel: bool) -> None:
    cfg = model.cfg
    kinds = cfg.layer_kinds()
    bad = [(i, k) for i, k in enumerate(kinds) if k not in TP_READY_KINDS]
    if bad:
        kinds = sorted({k for _, k in bad})
        raise ValueError(
            f"tensor parallelism does not support layer kind(s) {kinds} (layers {[i for i, _ in bad]}); "
            f"TP-ready kinds: {list(TP_READY_KINDS)}. Run these models with parallel.tensor_parallel=1")
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
        mx = block.mixer
        if isinstance(mx, _TTTBase):
            _parallelize_ttt(mx, ctx)
        else:
            assert isinstance(mx, Attention), type(mx)
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(mx, name, ColumnParallelLinear.from_linear(getattr(mx, name), ctx, input_in_region=True))
            mx.o_proj = RowParallelLinear.from_linear(mx.o_proj, ctx, input_is_parallel=True)
            mx.n_heads //= p
            mx.n_kv //= p
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


__all__ = ["parallelize_tp", "TPLM", "TP_READY_KINDS", "RegionEntryRMSNorm", "TPTTTLinear", "TPTTTMLP", "partition_dims",
           "gather_tp_tensor", "gather_full_state_dict"]
