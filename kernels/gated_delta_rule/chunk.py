r"""Triton chunked gated delta rule, forward and backward: the kernels of ``kernels/delta_rule/chunk.py``
with the decay folded in (Yang, Kautz & Hatamizadeh 2025, §3.3; the split into kernels follows
flash-linear-attention's ``chunk_gated_delta_rule``).

Recurrence (per sequence and head, state S ∈ R^{d_k×d_v}, the layout of ``reference.py``):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ q_t,     α_t = exp(g_t)

Per chunk of C tokens (K, Q ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β, g ∈ R^C, chunk-start state S_n), with
γ = cumsum(g) inside the chunk, Γ_ij = exp(γ_i − γ_j) (i ≥ j; every exponent ≤ 0) and γ_C its
last entry:

    L  = tril(diag(β) (K Kᵀ ∘ Γ), −1),   T = (I + L)⁻¹
    W  = T diag(β e^{γ}) K,               U = T diag(β) V,          Ṽ = U − W S_n
    O  = diag(e^{γ}) Q S_n + (M ∘ Γ ∘ Q Kᵀ) Ṽ                       (M = tril(1))
    S_{n+1} = e^{γ_C} S_n + K_dᵀ Ṽ,       K_d = diag(e^{γ_C − γ}) K

Kernels (each the delta rule's kernel of the same name without ``_gdr``; γ is recomputed from g
wherever it is needed, a cumulative sum over the chunk's C entries):
  ``_gdr_wy_inv``       T, by blocked forward substitution on 16 × 16 blocks of L.
  ``_gdr_wy_fwd``       W and U.
  ``_gdr_fwd_state``    the sweep over chunks: Ṽ = U − W S_n, S_{n+1} = e^{γ_C} S_n + K_dᵀ Ṽ.
  ``_gdr_fwd_o``        O, chunk-parallel.
Backward, dS the gradient of the state at the end of the chunk:
  ``_gdr_bwd_dv_local`` (M ∘ Γ ∘ Q Kᵀ)ᵀ dO.
  ``_gdr_bwd_state``    chunks in reverse: dṼ = (M ∘ Γ ∘ Q Kᵀ)ᵀ dO + K_d dS;
                    dS ← e^{γ_C} dS + (diag(e^{γ}) Q)ᵀ dO − Wᵀ dṼ.
  ``_gdr_bwd_dqk``      with dP = M ∘ Γ ∘ dO Ṽᵀ: dQ = diag(e^{γ}) dO S_nᵀ + dP K,
                    dK ∋ dPᵀ Q + diag(e^{γ_C − γ}) Ṽ dSᵀ, dW = −dṼ S_nᵀ, and the gradient of γ
                    from these terms: dγ_i ∋ e^{γ_i} q_i·(S_n dO_i) + Σ_j A_ij − Σ_j A_ji
                    (A = dP ∘ Q Kᵀ) − e^{γ_C − γ_i} k_i·(dS Ṽ_i), and dγ_C ∋ e^{γ_C} ⟨S_n, dS⟩ +
                    Σ_i e^{γ_C − γ_i} k_i·(dS Ṽ_i) (added to the chunk's last row).
  ``_gdr_bwd_wy``       through W, U and T: dT = dW (β e^{γ} K)ᵀ + dU (βV)ᵀ, dL = −tril(Tᵀ dT Tᵀ, −1),
                    dβ ∋ rowsum(dL ∘ K Kᵀ ∘ Γ) + …, dγ ∋ rowsum(B) − colsum(B) with
                    B = diag(β) dL ∘ K Kᵀ ∘ Γ, dγ_i ∋ β_i e^{γ_i} k_i·(Tᵀ dW)_i; then
                    dg = the reverse cumulative sum of dγ over the chunk (γ_i = Σ_{s≤i} g_s).

Variable-length batches (``cu_seqlens``), the chunk slot tables, precisions (``_mm``) and the
launch configuration (``launch_meta``) are the delta rule's, imported from its ``chunk.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import check_triton_device, device_arch, is_interpreting
from kernels._triton_utils import INTERPRET_ARCH
from kernels.delta_rule import chunk as _dr_chunk
from kernels.delta_rule.chunk import (_TL, _IN_DTYPES, _acc_dtype, _chunk_info, _layout,
                                      _mm, _pow2, _seq_info, _store_block, _unit_lower_inverse16)
from kernels.gated_delta_rule.shapes import check_gated_delta_rule_inputs

#: head dims the kernels take (the state tile and the [C, d_k] operands are sized for these; the
#: compile gate checks d_k = 64, 128 with d_v = d_k and 2·d_k)
MAX_DK = 128
MAX_DV = 256


def launch_meta(DK: int, DV: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH):
    """Kernel chunk cap, tiles and warps per kernel (the keys of the delta rule's
    ``launch_meta``): the delta rule's choice for the same head dims, dtype and GPU family, with
    two changes that the compile gate (``python -m kernels.compile_report --op gated_delta_rule``)
    called for, the decay's extra [C] vectors and [C, C] factors holding more registers:

    * float32 on sm_90: the state and backward kernels take 8 warps, not 4 (with 4, ptxas spilled
      36–104 bytes in ``_gdr_bwd_wy`` and ``_gdr_bwd_dqk`` at 255 registers, and 4 bytes in
      ``_gdr_bwd_state`` at d_k = 128), as the delta rule's state kernels do on sm_80, and
      ``_gdr_bwd_wy`` walks d_v in blocks of 16 (``BV_bwd_wy``; with 32, at d_k = 64, it still
      spilled 40 bytes at 8 warps; 16 warps cap a thread at 128 registers and spilled ~300);
    * half inputs on sm_80: ``_gdr_wy_fwd`` takes 32-wide column blocks, not 64 (4 bytes spilled
      in its packed-batch form)."""
    mt = dict(_dr_chunk.launch_meta(DK, DV, dtype, arch))
    half = dtype in (torch.bfloat16, torch.float16)
    mt.update(warps_bwd_wy=mt["warps_chunk"], BV_bwd_wy=mt["BV"])
    if not half and arch >= 90:
        mt.update(warps_state=8, warps_chunk=8, warps_bwd_wy=8, BV_bwd_wy=min(mt["BV"], 16))
    if half and arch < 90:
        mt.update(BKW=min(mt["BKW"], 32), BVW=min(mt["BVW"], 32))
    return mt


@triton.jit
def _decay(ga, gb):
    """exp(γ_a[i] − γ_b[j]) where that is ≤ 0 (row after column in a chunk), 1 elsewhere (the
    entries the caller masks)."""
    return tl.exp(tl.minimum(ga[:, None] - gb[None, :], 0.0))


@triton.jit
def _gamma(g, rows, m_t, ACC: tl.constexpr):
    """γ = cumsum(g) over the chunk's rows (0 past the sequence end) and γ_C, its last entry."""
    b_g = tl.load(g + rows, mask=m_t, other=0.0).to(ACC)
    gam = tl.cumsum(b_g, 0)
    return gam, tl.sum(b_g, 0)


@triton.jit
def _gamma_block(g, row0, Tn, c, i: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr):
    """γ of rows 16i … 16i+15 of chunk c (sums over the chunk's g up to each row)."""
    o_c = tl.arange(0, C)
    o_t = c * C + o_c
    b_g = tl.load(g + row0 + o_t, mask=o_t < Tn, other=0.0).to(ACC)
    r = i * 16 + tl.arange(0, 16)
    return tl.sum(tl.where(o_c[None, :] <= r[:, None], b_g[None, :], 0.0), 1)


@triton.jit
def _kblock(k, beta, g, row0, Tn, c, i: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
            ACC: tl.constexpr):
    """Rows 16i … 16i+15 of chunk c: k [16, BK] (input dtype), β [16] and γ [16]."""
    o_t = c * C + i * 16 + tl.arange(0, 16)
    m_t = o_t < Tn
    o_k = tl.arange(0, BK)
    b_k = tl.load(k + (row0 + o_t)[:, None] * DK + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < DK), other=0.0)
    b_b = tl.load(beta + row0 + o_t, mask=m_t, other=0.0).to(ACC)
    return b_k, b_b, _gamma_block(g, row0, Tn, c, i, C, ACC)


@triton.jit
def _lblock(k_i, b_i, g_i, k_j, g_j, PK: tl.constexpr, EMU: tl.constexpr):
    """Block (i, j) of diag(β) (K Kᵀ ∘ Γ), unmasked."""
    return b_i[:, None] * _mm(k_i, tl.trans(k_j), PK, EMU) * _decay(g_i, g_j)


@triton.jit
def _gdr_wy_inv(k, beta, g, Tm, cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
            ACC: tl.constexpr, PK: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr):
    """T = (I + L)⁻¹ of one chunk by blocked forward substitution on 16 × 16 blocks
    (T_ii = (I + L_ii)⁻¹, T_ij = −T_ii Σ_{m=j}^{i−1} L_im T_mj), L = tril(diag(β)(K Kᵀ ∘ Γ), −1)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o = tl.arange(0, 16)
    low = o[:, None] > o[None, :]
    zero = tl.zeros([16, 16], dtype=ACC)
    k0, b0, g0 = _kblock(k, beta, g, row0, Tn, c, 0, C, DK, BK, ACC)
    T00 = _unit_lower_inverse16(tl.where(low, _lblock(k0, b0, g0, k0, g0, PK, EMU), 0.0))
    _store_block(Tm, T00, row0, Tn, c, 0, 0, C)
    if C > 16:
        k1, b1, g1 = _kblock(k, beta, g, row0, Tn, c, 1, C, DK, BK, ACC)
        T11 = _unit_lower_inverse16(tl.where(low, _lblock(k1, b1, g1, k1, g1, PK, EMU), 0.0))
        L10 = _lblock(k1, b1, g1, k0, g0, PK, EMU)
        T10 = -_mm(T11, _mm(L10, T00, PS, EMU), PS, EMU)
        _store_block(Tm, T10, row0, Tn, c, 1, 0, C)
        _store_block(Tm, T11, row0, Tn, c, 1, 1, C)
        _store_block(Tm, zero, row0, Tn, c, 0, 1, C)
        if C > 32:
            k2, b2, g2 = _kblock(k, beta, g, row0, Tn, c, 2, C, DK, BK, ACC)
            k3, b3, g3 = _kblock(k, beta, g, row0, Tn, c, 3, C, DK, BK, ACC)
            T22 = _unit_lower_inverse16(tl.where(low, _lblock(k2, b2, g2, k2, g2, PK, EMU), 0.0))
            T33 = _unit_lower_inverse16(tl.where(low, _lblock(k3, b3, g3, k3, g3, PK, EMU), 0.0))
            L20 = _lblock(k2, b2, g2, k0, g0, PK, EMU)
            L21 = _lblock(k2, b2, g2, k1, g1, PK, EMU)
            T21 = -_mm(T22, _mm(L21, T11, PS, EMU), PS, EMU)
            T20 = -_mm(T22, _mm(L20, T00, PS, EMU) + _mm(L21, T10, PS, EMU), PS, EMU)
            L30 = _lblock(k3, b3, g3, k0, g0, PK, EMU)
            L31 = _lblock(k3, b3, g3, k1, g1, PK, EMU)
            L32 = _lblock(k3, b3, g3, k2, g2, PK, EMU)
            T32 = -_mm(T33, _mm(L32, T22, PS, EMU), PS, EMU)
            T31 = -_mm(T33, _mm(L31, T11, PS, EMU) + _mm(L32, T21, PS, EMU), PS, EMU)
            T30 = -_mm(T33, _mm(L30, T00, PS, EMU) + _mm(L31, T10, PS, EMU) + _mm(L32, T20, PS, EMU), PS, EMU)
            _store_block(Tm, T20, row0, Tn, c, 2, 0, C)
            _store_block(Tm, T21, row0, Tn, c, 2, 1, C)
            _store_block(Tm, T22, row0, Tn, c, 2, 2, C)
            _store_block(Tm, T30, row0, Tn, c, 3, 0, C)
            _store_block(Tm, T31, row0, Tn, c, 3, 1, C)
            _store_block(Tm, T32, row0, Tn, c, 3, 2, C)
            _store_block(Tm, T33, row0, Tn, c, 3, 3, C)
            for i in tl.static_range(2):
                _store_block(Tm, zero, row0, Tn, c, i, 2, C)
                _store_block(Tm, zero, row0, Tn, c, i, 3, C)
            _store_block(Tm, zero, row0, Tn, c, 2, 3, C)


@triton.jit
def _gdr_wy_fwd(k, v, beta, g, Tm, W, U, cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr):
    """W = T (β e^{γ} K) and U = T (βV) for one chunk and one block of BK key / BV value columns
    (grid: chunks, H, column blocks of d_k then of d_v)."""
    i_c, h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_c = tl.arange(0, C)
    b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
    X = tl.load(Tm + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
    NK = tl.cdiv(DK, BK)
    if i_b < NK:
        gam, gC = _gamma(g, rows, m_t, ACC)
        o_k = i_b * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k[None, :] < DK)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_k, other=0.0).to(ACC)
        b_w = _mm(X, (b_b * tl.exp(gam))[:, None] * b_k, PS, EMU)
        tl.store(W + rows[:, None] * DK + o_k[None, :], b_w.to(W.dtype.element_ty), mask=m_k)
    else:
        o_v = (i_b - NK) * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v[None, :] < DV)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_v, other=0.0).to(ACC)
        b_u = _mm(X, b_b[:, None] * b_v, PS, EMU)
        tl.store(U + rows[:, None] * DV + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_v)


@triton.jit
def _gdr_fwd_state(k, g, W, U, Hs, VN, h0, ht, cu_seqlens, chunk_offsets, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr):
    """The chunk recurrence for one block of d_v columns of one (sequence, head): per chunk
    Ṽ = U − W S and S ← e^{γ_C} S + K_dᵀ Ṽ, writing each chunk's starting S to Hs and Ṽ to VN;
    the state is read back from Hs in blocks of BK rows (see the delta rule's ``_fwd_state``)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < DV
    NT = tl.cdiv(Tn, C)
    h0_base = i_nh.to(tl.int64) * DK * DV
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_kv = (o_k[:, None] < DK) & m_v[None, :]
        kv_off = o_k[:, None] * DV + o_v[None, :]
        S0 = tl.zeros([BK, BV], dtype=ACC)
        if USE_H0:
            S0 += tl.load(h0 + h0_base + kv_off, mask=m_kv, other=0.0).to(ACC)
        if NT > 0:
            tl.store(Hs + (coff * H + h) * DK * DV + kv_off, S0.to(Hs.dtype.element_ty), mask=m_kv)
        elif STORE_HT:
            tl.store(ht + h0_base + kv_off, S0.to(ht.dtype.element_ty), mask=m_kv)
    tl.debug_barrier()  # Hs is read back by other threads of this program
    for c in range(NT):
        hs_c = Hs + ((coff + c) * H + h) * DK * DV
        o_t = c * C + o_c
        m_t = o_t < Tn
        rows = row0 + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        gam, gC = _gamma(g, rows, m_t, ACC)
        dec_end = tl.exp(gC - gam)
        WS = tl.zeros([C, BV], dtype=ACC)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            S = tl.load(hs_c + o_k[:, None] * DV + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
            b_w = tl.load(W + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            WS += _mm(b_w, S, PS, EMU)
        b_u = tl.load(U + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_vn = b_u - WS
        tl.store(VN + rows[:, None] * DV + o_v[None, :], b_vn.to(VN.dtype.element_ty), mask=m_tv)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            kv_off = o_k[:, None] * DV + o_v[None, :]
            b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            S = (tl.exp(gC) * tl.load(hs_c + kv_off, mask=m_kv, other=0.0).to(ACC)
                 + _mm(tl.trans(b_k * dec_end[:, None]), b_vn, PS, EMU))
            if c + 1 < NT:
                tl.store(hs_c + H * DK * DV + kv_off, S.to(Hs.dtype.element_ty), mask=m_kv)
            elif STORE_HT:
                tl.store(ht + h0_base + kv_off, S.to(ht.dtype.element_ty), mask=m_kv)
        tl.debug_barrier()


@triton.jit
def _gdr_fwd_o(q, k, g, VN, Hs, o, cu_seqlens, chunk_offsets, chunk_indices, T, H,
           DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
           EMU: tl.constexpr):
    """O = diag(e^{γ}) Q S_n + (M ∘ Γ ∘ Q Kᵀ) Ṽ for one chunk, one head and one block of BV value
    columns (grid: chunks, H, d_v blocks)."""
    i_c, h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    hs_c = Hs + ((coff + c) * H + h) * DK * DV
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < DV
    o_t = c * C + o_c
    m_t = o_t < Tn
    rows = row0 + o_t
    m_tv = m_t[:, None] & m_v[None, :]
    QS = tl.zeros([C, BV], dtype=ACC)
    QK = tl.zeros([C, C], dtype=ACC)
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        m_kv = (o_k[:, None] < DK) & m_v[None, :]
        S = tl.load(hs_c + o_k[:, None] * DV + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
        b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        QS += _mm(b_q, S, PS, EMU)
        QK += _mm(b_q, tl.trans(b_k), PREC, EMU)
    gam, gC = _gamma(g, rows, m_t, ACC)
    b_vn = tl.load(VN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
    P = tl.where(o_c[:, None] >= o_c[None, :], QK * _decay(gam, gam), 0.0)
    b_o = QS * tl.exp(gam)[:, None] + _mm(P, b_vn, PS, EMU)
    tl.store(o + rows[:, None] * DV + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def _gdr_bwd_dv_local(q, k, g, do, dVN, cu_seqlens, chunk_offsets, chunk_indices, T, H,
                  DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
                  EMU: tl.constexpr):
    """The chunk-local part of dṼ, (M ∘ Γ ∘ Q Kᵀ)ᵀ dO (grid: chunks, H, d_v blocks), written to
    dVN for ``_gdr_bwd_state`` to add K_d dS to."""
    i_c, h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < DV
    o_t = c * C + o_c
    m_t = o_t < Tn
    rows = row0 + o_t
    m_tv = m_t[:, None] & m_v[None, :]
    QK = tl.zeros([C, C], dtype=ACC)
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        QK += _mm(b_q, tl.trans(b_k), PREC, EMU)
    gam, gC = _gamma(g, rows, m_t, ACC)
    b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
    P = tl.where(o_c[:, None] >= o_c[None, :], QK * _decay(gam, gam), 0.0)
    b_dvn = _mm(tl.trans(P), b_do, PS, EMU)
    tl.store(dVN + rows[:, None] * DV + o_v[None, :], b_dvn.to(dVN.dtype.element_ty), mask=m_tv)


@triton.jit
def _gdr_bwd_state(q, k, g, W, do, dht, dHs, dVN, dh0, cu_seqlens, chunk_offsets, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr):
    """The reverse recurrence of the state gradient for one block of d_v columns: per chunk, from
    the gradient dS at its end, dṼ = dṼ_local + K_d dS (overwriting dVN) and
    dS ← e^{γ_C} dS + (diag(e^{γ}) Q)ᵀ dO − Wᵀ dṼ, writing each chunk's end gradient to dHs."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < DV
    NT = tl.cdiv(Tn, C)
    s_base = i_nh.to(tl.int64) * DK * DV
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_kv = (o_k[:, None] < DK) & m_v[None, :]
        kv_off = o_k[:, None] * DV + o_v[None, :]
        dS0 = tl.zeros([BK, BV], dtype=ACC)
        if USE_DHT:
            dS0 += tl.load(dht + s_base + kv_off, mask=m_kv, other=0.0).to(ACC)
        if NT > 0:
            tl.store(dHs + ((coff + NT - 1) * H + h) * DK * DV + kv_off, dS0.to(dHs.dtype.element_ty), mask=m_kv)
        elif STORE_DH0:
            tl.store(dh0 + s_base + kv_off, dS0.to(dh0.dtype.element_ty), mask=m_kv)
    tl.debug_barrier()  # dHs is read back by other threads of this program
    for ci in range(NT):
        c = NT - 1 - ci
        dhs_c = dHs + ((coff + c) * H + h) * DK * DV
        o_t = c * C + o_c
        m_t = o_t < Tn
        rows = row0 + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        gam, gC = _gamma(g, rows, m_t, ACC)
        dec_end = tl.exp(gC - gam)
        b_dvn = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            dS = tl.load(dhs_c + o_k[:, None] * DV + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
            b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            b_dvn += _mm(b_k * dec_end[:, None], dS, PS, EMU)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        tl.store(dVN + rows[:, None] * DV + o_v[None, :], b_dvn.to(dVN.dtype.element_ty), mask=m_tv)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            kv_off = o_k[:, None] * DV + o_v[None, :]
            b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            b_w = tl.load(W + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            dS = (tl.exp(gC) * tl.load(dhs_c + kv_off, mask=m_kv, other=0.0).to(ACC)
                  + _mm(tl.trans(b_q * tl.exp(gam)[:, None]), b_do, PS, EMU) - _mm(tl.trans(b_w), b_dvn, PS, EMU))
            if c > 0:
                tl.store(dhs_c - H * DK * DV + kv_off, dS.to(dHs.dtype.element_ty), mask=m_kv)
            elif STORE_DH0:
                tl.store(dh0 + s_base + kv_off, dS.to(dh0.dtype.element_ty), mask=m_kv)
        tl.debug_barrier()


@triton.jit
def _gdr_bwd_dqk(q, k, g, VN, do, dVN, Hs, dHs, dq, dk_part, dw, dg_part,
             cu_seqlens, chunk_offsets, chunk_indices, T, H,
             DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
             EMU: tl.constexpr):
    """Chunk-local gradients through the state and the intra-chunk attention, summed over d_v
    blocks: dQ, the dK terms dPᵀ Q + K_d's (stored as dk_part), dW = −dṼ S_nᵀ (for ``_gdr_bwd_wy``)
    and the gradient of γ from these terms (dg_part; module docstring)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    hs_off = ((coff + c) * H + h) * DK * DV
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_k = tl.arange(0, BK)
    o_c = tl.arange(0, C)
    m_tk = m_t[:, None] & (o_k[None, :] < DK)
    b_dq = tl.zeros([C, BK], dtype=ACC)
    b_dk = tl.zeros([C, BK], dtype=ACC)
    b_dw = tl.zeros([C, BK], dtype=ACC)
    dP = tl.zeros([C, C], dtype=ACC)
    sdS = tl.zeros([BK], dtype=ACC)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        m_kv = (o_k[:, None] < DK) & (o_v[None, :] < DV)
        kv_off = o_k[:, None] * DV + o_v[None, :]
        S = tl.load(Hs + hs_off + kv_off, mask=m_kv, other=0.0)
        dS = tl.load(dHs + hs_off + kv_off, mask=m_kv, other=0.0)
        b_vn = tl.load(VN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        b_du = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        b_dq += _mm(b_do, tl.trans(S), PS, EMU)
        dP += _mm(b_do, tl.trans(b_vn), PS, EMU)
        b_dk += _mm(b_vn, tl.trans(dS), PS, EMU)
        b_dw -= _mm(b_du, tl.trans(S), PS, EMU)
        sdS += tl.sum(S.to(ACC) * dS.to(ACC), 1)
    tl.store(dw + rows[:, None] * DK + o_k[None, :], b_dw.to(dw.dtype.element_ty), mask=m_tk)
    gam, gC = _gamma(g, rows, m_t, ACC)
    eg = tl.exp(gam)
    dec_end = tl.exp(gC - gam)
    b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
    # O ∋ diag(e^γ) Q S_n
    dgam = eg * tl.sum(b_q.to(ACC) * b_dq, 1)
    b_dq = b_dq * eg[:, None]
    # O ∋ (M ∘ Γ ∘ Q Kᵀ) Ṽ
    dP = tl.where(o_c[:, None] >= o_c[None, :], dP * _decay(gam, gam), 0.0)
    A = dP * _mm(b_q, tl.trans(b_k), PREC, EMU)
    dgam += tl.sum(A, 1) - tl.sum(A, 0)
    b_dq += _mm(dP, b_k, PS, EMU)
    tl.store(dq + rows[:, None] * DK + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    # S_{n+1} ∋ e^{γ_C} S_n + K_dᵀ Ṽ
    kd = tl.sum(b_dk * b_k.to(ACC), 1) * dec_end
    dgam -= kd
    dgC = tl.exp(gC) * tl.sum(sdS, 0) + tl.sum(kd, 0)
    last = tl.minimum(Tn - c * C, C) - 1
    dgam += tl.where(o_c == last, dgC, 0.0)
    b_dk = b_dk * dec_end[:, None] + _mm(tl.trans(dP), b_q, PS, EMU)
    tl.store(dk_part + rows[:, None] * DK + o_k[None, :], b_dk.to(dk_part.dtype.element_ty), mask=m_tk)
    tl.store(dg_part + rows, dgam.to(dg_part.dtype.element_ty), mask=m_t)


@triton.jit
def _gdr_bwd_wy(k, v, beta, g, Tm, dVN, dk_part, dw, dg_part, dk, dv, dbeta, dg,
            cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
            EMU: tl.constexpr):
    """Gradients through U = T (βV), W = T (β e^{γ} K) and T = (I + L)⁻¹ given dU = dṼ and dW
    from ``_gdr_bwd_dqk``: writes dv, dβ, dk = dk_part + β e^{γ} Tᵀ dW + (dG + dGᵀ) K and
    dg = the reverse cumulative sum of dγ (dg_part plus the terms here)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_c = tl.arange(0, C)
    b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
    gam, gC = _gamma(g, rows, m_t, ACC)
    eg = tl.exp(gam)
    X = tl.load(Tm + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
    dX = tl.zeros([C, C], dtype=ACC)
    b_db = tl.zeros([C], dtype=ACC)
    dgam = tl.load(dg_part + rows, mask=m_t, other=0.0).to(ACC)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_du = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        dX += _mm(b_du, tl.trans(b_b[:, None] * b_v), PS, EMU)
        b_dvb = _mm(tl.trans(X), b_du, PS, EMU)
        tl.store(dv + rows[:, None] * DV + o_v[None, :], (b_b[:, None] * b_dvb).to(dv.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_dvb * b_v, 1)
    G = tl.zeros([C, C], dtype=ACC)
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        dX += _mm(b_dw, tl.trans((b_b * eg)[:, None] * b_k.to(ACC)), PS, EMU)
        r = tl.sum(_mm(tl.trans(X), b_dw, PS, EMU) * b_k.to(ACC), 1) * eg
        b_db += r
        dgam += b_b * r
        G += _mm(b_k, tl.trans(b_k), PREC, EMU)
    dL = _mm(_mm(tl.trans(X), dX, PS, EMU), tl.trans(X), PS, EMU)
    dL = tl.where(o_c[:, None] > o_c[None, :], -dL, 0.0)
    Gam = _decay(gam, gam)
    GG = G * Gam
    b_db += tl.sum(dL * GG, 1)
    dGG = b_b[:, None] * dL
    Bm = dGG * GG
    dgam += tl.sum(Bm, 1) - tl.sum(Bm, 0)
    dG = dGG * Gam
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_dk = ((b_b * eg)[:, None] * _mm(tl.trans(X), b_dw, PS, EMU)
                + _mm(dG, b_k, PS, EMU) + _mm(tl.trans(dG), b_k, PS, EMU))
        b_dk += tl.load(dk_part + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        tl.store(dk + rows[:, None] * DK + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + rows, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    # γ_i = Σ_{s≤i} g_s  ⇒  dg_s = Σ_{i≥s} dγ_i
    b_dg = tl.sum(dgam, 0) - tl.cumsum(dgam, 0) + dgam
    tl.store(dg + rows, b_dg.to(dg.dtype.element_ty), mask=m_t)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """The packed batch's offsets as int32 on ``device``, checked there (one flag read back)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    if bool((cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"gated_delta_rule_triton: cu_seqlens must rise from 0 to T = {T} without decreasing, "
                         f"got {cu_seqlens.tolist()}")
    return cu


# The op is a PyTorch custom op, as the delta rule's: torch.compile captures it as one opaque node.
@torch.library.custom_op("kernels::gated_delta_rule_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], C: int, arch: int,
            output_final_state: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, torch.Tensor]:
    """o, final state ([0] when not asked for), and what the backward reads: Tm, W, VN, Hs."""
    mt = launch_meta(k.shape[-1], v.shape[-1], q.dtype, arch)
    B, H, T, DK = k.shape
    DV = v.shape[-1]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    acc = _acc_dtype(k)
    N, NC, chunk_offsets, chunk_indices = _layout(B, T, C, cu_seqlens)
    BK, BV = mt["BK"], mt["BV"]
    NV = triton.cdiv(DV, BV)
    common = dict(C=C, IS_VARLEN=cu_seqlens is not None, ACC=_TL[acc], EMU=is_interpreting(),
                  num_stages=mt["stages"])
    Tm = torch.empty(B, H, T, C, dtype=acc, device=k.device)
    W = torch.empty(B, H, T, DK, dtype=acc, device=k.device)
    U = torch.empty(B, H, T, DV, dtype=acc, device=k.device)
    VN = torch.empty_like(U)
    Hs = torch.empty(max(NC, 1), H, DK, DV, dtype=acc, device=k.device)
    o = torch.empty(B, H, T, DV, dtype=v.dtype, device=v.device)
    h0 = None if initial_state is None else initial_state.to(acc).contiguous()
    ht = torch.empty(N, H, DK, DV, dtype=acc, device=k.device) if output_final_state else None
    cu = cu_seqlens
    if B * T > 0:
        _gdr_wy_inv[(NC, H)](k, beta, g, Tm, cu, chunk_offsets, chunk_indices, T, H, DK=DK, BK=BK,
                         PK=mt["PREC"], PS=mt["PS"], num_warps=mt["warps_inv"], **common)
        BKW, BVW = mt["BKW"], mt["BVW"]
        _gdr_wy_fwd[(NC, H, triton.cdiv(DK, BKW) + triton.cdiv(DV, BVW))](
            k, v, beta, g, Tm, W, U, cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV, BK=BKW, BV=BVW,
            PS=mt["PS"], num_warps=mt["warps_wy"], **common)
    _gdr_fwd_state[(NV, N * H)](k, g, W, U, Hs, VN, h0, ht, cu, chunk_offsets, T, H,
                            DK=DK, DV=DV, BK=mt["BKS"], BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None,
                            PS=mt["PS"], num_warps=mt["warps_state"], **common)
    if B * T > 0:
        _gdr_fwd_o[(NC, H, NV)](q, k, g, VN, Hs, o, cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV,
                            BK=mt["BKS"], BV=BV, PREC=mt["PREC"], PS=mt["PS"], num_warps=mt["warps_o"], **common)
    if ht is None:
        ht = o.new_empty(0, dtype=acc)
    return o, ht, Tm, W, VN, Hs


@_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, C, arch, output_final_state):
    B, H, T, DK = k.shape
    DV = v.shape[-1]
    acc = _acc_dtype(k)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NC = B * triton.cdiv(T, C) if cu_seqlens is None else T // C + N
    Tm = k.new_empty(B, H, T, C, dtype=acc)
    W = k.new_empty(B, H, T, DK, dtype=acc)
    U = k.new_empty(B, H, T, DV, dtype=acc)
    Hs = k.new_empty(torch.sym_max(NC, 1), H, DK, DV, dtype=acc)
    ht = k.new_empty(N, H, DK, DV, dtype=acc) if output_final_state else k.new_empty(0, dtype=acc)
    return v.new_empty(B, H, T, DV), ht, Tm, W, U, Hs   # contiguous, as the real o


@torch.library.custom_op("kernels::gated_delta_rule_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            Tm: torch.Tensor, W: torch.Tensor, VN: torch.Tensor, Hs: torch.Tensor, do: torch.Tensor,
            dht: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], C: int, arch: int,
            h0_dtype: Optional[torch.dtype]
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, dg, dbeta, d initial_state ([0] when there is none); each input's gradient in
    that input's memory layout (strides), as the fake implementation and autograd expect."""
    cu = cu_seqlens
    given = (q, k, v, g, beta)
    q, k, v, g, beta = (t.contiguous() for t in given)
    mt = launch_meta(k.shape[-1], v.shape[-1], q.dtype, arch)
    BK, BV = mt["BK"], mt["BV"]
    B, H, T, DK = k.shape
    DV = v.shape[-1]
    N, NC, chunk_offsets, chunk_indices = _layout(B, T, C, cu)
    NV = triton.cdiv(DV, BV)
    has_h0 = h0_dtype is not None
    common = dict(C=C, IS_VARLEN=cu is not None, ACC=_TL[Hs.dtype], EMU=is_interpreting(),
                  num_stages=mt["stages"])
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()
    dHs = torch.empty_like(Hs)
    dVN = torch.empty_like(VN)
    dh0 = torch.empty(N, H, DK, DV, dtype=Hs.dtype, device=k.device) if has_h0 else None
    if B * T > 0:
        _gdr_bwd_dv_local[(NC, H, NV)](q, k, g, do, dVN, cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV,
                                   BK=mt["BKS"], BV=BV, PREC=mt["PREC"], PS=mt["PS"],
                                   num_warps=mt["warps_o"], **common)
    _gdr_bwd_state[(NV, N * H)](q, k, g, W, do, dht, dHs, dVN, dh0, cu, chunk_offsets, T, H,
                            DK=DK, DV=DV, BK=mt["BKS"], BV=BV, USE_DHT=dht is not None, STORE_DH0=has_h0,
                            PS=mt["PS"], num_warps=mt["warps_state"], **common)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    if B * T > 0:
        acc = Hs.dtype
        dk_part = torch.empty(B, H, T, DK, dtype=acc, device=k.device)
        dw = torch.empty_like(dk_part)
        dg_part = torch.empty(B, H, T, dtype=acc, device=k.device)
        _gdr_bwd_dqk[(NC, H)](q, k, g, VN, do, dVN, Hs, dHs, dq, dk_part, dw, dg_part, cu, chunk_offsets,
                          chunk_indices, T, H, DK=DK, DV=DV, BK=BK, BV=BV, PREC=mt["PREC"], PS=mt["PS"],
                          num_warps=mt["warps_chunk"], **common)
        _gdr_bwd_wy[(NC, H)](k, v, beta, g, Tm, dVN, dk_part, dw, dg_part, dk, dv, dbeta, dg, cu, chunk_offsets,
                         chunk_indices, T, H, DK=DK, DV=DV, BK=mt["BKS"], BV=mt["BV_bwd_wy"], PREC=mt["PREC"],
                         PS=mt["PS"],
                         num_warps=mt["warps_bwd_wy"], **common)
    dh0 = dh0.to(h0_dtype) if dh0 is not None else q.new_empty(0)
    dq, dk, dv, dg, dbeta = (d if x.is_contiguous() else torch.empty_like(x).copy_(d)
                             for x, d in zip(given, (dq, dk, dv, dg, dbeta)))
    return dq, dk, dv, dg, dbeta, dh0


@_bwd_op.register_fake
def _(q, k, v, g, beta, Tm, W, VN, Hs, do, dht, cu_seqlens, C, arch, h0_dtype):
    B, H, T, DK = k.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dh0 = k.new_empty(N, H, DK, v.shape[-1], dtype=h0_dtype) if h0_dtype is not None else q.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, cu_seqlens, C, arch, output_final_state = inputs
    _, _, Tm, W, VN, Hs = output
    ctx.save_for_backward(q, k, v, g, beta, Tm, W, VN, Hs, cu_seqlens)
    ctx.mark_non_differentiable(Tm, W, VN, Hs)
    ctx.meta = (C, arch, output_final_state, None if h0 is None else h0.dtype)


def _backward_rule(ctx, do, dht, *_):
    q, k, v, g, beta, Tm, W, VN, Hs, cu_seqlens = ctx.saved_tensors
    C, arch, output_final_state, h0_dtype = ctx.meta
    dht = dht if output_final_state else None
    dq, dk, dv, dg, dbeta, dh0 = _bwd_op(q, k, v, g, beta, Tm, W, VN, Hs, do, dht, cu_seqlens, C, arch, h0_dtype)
    return dq, dk, dv, dg, dbeta, (dh0 if h0_dtype is not None else None), None, None, None, None


_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


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
    B, H, T, DK = k.shape
    DV = v.shape[-1]
    if DK > MAX_DK or DV > MAX_DV:
        raise ValueError(f"gated_delta_rule_triton: head dims up to d_k = {MAX_DK} and d_v = {MAX_DV} are "
                         f"supported, got d_k = {DK} (q, k) and d_v = {DV} (v); use backend='torch'")
    if cu_seqlens is not None:
        cu_seqlens = _check_cu_seqlens(cu_seqlens, T, k.device)
    arch = device_arch(q.device)
    C = min(launch_meta(DK, DV, q.dtype, arch)["C"], _pow2(chunk_size))
    g = g.to(_acc_dtype(k))   # made contiguous inside the op: its gradient keeps g's layout
    o, ht = _fwd_op(q, k, v, g, beta, initial_state, cu_seqlens, C, arch, output_final_state)[:2]
    return o, (ht if output_final_state else None)


__all__ = ["gated_delta_rule_triton", "launch_meta", "MAX_DK", "MAX_DV"]
