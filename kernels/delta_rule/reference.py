r"""The delta rule, one token at a time: the specification of ``kernels.delta_rule``.

Per batch element and head, with state S ∈ R^{d_k×d_v} (the fast weight W = Sᵀ of Schlag et al.
2021) and write strength β_t ∈ (0, 1):

    S_t = S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ  =  (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ
    o_t = S_tᵀ q_t

i.e. the value stored under k_t is moved a fraction β_t of the way towards v_t. With a
per-channel β_t ∈ R^{d_v} (β of shape [B, H, T, d_v]) the write is β_t ∘ (v_t − S_{t−1}ᵀ k_t):
value channel j moves a fraction β_{t,j} of the way (see ``shapes.py``). Inputs are used as
given: feature maps, normalization and any query scale are the caller's.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.delta_rule.shapes import check_delta_rule_inputs


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False
                         ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T] or [B, H, T, d_v] (per value
    channel); initial_state [B, H, d_k, d_v].
    Returns o [B, H, T, d_v] in v's dtype and the final state (accumulation dtype) if asked."""
    per_channel = check_delta_rule_inputs("delta_rule_reference", q, k, v, beta, initial_state)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, beta = _acc(q), _acc(k), _acc(v), _acc(beta)
    S = (torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if initial_state is None
         else _acc(initial_state).to(k.dtype))
    outs = []
    for t in range(T):
        k_t, v_t, q_t = k[:, :, t], v[:, :, t], q[:, :, t]
        b_t = beta[:, :, t] if per_channel else beta[:, :, t, None]
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v_t - v_old))
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
    o = torch.stack(outs, dim=2) if T > 0 else v.new_zeros(B, H, 0, dv)
    return o.to(out_dtype), (S if output_final_state else None)
