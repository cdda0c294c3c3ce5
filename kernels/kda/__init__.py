r"""Kimi Delta Attention (KDA; Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture"): the gated delta rule with a decay per key channel,

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ q_t,     g_t ∈ R^{d_k}, g ≤ 0

``reference.py`` is the sequential specification; ``torch_chunk.py`` the chunkwise WY/UT form,
finite under any decay (its docstring says how, and how flash-linear-attention's ``chunk_kda``
does it); ``chunk.py`` the same form as Triton kernels, the delta-rule family's
(``kernels/delta_rule/core.py``) with the per-channel decay switch ``USE_GK``, forward and
backward, packed batches in one launch. Every backend checks shapes and dtypes at entry
(``shapes.py``); the public function also checks g ≤ 0 and β ∈ [0, 1]. Design notes:
``kernels/kda/README.md``.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract, Requirement, backends_listed
from kernels.gated_delta_rule.shapes import MAX_DK, MAX_DV
from kernels.kda.reference import kda_reference
from kernels.kda.shapes import check_kda_gate_values, check_kda_inputs
from kernels.kda.torch_chunk import kda_chunk_torch

try:
    from kernels.kda.chunk import kda_triton
except ImportError:  # no triton installed: the PyTorch forms still work
    kda_triton = None

#: implementations ``kda`` can dispatch to
BACKENDS = ("torch", "reference") + (("triton",) if kda_triton is not None else ())
#: what the Triton backend covers (``kernels.contract``): the gated delta rule's head sizes, and
#: β ∈ [0, 1] (``beta_max``: the largest β a caller's gate can give)
CONTRACT = OpContract("kernels.kda", backends_listed(sys.modules[__name__]),
                      max_dims={"d_k": MAX_DK, "d_v": MAX_DV},
                      requires=(Requirement("beta_max", lambda b: b <= 1,
                                            "{name} gives β ∈ (0, {value:g}); the Triton kernels are tested "
                                            "for β ∈ [0, 1] only"),))


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
        backend: str = "torch", chunk_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None
        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; g [B, H, T, d_k] the per-channel log decay (≤ 0);
    beta [B, H, T] in [0, 1]; initial_state [N, H, d_k, d_v] or None (no scaling or normalisation
    inside: the caller's).

    Returns (o [B, H, T, d_v] in v's dtype, final state [N, H, d_k, d_v] in the accumulation dtype
    — float32 for half inputs — or None unless ``output_final_state``). ``backend``: "torch"
    (chunked, ``chunk_size`` tokens per chunk; the result does not depend on it), "triton"
    (``chunk.py``; d_k ≤ 128, d_v ≤ 256, contiguous inputs; kernel chunk a power of two in [16, 64]
    capped per dtype and GPU) or "reference" (sequential). ``cu_seqlens`` [N + 1] (B = 1): a
    packed batch of N sequences, each from its own initial state (or zero) with its own final
    state; the Triton form runs them in one launch per kernel, the torch form without states in
    one call with resets inside the scan, with states one call per sequence."""
    check_kda_inputs("kda", q, k, v, g, beta, initial_state, chunk_size, cu_seqlens)
    if backend not in BACKENDS:
        raise ValueError(f"kda: unknown backend {backend!r}; available: {list(BACKENDS)}")
    if not torch.compiler.is_compiling():
        check_kda_gate_values("kda", g, beta)
    return kda_trusted(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size, cu_seqlens)


def kda_trusted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                backend: str = "torch", chunk_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``kda`` for callers whose g and β are in range by construction (the KDA layer's
    g = −exp(A_log)·softplus(·) ≤ 0 and β = σ(·)): shapes and dtypes are checked, the values are
    not, which saves the copy of a flag to the host per call (and runs on the meta device)."""
    check_kda_inputs("kda", q, k, v, g, beta, initial_state, chunk_size, cu_seqlens)
    if backend not in BACKENDS:
        raise ValueError(f"kda: unknown backend {backend!r}; available: {list(BACKENDS)}")
    if backend == "triton":
        return kda_triton(q, k, v, g, beta, initial_state, output_final_state, chunk_size, cu_seqlens)
    if cu_seqlens is None:
        return _dispatch(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size)
    T = k.shape[2]
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"kda: cu_seqlens must rise from 0 to T = {T}, got {cu}")
    if backend == "torch" and initial_state is None and not output_final_state:
        resets = torch.zeros(1, T, dtype=torch.bool, device=k.device)
        resets[0, [a for a in cu[:-1] if a < T]] = True
        return kda_chunk_torch(q, k, v, g, beta, None, False, chunk_size, resets)
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, s = _dispatch(*(t[:, :, a:b] for t in (q, k, v, g, beta)), h0, output_final_state, backend, chunk_size)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 2), (torch.cat(finals, 0) if output_final_state else None)


def _dispatch(q, k, v, g, beta, initial_state, output_final_state, backend, chunk_size):
    if backend == "torch":
        return kda_chunk_torch(q, k, v, g, beta, initial_state, output_final_state, chunk_size)
    return kda_reference(q, k, v, g, beta, initial_state, output_final_state)


__all__ = ["CONTRACT", "kda", "kda_trusted", "kda_reference", "kda_chunk_torch", "kda_triton", "BACKENDS"]
