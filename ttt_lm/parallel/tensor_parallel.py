r"""Megatron-style tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022), built on torch.distributed collectives wrapped in autograd functions.

Tensor parallelism. A column-parallel linear splits the output features of Y = X Aᵀ across the
p ranks of the tensor-parallel group (A = [A_1; …; A_p], rank i computes Y_i = X A_iᵀ); a
row-parallel linear splits its input features (Z = Σ_i Y_i B_iᵀ, one all-reduce). An MLP or
an attention layer is a column-parallel linear followed by a row-parallel one, so its forward
costs one all-reduce (g) and its backward one all-reduce at the entry (f):

    f = copy_to_tensor_parallel_region       forward: identity     backward: all-reduce
    g = reduce_from_tensor_parallel_region   forward: all-reduce   backward: identity

Sequence parallelism. Between the TP regions (norms, residual adds) every rank holds the same
activations; with sequence parallelism each holds T/p of the sequence instead, and f/g become

    f̄ = gather_from_sequence_parallel_region         forward: all-gather(T)   backward: reduce-scatter(T)
    ḡ = reduce_scatter_to_sequence_parallel_region   forward: reduce-scatter(T) backward: all-gather(T)

which move the same number of bytes as one all-reduce (= reduce-scatter + all-gather). A weight
used in the sequence-parallel region (the norms' gains) sees only T/p tokens per rank, so its
gradient is all-reduced over the group (``copy_to_tensor_parallel_region`` applied to the weight).

Activations here are batch-first [B, T, D], so the sequence dimension is 1 (Megatron keeps
[T, B, D] and splits dimension 0).

Vocab parallelism. The embedding table and the LM head are split along the vocabulary; the
cross-entropy is computed without ever gathering the logits (``vocab_parallel_cross_entropy``):
with z the logits of one token, split into shards z^(i), and target y,

    m = max_i max z^(i),   S = Σ_i Σ_v exp(z^(i)_v − m),   ℓ = log S − (z_y − m),
    ∂ℓ/∂z^(i)_v = exp(z^(i)_v − m)/S − [v is y]

using three all-reduces of one number per token (max, the target logit, S).

LayerNorm over split features. When the features of x are split across the ranks (a TP region's
column-parallel output, e.g. TTT's heads before its post_norm), ``tp_layer_norm`` takes the mean
and the variance over all n features with two all-reduces of one number per token:

    μ = (Σ_i Σ_j x^(i)_j) / n,   σ² = (Σ_i Σ_j (x^(i)_j − μ)²) / n,   y^(i) = (x^(i) − μ)/√(σ² + ε) · γ^(i) + β^(i)

(centered second pass, as F.layer_norm, rather than E[x²] − μ², which cancels when |μ| ≫ σ).
Each sum is used by every rank, so its backward all-reduces the gradient too (``all_reduce_sum``).

Second order. f, g, ``all_reduce_sum`` and the feature scatter/gather are twice differentiable:
each backward is the other function's ``apply`` (f's backward is g, g's is f, Σ's is Σ, scatter's
is gather and gather's scatter), so a backward taken with ``create_graph=True`` records the
collective it runs, and differentiating that graph again runs the adjoint collective. A model whose
forward contains a gradient step (TTT-E2E's inner step, ``torch.autograd.grad(create_graph=True)``)
is differentiated through them exactly. Without ``create_graph`` the numbers are those of the raw
collectives. The sequence-parallel functions and the vocab-parallel cross-entropy differentiate once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ttt_lm.model.layers import acc

SEQ_DIM = 1


@dataclass
class TPContext:
    """The tensor-parallel group and whether sequence parallelism is on. One object is shared by
    every TP layer of a model, so the flag can be switched for the whole model (decoding one
    token at a time cannot split the sequence)."""
    group: Optional[dist.ProcessGroup]
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


# ---- raw collectives (no autograd) -----------------------------------------------------------
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    # reduce a copy: the input may be saved for backward or used elsewhere
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group)
    return y


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    y = x.contiguous().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
    return y


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    w = dist.get_world_size(group)
    if w == 1:
        return x
    if x.shape[dim] % w != 0:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} across {w} tensor-parallel ranks")
    return x.chunk(w, dim=dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    w = dist.get_world_size(group)
    if w == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    w = dist.get_world_size(group)
    if w == 1:
        return x
    if x.shape[dim] % w != 0:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} across {w} ranks")
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter; an all-reduce then a split gives the same numbers
        return _split(_all_reduce(x, group), dim, group)
    chunks = [c.contiguous() for c in x.chunk(w, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


# ---- autograd-wrapped collectives ------------------------------------------------------------
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        # g's forward: under create_graph the all-reduce is itself differentiable (as f's adjoint)
        return _ReduceFromRegion.apply(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        # f's forward (identity), whose own backward all-reduces: twice differentiable
        return _CopyToRegion.apply(g, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        # every rank consumes the sum: a rank's term gets the sum of all ranks' gradients (the
        # same function again, so that its double backward all-reduces too)
        return _AllReduceSum.apply(g, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _GatherFromRegion.apply(g, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _ScatterToRegion.apply(g, ctx.group), None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, SEQ_DIM, ctx.group), None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_is_partial:
            return _reduce_scatter(g, SEQ_DIM, ctx.group), None, None
        return _split(g, SEQ_DIM, ctx.group), None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, SEQ_DIM, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Σ over the ranks, used by every rank afterwards: all-reduce forward and backward (unlike g,
    whose result feeds a replicated region that already holds the full gradient)."""
    return _AllReduceSum.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers it."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's slice."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's T/p slice of the sequence; backward all-gathers it."""
    return _ScatterToSeq.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """f̄: all-gather the sequence. Backward reduce-scatters when the consumer is a TP region
    (each rank's gradient is a partial sum over its shard of the features), else splits."""
    return _GatherFromSeq.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """ḡ: sum the partial results of the ranks and keep this rank's T/p slice; backward all-gathers."""
    return _ReduceScatterToSeq.apply(x, group)


def tp_layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                  group) -> torch.Tensor:
    """LayerNorm over the last dimension of x when that dimension is split across ``group``
    (this rank's [..., n/p] shard, with its slices of γ and β); equals this rank's slice of
    F.layer_norm of the full x. Computed in x's dtype (pass acc(x) for float32 statistics)."""
    n = x.shape[-1] * dist.get_world_size(group)
    mu = all_reduce_sum(x.sum(-1, keepdim=True), group) / n
    xc = x - mu
    var = all_reduce_sum(xc.pow(2).sum(-1, keepdim=True), group) / n
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


# ---- layers ----------------------------------------------------------------------------------
def _mark(p: nn.Parameter, dim: int, stride: int = 1) -> nn.Parameter:
    # DeepSpeed's gradient-norm code counts parameters with this flag on every TP rank and the
    # replicated ones only on TP rank 0; partition_dim (and Megatron's partition_stride) say how
    # to gather the full tensor
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_stride = stride
    return p


def fused_parts(n: int, stride) -> list:
    """The sizes of the parts a fused dimension of size ``n`` concatenates: ``stride`` equal ones
    (an int, Megatron's partition_stride), or the sizes themselves (a sequence, for parts of
    unequal sizes such as an SSM's fused [z | x | B | C | dt]; they must sum to n)."""
    if isinstance(stride, int):
        return [n // stride] * stride
    sizes = [int(k) for k in stride]
    if sum(sizes) != n:
        raise ValueError(f"fused parts {sizes} sum to {sum(sizes)}, not to the dimension's size {n}")
    return sizes


def _shard(w: torch.Tensor, dim: int, ctx: TPContext, stride=1) -> torch.Tensor:
    """This rank's slice of ``w`` along ``dim``. With ``stride`` s > 1 the dimension is the
    concatenation of s equal parts (a fused [q | k | v] or [x | z]) and each part is split by
    heads: the rank keeps chunks r, r + p, … of s·p (Megatron's partition_stride). ``stride`` may
    also be the parts' sizes (``fused_parts``): each part is split in p, the rank keeps its chunk
    of each."""
    n, p = w.shape[dim], ctx.world_size
    if not isinstance(stride, int):
        parts = fused_parts(n, stride)
        if any(k % p for k in parts):
            raise ValueError(f"dimension {dim} of fused parts {parts} is not divisible by tensor_parallel={p} "
                             "part by part")
        return torch.cat([t.chunk(p, dim=dim)[ctx.rank] for t in w.detach().split(parts, dim=dim)],
                         dim=dim).clone()
    if n % (p * stride) != 0:
        raise ValueError(f"dimension {dim} of size {n} is not divisible by tensor_parallel={p}"
                         + (f" × {stride} fused parts" if stride > 1 else ""))
    chunks = w.detach().chunk(p * stride, dim=dim)
    return torch.cat(chunks[ctx.rank::p], dim=dim).clone()


def join_shards(shards, dim: int, stride=1) -> torch.Tensor:
    """The full tensor from every rank's ``_shard`` (in rank order): the inverse of ``_shard``."""
    p = len(shards)
    if not isinstance(stride, int):
        local = [k // p for k in fused_parts(sum(s.shape[dim] for s in shards), stride)]
        parts = [s.split(local, dim=dim) for s in shards]
        return torch.cat([parts[r][j] for j in range(len(local)) for r in range(p)], dim=dim)
    if stride == 1:
        return torch.cat(shards, dim=dim)
    parts = [s.chunk(stride, dim=dim) for s in shards]           # rank r: its chunk of each part
    return torch.cat([parts[r][j] for j in range(stride) for r in range(p)], dim=dim)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_iᵀ (+ b_i): this rank's out_features/p output features.

    The input enters the TP region through f (or f̄ with sequence parallelism) unless
    ``input_in_region`` says the caller already did that (several linears reading one normalized
    input share one collective). ``gather_output`` all-gathers Y along the features."""

    def __init__(self, in_features: int, out_features: int, ctx: TPContext, bias: bool = False,
                 gather_output: bool = False, input_in_region: bool = False, device=None, dtype=None):
        super().__init__()
        p = ctx.world_size
        if out_features % p != 0:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} is not divisible by tensor_parallel={p}")
        self.in_features, self.out_features = in_features, out_features
        self.ctx, self.gather_output, self.input_in_region = ctx, gather_output, input_in_region
        self.weight = _mark(nn.Parameter(torch.empty(out_features // p, in_features, device=device, dtype=dtype)), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(out_features // p, device=device, dtype=dtype)), 0) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, ctx: TPContext, stride=1, **kw) -> "ColumnParallelLinear":
        """``stride``: the output features concatenate that many parts (or parts of these sizes),
        each split by heads."""
        m = cls(lin.in_features, lin.out_features, ctx, bias=lin.bias is not None,
                device=lin.weight.device, dtype=lin.weight.dtype, **kw)
        with torch.no_grad():
            m.weight.copy_(_shard(lin.weight, 0, ctx, stride))
            if lin.bias is not None:
                m.bias.copy_(_shard(lin.bias, 0, ctx, stride))
        m.weight.partition_stride = stride
        if m.bias is not None:
            m.bias.partition_stride = stride
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.ctx.group
        if not self.input_in_region:
            x = gather_from_sequence_parallel_region(x, g) if self.ctx.sequence_parallel \
                else copy_to_tensor_parallel_region(x, g)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, g) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Z = Σ_i X_i B_iᵀ (+ b): this rank holds in_features/p input features; the partial
    products are summed by g (or reduce-scattered over the sequence by ḡ). With
    ``input_is_parallel=False`` the full input is split first.

    ``output_to_heads``: the sum stays inside the TP region, where every rank's heads read it (a
    selective SSM's x_proj, whose dt/B/C every channel uses): it is summed by ``all_reduce_sum``
    (the gradient is all-reduced too, since each rank's gradient covers its own heads only) and
    never scattered over the sequence.

    ``full_sequence``: the sum is g (all-reduce forward, identity backward) even with sequence
    parallelism: the mixer reads it over the whole sequence and hands this rank's T/p tokens to the
    block itself (``TPPlan.sequence_split``), as Titans MAC and MAL do."""

    def __init__(self, in_features: int, out_features: int, ctx: TPContext, bias: bool = False,
                 input_is_parallel: bool = True, output_to_heads: bool = False, full_sequence: bool = False,
                 device=None, dtype=None):
        super().__init__()
        p = ctx.world_size
        if in_features % p != 0:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by tensor_parallel={p}")
        self.in_features, self.out_features = in_features, out_features
        self.ctx, self.input_is_parallel, self.output_to_heads = ctx, input_is_parallel, output_to_heads
        self.full_sequence = full_sequence
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // p, device=device, dtype=dtype)), 1)
        # the bias is replicated: added once, after the reduction
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, ctx: TPContext, **kw) -> "RowParallelLinear":
        m = cls(lin.in_features, lin.out_features, ctx, bias=lin.bias is not None,
                device=lin.weight.device, dtype=lin.weight.dtype, **kw)
        with torch.no_grad():
            m.weight.copy_(_shard(lin.weight, 1, ctx))
            if lin.bias is not None:
                m.bias.copy_(lin.bias.detach())
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, sp = self.ctx.group, self.ctx.sequence_parallel
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, g)
        y = F.linear(x, self.weight)
        if self.output_to_heads:
            y = all_reduce_sum(y, g)
            return y if self.bias is None else y + copy_to_tensor_parallel_region(self.bias, g)
        if self.full_sequence:  # every rank keeps the whole sum: the bias gradient is complete on each
            y = reduce_from_tensor_parallel_region(y, g)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel_region(y, g) if sp else reduce_from_tensor_parallel_region(y, g)
        if self.bias is not None:
            # with sequence parallelism each rank adds the bias to T/p tokens: sum its gradient
            y = y + (copy_to_tensor_parallel_region(self.bias, g) if sp else self.bias)
        return y


class VocabParallelEmbedding(nn.Module):
    """Rows [r·V/p, (r+1)·V/p) of the embedding table on rank r. A token outside the shard
    looks up zeros; g (or ḡ, which also splits the sequence) sums the shards' lookups."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: TPContext, device=None, dtype=None):
        super().__init__()
        p = ctx.world_size
        if num_embeddings % p != 0:
            raise ValueError(f"VocabParallelEmbedding: vocab_size={num_embeddings} is not divisible by "
                             f"tensor_parallel={p}; pad the vocabulary to a multiple of it")
        self.num_embeddings, self.embedding_dim, self.ctx = num_embeddings, embedding_dim, ctx
        self.vocab_start = ctx.rank * (num_embeddings // p)
        self.vocab_end = self.vocab_start + num_embeddings // p
        self.weight = _mark(nn.Parameter(torch.empty(num_embeddings // p, embedding_dim, device=device, dtype=dtype)), 0)
        # not an nn.Embedding, which the optimizer's parameter groups leave undecayed: say so on the weight
        self.weight._no_weight_decay = True

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, ctx: TPContext) -> "VocabParallelEmbedding":
        m = cls(emb.num_embeddings, emb.embedding_dim, ctx, device=emb.weight.device, dtype=emb.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(_shard(emb.weight, 0, ctx))
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        e = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        g = self.ctx.group
        if self.ctx.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(e, g)
        return reduce_from_tensor_parallel_region(e, g)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        z = acc(logits)
        vl = z.shape[-1]
        start = dist.get_rank(group) * vl
        m = _all_reduce_max(z.detach().max(-1).values, group)
        z = z - m[..., None]
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + vl)
        t_local = (target - start).masked_fill(~mine, 0)
        z_y = _all_reduce(z.gather(-1, t_local[..., None])[..., 0] * mine, group)
        e = z.exp()
        s = _all_reduce(e.sum(-1), group)
        loss = (s.log() - z_y).masked_fill(~valid, 0.0)
        ctx.save_for_backward(e / s[..., None], t_local, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, t_local, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, t_local[..., None], -mine[..., None].to(grad.dtype))
        grad = grad * (g * valid)[..., None]
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits split along the vocabulary (this rank's [..., V/p] shard, rank r
    holding columns r·V/p …) against full-vocabulary targets [...]; equals
    F.cross_entropy(full_logits, target, ignore_index=ignore_index, reduction=reduction).
    Computed in float32 for half-precision logits, in the logits' dtype otherwise."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # as F.cross_entropy: the mean over non-ignored targets (nan when there are none)
    return loss.sum() / (target != ignore_index).sum()


__all__ = [
    "TPContext", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "all_reduce_sum", "tp_layer_norm",
]
