r"""The gated delta rule, one token at a time: the specification of ``kernels.gated_delta_rule``.

Per batch element and head, with state S ∈ R^{d_k×d_v}, decay α_t = exp(g_t) ∈ (0, 1] and write
strength β_t ∈ [0, 1] (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks", eq. 10, in the
state layout of ``kernels.delta_rule``):

    S_t = α_t S_{t−1} + β_t k_t (v_t − α_t S_{t−1}ᵀ k_t)ᵀ
        = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ
    o_t = S_tᵀ q_t

i.e. the state first decays by α_t, then the value stored under k_t is moved a fraction β_t of
the way to v_t. α ≡ 1 is the delta rule. It is KDA's recurrence (``kernels/kda/reference.py``)
with one decay for every key channel, and runs as that. Inputs are used as given: feature maps,
normalization and any query scale are the caller's.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.gated_delta_rule.shapes import check_gated_delta_rule_inputs


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                               output_final_state: bool = False
                               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; g, beta [B, H, T]; initial_state [B, H, d_k, d_v].
    Returns o [B, H, T, d_v] in v's dtype and the final state (accumulation dtype) if asked."""
    check_gated_delta_rule_inputs("gated_delta_rule_reference", q, k, v, g, beta, initial_state)
    # Diag(α_t) with every channel's decay equal: KDA's recurrence with g broadcast over d_k
    # imported here: kernels.kda imports this package (its Triton entry takes the launch configs of chunk.py)
    from kernels.kda.reference import kda_reference
    return kda_reference(q, k, v, g[..., None].expand(k.shape), beta, initial_state, output_final_state)
