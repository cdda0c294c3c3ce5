r"""Triton chunked KDA, forward and backward: the delta-rule family's kernels
(``kernels/delta_rule/core.py``) with the per-channel decay switched on (``USE_GK = True``; the
split of the decayed scores follows flash-linear-attention's ``chunk_kda``).

Recurrence (per sequence and head, state S ∈ R^{d_k×d_v}, the layout of ``reference.py``):

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ q_t,     g_t ∈ R^{d_k}

Per chunk of C tokens, with γ = cumsum(g) inside the chunk ([C, d_k], every entry non-increasing
down the chunk) and γ_C its last row:

    P(X)_ij = Σ_c x_ic k_jc e^{γ_ic − γ_jc}   (j ≤ i),   L = tril(diag(β) P(K), −1),   T = (I + L)⁻¹
    W = T diag(β) (K ∘ e^{γ}),   U = T diag(β) V,   Ṽ = U − W S_n
    O = (Q ∘ e^{γ}) S_n + (M ∘ P(Q)) Ṽ,       S_{n+1} = Diag(e^{γ_C}) S_n + (K ∘ e^{γ_C − γ})ᵀ Ṽ

Every exponent the kernels take is a later cumulative log decay minus an earlier one, so ≤ 0: the
scores P are built in 16-row blocks, across blocks as products of factors e^{γ_i − γ_r} and
e^{γ_r − γ_j} about a reference row r between them, the diagonal blocks per pair (``core.py``:
``_gk_scores``, ``_gk_bwd_intra``). Log decays of −20 per token (a chunk's cumulative −1280, far
below float32's range) stay finite and accurate.

This file holds what is KDA's own: its launch configuration (``launch_meta``, the gated delta
rule's plus the tiles of the three USE_GK kernels), the head-dim limits, the custom op
``kernels::kda_fwd`` / ``_bwd`` and the entry ``kda_triton``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels._triton_utils import INTERPRET_ARCH, check_triton_device, device_arch
from kernels.delta_rule import core
from kernels.delta_rule.core import _IN_DTYPES
from kernels.gated_delta_rule import chunk as _gdr_chunk
from kernels.kda.shapes import check_kda_inputs

#: head dims the kernels take (those of the gated delta rule's kernels, whose tiles these are)
MAX_DK = _gdr_chunk.MAX_DK
MAX_DV = _gdr_chunk.MAX_DV
#: the d_k block of the USE_GK kernels (``_gk_cumsum``, ``_gk_scores``, ``_gk_bwd_intra``)
BKG_MAX = 32


def launch_meta(DK: int, DV: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH):
    """The gated delta rule's launch config for the same head dims, dtype and GPU family (the
    eight shared kernels), plus ``BKG``, the d_k block, and ``warps_gk``, the warps, of the three
    kernels of the per-channel decay."""
    mt = dict(_gdr_chunk.launch_meta(DK, DV, dtype, arch))
    mt.update(BKG=min(mt["BK"], BKG_MAX), warps_gk=4)
    if arch < 90:
        # with USE_GK ``_wy_inv`` only inverts the stored scores: at 8 warps ptxas spilled 4 B of it
        # at 32 registers on sm_80 (d_k 128); 4 warps keep it in registers
        mt.update(warps_inv=4)
    return mt


#: ``kernels::kda_fwd`` (and ``_bwd``), the family's op with a per-channel g (core.make_op); the
#: launch config is looked up in this module at each launch
_fwd_op = core.make_op("kda", lambda *a: launch_meta(*a))

_ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def kda_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
               chunk_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k, g [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T]; initial_state [N, H, d_k, d_v] or
    None (N = B, or the number of sequences with ``cu_seqlens``, int32 [N+1] over a B = 1 packed
    row), each contiguous. d_k ≤ ``MAX_DK``, d_v ≤ ``MAX_DV``.

    Returns (o [B, H, T, d_v] in v's dtype, final state [N, H, d_k, d_v] in float32 — float64 for
    float64 inputs — or None unless ``output_final_state``). g is read in the accumulation dtype
    (its gradient comes back in g's dtype). The kernel chunk is ``chunk_size`` rounded up to a
    power of two in [16, 64], capped per dtype and GPU by ``launch_meta``; the result does not
    depend on it."""
    name = "kda_triton"
    check_kda_inputs(name, q, k, v, g, beta, initial_state, chunk_size, cu_seqlens)
    check_triton_device(name, q, k, v, g, beta, initial_state)
    if q.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}: inputs must be one of {[str(d) for d in _IN_DTYPES]}, got {q.dtype}")
    DK, DV = k.shape[-1], v.shape[-1]
    if DK > MAX_DK or DV > MAX_DV:
        raise ValueError(f"{name}: head dims up to d_k = {MAX_DK} and d_v = {MAX_DV} are supported, got "
                         f"d_k = {DK} (q, k, g) and d_v = {DV} (v); use backend='torch'")
    for n, t in zip(_ARGS, (q, k, v, g, beta, initial_state)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: {n} must be contiguous (the kernels read rows of the [B, H, T, ...] "
                             f"layout), got shape {tuple(t.shape)} with strides {t.stride()}; pass "
                             f"{n}.contiguous()")
    return core.run(name, _fwd_op, launch_meta, device_arch(q.device), q, k, v, g, beta,
                    initial_state, output_final_state, chunk_size, cu_seqlens)


__all__ = ["kda_triton", "launch_meta", "MAX_DK", "MAX_DV"]
