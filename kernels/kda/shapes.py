r"""What every backend of ``kernels.kda`` accepts, checked once at its entry.

Shapes (the project's BHTD layout): q, k [B, H, T, d_k]; v [B, H, T, d_v]; g [B, H, T, d_k] the
per-channel log decay (α_t = exp(g_t) ∈ (0, 1]^{d_k}); β [B, H, T]; initial_state [N, H, d_k, d_v]
with N = B, or N = the number of sequences of a packed ``cu_seqlens`` batch (B = 1). q, k and v
share one floating-point dtype; g and β are floating point (read in the accumulation dtype).

Values (``check_kda_gate_values``, run by the public entry ``kda``): g ≤ 0 and β ∈ [0, 1]; one
flag read back to the host, skipped inside ``torch.compile`` graphs.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.delta_rule.shapes import check_delta_rule_inputs, check_gate_values


def check_kda_inputs(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                     chunk_size: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None) -> None:
    """Raises ValueError naming the first problem (the argument and what it should be)."""
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"{name}: g must be a tensor, got {type(g).__name__}")
    if check_delta_rule_inputs(name, q, k, v, beta, initial_state, chunk_size, cu_seqlens):
        raise ValueError(f"{name}: beta must be [B, H, T] = {tuple(k.shape[:3])} (one write strength per "
                         f"token and head), got {tuple(beta.shape)}")
    if not g.is_floating_point():
        raise ValueError(f"{name}: g must be a floating-point tensor (the log decay), got {g.dtype}")
    if tuple(g.shape) != tuple(k.shape):
        raise ValueError(f"{name}: g (the per-channel log decay) must be [B, H, T, d_k] = {tuple(k.shape)}, "
                         f"got {tuple(g.shape)}")
    if g.device != k.device:
        raise ValueError(f"{name}: g is on {g.device}, the other inputs on {k.device}")


def check_kda_gate_values(name: str, g: torch.Tensor, beta: torch.Tensor) -> None:
    """g ≤ 0 and 0 ≤ β ≤ 1 (NaN fails both): the gated delta rule's check, which reads any shape
    of g (one flag read back to the host)."""
    check_gate_values(name, g, beta)


__all__ = ["check_kda_inputs", "check_kda_gate_values"]
