r"""Triton chunked delta rule, forward and backward (the WY/UT form of Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length").

Recurrence (per sequence and head, state S ∈ R^{d_k×d_v}, the layout of ``reference.py``):

    S_t = S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t

Per chunk of C tokens (K, Q ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β ∈ R^C, chunk-start state S_n):

    L  = tril(diag(β) K Kᵀ, −1),   T = (I + L)⁻¹            (unit lower triangular)
    W  = T diag(β) K,              U = T diag(β) V
    Ṽ  = U − W S_n                                           (pseudo-values)
    O  = Q S_n + (M ∘ Q Kᵀ) Ṽ,     M = tril(1), diagonal included
    S_{n+1} = S_n + Kᵀ Ṽ

Kernels, forward:
  ``_wy_fwd``     grid (chunks, H): T (stored for the backward), W and U.
  ``_fwd_state``  grid (d_v blocks, sequences·H): the sequential sweep over chunks with S_n in
                  registers; stores every S_n, Ṽ, and writes O and the final state.
Backward, with dS the gradient of the state at the end of the chunk being processed:
  ``_bwd_state``  grid (d_v blocks, sequences·H), chunks in reverse:
                  dṼ = (M ∘ Q Kᵀ)ᵀ dO + K dS;   dS ← dS + Qᵀ dO − Wᵀ dṼ   (stores each dS and dṼ)
  ``_bwd_chunk``  grid (chunks, H), everything else, chunk-local:
                  dP = M ∘ dO Ṽᵀ,  dQ = dO S_nᵀ + dP K,  dK ∋ dPᵀ Q + Ṽ dSᵀ,  dW = −dṼ S_nᵀ, dU = dṼ;
                  through W, U:  dT = dW (βK)ᵀ + dU (βV)ᵀ,  d(βK) = Tᵀ dW,  d(βV) = Tᵀ dU;
                  through T = (I + L)⁻¹:  dL = −tril(Tᵀ dT Tᵀ, −1),  dG = diag(β) dL (G = K Kᵀ),
                  dK ∋ (dG + dGᵀ) K,  dβ ∋ rowsum(dL ∘ G).

Variable-length batches: with ``cu_seqlens`` (int32 [N+1]) the input is one packed row
(B = 1, T = cu_seqlens[-1]) and the state restarts at every sequence start (from
``initial_state[i]`` for sequence i when given); chunks never straddle two sequences.

All arithmetic is in float32 (float64 for float64 inputs). Products of float32 inputs use IEEE
precision so results match the reference closely; half-precision inputs use TF32 tensor cores.
The kernel chunk is a power of two in [16, 64] (``tl.dot`` needs tiles of at least 16): the
result does not depend on it, only the speed does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import check_triton_device
from kernels.delta_rule.shapes import check_delta_rule_inputs, fold_channel_beta, unfold_channel_beta


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First packed row of sequence n / head h, its length, and its first global chunk."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
        Tn = eos - bos
        row0 = h.to(tl.int64) * T + bos
        coff = tl.load(chunk_offsets + n).to(tl.int64)
    else:
        Tn = T
        row0 = (n.to(tl.int64) * H + h) * T
        coff = n.to(tl.int64) * tl.cdiv(T, C)
    return row0, Tn, coff


@triton.jit
def _unit_lower_inverse(L, C: tl.constexpr):
    """(I + L)⁻¹ for strictly lower triangular L [C, C] by forward substitution on rows:
    X_i = −L_i − Σ_{j<i} L_ij X_j for the off-diagonal part, rows j < i already final."""
    o = tl.arange(0, C)
    X = -L
    for i in range(1, C):
        row = tl.sum(tl.where(o[:, None] == i, X, 0.0), 0)
        row = row + tl.sum(row[:, None] * X, 0)
        X = tl.where(o[:, None] == i, row[None, :], X)
    return X + tl.where(o[:, None] == o[None, :], 1.0, 0.0).to(X.dtype)


@triton.jit
def _wy_fwd(k, v, beta, Tm, W, U, cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    i_c, h = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        n = tl.load(chunk_indices + 2 * i_c)
        c = tl.load(chunk_indices + 2 * i_c + 1)
    else:
        NT = tl.cdiv(T, C)
        n = i_c // NT
        c = i_c % NT
    row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C, IS_VARLEN)
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_k = tl.arange(0, BK)
    o_c = tl.arange(0, C)
    b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < DK), other=0.0).to(ACC)
    b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
    G = tl.dot(b_k, tl.trans(b_k), input_precision=PREC, out_dtype=ACC)
    L = tl.where(o_c[:, None] > o_c[None, :], b_b[:, None] * G, 0.0)
    X = _unit_lower_inverse(L, C)
    tl.store(Tm + rows[:, None] * C + o_c[None, :], X.to(Tm.dtype.element_ty), mask=m_t[:, None])
    b_w = tl.dot(X, b_b[:, None] * b_k, input_precision=PREC, out_dtype=ACC)
    tl.store(W + rows[:, None] * DK + o_k[None, :], b_w.to(W.dtype.element_ty),
             mask=m_t[:, None] & (o_k[None, :] < DK))
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v[None, :] < DV)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_v, other=0.0).to(ACC)
        b_u = tl.dot(X, b_b[:, None] * b_v, input_precision=PREC, out_dtype=ACC)
        tl.store(U + rows[:, None] * DV + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_v)


@triton.jit
def _fwd_state(q, k, W, U, Hs, VN, o, h0, ht, cu_seqlens, chunk_offsets, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_kv = (o_k[:, None] < DK) & (o_v[None, :] < DV)
    kv_off = o_k[:, None] * DV + o_v[None, :]
    causal = o_c[:, None] >= o_c[None, :]
    S = tl.zeros([BK, BV], dtype=ACC)
    if USE_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * DK * DV + kv_off, mask=m_kv, other=0.0).to(ACC)
    for c in range(tl.cdiv(Tn, C)):
        tl.store(Hs + ((coff + c) * H + h) * DK * DV + kv_off, S.to(Hs.dtype.element_ty), mask=m_kv)
        o_t = c * C + o_c
        m_t = o_t < Tn
        rows = row0 + o_t
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_w = tl.load(W + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_u = tl.load(U + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_vn = b_u - tl.dot(b_w, S, input_precision=PREC, out_dtype=ACC)
        tl.store(VN + rows[:, None] * DV + o_v[None, :], b_vn.to(VN.dtype.element_ty), mask=m_tv)
        P = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC, out_dtype=ACC), 0.0)
        b_o = tl.dot(b_q, S, input_precision=PREC, out_dtype=ACC) + tl.dot(P, b_vn, input_precision=PREC, out_dtype=ACC)
        tl.store(o + rows[:, None] * DV + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        S += tl.dot(tl.trans(b_k), b_vn, input_precision=PREC, out_dtype=ACC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * DK * DV + kv_off, S.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def _bwd_state(q, k, W, do, dht, dHs, dVN, dh0, cu_seqlens, chunk_offsets, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    n = i_nh // H
    h = i_nh % H
    row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_kv = (o_k[:, None] < DK) & (o_v[None, :] < DV)
    kv_off = o_k[:, None] * DV + o_v[None, :]
    causal = o_c[:, None] >= o_c[None, :]
    dS = tl.zeros([BK, BV], dtype=ACC)
    if USE_DHT:
        dS += tl.load(dht + i_nh.to(tl.int64) * DK * DV + kv_off, mask=m_kv, other=0.0).to(ACC)
    NT = tl.cdiv(Tn, C)
    for ci in range(NT):
        c = NT - 1 - ci
        # dS is the gradient of the state at the end of chunk c
        tl.store(dHs + ((coff + c) * H + h) * DK * DV + kv_off, dS.to(dHs.dtype.element_ty), mask=m_kv)
        o_t = c * C + o_c
        m_t = o_t < Tn
        rows = row0 + o_t
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_w = tl.load(W + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        P = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC, out_dtype=ACC), 0.0)
        b_dvn = (tl.dot(tl.trans(P), b_do, input_precision=PREC, out_dtype=ACC)
                 + tl.dot(b_k, dS, input_precision=PREC, out_dtype=ACC))
        tl.store(dVN + rows[:, None] * DV + o_v[None, :], b_dvn.to(dVN.dtype.element_ty), mask=m_tv)
        dS += (tl.dot(tl.trans(b_q), b_do, input_precision=PREC, out_dtype=ACC)
               - tl.dot(tl.trans(b_w), b_dvn, input_precision=PREC, out_dtype=ACC))
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * DK * DV + kv_off, dS.to(dh0.dtype.element_ty), mask=m_kv)


@triton.jit
def _bwd_chunk(q, k, v, beta, Tm, VN, do, dVN, Hs, dHs, dq, dk, dv, dbeta,
               cu_seqlens, chunk_offsets, chunk_indices, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    i_c, h = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        n = tl.load(chunk_indices + 2 * i_c)
        c = tl.load(chunk_indices + 2 * i_c + 1)
    else:
        NT = tl.cdiv(T, C)
        n = i_c // NT
        c = i_c % NT
    row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, n, h, T, H, C, IS_VARLEN)
    hs_off = ((coff + c) * H + h) * DK * DV
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_k = tl.arange(0, BK)
    o_c = tl.arange(0, C)
    m_tk = m_t[:, None] & (o_k[None, :] < DK)
    b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
    b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
    b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
    X = tl.load(Tm + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0).to(ACC)
    b_dq = tl.zeros([C, BK], dtype=ACC)
    b_dk = tl.zeros([C, BK], dtype=ACC)
    b_dw = tl.zeros([C, BK], dtype=ACC)
    dP = tl.zeros([C, C], dtype=ACC)
    dX = tl.zeros([C, C], dtype=ACC)
    b_db = tl.zeros([C], dtype=ACC)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        m_kv = (o_k[:, None] < DK) & (o_v[None, :] < DV)
        kv_off = o_k[:, None] * DV + o_v[None, :]
        S = tl.load(Hs + hs_off + kv_off, mask=m_kv, other=0.0).to(ACC)
        dS = tl.load(dHs + hs_off + kv_off, mask=m_kv, other=0.0).to(ACC)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_vn = tl.load(VN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_du = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_dq += tl.dot(b_do, tl.trans(S), input_precision=PREC, out_dtype=ACC)
        dP += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC, out_dtype=ACC)
        b_dk += tl.dot(b_vn, tl.trans(dS), input_precision=PREC, out_dtype=ACC)
        b_dw -= tl.dot(b_du, tl.trans(S), input_precision=PREC, out_dtype=ACC)
        # U = T (βV)
        dX += tl.dot(b_du, tl.trans(b_b[:, None] * b_v), input_precision=PREC, out_dtype=ACC)
        b_dvb = tl.dot(tl.trans(X), b_du, input_precision=PREC, out_dtype=ACC)
        tl.store(dv + rows[:, None] * DV + o_v[None, :], (b_b[:, None] * b_dvb).to(dv.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_dvb * b_v, 1)
    dP = tl.where(o_c[:, None] >= o_c[None, :], dP, 0.0)
    b_dq += tl.dot(dP, b_k, input_precision=PREC, out_dtype=ACC)
    b_dk += tl.dot(tl.trans(dP), b_q, input_precision=PREC, out_dtype=ACC)
    # W = T (βK)
    dX += tl.dot(b_dw, tl.trans(b_b[:, None] * b_k), input_precision=PREC, out_dtype=ACC)
    b_dkb = tl.dot(tl.trans(X), b_dw, input_precision=PREC, out_dtype=ACC)
    b_dk += b_b[:, None] * b_dkb
    b_db += tl.sum(b_dkb * b_k, 1)
    # T = (I + L)⁻¹  ⇒  dL = −Tᵀ dT Tᵀ, kept on the strictly lower part where L lives
    dL = tl.dot(tl.dot(tl.trans(X), dX, input_precision=PREC, out_dtype=ACC), tl.trans(X),
                input_precision=PREC, out_dtype=ACC)
    dL = tl.where(o_c[:, None] > o_c[None, :], -dL, 0.0)
    G = tl.dot(b_k, tl.trans(b_k), input_precision=PREC, out_dtype=ACC)
    b_db += tl.sum(dL * G, 1)
    dG = b_b[:, None] * dL
    b_dk += (tl.dot(dG, b_k, input_precision=PREC, out_dtype=ACC)
             + tl.dot(tl.trans(dG), b_k, input_precision=PREC, out_dtype=ACC))
    tl.store(dq + rows[:, None] * DK + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + rows[:, None] * DK + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + rows, b_db.to(dbeta.dtype.element_ty), mask=m_t)


def _layout(B: int, T: int, C: int, cu_seqlens: Optional[torch.Tensor], device):
    """(number of sequences, total chunks, per-sequence first chunk, (sequence, chunk) per chunk)."""
    if cu_seqlens is None:
        nt = triton.cdiv(T, C)
        return B, B * nt, None, None
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    nts = [triton.cdiv(int(n), C) for n in lens]
    offs, idx, total = [], [], 0
    for s, nt in enumerate(nts):
        offs.append(total)
        idx.extend((s, c) for c in range(nt))
        total += nt
    chunk_offsets = torch.tensor(offs, dtype=torch.int32, device=device)
    chunk_indices = torch.tensor(idx, dtype=torch.int32, device=device).reshape(-1, 2)
    return len(lens), total, chunk_offsets, chunk_indices


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


#: widest d_v block one program holds (the state tile is [d_k, BV]); more d_v means more programs
BV_MAX = 64

_TL = {torch.float32: tl.float32, torch.float64: tl.float64}
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DeltaRuleChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, initial_state, cu_seqlens, C, output_final_state):
        B, H, T, DK = k.shape
        DV = v.shape[-1]
        q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
        acc = _acc_dtype(k)
        N, NC, chunk_offsets, chunk_indices = _layout(B, T, C, cu_seqlens, k.device)
        BK, BVW = _pow2(DK), _pow2(DV)
        BV = min(BVW, BV_MAX)
        NV = triton.cdiv(DV, BV)
        ACC = _TL[acc]
        PREC = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
        Tm = torch.empty(B, H, T, C, dtype=acc, device=k.device)
        W = torch.empty(B, H, T, DK, dtype=acc, device=k.device)
        U = torch.empty(B, H, T, DV, dtype=acc, device=k.device)
        VN = torch.empty_like(U)
        Hs = torch.empty(max(NC, 1), H, DK, DV, dtype=acc, device=k.device)
        o = torch.empty(B, H, T, DV, dtype=v.dtype, device=v.device)
        h0 = None if initial_state is None else initial_state.to(acc).contiguous()
        ht = torch.empty(N, H, DK, DV, dtype=acc, device=k.device) if output_final_state else None
        cu = cu_seqlens
        if NC > 0:
            _wy_fwd[(NC, H)](k, v, beta, Tm, W, U, cu, chunk_offsets, chunk_indices, T, H,
                             DK=DK, DV=DV, C=C, BK=BK, BV=BV, IS_VARLEN=cu is not None, ACC=ACC, PREC=PREC)
        _fwd_state[(NV, N * H)](q, k, W, U, Hs, VN, o, h0, ht, cu, chunk_offsets, T, H,
                                DK=DK, DV=DV, C=C, BK=BK, BV=BV, USE_H0=h0 is not None,
                                STORE_HT=ht is not None, IS_VARLEN=cu is not None, ACC=ACC, PREC=PREC)
        ctx.save_for_backward(q, k, v, beta, Tm, W, VN, Hs, cu_seqlens, chunk_offsets, chunk_indices)
        ctx.meta = (N, NC, C, BK, BV, NV, ACC, PREC, initial_state is not None,
                    None if initial_state is None else initial_state.dtype)
        if ht is not None:
            return o, ht
        return o

    @staticmethod
    def backward(ctx, do, dht=None):
        q, k, v, beta, Tm, W, VN, Hs, cu, chunk_offsets, chunk_indices = ctx.saved_tensors
        N, NC, C, BK, BV, NV, ACC, PREC, has_h0, h0_dtype = ctx.meta
        B, H, T, DK = k.shape
        DV = v.shape[-1]
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        dHs = torch.empty_like(Hs)
        dVN = torch.empty_like(VN)
        dh0 = torch.empty(N, H, DK, DV, dtype=Hs.dtype, device=k.device) if has_h0 else None
        _bwd_state[(NV, N * H)](q, k, W, do, dht, dHs, dVN, dh0, cu, chunk_offsets, T, H,
                                DK=DK, DV=DV, C=C, BK=BK, BV=BV, USE_DHT=dht is not None,
                                STORE_DH0=has_h0, IS_VARLEN=cu is not None, ACC=ACC, PREC=PREC)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dbeta = torch.empty_like(beta)
        if NC > 0:
            _bwd_chunk[(NC, H)](q, k, v, beta, Tm, VN, do, dVN, Hs, dHs, dq, dk, dv, dbeta,
                                cu, chunk_offsets, chunk_indices, T, H,
                                DK=DK, DV=DV, C=C, BK=BK, BV=BV, IS_VARLEN=cu is not None, ACC=ACC, PREC=PREC)
        if dh0 is not None:
            dh0 = dh0.to(h0_dtype)
        return dq, dk, dv, dbeta, dh0, None, None, None


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
    B, H, T, DK = k.shape
    if cu_seqlens is not None:
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
            raise ValueError("delta_rule_triton: cu_seqlens must start at 0 and end at T")
        cu_seqlens = cu_seqlens.to(device=k.device, dtype=torch.int32).contiguous()
    C = min(64, _pow2(chunk_size))
    res = DeltaRuleChunkFunction.apply(q, k, v, beta, initial_state, cu_seqlens, C, output_final_state)
    if output_final_state:
        return res[0], res[1]
    return res, None
