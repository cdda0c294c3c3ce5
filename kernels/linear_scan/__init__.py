r"""Gated linear recurrence with log-space gates, element-wise over channels:

    h_t = exp(log_a_t) ⊙ h_{t−1} + b_t,     log_a, b ∈ R^{B×T×D},  h_{−1} = initial_state ∈ R^{B×D}

Used by Griffin's RG-LRU (De et al. 2024) and any diagonal linear RNN. ``reference.py`` is the
specification (one step per token); ``torch_chunk.py`` the chunked PyTorch form; a Triton kernel
in ``chunk.py`` serves ``backend="triton"`` when present.
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from kernels.linear_scan.reference import linear_scan_ref
from kernels.linear_scan.torch_chunk import linear_scan_chunk


def has_triton_backend() -> bool:
    return importlib.util.find_spec("kernels.linear_scan.chunk") is not None


def linear_scan(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                output_final_state: bool = False, backend: str = "torch", chunk_size: int = 64
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h [B, T, D] (b's dtype) and, if ``output_final_state``, h_{T−1} [B, D] in the accumulation
    dtype (float32 for half inputs). ``backend``: "torch" (chunked PyTorch), "reference"
    (sequential), "triton"."""
    if log_a.shape != b.shape or b.dim() != 3:
        raise ValueError(f"linear_scan: log_a and b must both be [B, T, D], got {tuple(log_a.shape)} and {tuple(b.shape)}")
    if initial_state is not None and initial_state.shape != (b.shape[0], b.shape[2]):
        raise ValueError(f"linear_scan: initial_state must be [B, D] = {(b.shape[0], b.shape[2])}, "
                         f"got {tuple(initial_state.shape)}")
    if backend == "torch":
        return linear_scan_chunk(log_a, b, initial_state, output_final_state, chunk_size)
    if backend == "reference":
        return linear_scan_ref(log_a, b, initial_state, output_final_state)
    if backend == "triton":
        if not has_triton_backend():
            raise RuntimeError("linear_scan: backend='triton' needs kernels/linear_scan/chunk.py, which is absent")
        from kernels.linear_scan.chunk import linear_scan_triton
        return linear_scan_triton(log_a, b, initial_state, output_final_state, chunk_size)
    raise ValueError(f"linear_scan: backend must be torch, reference or triton, got {backend!r}")


__all__ = ["linear_scan", "linear_scan_ref", "linear_scan_chunk", "has_triton_backend"]
