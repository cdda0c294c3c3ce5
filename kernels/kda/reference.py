r"""Kimi Delta Attention (KDA), one token at a time: the specification of ``kernels.kda``.

Per batch element and head, with state S ∈ R^{d_k×d_v}, a per-channel decay α_t = exp(g_t) ∈
(0, 1]^{d_k} and write strength β_t ∈ [0, 1] (Kimi Team 2025, "Kimi Linear: An Expressive,
Efficient Attention Architecture", eq. 1, in the state layout of ``kernels.delta_rule``):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ
    o_t = S_tᵀ q_t

i.e. row c of the state (key channel c) first decays by α_{t,c}, then the value stored under k_t
is moved a fraction β_t of the way to v_t. A decay equal over the channels (α_{t,c} = α_t) is the
gated delta rule (``kernels.gated_delta_rule``), α ≡ 1 the delta rule. Inputs are used as given:
feature maps, normalization and the query scale are the caller's (flash-linear-attention's
``chunk_kda`` scales q by d_k^−1/2 inside; here the mixer does).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.kda.shapes import check_kda_inputs


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k, g [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T]; initial_state [B, H, d_k, d_v].
    Returns o [B, H, T, d_v] in v's dtype and the final state (accumulation dtype) if asked."""
    check_kda_inputs("kda_reference", q, k, v, g, beta, initial_state)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v = _acc(q), _acc(k), _acc(v)
    g, beta = g.to(k.dtype), beta.to(k.dtype)
    S = (torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if initial_state is None
         else _acc(initial_state).to(k.dtype))
    a = g.exp()
    outs = []
    for t in range(T):
        k_t, v_t, q_t = k[:, :, t], v[:, :, t], q[:, :, t]
        S = a[:, :, t, :, None] * S
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, :, t, None] * (v_t - v_old))
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
    o = torch.stack(outs, dim=2) if T > 0 else v.new_zeros(B, H, 0, dv)
    return o.to(out_dtype), (S if output_final_state else None)


__all__ = ["kda_reference"]
