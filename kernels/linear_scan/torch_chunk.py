r"""PyTorch form of h_t = exp(log_a_t) ⊙ h_{t−1} + b_t (the CPU path and the GPU fallback), with
a hand-written backward: one autograd node for the whole scan.

Forward, one fused multiply-add per token over [B, D], written straight into the output:

    h_t = addcmul(b_t, a_t, h_{t−1}),      a = exp(log_a) computed once for all tokens

Backward, with g_t = ∂ℓ/∂h_t and ∂ℓ/∂h_{T−1} from the final state added at the last token:

    dh_t = g_t + a_{t+1} ⊙ dh_{t+1}                  (reverse scan, two operations per token)
    ∂ℓ/∂b_t = dh_t,    ∂ℓ/∂log_a_t = dh_t ⊙ a_t ⊙ h_{t−1},    ∂ℓ/∂h_{−1} = a_0 ⊙ dh_0

It saves a and h (h is the output anyway), so memory and time grow linearly with T. The earlier
chunked form built an [L, L] decay matrix per chunk and channel (O(T·L·D) memory: 38 GB at
B·T = 64k, D = 768, L = 64) and indexed chunk ends inside its loop; it grew with a log-log slope
above 1.3 from 2k to 8k tokens. Products of gates are formed one step at a time, never as
ratios of cumulative sums, so nothing overflows however strong the decay. ``chunk_size`` is
accepted for the backends' common signature; this form does not use it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.linear_scan.reference import acc_dtype, check_linear_scan_inputs


class _LinearScan(torch.autograd.Function):
    """(log_a, b, h0) → (h, h_{T−1}), all in the accumulation dtype."""

    @staticmethod
    def forward(ctx, log_a, b, h0, keep=None):
        a = log_a.exp()
        if keep is not None:
            a = a * keep[..., None]   # a_t = 0 where a sequence starts: the same formulas hold
        h = torch.empty_like(b)
        prev = h0 if h0 is not None else b.new_zeros(b.shape[0], b.shape[2])
        for t in range(b.shape[1]):
            prev = torch.addcmul(b[:, t], a[:, t], prev, out=h[:, t])
        ctx.save_for_backward(a, h, h0)
        return h, prev.clone()

    @staticmethod
    def backward(ctx, gh, ghT):
        a, h, h0 = ctx.saved_tensors
        B, T, D = h.shape
        # carry = a_{t+1} ⊙ dh_{t+1}, the part of dh_t that comes from later tokens
        carry = ghT.clone() if ghT is not None else h.new_zeros(B, D)
        dh = torch.empty_like(h)
        for t in reversed(range(T)):
            if gh is not None:
                torch.add(gh[:, t], carry, out=dh[:, t])
            else:
                dh[:, t] = carry
            carry = a[:, t] * dh[:, t]
        h_prev = torch.cat([(h0 if h0 is not None else h.new_zeros(B, D))[:, None], h[:, :-1]], 1)
        return dh * a * h_prev, dh, (carry if h0 is not None else None), None


def linear_scan_chunk(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                      output_final_state: bool = False, chunk_size: int = 64,
                      resets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``resets`` [B, T] bool: h_t = b_t there (a_t replaced by 0 inside the scan, the initial
    state dropped at a reset on the first token)."""
    check_linear_scan_inputs("linear_scan_chunk", log_a, b, initial_state, chunk_size)
    dt = acc_dtype(b.dtype)
    B, T, D = b.shape
    h0 = None if initial_state is None else initial_state.to(dt)
    if T == 0:
        hT = h0 if h0 is not None else torch.zeros(B, D, dtype=dt, device=b.device)
        return b, (hT if output_final_state else None)
    keep = None if resets is None else (~resets.to(torch.bool)).to(dt)
    h, hT = _LinearScan.apply(log_a.to(dt), b.to(dt), h0, keep)
    return h.to(b.dtype), (hT if output_final_state else None)
