r"""What every backend of ``kernels.gated_delta_rule`` accepts, checked once at its entry.

Shapes: q, k [B, H, T, d_k]; v [B, H, T, d_v]; g [B, H, T] (the log decay, α_t = exp(g_t));
β [B, H, T]; initial_state [N, H, d_k, d_v] with N = B, or N = the number of sequences of a
packed ``cu_seqlens`` batch (Triton backend). q, k and v share one floating-point dtype; g and β
are floating point (any float dtype: they are read in the accumulation dtype).

Values (``check_gate_values``, run by the public entry ``gated_delta_rule``): g ≤ 0 (a decay,
α ∈ (0, 1]) and β ∈ [0, 1]. Reading them costs one copy of a flag to the host, so the check
is done once at the public entry and skipped inside ``torch.compile`` graphs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.delta_rule.shapes import check_delta_rule_inputs, check_gate_values


#: head dims the Triton kernels take (the state tile and the [C, d_k] operands are sized for these;
#: the compile gate checks d_k = 64, 128 with d_v = d_k and 2·d_k)
MAX_DK = 128
MAX_DV = 256


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def check_gated_delta_rule_inputs(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  g: torch.Tensor, beta: torch.Tensor,
                                  initial_state: Optional[torch.Tensor] = None,
                                  chunk_size: Optional[int] = None,
                                  cu_seqlens: Optional[torch.Tensor] = None) -> None:
    """Raises ValueError naming the first problem (the argument and what it should be)."""
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"{name}: g must be a tensor, got {type(g).__name__}")
    if check_delta_rule_inputs(name, q, k, v, beta, initial_state, chunk_size, cu_seqlens):
        raise ValueError(f"{name}: beta must be [B, H, T] = {tuple(k.shape[:3])} (one write strength per "
                         f"token and head), got {_shape(beta)}")
    if not g.is_floating_point():
        raise ValueError(f"{name}: g must be a floating-point tensor (the log decay), got {g.dtype}")
    if _shape(g) != _shape(beta):
        raise ValueError(f"{name}: g (the log decay) must be [B, H, T] = {tuple(k.shape[:3])}, got {_shape(g)}")
    if g.device != k.device:
        raise ValueError(f"{name}: g is on {g.device}, the other inputs on {k.device}")


__all__ = ["check_gated_delta_rule_inputs", "check_gate_values", "MAX_DK", "MAX_DV"]
