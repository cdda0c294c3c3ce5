r"""Triton chunked gated delta rule, forward and backward: the delta-rule family's kernels
(``kernels/delta_rule/core.py``) with the scalar decay switched on (``USE_G = True``; Yang, Kautz &
Hatamizadeh 2025, §3.3; the split into kernels follows flash-linear-attention's
``chunk_gated_delta_rule``).

Recurrence (per sequence and head, state S ∈ R^{d_k×d_v}, the layout of ``reference.py``):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ q_t,     α_t = exp(g_t)

Per chunk of C tokens (K, Q ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β, g ∈ R^C, chunk-start state S_n), with
γ = cumsum(g) inside the chunk, Γ_ij = exp(γ_i − γ_j) (i ≥ j; every exponent ≤ 0) and γ_C its
last entry:

    L  = tril(diag(β) (K Kᵀ ∘ Γ), −1),   T = (I + L)⁻¹
    W  = T diag(β e^{γ}) K,               U = T diag(β) V,          Ṽ = U − W S_n
    O  = diag(e^{γ}) Q S_n + (M ∘ Γ ∘ Q Kᵀ) Ṽ                       (M = tril(1))
    S_{n+1} = e^{γ_C} S_n + K_dᵀ Ṽ,       K_d = diag(e^{γ_C − γ}) K

The kernels, their backward (with the gradient of g, the reverse cumulative sum of that of γ),
packed batches (``cu_seqlens``) and precisions are described in ``core.py``. This file holds what
is the gated rule's own: its launch configuration (``launch_meta``, the delta rule's with the
changes the decay's registers call for), the head-dim limits, the custom op
``kernels::gated_delta_rule_fwd`` / ``_bwd`` and the entry ``gated_delta_rule_triton``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels._triton_utils import INTERPRET_ARCH, check_triton_device, device_arch
from kernels.delta_rule import chunk as _dr_chunk
from kernels.delta_rule import core
from kernels.delta_rule.core import _IN_DTYPES
from kernels.gated_delta_rule.shapes import MAX_DK, MAX_DV, check_gated_delta_rule_inputs

#: head dims the kernels take, MAX_DK and MAX_DV (``shapes.py``, which the op's contract reads)


def launch_meta(DK: int, DV: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH):
    """Kernel chunk cap, tiles and warps per kernel (the keys of the delta rule's
    ``launch_meta``): the delta rule's choice for the same head dims, dtype and GPU family, with
    two changes that the compile gate (``python -m kernels.compile_report --op gated_delta_rule``)
    called for, the decay's extra [C] vectors and [C, C] factors holding more registers:

    * float32 on sm_90: the state and backward kernels take 8 warps, not 4 (with 4, ptxas spilled
      36–104 bytes in ``_bwd_wy`` and ``_bwd_dqk`` at 255 registers, and 4 bytes in
      ``_bwd_state`` at d_k = 128), as the delta rule's state kernels do on sm_80, and
      ``_bwd_wy`` walks d_v in blocks of 16 (``BV_bwd_wy``; with 32, at d_k = 64, it still
      spilled 40 bytes at 8 warps; 16 warps cap a thread at 128 registers and spilled ~300);
    * half inputs on sm_80: ``_wy_fwd`` takes 32-wide column blocks, not 64 (4 bytes spilled
      in its packed-batch form)."""
    mt = dict(_dr_chunk.launch_meta(DK, DV, dtype, arch))
    half = dtype in (torch.bfloat16, torch.float16)
    if not half and arch >= 90:
        mt.update(warps_state=8, warps_chunk=8, warps_dqk=8, warps_bwd_wy=8, BV_bwd_wy=min(mt["BV"], 16))
    if half and arch < 90:
        mt.update(BKW=min(mt["BKW"], 32), BVW=min(mt["BVW"], 32))
    return mt


#: ``kernels::gated_delta_rule_fwd`` (and ``_bwd``), the family's op with g (core.make_op); the
#: launch config is looked up in this module at each launch
_fwd_op = core.make_op("gated_delta_rule", lambda *a: launch_meta(*a))


def gated_delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                            output_final_state: bool = False, chunk_size: int = 64,
                            cu_seqlens: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; g, beta [B, H, T]; initial_state [N, H, d_k, d_v]
    or None (N = B, or the number of sequences with ``cu_seqlens``, int32 [N+1] over a B = 1
    packed row). d_k ≤ ``MAX_DK``, d_v ≤ ``MAX_DV``.

    Returns (o [B, H, T, d_v] in v's dtype, final state [N, H, d_k, d_v] in float32 — float64
    for float64 inputs — or None unless ``output_final_state``). g is read in the accumulation
    dtype (its gradient comes back in g's dtype)."""
    check_gated_delta_rule_inputs("gated_delta_rule_triton", q, k, v, g, beta, initial_state, chunk_size,
                                  cu_seqlens)
    check_triton_device("gated_delta_rule_triton", q, k, v, g, beta, initial_state)
    if q.dtype not in _IN_DTYPES:
        raise ValueError(f"gated_delta_rule_triton: inputs must be one of {[str(d) for d in _IN_DTYPES]}, "
                         f"got {q.dtype}")
    DK, DV = k.shape[-1], v.shape[-1]
    if DK > MAX_DK or DV > MAX_DV:
        raise ValueError(f"gated_delta_rule_triton: head dims up to d_k = {MAX_DK} and d_v = {MAX_DV} are "
                         f"supported, got d_k = {DK} (q, k) and d_v = {DV} (v); use backend='torch'")
    return core.run("gated_delta_rule_triton", _fwd_op, launch_meta, device_arch(q.device), q, k, v, g, beta,
                    initial_state, output_final_state, chunk_size, cu_seqlens)


__all__ = ["gated_delta_rule_triton", "launch_meta", "MAX_DK", "MAX_DV"]
