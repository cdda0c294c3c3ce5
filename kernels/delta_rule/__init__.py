r"""The delta rule (Schlag et al. 2021; Widrow & Hoff 1960), the fast-weight update of DeltaNet:

    S_t = S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t

``reference.py`` is the sequential specification; ``torch_chunk.py`` the chunkwise WY/UT form
(Yang et al. 2024) used for training; ``chunk.py`` the same form as Triton kernels (forward and
backward, optional variable-length batches via ``delta_rule_triton(..., cu_seqlens=...)``).
Every backend checks its inputs at entry (``shapes.py``) and accepts a per-channel β
[B, H, T, d_v] as well as the per-head β [B, H, T].
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract, backends_listed
from kernels.delta_rule.reference import delta_rule_reference
from kernels.delta_rule.shapes import check_delta_rule_inputs
from kernels.delta_rule.torch_chunk import delta_rule_chunk_torch

try:
    from kernels.delta_rule.chunk import delta_rule_triton
except ImportError:  # no triton installed: the PyTorch forms still work
    delta_rule_triton = None

#: implementations ``delta_rule`` can dispatch to
BACKENDS = ("torch", "reference") + (("triton",) if delta_rule_triton is not None else ())
#: what the Triton backend covers (``kernels.contract``): every head size, packed sequences, states
CONTRACT = OpContract("kernels.delta_rule", backends_listed(sys.modules[__name__]))


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
               backend: str = "torch", chunk_size: int = 64) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T], or [B, H, T, d_v] for one write
    strength per value channel (see ``shapes.py``); initial_state [B, H, d_k, d_v] or None.

    Returns (o [B, H, T, d_v] in v's dtype, final state [B, H, d_k, d_v] in the accumulation
    dtype — float32 for half inputs — or None unless ``output_final_state``). ``backend``: "torch"
    (chunked, ``chunk_size`` tokens per chunk), "triton" (``chunk.py``; chunk rounded to a power
    of two in [16, 64] and capped per dtype and GPU by ``chunk.launch_meta``; the result does not
    depend on it) or "reference" (sequential)."""
    check_delta_rule_inputs("delta_rule", q, k, v, beta, initial_state, chunk_size)
    if backend == "triton" and delta_rule_triton is not None:
        return delta_rule_triton(q, k, v, beta, initial_state, output_final_state, chunk_size)
    if backend == "torch":
        return delta_rule_chunk_torch(q, k, v, beta, initial_state, output_final_state, chunk_size)
    if backend == "reference":
        return delta_rule_reference(q, k, v, beta, initial_state, output_final_state)
    raise ValueError(f"delta_rule: unknown backend {backend!r}; available: {list(BACKENDS)}")


__all__ = ["CONTRACT", "delta_rule", "delta_rule_reference", "delta_rule_chunk_torch", "delta_rule_triton", "BACKENDS"]
