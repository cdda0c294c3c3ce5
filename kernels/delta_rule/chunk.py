r"""Triton chunked delta rule, forward and backward (the WY/UT form of Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length"): the delta-rule
family's kernels (``core.py``) without a decay (``USE_G = False``, g = None).

Recurrence (per sequence and head, state S ∈ R^{d_k×d_v}, the layout of ``reference.py``):

    S_t = S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t

Per chunk of C tokens (K, Q ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β ∈ R^C, chunk-start state S_n):

    L  = tril(diag(β) K Kᵀ, −1),   T = (I + L)⁻¹            (unit lower triangular)
    W  = T diag(β) K,              U = T diag(β) V
    Ṽ  = U − W S_n                                           (pseudo-values)
    O  = Q S_n + (M ∘ Q Kᵀ) Ṽ,     M = tril(1), diagonal included
    S_{n+1} = S_n + Kᵀ Ṽ

The kernels, their split into forward and backward passes, packed batches (``cu_seqlens``) and
precisions are described in ``core.py``. This file holds what is the delta rule's own: the launch
configuration per GPU family (``launch_meta``, which the gated delta rule starts from), the custom
op ``kernels::delta_rule_fwd`` / ``_bwd`` and the entry ``delta_rule_triton`` (its input checks and
the per-channel β, run as d_v scalar-β problems of width 1).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels._triton_utils import INTERPRET_ARCH, check_triton_device, device_arch
from kernels.delta_rule import core
from kernels.delta_rule.core import _IN_DTYPES, _PREC, _PREC_SOLVE, _layout, _pow2  # noqa: F401 (_layout: tests)
from kernels.delta_rule.shapes import check_delta_rule_inputs, fold_channel_beta, unfold_channel_beta


#: the state tile one program holds is [d_k, BV] with BK · BV ≤ STATE_TILE: d_v is split into more
#: programs as d_k grows (64 × 32, or 128 × 16). Compiled for sm_90 at d = 64, bf16, C = 64 with
#: 8 warps: BV = 64 spilled in all three state/backward kernels, BV = 32 spills 24 bytes in
#: ``_fwd_state`` only (4 warps spilled more)
STATE_TILE = 64 * 32
#: widest d_v block one program holds
BV_MAX = 64
#: the d_k block of ``_fwd_state`` and ``_bwd_state`` (rows of the state read back at a time) and
#: of ``_bwd_wy`` (columns of K): their products over d_k are summed over blocks of this size
BKS_MAX = 32


def launch_meta(DK: int, DV: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH):
    """Kernel chunk cap, tiles and warps of every kernel for head dims (DK, DV), input dtype and
    launch-config family ``arch`` (90 or 80, ``device_arch``): the one place the launches and
    ``compile_cases.py`` read them from. The kernel chunk is ``min(C, chunk_size rounded up)``.

    What ptxas reported (``python -m kernels.compile_report``, spilled bytes) chose them:
    half inputs keep C = 64 on sm_90 at d ≤ 64, where nothing spills; elsewhere their state and
    backward kernels spilled 0.1–8 KB at C = 64 and none at C = 32 (8 warps), the [C, C] and
    [C, d_k] tiles being what overflows. float32 inputs (TF32×3 products hold three operand
    splits) take C = 16 with 4 warps; on sm_80 the state kernels also need BV = 16 and 8 warps.
    At d = 128 float32, ``_fwd_state``, ``_bwd_state`` and ``_bwd_wy`` spilled 0.2–7 KB with every
    BV and warp count tried while they held [C, d_k] operands (each warp holds a 16-row left
    operand whole) and the [d_k, BV] state in registers; they now sum over d_k in blocks of
    ``BKS`` = 32 rows (the state read back from Hs / dHs), and nothing spills.
    ``_wy_fwd`` (W, U by column blocks) spilled 32 B on sm_90 at C = 32 with 64-wide blocks and
    takes 32-wide ones there. The chunk-parallel ``_fwd_o`` and ``_bwd_dv_local`` take the state
    kernels' d_k and d_v blocks (BKS, BV) and ``warps_o`` warps (those of the state kernels)."""
    BK = _pow2(DK)
    BV = min(_pow2(DV), BV_MAX, max(16, STATE_TILE // BK))
    half = dtype in (torch.bfloat16, torch.float16)
    small = BK <= 64 and _pow2(DV) <= 64
    mt = dict(BK=BK, BV=BV, BKS=min(BK, BKS_MAX), PREC=_PREC[dtype], PS=_PREC_SOLVE[dtype], stages=1)
    if half and arch >= 90 and small:
        mt.update(C=64, BKW=min(BK, 64), BVW=min(_pow2(DV), 64),
                  warps_inv=4, warps_wy=8, warps_state=8, warps_o=8, warps_chunk=8)
    elif half:
        W = 32 if arch >= 90 else 64
        mt.update(C=32, BKW=min(BK, W), BVW=min(_pow2(DV), W),
                  warps_inv=8, warps_wy=8, warps_state=8, warps_o=8, warps_chunk=8)
    else:
        mt.update(C=16, BKW=min(BK, 64), BVW=min(_pow2(DV), 64),
                  warps_inv=4, warps_wy=4, warps_state=4, warps_o=4, warps_chunk=4)
        if arch < 90:
            mt.update(BV=min(BV, 16), warps_state=8, warps_o=8)
    mt.update(BV_bwd_wy=mt["BV"], warps_bwd_wy=mt["warps_chunk"])   # ``_bwd_wy``'s own (the gated rule's differ)
    return mt


#: ``kernels::delta_rule_fwd`` (and ``_bwd``), the family's op without g (core.make_op); the
#: launch config is looked up in this module at each launch
_fwd_op = core.make_op("delta_rule", lambda *a: launch_meta(*a))


def delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                      chunk_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; beta [B, H, T] or [B, H, T, d_v] (per value
    channel, run as d_v scalar-β problems of width 1, see ``shapes.py``); initial_state
    [N, H, d_k, d_v] or None (N = B, or the number of sequences with ``cu_seqlens``, int32 [N+1]
    over a B = 1 packed row).

    Returns (o [B, H, T, d_v] in v's dtype, final state [N, H, d_k, d_v] in float32 — float64
    for float64 inputs — or None unless ``output_final_state``)."""
    per_channel = check_delta_rule_inputs("delta_rule_triton", q, k, v, beta, initial_state, chunk_size,
                                          cu_seqlens)
    check_triton_device("delta_rule_triton", q, k, v, beta, initial_state)
    if q.dtype not in _IN_DTYPES:
        raise ValueError(f"delta_rule_triton: inputs must be one of {[str(d) for d in _IN_DTYPES]}, got {q.dtype}")
    if per_channel:
        H, DV = k.shape[1], v.shape[-1]
        o, S = delta_rule_triton(*fold_channel_beta(q, k, v, beta, initial_state), output_final_state,
                                 chunk_size, cu_seqlens)
        return unfold_channel_beta(o, S, H, DV)
    return core.run("delta_rule_triton", _fwd_op, launch_meta, device_arch(q.device), q, k, v, None, beta,
                    initial_state, output_final_state, chunk_size, cu_seqlens)

