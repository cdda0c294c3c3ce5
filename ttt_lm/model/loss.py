r"""The LM head's cross-entropy without the full [N, V] logits.

For hidden states h [N, D] (the final norm's output, N = B·T tokens), the head W [V, D] and targets
y [N] (``ignore_index`` marks tokens without a target):

    z_i = W h_i,    lse_i = log Σ_v exp(z_iv),    ℓ_i = lse_i − z_{i,y_i},
    L = Σ_{i valid} ℓ_i            (reduction="sum"),    L / #valid   (reduction="mean")

and its gradients, with p_i = softmax(z_i) and e_y the one-hot row of y_i,

    ∂ℓ_i/∂z_i = p_i − e_{y_i},    ∂L/∂h_i = (p_i − e_{y_i}) W,    ∂L/∂W = Σ_i (p_i − e_{y_i})ᵀ h_i.

``linear_cross_entropy`` walks the tokens in chunks of C rows: each chunk's logits are formed, turned
into its loss and (when a gradient is wanted) into its share of ∂L/∂h and ∂L/∂W at once, and freed
before the next chunk. The gradients are thus computed in the forward pass (as Liger-Kernel's fused
linear cross-entropy does), and the backward pass only scales them by the incoming gradient: one
matrix product fewer than recomputing the logits in the backward. Extra memory: one chunk's logits
and softmax (C × V, float32) plus ∂L/∂W in float32 (V × D) and ∂L/∂h (N × D, which the plain head
saves as its input anyway) — nothing of size N × V. The plain loss (``F.cross_entropy`` of the
float32 copy of [B, T, V] logits) holds N × V in the compute dtype, N × V in float32 and the
float32 softmax gradient of N × V: 3.3 GB each at 8 × 2048 tokens and V = 50280.

Precision: the matrix products run in the compute dtype (the inputs' dtype, or the autocast dtype
when autocast is on, as ``nn.Linear`` would under it) with float32 accumulation; the log-sum-exp,
softmax and loss are float32 (float64 inputs stay float64); ∂L/∂W is accumulated over chunks in
float32 and returned in the weight's dtype.

Tied embeddings need nothing special: W is a parameter like any other and receives its gradient
through autograd, summed with the embedding's. Tensor parallelism keeps its own vocab-parallel
cross-entropy (``ttt_lm.parallel.tensor_parallel.vocab_parallel_cross_entropy``), which forms this
rank's [N, V/p] shard only; the context-parallel forward computes each rank's slice of the logits.
"""
from __future__ import annotations

from typing import Optional

import torch

#: tokens per chunk in ``LM.forward`` unless ``model.loss_chunk_size`` says otherwise
DEFAULT_CHUNK = 1024


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk: int,
            grad_h: Optional[torch.Tensor], grad_w: Optional[torch.Tensor]) -> torch.Tensor:
    """The summed loss (accumulation dtype, on the device); fills grad_h / grad_w (when given) with
    the gradient of that sum."""
    cdt = _compute_dtype(h)
    adt = _acc_dtype(cdt)
    w = weight.to(cdt)
    total = torch.zeros((), dtype=adt, device=h.device)
    want_grad = grad_h is not None or grad_w is not None
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk):
            hc = h[s:s + chunk].to(cdt)
            yc = labels[s:s + chunk]
            valid = yc != ignore_index
            y = yc.masked_fill(~valid, 0)
            z = (hc @ w.t()).to(adt)                     # [n, V], the chunk's logits
            m = z.max(-1, keepdim=True).values
            z_y = z.gather(-1, y[:, None])               # before z is overwritten
            z.sub_(m).exp_()                             # exp(z − m)
            se = z.sum(-1, keepdim=True)
            lse = m + se.log()
            total += (lse - z_y)[:, 0].masked_fill(~valid, 0.0).sum()
            if not want_grad:
                continue
            z.div_(se)                                   # p = softmax(z)
            z.scatter_add_(-1, y[:, None], -valid[:, None].to(z.dtype))   # p − e_y
            z.mul_(valid[:, None])                       # ignored tokens: no gradient
            g = z.to(cdt)
            del z
            if grad_h is not None:
                grad_h[s:s + chunk] = (g @ w).to(grad_h.dtype)
            if grad_w is not None:
                grad_w += g.t() @ hc
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ of the valid tokens' cross-entropies of h Wᵀ; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index, chunk):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) if need_w else None
        total = _chunks(h, weight, labels, ignore_index, chunk, grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        h_dt, w_dt = ctx.dtypes
        gh = None if grad_h is None else (grad_h * g.to(grad_h.dtype)).to(h_dt)
        gw = None if grad_w is None else (grad_w * g.to(grad_w.dtype)).to(w_dt)
        return gh, gw, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         chunk_size: int = DEFAULT_CHUNK, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, labels, ignore_index=ignore_index, reduction=reduction)``
    computed ``chunk_size`` tokens at a time (module docstring): h [N, D] (or [..., D]),
    weight [V, D], labels [N] (or [...]) of integer class ids. ``reduction``: "mean" (over the
    tokens whose label is not ``ignore_index``; nan when there are none, as F.cross_entropy) or
    "sum". The result is float32 (float64 for float64 inputs). Under autograd the gradients of h and
    weight are computed in this call; a second backward through it is not supported."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive number of tokens, got {chunk_size!r}")
    if weight.ndim != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: weight must be [V, D] with D = h.shape[-1]; got h "
                         f"{tuple(h.shape)} and weight {tuple(weight.shape)}")
    if labels.dtype not in (torch.int64, torch.int32) or labels.shape != h.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: labels must be integer class ids of shape {tuple(h.shape[:-1])} "
                         f"(h's without its last dimension); got {labels.dtype} {tuple(labels.shape)}")
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1).long()
    if torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad):
        total = _LinearCrossEntropy.apply(h2, weight, y, ignore_index, chunk_size)
    else:
        total = _chunks(h2, weight, y, ignore_index, chunk_size, None, None)
    if reduction == "sum":
        return total
    return total / (y != ignore_index).sum()


def plain_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The plain loss: F.cross_entropy of the full logits [..., V] in float32 (float64 stays);
    the mean over the tokens whose label is not ``ignore_index``."""
    import torch.nn.functional as F
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=ignore_index)


__all__ = ["linear_cross_entropy", "plain_cross_entropy", "DEFAULT_CHUNK"]
