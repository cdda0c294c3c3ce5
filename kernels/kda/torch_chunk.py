r"""Chunkwise-parallel KDA in PyTorch: the WY/UT form of ``kernels.gated_delta_rule`` with the
decay per key channel (Kimi Team 2025, "Kimi Linear", §3 and App. A).

Split the sequence into chunks of C tokens. Inside a chunk that starts from state S, let
γ_i = Σ_{s≤i} g_s ∈ R^{d_k} (cumulative log decay per channel from the chunk start). Unrolling
S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ gives

    S_t = Diag(e^{γ_t}) S + Σ_{i≤t} Diag(e^{γ_t − γ_i}) k_i (u_i − w_iᵀ S)ᵀ

with, for rows t, i of the chunk,

    P(x)_ti = Σ_c x_tc k_ic e^{γ_tc − γ_ic}   (i ≤ t; 0 above the diagonal)
    A  = I + tril(diag(β) P(K), −1)            (unit lower triangular)
    U  = A⁻¹ diag(β) V,     W = A⁻¹ diag(β) (K ∘ e^{γ}),     Ṽ = U − W S
    O  = (Q ∘ e^{γ}) S + P(Q) Ṽ
    S_end = Diag(e^{γ_C}) S + (K ∘ e^{γ_C − γ})ᵀ Ṽ

A decay equal over the channels is the gated delta rule's form (P(x) = (X Kᵀ) ∘ Γ).

Stability. γ is non-increasing inside a chunk (g ≤ 0), so every factor above is e^{(later) −
(earlier)} ≤ 1: nothing overflows, whatever the decay (a log decay of −20 per token over a chunk of
64 is −1280, e^{−1280} = 0 in any float type, and 0 is the right value to rounding). The one
place a naive form overflows is P: written as (X ∘ e^{γ}) (K ∘ e^{−γ})ᵀ it needs e^{−γ_i}, which
is e^{+1280} there. Instead P is built from blocks of ``SUB`` = 16 rows: for a block of rows
a and the columns of the earlier blocks, with r the last token before block a (so i ≤ r ≤ t),

    e^{γ_t − γ_i} = e^{γ_t − γ_r} · e^{γ_r − γ_i},    both factors ≤ 1,

and that block of P is one matrix product (X_a ∘ e^{γ_a − γ_r}) (K_{<a} ∘ e^{γ_r − γ_{<a}})ᵀ; where
the product underflows so does the true value. Inside a block (i, t both in it) the exponents
are taken per pair: a [16, 16, d_k] tensor, its upper triangle set to −∞ before the exponential
so that no inf·0 reaches the backward. flash-linear-attention's ``chunk_kda`` does the same: its
intra-chunk kernel (``fla/ops/kda/chunk_intra.py``) splits a chunk of 64 into sub-chunks of 16,
computes the off-diagonal sub-chunk blocks of A_kk and A_qk as products of k and q scaled by the
exponential of the gate's difference to a reference row between the two sub-chunks, and the
diagonal sub-chunks token by token; the state and output kernels only ever use e^{γ_C − γ_i} and
e^{γ_i}. (FLA's layer also bounds the gate from below, ``lower_bound``; this op needs no bound.)

A ragged tail is padded with g = 0, β = 0, k = 0, which leaves the state unchanged. Gradients come
from autograd through these operations. Linear cost in T: the per-chunk tensors are split once
(``unbind``) before the chunk loop and the outputs stacked once after it (see
``kernels/delta_rule/torch_chunk.py``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kernels.delta_rule.torch_chunk import reset_masks
from kernels.kda.shapes import check_kda_inputs

#: rows per block of the decayed scores P (module docstring)
SUB = 16


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def decayed_scores(x: torch.Tensor, k: torch.Tensor, gam: torch.Tensor, sub: int = SUB) -> torch.Tensor:
    """P(x)_ti = Σ_c x_tc k_ic e^{γ_tc − γ_ic} for i ≤ t (0 above the diagonal) of every chunk:
    x, k, gam [..., C, d_k] → [..., C, C]; gam non-increasing along C (module docstring)."""
    C = x.shape[-2]
    c = sub if C % sub == 0 else C
    xb, kb, gb = x.split(c, -2), k.split(c, -2), gam.split(c, -2)
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()[..., None]
    rows = []
    for a, (xa, ka, ga) in enumerate(zip(xb, kb, gb)):
        d = (ga[..., :, None, :] - ga[..., None, :, :]).masked_fill(~lower, float("-inf")).exp()
        parts = []
        if a:
            r = gb[a - 1][..., -1:, :]                                     # γ_r: the token before block a
            k_prev = torch.cat(kb[:a], -2) * (r - torch.cat(gb[:a], -2)).exp()
            parts.append((xa * (ga - r).exp()) @ k_prev.transpose(-1, -2))
        parts.append((xa[..., :, None, :] * ka[..., None, :, :] * d).sum(-1))
        if a < len(xb) - 1:
            parts.append(x.new_zeros(*x.shape[:-2], c, C - (a + 1) * c))
        rows.append(torch.cat(parts, -1))
    return torch.cat(rows, -2)


def kda_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                    chunk_size: int = 64, resets: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k, g [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T]; initial_state [B, H, d_k, d_v];
    resets [B, T] bool: a sequence starts there from a zero state (masks inside the scan:
    ``kernels.delta_rule.torch_chunk.reset_masks``). Returns (o in v's dtype, final state in the
    accumulation dtype or None)."""
    check_kda_inputs("kda_chunk_torch", q, k, v, g, beta, initial_state, chunk_size)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v = _acc(q), _acc(k), _acc(v)
    g, beta = g.to(k.dtype), beta.to(k.dtype)
    S = (torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if initial_state is None
         else _acc(initial_state).to(k.dtype))
    if T == 0:
        return v.new_zeros(B, H, 0, dv).to(out_dtype), (S if output_final_state else None)
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (t.reshape(B, H, N, C, -1) for t in (q, k, v, g))
    beta = beta.reshape(B, H, N, C, 1)
    gam = g.cumsum(-2)                                                   # γ_i [.., C, d_k]
    Pk, Pq = decayed_scores(k, k, gam), decayed_scores(q, k, gam)
    eg = gam.exp()                                                       # e^{γ_i}
    decay_end = (gam[..., -1:, :] - gam).exp()                           # e^{γ_C − γ_i}
    chunk_decay = gam[..., -1, :].exp()[..., None]                       # e^{γ_C} [.., d_k, 1]
    if resets is not None:
        same, carry, last, keep = reset_masks(resets, T, C, k.dtype)
        Pk, Pq = Pk * same, Pq * same
        eg, decay_end, chunk_decay = eg * carry, decay_end * last, chunk_decay * keep

    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    A = (beta * Pk).masked_fill(~strict, 0.0) + torch.eye(C, dtype=k.dtype, device=k.device)
    U = torch.linalg.solve_triangular(A, beta * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, beta * eg * k, upper=False, unitriangular=True)
    Qg = q * eg
    Kd = k * decay_end

    outs = []
    # split once: slicing chunk n inside the loop would cost a full-size gradient per chunk
    for Qg_n, Kd_n, U_n, W_n, P_n, a_n in zip(*(t.unbind(2) for t in (Qg, Kd, U, W, Pq, chunk_decay))):
        v_new = U_n - W_n @ S
        outs.append(Qg_n @ S + P_n @ v_new)
        S = a_n * S + Kd_n.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, dv)[:, :, :T]
    return o.to(out_dtype), (S if output_final_state else None)


__all__ = ["kda_chunk_torch", "decayed_scores", "SUB"]
