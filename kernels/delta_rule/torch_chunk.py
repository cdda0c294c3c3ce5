r"""Chunkwise-parallel delta rule in PyTorch (Yang et al. 2024, "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length"), the WY / UT form.

Split the sequence into chunks of C tokens. Within a chunk that starts from state S (rows
i = 1..C, K ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β ∈ R^C), unrolling S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ
gives the WY representation

    S_t = S + Σ_{i≤t} k_i (u_i − w_iᵀ S)ᵀ,
    u_i = β_i (v_i − Σ_{j<i} (k_iᵀ k_j) u_j),     w_i = β_i (k_i − Σ_{j<i} (k_iᵀ k_j) w_j),

which in matrix form is the UT transform with A = I + tril(diag(β) K Kᵀ, −1) (unit lower
triangular):  U = A⁻¹ diag(β) V,  W = A⁻¹ diag(β) K.  With the pseudo-values Ṽ = U − W S:

    O     = Q S + tril(Q Kᵀ) Ṽ          (tril includes the diagonal: o_t sees its own write)
    S_end = S + Kᵀ Ṽ

A⁻¹ is applied by a unit-triangular solve. U and W of all chunks are computed at once; only the
C-step-long recurrence over chunk states is sequential. A ragged tail is padded with β = 0, k = 0,
which leaves the state unchanged. Gradients come from autograd through these operations.

Linear cost in T: the per-chunk tensors are split once (``unbind``) before the chunk loop and the
outputs stacked once after it. Indexing chunk n inside the loop instead (``U[:, :, n]``) would
make autograd's backward of every such slice a zero-filled gradient of the whole sequence, so
forward+backward would grow as T²/C.

A per-channel β ([B, H, T, d_v]) runs as d_v scalar-β delta rules of value width 1
(``shapes.fold_channel_beta``).

The chunk scan itself (``wy_chunk_scan``) is the delta-rule family's, shared with
``kernels.gated_delta_rule.torch_chunk`` (the same form with the decay folded in, g given).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kernels.delta_rule.shapes import check_delta_rule_inputs, fold_channel_beta, unfold_channel_beta


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def reset_masks(resets: torch.Tensor, T: int, C: int, dtype):
    """Masks of the chunked forms for state resets inside the scan (masks, not slices): a sequence
    starts at every t with resets[b, t] (bool [B, T]), from a zero state. Per chunk n of C tokens
    (the tail padded): ``same`` [B, 1, N, C, C]: tokens i and j are in one sequence; ``carry``
    [B, 1, N, C, 1]: the state entering the chunk reaches token i (no start in the chunk up to i);
    ``last`` [B, 1, N, C, 1]: token i is in the chunk's last sequence (it reaches the state leaving
    the chunk); ``keep`` [B, 1, N, 1, 1]: no start in the chunk (the entering state survives it)."""
    B = resets.shape[0]
    r = F.pad(resets.to(torch.long), (0, (-T) % C))
    N = r.shape[1] // C
    seg = r.cumsum(1).view(B, N, C)                       # sequence index, running over the row
    first = seg[..., :1] - r.view(B, N, C)[..., :1]        # the sequence entering the chunk
    same = (seg[..., :, None] == seg[..., None, :]).to(dtype)[:, None]
    carry = (seg == first).to(dtype)[:, None, ..., None]
    last = (seg == seg[..., -1:]).to(dtype)[:, None, ..., None]
    keep = (seg[..., -1:] == first).to(dtype)[:, None, ..., None]
    return same, carry, last, keep


def wy_chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: Optional[torch.Tensor],
                  S: torch.Tensor, chunk_size: int, resets: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""The chunked WY/UT form of the delta-rule family, shared by the delta rule (g None) and the
    gated delta rule (g the log decay), on tensors already in the accumulation dtype: q, k
    [B, H, T, d_k], v [B, H, T, d_v], beta and g [B, H, T] (T ≥ 1), S the initial state
    [B, H, d_k, d_v]; resets [B, T] bool (``reset_masks``). Returns (o [B, H, T, d_v], final S).

    With g, per chunk γ_i = Σ_{s≤i} g_s and Γ_ij = exp(γ_i − γ_j) (i ≥ j; masked to −∞ above the
    diagonal before the exponential, so that no inf·0 reaches autograd):

        A = I + tril(diag(β) (K Kᵀ ∘ Γ), −1),   U = A⁻¹ diag(β) V,   W = A⁻¹ diag(β e^{γ}) K
        Ṽ = U − W S,   O = diag(e^{γ}) Q S + (Q Kᵀ ∘ Γ) Ṽ,   S_end = e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ Ṽ

    Without g every decay factor is 1 and is not formed (Γ = tril(1), a mask)."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = max(1, min(chunk_size, T))
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta = F.pad(beta, (0, pad))
        g = None if g is None else F.pad(g, (0, pad))
    N = (T + pad) // C
    q, k, v = (t.reshape(B, H, N, C, -1) for t in (q, k, v))
    beta = beta.reshape(B, H, N, C, 1)
    lower = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = lower.tril(-1)
    # the decay factors, None where they are 1: Γ, e^{γ_i}, e^{γ_C − γ_i}, e^{γ_C}
    Gam = eg = decay_end = chunk_decay = None
    if g is not None:
        gam = g.reshape(B, H, N, C).cumsum(-1)                                          # γ_i
        Gam = (gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        eg = gam.exp()[..., None]
        decay_end = (gam[..., -1:] - gam).exp()[..., None]
        chunk_decay = gam[..., -1].exp()[..., None, None]
    if resets is not None:
        # A and QK block-diagonal by sequence (A's inverse then is too); S reaches only the
        # chunk's first sequence (carry), and the next chunk only from its last one (last, keep)
        same, carry, last, keep = reset_masks(resets, T, C, k.dtype)
        Gam = same if Gam is None else Gam * same
        eg = carry if eg is None else eg * carry
        decay_end = last if decay_end is None else decay_end * last
        chunk_decay = keep if chunk_decay is None else chunk_decay * keep

    # UT transform of every chunk at once
    KK = beta * (k @ k.transpose(-1, -2))
    A = (KK if Gam is None else KK * Gam).masked_fill(~strict, 0.0)
    A = A + torch.eye(C, dtype=k.dtype, device=k.device)
    U = torch.linalg.solve_triangular(A, beta * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, beta * k if eg is None else beta * eg * k, upper=False,
                                      unitriangular=True)
    QK = (q @ k.transpose(-1, -2)).masked_fill(~lower, 0.0)
    QK = QK if Gam is None else QK * Gam
    Qg = q if eg is None else q * eg
    Kd = k if decay_end is None else k * decay_end

    outs = []
    # split once: slicing chunk n inside the loop would cost a full-size gradient per chunk
    per_chunk = [t.unbind(2) for t in (Qg, Kd, U, W, QK)]
    decays = chunk_decay.unbind(2) if chunk_decay is not None else [None] * N
    for Qg_n, Kd_n, U_n, W_n, QK_n, a_n in zip(*per_chunk, decays):
        v_new = U_n - W_n @ S
        outs.append(Qg_n @ S + QK_n @ v_new)
        S = (S if a_n is None else a_n * S) + Kd_n.transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(B, H, N * C, dv)[:, :, :T], S


def delta_rule_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                           chunk_size: int = 64, resets: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T] or [B, H, T, d_v] (per value
    channel); initial_state [B, H, d_k, d_v]; resets [B, T] bool (``reset_masks``). Returns (o in
    v's dtype, final state or None)."""
    if check_delta_rule_inputs("delta_rule_chunk_torch", q, k, v, beta, initial_state, chunk_size):
        H, dv = k.shape[1], v.shape[-1]
        o, S = delta_rule_chunk_torch(*fold_channel_beta(q, k, v, beta, initial_state),
                                      output_final_state, chunk_size, resets)
        return unfold_channel_beta(o, S, H, dv)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, beta = _acc(q), _acc(k), _acc(v), _acc(beta)
    if T == 0:
        S = None if not output_final_state else (
            torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if initial_state is None
            else _acc(initial_state).to(k.dtype))
        return v.new_zeros(B, H, 0, dv).to(out_dtype), S
    S = (torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if initial_state is None
         else _acc(initial_state).to(k.dtype))
    o, S = wy_chunk_scan(q, k, v, beta, None, S, chunk_size, resets)
    return o.to(out_dtype), (S if output_final_state else None)
