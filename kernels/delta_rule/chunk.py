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
#: programs as d_k grows (64 × 32, or 128 × 16); ``_bwd_dqk`` holds [BK_dqk, BV] blocks of S_n and dS
STATE_TILE = 64 * 32
#: widest d_v block one program holds
BV_MAX = 64
#: the d_k block of ``_fwd_state`` and ``_bwd_state`` (rows of the state read back at a time) and
#: of ``_bwd_wy`` (columns of K): their products over d_k are summed over blocks of this size
BKS_MAX = 32
#: the same d_k block for half inputs on sm_90: 64 rows, so that the state kernels' products with a d_k-row
#: left operand (K_dᵀ Ṽ, Qᵀ dO, Wᵀ dṼ) have the 64 rows a Hopper warpgroup's wgmma needs
BKS_MAX_HALF = 64


def launch_meta(DK: int, DV: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH):
    """Kernel chunk cap, tiles and warps of every kernel for head dims (DK, DV), input dtype and
    launch-config family ``arch`` (90 or 80, ``device_arch``): the one place the launches and
    ``compile_cases.py`` read them from. The kernel chunk is ``min(C, chunk_size rounded up)``.

    What ptxas reported (``python -m kernels.compile_report``, spilled bytes) chose them:
    half inputs take C = 64 on sm_90 (flash-linear-attention's chunk) at every head size up to
    d_k = 128, d_v = 256, nothing spilling, and every product over the chunk is a wgmma there
    (the 16-row blocks of ``_wy_inv`` and of KDA's score kernels excepted: mma). That takes
    64-row d_k blocks in the state kernels (``BKS_MAX_HALF``: with 32, K_dᵀ Ṽ, Qᵀ dO and Wᵀ dṼ have
    32-row left operands and lowered to mma), ``_bwd_dqk`` split over d_k in blocks of 64
    (``BK_dqk``, a grid axis: whole, at d_k = 128 it spilled 8 B in the SSD's form and sat at
    252–253 registers in the gated rule's and KDA's), ``_bwd_wy`` summing over d_k in blocks of 32
    (``BK_bwd_wy``: with 64, 16 B spilled in the gated rule's at d_k = 64) and ``_wy_inv`` forming
    every block of L before the inverses, each K_i K_jᵀ summed over d_k in blocks of 64
    (``BK_inv``; with the four [16, d_k] row blocks of K held whole, 36–84 B spilled at
    d_k = 128). On sm_80 half inputs take C = 64 as well, where mma.sync keeps every warp's share
    of each operand and accumulator in registers: with the sm_90 blocks ptxas spilled 7.5–9.6 KB
    in ``_bwd_dqk`` (d_k = 64, one block), 0.3–0.6 KB in ``_bwd_wy`` and 4 B in ``_bwd_dv_local``
    (d_k = 128, 8 warps). So ``_bwd_dqk`` takes d_k and d_v blocks of 16 (``BK_dqk``, ``BV_dqk``:
    with blocks of 32 it spilled 8–500 B or sat at 255 registers; at 16 × 16, 172–206 registers),
    ``_bwd_dv_local`` 4 warps (``warps_dv_local``), and ``_bwd_wy`` d_k blocks of 16 with
    ``stage_dl``: dL = −Tᵀ dT Tᵀ through memory (its STAGE_DL; the two chained [C, C] products
    alone held ~60 registers more, and no d_k or d_v block of 16 or 32 at 4, 8 or 16 warps, in TF32
    or in bf16, kept it from spilling 0.1–0.9 KB); it then compiles at 250–255 registers, 0 spills.
    Chunk 32 there (before) spilled nothing with the sm_90 blocks.
    float32 inputs (TF32×3 products hold three operand splits) take C = 16 with 4 warps; on
    sm_80 the state kernels also need BV = 16 and 8 warps.
    At d = 128 float32, ``_fwd_state``, ``_bwd_state`` and ``_bwd_wy`` spilled 0.2–7 KB with every
    BV and warp count tried while they held [C, d_k] operands (each warp holds a 16-row left
    operand whole) and the [d_k, BV] state in registers; they now sum over d_k in blocks of
    ``BKS`` = 32 rows (the state read back from Hs / dHs), and nothing spills.
    The chunk-parallel ``_fwd_o`` and ``_bwd_dv_local`` take the state
    kernels' d_k and d_v blocks (BKS, BV) and ``warps_o`` warps (those of the state kernels;
    ``warps_dv_local`` for ``_bwd_dv_local``)."""
    BK = _pow2(DK)
    BV = min(_pow2(DV), BV_MAX, max(16, STATE_TILE // BK))
    half = dtype in (torch.bfloat16, torch.float16)
    mt = dict(BK=BK, BV=BV, BKS=min(BK, BKS_MAX), PREC=_PREC[dtype], PS=_PREC_SOLVE[dtype], stages=1)
    if half and arch >= 90:
        mt.update(C=64, BKS=min(BK, BKS_MAX_HALF), BKW=min(BK, 64), BVW=min(_pow2(DV), 64),
                  warps_inv=4, warps_wy=8, warps_state=8, warps_o=8, warps_chunk=8)
    elif half:
        mt.update(C=64, BKW=min(BK, 64), BVW=min(_pow2(DV), 64),
                  warps_inv=8, warps_wy=8, warps_state=8, warps_o=8, warps_chunk=8)
    else:
        mt.update(C=16, BKW=min(BK, 64), BVW=min(_pow2(DV), 64),
                  warps_inv=4, warps_wy=4, warps_state=4, warps_o=4, warps_chunk=4)
        if arch < 90:
            mt.update(BV=min(BV, 16), warps_state=8, warps_o=8)
    # ``_bwd_wy``'s own (the gated rule's differ); its d_k block stays at BKS_MAX for half inputs too
    mt.update(BK_bwd_wy=min(BK, BKS_MAX), BV_bwd_wy=mt["BV"], warps_bwd_wy=mt["warps_chunk"], stage_dl=False)
    # ``_bwd_dqk``'s d_k block (a grid axis): 64 for half inputs on sm_90, all of d_k elsewhere;
    # ``_wy_inv``'s (the K Kᵀ blocks summed over d_k blocks of 64)
    mt.update(BK_dqk=min(BK, 64) if half and arch >= 90 else BK, BK_inv=min(BK, 64),
              BV_dqk=mt["BV"], warps_dqk=mt["warps_chunk"], warps_dv_local=mt["warps_o"])
    if half and arch < 90:
        # C = 64 on sm_80: ``_bwd_dqk`` in d_k and d_v blocks of 16, ``_bwd_wy`` in d_k blocks of 16
        # with dL staged through memory (STAGE_DL), ``_bwd_dv_local`` at 4 warps
        mt.update(BK_dqk=min(BK, 16), BV_dqk=min(mt["BV"], 16), warps_dqk=8,
                  BK_bwd_wy=min(BK, 16), warps_bwd_wy=8, stage_dl=True, warps_dv_local=4)
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

