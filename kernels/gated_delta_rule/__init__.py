r"""The gated delta rule (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2
with Delta Rule"), the recurrence of Gated DeltaNet:

    S_t = α_t S_{t−1} + β_t k_t (v_t − α_t S_{t−1}ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t,     α_t = exp(g_t)

``reference.py`` is the sequential specification; ``torch_chunk.py`` the chunkwise WY/UT form
with the decay folded in; ``chunk.py`` the same form as Triton kernels (forward and backward,
variable-length batches via ``gated_delta_rule_triton(..., cu_seqlens=...)``). Every backend checks its inputs' shapes
and dtypes at entry (``shapes.py``); the public function also checks g ≤ 0 and β ∈ [0, 1].
Design notes: ``kernels/gated_delta_rule/README.md``.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract, backends_listed
from kernels.gated_delta_rule.reference import gated_delta_rule_reference
from kernels.gated_delta_rule.shapes import MAX_DK, MAX_DV, check_gate_values, check_gated_delta_rule_inputs
from kernels.gated_delta_rule.torch_chunk import gated_delta_rule_chunk_torch

try:
    from kernels.gated_delta_rule.chunk import gated_delta_rule_triton
except ImportError:  # no triton installed: the PyTorch forms still work
    gated_delta_rule_triton = None

#: implementations ``gated_delta_rule`` can dispatch to
BACKENDS = ("torch", "reference") + (("triton",) if gated_delta_rule_triton is not None else ())
#: what the Triton backend covers (``kernels.contract``): d_k ≤ MAX_DK, d_v ≤ MAX_DV
CONTRACT = OpContract("kernels.gated_delta_rule", backends_listed(sys.modules[__name__]),
                      max_dims={"d_k": MAX_DK, "d_v": MAX_DV})


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                     backend: str = "torch", chunk_size: int = 64
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; g [B, H, T] the log decay (≤ 0), or [B, H, T, d_k]
    one per key channel (KDA's recurrence, run by ``kernels.kda`` on the same backend); beta
    [B, H, T] in [0, 1]; initial_state [B, H, d_k, d_v] or None.

    Returns (o [B, H, T, d_v] in v's dtype, final state [B, H, d_k, d_v] in the accumulation
    dtype — float32 for half inputs — or None unless ``output_final_state``). ``backend``: "torch"
    (chunked, ``chunk_size`` tokens per chunk; the result does not depend on it), "triton"
    (``chunk.py``; d_k ≤ 128, d_v ≤ 256; kernel chunk a power of two in [16, 64] capped per dtype
    and GPU as the delta rule's) or "reference" (sequential)."""
    if isinstance(g, torch.Tensor) and g.dim() == 4:
        return _per_channel(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size)
    check_gated_delta_rule_inputs("gated_delta_rule", q, k, v, g, beta, initial_state, chunk_size)
    if backend not in BACKENDS:
        raise ValueError(f"gated_delta_rule: unknown backend {backend!r}; available: {list(BACKENDS)}")
    if not torch.compiler.is_compiling():
        check_gate_values("gated_delta_rule", g, beta)
    return _dispatch(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size)


def gated_delta_rule_trusted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                             output_final_state: bool = False, backend: str = "torch", chunk_size: int = 64
                             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``gated_delta_rule`` for callers whose g and β are in range by construction (Gated
    DeltaNet's g = −exp(A_log)·softplus(·) ≤ 0 and β = σ(·)): shapes and dtypes are checked,
    the values are not, which saves the copy of a flag to the host per call."""
    check_gated_delta_rule_inputs("gated_delta_rule", q, k, v, g, beta, initial_state, chunk_size)
    if backend not in BACKENDS:
        raise ValueError(f"gated_delta_rule: unknown backend {backend!r}; available: {list(BACKENDS)}")
    return _dispatch(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size)


def _per_channel(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size):
    """A per-channel log decay g [B, H, T, d_k]: KDA's recurrence (``kernels.kda``), which is this
    rule with Diag(exp(g_t)) for exp(g_t), on the same backend (triton: the family's kernels with
    ``USE_GK``)."""
    from kernels.kda import kda
    return kda(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size)


def _dispatch(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size):
    if backend == "triton":
        return gated_delta_rule_triton(q, k, v, g, beta, initial_state, output_final_state, chunk_size)
    if backend == "torch":
        return gated_delta_rule_chunk_torch(q, k, v, g, beta, initial_state, output_final_state, chunk_size)
    return gated_delta_rule_reference(q, k, v, g, beta, initial_state, output_final_state)

__all__ = ["CONTRACT", "gated_delta_rule", "gated_delta_rule_trusted", "gated_delta_rule_reference", "gated_delta_rule_chunk_torch",
           "gated_delta_rule_triton", "BACKENDS"]
