r"""Chunkwise-parallel gated delta rule in PyTorch: the WY/UT form of ``kernels.delta_rule``
(Yang et al. 2024) with the decay folded in (Yang, Kautz & Hatamizadeh 2025, §3.3).

Split the sequence into chunks of C tokens. Inside a chunk that starts from state S, let
γ_i = Σ_{s≤i} g_s (cumulative log decay from the chunk start, i = 1..C) and Γ_ij = exp(γ_i − γ_j)
for i ≥ j (0 above the diagonal; every entry ≤ 1). Unrolling
S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ gives

    S_t = e^{γ_t} S + Σ_{i≤t} e^{γ_t − γ_i} k_i (u_i − w_iᵀ S)ᵀ

with, in matrix form (K ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β, γ ∈ R^C),

    A  = I + tril(diag(β) (K Kᵀ ∘ Γ), −1)             (unit lower triangular)
    U  = A⁻¹ diag(β) V,       W = A⁻¹ diag(β e^{γ}) K,       Ṽ = U − W S
    O  = diag(e^{γ}) Q S + (Q Kᵀ ∘ Γ) Ṽ                (Γ's tril includes the diagonal)
    S_end = e^{γ_C} S + (diag(e^{γ_C − γ}) K)ᵀ Ṽ

α ≡ 1 (γ = 0, Γ = tril(1)) is the delta rule's form. Every exponent is ≤ 0 (γ is non-increasing
inside a chunk), so nothing overflows; Γ's upper triangle is masked before the exponential so
that no inf·0 reaches the backward pass. A ragged tail is padded with g = 0, β = 0, k = 0, which
leaves the state unchanged. Gradients come from autograd through these operations.

The scan is the delta-rule family's ``kernels.delta_rule.torch_chunk.wy_chunk_scan`` with g given
(the delta rule runs it without): linear cost in T, the per-chunk tensors split once (``unbind``)
before the chunk loop and the outputs stacked once after it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.delta_rule.torch_chunk import wy_chunk_scan
from kernels.gated_delta_rule.shapes import check_gated_delta_rule_inputs


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def gated_delta_rule_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                                 output_final_state: bool = False, chunk_size: int = 64,
                                 resets: Optional[torch.Tensor] = None
                                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; g, beta [B, H, T]; initial_state [B, H, d_k, d_v];
    resets [B, T] bool: a sequence starts there from a zero state (masks inside the scan:
    ``kernels.delta_rule.torch_chunk.reset_masks``). Returns (o in v's dtype, final state in the
    accumulation dtype or None)."""
    check_gated_delta_rule_inputs("gated_delta_rule_chunk_torch", q, k, v, g, beta, initial_state, chunk_size)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v = _acc(q), _acc(k), _acc(v)
    g, beta = g.to(k.dtype), beta.to(k.dtype)
    S = (torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if initial_state is None
         else _acc(initial_state).to(k.dtype))
    if T == 0:
        return v.new_zeros(B, H, 0, dv).to(out_dtype), (S if output_final_state else None)
    o, S = wy_chunk_scan(q, k, v, beta, g, S, chunk_size, resets)
    return o.to(out_dtype), (S if output_final_state else None)
