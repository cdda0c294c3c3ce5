r"""Mamba's selective scan (Gu & Dao 2023):

    h_t = exp(Δ_t A) ⊙ h_{t−1} + (Δ_t x_t) B_t,    y_t = C_t · h_t + D ⊙ x_t,    out_t = y_t ⊙ SiLU(z_t)

with Δ_t = softplus(δ_t + δ_bias) when ``delta_softplus``. ``reference.py`` is the
specification; ``torch_chunk.py`` the chunked PyTorch form; the Triton kernels in ``chunk.py``
serve ``backend="triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract
from kernels.selective_scan.reference import check_inputs, selective_scan_ref
from kernels.selective_scan.torch_chunk import selective_scan_chunk


def has_triton_backend() -> bool:
    return importlib.util.find_spec("kernels.selective_scan.chunk") is not None


#: what the Triton backend covers (``kernels.contract``): every width, packed sequences, states
CONTRACT = OpContract("kernels.selective_scan", lambda: None if has_triton_backend() else "kernels/selective_scan has no Triton kernel")


def selective_scan(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                   delta_bias: Optional[torch.Tensor] = None, delta_softplus: bool = False,
                   initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                   backend: str = "torch", chunk_size: int = 64,
                   cu_seqlens: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x, delta, z: [Bt, T, Di]; A: [Di, N]; B, C: [Bt, T, N]; D, delta_bias: [Di];
    initial_state: [Bt, Di, N]. Returns out [Bt, T, Di] (x's dtype) and, if
    ``output_final_state``, h_{T−1} [Bt, Di, N] in the accumulation dtype (float32 for half).
    ``backend``: "torch" (chunked PyTorch), "reference" (sequential), "triton".
    ``cu_seqlens`` (int32 [S+1], Bt = 1): S packed sequences, the state restarting at each (from
    ``initial_state`` [S, Di, N] or 0); the final state is then [S, Di, N]. The Triton kernel
    runs them in one launch; the other backends run one call per sequence (reading the offsets
    on the host)."""
    check_inputs("selective_scan", x, delta, A, B, C, initial_state, cu_seqlens)
    if backend == "triton":
        if not has_triton_backend():
            raise RuntimeError("selective_scan: backend='triton' needs kernels/selective_scan/chunk.py, which is absent")
        from kernels.selective_scan.chunk import selective_scan_triton
        return selective_scan_triton(x, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                                     output_final_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if backend not in ("torch", "reference"):
        raise ValueError(f"selective_scan: backend must be torch, reference or triton, got {backend!r}")
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        sizes = [s1 - s0 for s0, s1 in zip(bounds[:-1], bounds[1:])]
        if bounds[-1] != x.shape[1] or bounds[0] != 0 or min(sizes) < 0:
            raise ValueError(f"selective_scan: cu_seqlens must rise from 0 to T = {x.shape[1]}, got {bounds}")
        # each input split once (slicing per sequence would make each slice's backward write a
        # zero-filled gradient of the whole packed row)
        pieces = [t.split(sizes, 1) if t is not None else [None] * len(sizes) for t in (x, delta, B, C, z)]
        h0s = initial_state.unbind(0) if initial_state is not None else [None] * len(sizes)
        parts = [selective_scan(xs, ds, A, bs, cs, D, zs, delta_bias, delta_softplus,
                                None if h0 is None else h0[None], True, backend, chunk_size)
                 for xs, ds, bs, cs, zs, h0 in zip(*pieces, h0s)]
        out = torch.cat([p[0] for p in parts], 1) if parts else x
        return out, (torch.cat([p[1] for p in parts], 0) if output_final_state else None)
    args = (x, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, output_final_state)
    if backend == "torch":
        return selective_scan_chunk(*args, chunk_size=chunk_size)
    return selective_scan_ref(*args)


__all__ = ["CONTRACT", "selective_scan", "selective_scan_ref", "selective_scan_chunk", "has_triton_backend"]
