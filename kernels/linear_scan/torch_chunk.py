r"""Chunked PyTorch form of h_t = exp(log_a_t) ⊙ h_{t−1} + b_t.

The sequence is cut into chunks of L tokens. With Λ_t = Σ_{r ≤ t} log_a_r, the cumulative
log-gate from the chunk start (inclusive), every position of chunk c is

    h_t = Σ_{s ≤ t, s ∈ c} exp(Λ_t − Λ_s) ⊙ b_s  +  exp(Λ_t) ⊙ H_{c−1}

where H_{c−1} is the state at the end of the previous chunk. The first term is a masked L×L
reduction, parallel over all chunks; only the chunk-end states H_c = h_{last of c} need a short
sequential scan over T/L chunks. Λ_t − Λ_s (s ≤ t) is a sum of log-gates, hence ≤ 0, and the
entries with s > t are set to −∞ before the exponential, so nothing overflows however strong
the decay. Memory is O(B·T·L·D) for the decay weights; a Triton kernel keeps them on chip.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kernels.linear_scan.reference import acc_dtype


def linear_scan_chunk(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                      output_final_state: bool = False, chunk_size: int = 64
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    dt = acc_dtype(b.dtype)
    B, T, D = b.shape
    L = max(1, min(chunk_size, T))
    n = math.ceil(T / L) if T > 0 else 0
    h0 = (torch.zeros(B, D, dtype=dt, device=b.device) if initial_state is None
          else initial_state.to(dt))
    if n == 0:
        return b, (h0 if output_final_state else None)
    pad = n * L - T
    # padding with log_a = 0, b = 0 leaves the state unchanged, so the last chunk's end is h_{T−1}
    la = F.pad(log_a.to(dt), (0, 0, 0, pad)).view(B, n, L, D)
    bb = F.pad(b.to(dt), (0, 0, 0, pad)).view(B, n, L, D)
    cum = la.cumsum(2)                                            # Λ_t within each chunk
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]           # [B, n, t, s, D]
    causal = torch.ones(L, L, dtype=torch.bool, device=b.device).tril()
    w = seg.masked_fill(~causal[:, :, None], float("-inf")).exp()
    h_local = torch.einsum("bctsd,bcsd->bctd", w, bb)             # chunk started from zero state
    decay = cum.exp()                                             # exp(Λ_t): reach of H_{c−1}
    # H_c = exp(Λ_last) ⊙ H_{c−1} + h_local_last: the scan across chunks
    # (the chunk ends are unbound once: indexing them inside the loop would make each index's
    # backward write a zero-filled gradient of the whole sequence, quadratic in T)
    carry = [h0]
    for d_c, l_c in zip(decay[:, :, -1].unbind(1), h_local[:, :, -1].unbind(1)):
        carry.append(d_c * carry[-1] + l_c)
    h_prev = torch.stack(carry[:-1], 1)                           # [B, n, D]
    h = (h_local + decay * h_prev[:, :, None]).reshape(B, n * L, D)[:, :T]
    return h.to(b.dtype), (carry[-1] if output_final_state else None)
