r"""Chunked PyTorch form of the selective scan (see reference.py for the recurrence).

Within a chunk of L tokens, with Λ_t = Σ_{r ≤ t} Δ_r A (per d, n; cumulative from the chunk
start, inclusive) and u_s = Δ_s x_s:

    y_t = Σ_n C_t[n] ( Σ_{s ≤ t} exp(Λ_t − Λ_s)[d, n] B_s[n] u_s[d]  +  exp(Λ_t)[d, n] H_{c−1}[d, n] )
    H_c = exp(Λ_last) ⊙ H_{c−1} + Σ_s exp(Λ_last − Λ_s) ⊙ B_s u_s

The decay exp(Λ_t − Λ_s) depends on (d, n) as well as (t, s), so a chunk needs an
[L, L, Di, N] tensor; chunks run one after another, each under activation checkpointing when
gradients are on, so only the chunk-boundary states H_c are kept between forward and backward.
Masked entries (s > t) are −∞ before the exponential: no overflow at any decay strength.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels.selective_scan.reference import acc_dtype, discretize, finish


def _chunk(h_prev, dA, u, Bc, Cc):
    """One chunk: dA = Δ·A [Bt, L, Di, N], u = Δ·x [Bt, L, Di], Bc/Cc [Bt, L, N], h_prev [Bt, Di, N]."""
    L = dA.shape[1]
    cum = dA.cumsum(1)                                                   # Λ_t
    seg = cum[:, :, None] - cum[:, None, :]                              # [Bt, t, s, Di, N]
    causal = torch.ones(L, L, dtype=torch.bool, device=dA.device).tril()
    w = seg.masked_fill(~causal[:, :, None, None], float("-inf")).exp()
    wB = w * Bc[:, None, :, None, :]                                     # exp(Λ_t − Λ_s) B_s
    y = torch.einsum("btsdn,bsd,btn->btd", wB, u, Cc)
    decay = cum.exp()
    y = y + torch.einsum("btdn,bdn,btn->btd", decay, h_prev, Cc)
    h_next = decay[:, -1] * h_prev + torch.einsum("bsdn,bsd->bdn", wB[:, -1], u)
    return y, h_next


def selective_scan_chunk(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         initial_state=None, output_final_state=False, chunk_size: int = 64
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    dt = acc_dtype(x.dtype)
    Bt, T, Di = x.shape
    N = A.shape[1]
    Delta = discretize(delta, delta_bias, delta_softplus, dt)
    h = (torch.zeros(Bt, Di, N, dtype=dt, device=x.device) if initial_state is None
         else initial_state.to(dt))
    L = max(1, min(chunk_size, T))
    n = math.ceil(T / L) if T > 0 else 0
    pad = n * L - T
    # Δ = 0 on padding: Ā = 1 and ΔBx = 0, so the state after the padding is h_{T−1}
    Delta = F.pad(Delta, (0, 0, 0, pad))
    u = Delta * F.pad(x.to(dt), (0, 0, 0, pad))
    dA = Delta[..., None] * A.to(dt)                                     # [Bt, T', Di, N]
    Bp, Cp = F.pad(B.to(dt), (0, 0, 0, pad)), F.pad(C.to(dt), (0, 0, 0, pad))
    ys = []
    ckpt = torch.is_grad_enabled() and n > 1
    for c in range(n):
        sl = slice(c * L, (c + 1) * L)
        args = (h, dA[:, sl], u[:, sl], Bp[:, sl], Cp[:, sl])
        yc, h = checkpoint(_chunk, *args, use_reentrant=False) if ckpt else _chunk(*args)
        ys.append(yc)
    y = torch.cat(ys, 1)[:, :T] if n > 0 else x.new_zeros(Bt, 0, Di, dtype=dt)
    return finish(y, x, D, z), (h if output_final_state else None)
