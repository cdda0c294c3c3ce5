r"""Mamba's selective scan (Gu & Dao 2023):

    h_t = exp(Δ_t A) ⊙ h_{t−1} + (Δ_t x_t) B_t,    y_t = C_t · h_t + D ⊙ x_t,    out_t = y_t ⊙ SiLU(z_t)

with Δ_t = softplus(δ_t + δ_bias) when ``delta_softplus``. ``reference.py`` is the
specification; ``torch_chunk.py`` the chunked PyTorch form; a Triton kernel in ``chunk.py``
serves ``backend="triton"`` when present.
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from kernels.selective_scan.reference import selective_scan_ref
from kernels.selective_scan.torch_chunk import selective_scan_chunk


def has_triton_backend() -> bool:
    return importlib.util.find_spec("kernels.selective_scan.chunk") is not None


def selective_scan(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                   delta_bias: Optional[torch.Tensor] = None, delta_softplus: bool = False,
                   initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                   backend: str = "torch", chunk_size: int = 64
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x, delta, z: [Bt, T, Di]; A: [Di, N]; B, C: [Bt, T, N]; D, delta_bias: [Di];
    initial_state: [Bt, Di, N]. Returns out [Bt, T, Di] (x's dtype) and, if
    ``output_final_state``, h_{T−1} [Bt, Di, N] in the accumulation dtype (float32 for half).
    ``backend``: "torch" (chunked PyTorch), "reference" (sequential), "triton"."""
    Bt, T, Di = x.shape
    N = A.shape[-1]
    if delta.shape != x.shape or A.shape != (Di, N) or B.shape != (Bt, T, N) or C.shape != (Bt, T, N):
        raise ValueError(f"selective_scan: expected x, delta [Bt, T, Di], A [Di, N], B, C [Bt, T, N]; got "
                         f"x {tuple(x.shape)}, delta {tuple(delta.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if initial_state is not None and initial_state.shape != (Bt, Di, N):
        raise ValueError(f"selective_scan: initial_state must be [Bt, Di, N] = {(Bt, Di, N)}, "
                         f"got {tuple(initial_state.shape)}")
    args = (x, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, output_final_state)
    if backend == "torch":
        return selective_scan_chunk(*args, chunk_size=chunk_size)
    if backend == "reference":
        return selective_scan_ref(*args)
    if backend == "triton":
        if not has_triton_backend():
            raise RuntimeError("selective_scan: backend='triton' needs kernels/selective_scan/chunk.py, which is absent")
        from kernels.selective_scan.chunk import selective_scan_triton
        return selective_scan_triton(*args, chunk_size=chunk_size)
    raise ValueError(f"selective_scan: backend must be torch, reference or triton, got {backend!r}")


__all__ = ["selective_scan", "selective_scan_ref", "selective_scan_chunk", "has_triton_backend"]
