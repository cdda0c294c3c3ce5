r"""Titans linear neural memory with momentum and forgetting (Behrouz et al. 2025):

    S_t = η_t S_{t−1} − θ_t ∇ℓ(M̂_t; k_t, v_t),   M_t = (1 − α_t) M_{t−1} + S_t,   o_t = M_t(q_t)

with ℓ(M; k, v) = ‖Mᵀk − v‖² and gradients within a chunk taken at the memory at the chunk's start
(see ``reference.py``, the specification). ``torch_chunk.py`` is the chunk-parallel form; its
``chunk_decays`` / ``chunk_memory_step`` also serve the MLP memory of the Titans mixer.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from kernels.titans.reference import titans_linear_reference
from kernels.titans.torch_chunk import (chunk_decays, chunk_memory_step, chunk_spans,
                                        titans_linear_chunk_torch)

#: implementations ``titans_linear`` can dispatch to
BACKENDS = ("torch", "reference", "triton")


def titans_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                  log_eta: torch.Tensor, log_keep: torch.Tensor,
                  initial_state: Optional[Sequence[torch.Tensor]] = None, output_final_state: bool = False,
                  backend: str = "torch", chunk_size: int = 16, offset: int = 0
                  ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; theta (θ_t), log_eta (log η_t), log_keep
    (log(1 − α_t)) [B, H, T]; initial_state None or (M, S) or (M, S, M̂), each [B, H, d_k, d_v].

    ``offset``: tokens of the current chunk already consumed (their chunk's anchor is M̂).
    Returns (o [B, H, T, d_v] in v's dtype, (M, S, M̂) in the accumulation dtype or None)."""
    if backend == "torch":
        return titans_linear_chunk_torch(q, k, v, theta, log_eta, log_keep, initial_state,
                                         output_final_state, chunk_size, offset)
    if backend == "triton":
        # imported here so that importing kernels.titans neither needs triton nor fixes
        # TRITON_INTERPRET before a caller sets it
        from kernels.titans.chunk import titans_linear_triton
        return titans_linear_triton(q, k, v, theta, log_eta, log_keep, initial_state,
                                    output_final_state, chunk_size, offset)
    if backend == "reference":
        return titans_linear_reference(q, k, v, theta, log_eta, log_keep, initial_state,
                                       output_final_state, chunk_size, offset)
    raise ValueError(f"titans_linear: unknown backend {backend!r}; available: {list(BACKENDS)}")


__all__ = ["titans_linear", "titans_linear_reference", "titans_linear_chunk_torch", "chunk_decays",
           "chunk_memory_step", "chunk_spans", "BACKENDS"]
