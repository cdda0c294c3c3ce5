r"""Triton chunked forward and backward of the Titans linear memory (Behrouz et al. 2025, §3.2).

Per batch element and head, with the chunk's gradients taken at the memory M₀ at its start,

    S_t = η_t S_{t−1} − θ_t ∇ℓ(M₀; k_t, v_t),   M_t = (1 − α_t) M_{t−1} + S_t,   o_t = q_t M_t,

∇ℓ(M₀; k_j, v_j) = k_jᵀ δ_j with δ_j = 2(k_j M₀ − v_j). With A = cumsum log η, B = cumsum log(1 − α)
inside the chunk, L_a[i, j] = e^{A_i − A_j}, L_b[t, i] = e^{B_t − B_i} (lower triangular),
a = e^A, b = e^B, c = L_b a and D = L_b L_a (see ``torch_chunk.py``), one chunk is

    O   = diag(b) q M₀ + diag(c) q S₀ − [(q kᵀ) ∘ D diag(θ)] δ
    M_C = b_C M₀ + c_C S₀ − kᵀ diag(D[C, :] θ) δ
    S_C = a_C S₀ − kᵀ diag(e^{A_C − A} θ) δ

Every term is a [C, C] or [C, d] tile product (``tl.dot``). The columns of M are independent
(momentum and decay act elementwise on the memory, δ, O and the updates column-wise), so d_v is
split into blocks with no communication; every product over d_k is summed over blocks of BK
rows of the memory (BK columns of q, k), so no program holds a [C, d_k] operand or a [d_k, d_v]
tile whole. Five kernels:

* ``_titans_fwd_state_kernel``: one program per (block of d_v columns, sequence·head) walks the
  sequence's chunks and stores each chunk's starting (M, S), the final ones and the anchor M̂,
  reading each chunk's (M, S) back from what it stored (cache-resident) instead of carrying them
  in registers;
* ``_titans_fwd_kernel``: one program per (chunk slot, d_v block, batch·head) computes the chunk's
  O from its stored (M₀, S₀);
* ``_titans_bwd_state_kernel``: one program per (d_v block, sequence·head) sweeps the chunks in
  reverse and stores the gradients (∂M_C, ∂S_C) at each chunk's end; this needs only q, k, ∂O
  and the gates (∂δ = −Pᵀ ∂O − diag(u) k ∂M_C − diag(w) k ∂S_C does not involve M₀);
* ``_titans_bwd_kernel``: one program per (chunk slot, d_v block, batch·head) recomputes the chunk
  from its (M₀, S₀) and (∂M_C, ∂S_C) and writes the gradients of q, k, v (those of q, k as partial
  sums over its d_v block) and the partial sums the gate gradients are linear in;
* ``_titans_bwd_gates_kernel``: one program per (chunk slot, batch·head) turns those, summed over
  the d_v blocks, into the gradients of θ, log η, log(1 − α).

The chunk-parallel kernels fill the GPU with B·H·N·(d_v / BV) programs.

Variable-length batches (``cu_seqlens`` int32 [N+1] over one packed row, B = 1): every kernel is
launched once for the whole batch. The serial kernels take one program per (d_v block,
sequence·head) and restart from the sequence's row of the initial state; the chunk-parallel
ones one per chunk slot, whose (sequence, chunk) they read from a table built on the device
(``_layout``: ⌊T / C⌋ + N slots per head bound the Σ ⌈T_i / C⌉ chunks, the spare ones do
nothing), so chunks never straddle two sequences and the launches need nothing from the host
(``titans_linear_triton`` reads back one flag, the check of the offsets). Final states and M̂ are
per sequence; an empty sequence passes its initial state through.

Tiles and warps come from ``launch_meta`` per GPU family (the compile gate checks each family's
choice, fixed-length and packed).

Precision: every tile is loaded into float32 (float64 for float64 inputs); ``tl.dot`` runs TF32
products for bfloat16/float16 inputs (their own rounding, 2^-9, exceeds TF32's), TF32×3 (about
float32 accuracy) for float32 inputs, IEEE for float64; accumulation is float32 (float64).

Coverage: the kernels run chunks counted from its first token (offset ≡ 0 mod C), a trailing
partial chunk included, for any C: a chunk sits in a tile of max(16, 2^⌈log₂ C⌉) rows and the
rows past the chunk or past T are masked (θ = 0, zero inputs, their rows of L_a and a zeroed,
which makes them exact no-ops for the chunk's final state). A call that starts
inside a chunk (offset % C ≠ 0) runs that first partial chunk, whose gradients are taken at the
carried anchor M̂, with ``titans_linear_chunk_torch`` and the rest with the kernel.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import INTERPRET_ARCH, check_triton_device, device_arch, packed_chunk_tables
from kernels.titans.reference import _acc, _initial, check_titans_inputs
from kernels.titans.torch_chunk import titans_linear_chunk_torch

# log-gates are clamped as in torch_chunk.chunk_decays: e^{−1e4} is already 0 and keeps −inf − −inf
# from producing nan
_LOG_MIN: tl.constexpr = tl.constexpr(-1e4)


@triton.jit
def _chunk_coefs(th_ptr, le_ptr, lk_ptr, base_g, n, T, C, BC: tl.constexpr, ACC: tl.constexpr):
    """Decay coefficients of chunk n in a tile of BC ≥ C rows (see the module docstring); rows
    past the chunk or past T get θ = 0, log-gates 0 and zero rows of L_a and a."""
    oc = tl.arange(0, BC)
    t = n * C + oc
    mt = (oc < C) & (t < T)
    th = tl.load(th_ptr + base_g + t, mask=mt, other=0.).to(ACC)
    le_raw = tl.load(le_ptr + base_g + t, mask=mt, other=0.).to(ACC)
    lk_raw = tl.load(lk_ptr + base_g + t, mask=mt, other=0.).to(ACC)
    le = tl.maximum(le_raw, _LOG_MIN)
    lk = tl.maximum(lk_raw, _LOG_MIN)
    low = oc[:, None] >= oc[None, :]
    # within-chunk cumulative sums as masked row sums of a [BC, BC] tile
    A = tl.sum(tl.where(low, le[None, :], 0.), 1)
    Bc = tl.sum(tl.where(low, lk[None, :], 0.), 1)
    A_L = tl.sum(le, 0)
    B_L = tl.sum(lk, 0)
    La = tl.exp(tl.where(low & mt[:, None], A[:, None] - A[None, :], float("-inf")))
    Lb = tl.exp(tl.where(low, Bc[:, None] - Bc[None, :], float("-inf")))
    a = tl.where(mt, tl.exp(A), 0.)
    b = tl.exp(Bc)
    La_last = tl.exp(A_L - A)
    Lb_last = tl.exp(B_L - Bc)
    return th, le_raw, lk_raw, t, mt, low, La, Lb, a, b, A_L, B_L, La_last, Lb_last


@triton.jit
def _seq_rows(cu_seqlens, chunk_offsets, i_s, h, T, H, NCH, IS_VARLEN: tl.constexpr):
    """Sequence i_s (the batch element without ``cu_seqlens``) at head h: its first row in the
    [B·H·T] token layout, its length and its first chunk slot (row of the chunk-state buffers
    [B·H·NCH, d_k, d_v]); packed sequences take their chunks from ``chunk_offsets``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_s).to(tl.int64)
        Tn = tl.load(cu_seqlens + i_s + 1).to(tl.int64) - bos
        base_g = h.to(tl.int64) * T + bos
        slot0 = h.to(tl.int64) * NCH + tl.load(chunk_offsets + i_s).to(tl.int64)
    else:
        bh = i_s.to(tl.int64) * H + h
        base_g = bh * T
        Tn = T
        slot0 = bh * NCH
    return base_g, Tn, slot0


@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_c, i_bh, T, NCH, IS_VARLEN: tl.constexpr):
    """Chunk slot i_c of row i_bh (batch·head; the head with ``cu_seqlens``): the chunk's index
    inside its sequence, the sequence's first token row and length, and the slot's row of the
    chunk buffers. Packed chunks read (sequence, chunk) from ``chunk_indices``; the spare slots
    past the last chunk (sequence −1) get length 0, so every load and store of theirs is masked."""
    if IS_VARLEN:
        n = tl.load(chunk_indices + 2 * i_c)
        c = tl.load(chunk_indices + 2 * i_c + 1)
        valid = n >= 0
        n = tl.maximum(n, 0)
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        Tn = tl.where(valid, tl.load(cu_seqlens + n + 1).to(tl.int64) - bos, 0)
        base_g = i_bh.to(tl.int64) * T + bos
    else:
        c = i_c
        Tn = T
        base_g = i_bh.to(tl.int64) * T
    return c, base_g, Tn, i_bh.to(tl.int64) * NCH + i_c


@triton.jit
def _titans_fwd_state_kernel(k_ptr, v_ptr, th_ptr, le_ptr, lk_ptr, M0_ptr, S0_ptr,
                             Mst_ptr, Sst_ptr, MT_ptr, ST_ptr, Mh_ptr, cu_seqlens, chunk_offsets,
                             T, H, NCH, DK, DV, C,
                             BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                             ACC: tl.constexpr, PREC: tl.constexpr):
    """The serial half of the forward: one program per (block of d_v columns, sequence·head) walks
    the sequence's chunks and writes each chunk's starting (M, S) and the final ones,

        M_C = b_C M₀ + c_C S₀ − kᵀ diag(D[C, :] θ) δ,   S_C = a_C S₀ − kᵀ diag(e^{A_C − A} θ) δ,

    and the anchor M̂ (the memory at the start of a partial last chunk, else the final M; M₀ for
    an empty sequence).

    The memory is not held in registers: each chunk reads its (M₀, S₀) back from the stored
    chunk-start states (cache-resident, written by this program) in blocks of BK rows, first to sum
    δ = 2(k M₀ − v) over d_k, then to write the next chunk's (M, S) block by block."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < DV
    base_s = i_nh.to(tl.int64) * DK * DV
    base_g, Tn, slot0 = _seq_rows(cu_seqlens, chunk_offsets, i_nh // H, i_nh % H, T, H, NCH, IS_VARLEN)
    base_0 = slot0 * DK * DV
    NT = tl.cdiv(Tn, C)
    tail = Tn % C != 0
    for k0 in range(0, DK, BK):
        ok = k0 + tl.arange(0, BK)
        mkv = (ok < DK)[:, None] & mv[None, :]
        off = ok[:, None] * DV + ov[None, :]
        M0 = tl.load(M0_ptr + base_s + off, mask=mkv, other=0.)
        S0 = tl.load(S0_ptr + base_s + off, mask=mkv, other=0.)
        if NT > 0:
            tl.store(Mst_ptr + base_0 + off, M0.to(Mst_ptr.dtype.element_ty), mask=mkv)
            tl.store(Sst_ptr + base_0 + off, S0.to(Sst_ptr.dtype.element_ty), mask=mkv)
        else:   # an empty sequence: its final state is its initial one, M̂ = M
            tl.store(MT_ptr + base_s + off, M0.to(MT_ptr.dtype.element_ty), mask=mkv)
            tl.store(ST_ptr + base_s + off, S0.to(ST_ptr.dtype.element_ty), mask=mkv)
            tl.store(Mh_ptr + base_s + off, M0.to(Mh_ptr.dtype.element_ty), mask=mkv)
    tl.debug_barrier()  # the stores are read back by other threads of the program
    for n in range(NT):
        base_n = base_0 + n * DK * DV
        th, le_raw, lk_raw, t, mt, low, La, Lb, a, b, A_L, B_L, La_last, Lb_last = _chunk_coefs(
            th_ptr, le_ptr, lk_ptr, base_g, n, Tn, C, BC, ACC)
        rows = (base_g + t)[:, None]
        kM = tl.zeros([BC, BV], dtype=ACC)
        for k0 in range(0, DK, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < DK
            k = tl.load(k_ptr + rows * DK + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.).to(ACC)
            M = tl.load(Mst_ptr + base_n + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :],
                        other=0.).to(ACC)
            kM += tl.dot(k, M, input_precision=PREC)
        v = tl.load(v_ptr + rows * DV + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.).to(ACC)
        delta = 2. * (kM - v)
        u = tl.sum(Lb_last[:, None] * La, 0) * th
        w = La_last * th
        c_L = tl.sum(Lb_last * a, 0)
        u_delta = u[:, None] * delta
        w_delta = w[:, None] * delta
        for k0 in range(0, DK, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < DK
            mkv = mk[:, None] & mv[None, :]
            off = ok[:, None] * DV + ov[None, :]
            k = tl.load(k_ptr + rows * DK + ok[None, :], mask=mt[:, None] & mk[None, :], other=0.).to(ACC)
            M = tl.load(Mst_ptr + base_n + off, mask=mkv, other=0.).to(ACC)
            S = tl.load(Sst_ptr + base_n + off, mask=mkv, other=0.).to(ACC)
            kt = tl.trans(k)
            M_new = tl.exp(B_L) * M + c_L * S - tl.dot(kt, u_delta, input_precision=PREC)
            S_new = tl.exp(A_L) * S - tl.dot(kt, w_delta, input_precision=PREC)
            if n + 1 < NT:
                tl.store(Mst_ptr + base_n + DK * DV + off, M_new.to(Mst_ptr.dtype.element_ty), mask=mkv)
                tl.store(Sst_ptr + base_n + DK * DV + off, S_new.to(Sst_ptr.dtype.element_ty), mask=mkv)
            else:
                tl.store(MT_ptr + base_s + off, M_new.to(MT_ptr.dtype.element_ty), mask=mkv)
                tl.store(ST_ptr + base_s + off, S_new.to(ST_ptr.dtype.element_ty), mask=mkv)
                # the anchor: the memory at the start of a partial last chunk, else the final one
                tl.store(Mh_ptr + base_s + off, tl.where(tail, M, M_new).to(Mh_ptr.dtype.element_ty), mask=mkv)
        tl.debug_barrier()


@triton.jit
def _titans_fwd_kernel(q_ptr, k_ptr, v_ptr, th_ptr, le_ptr, lk_ptr, Mst_ptr, Sst_ptr, y_ptr,
                       cu_seqlens, chunk_indices, T, NCH, DK, DV, C,
                       BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                       ACC: tl.constexpr, PREC: tl.constexpr):
    """The chunk-parallel half of the forward: one program per (chunk slot, block of d_v columns,
    batch·head) reads the chunk's starting (M₀, S₀) and writes
    O = diag(b) q M₀ + diag(c) q S₀ − [(q kᵀ) ∘ D diag(θ)] δ. The products over d_k are summed
    over blocks of BK rows of M₀, S₀ (BK columns of q, k), so no [C, d_k] operand is held whole."""
    i_c = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2)
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < DV
    n, base_g, Tn, slot = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_bh, T, NCH, IS_VARLEN)
    base_n = slot * DK * DV
    th, le_raw, lk_raw, t, mt, low, La, Lb, a, b, A_L, B_L, La_last, Lb_last = _chunk_coefs(
        th_ptr, le_ptr, lk_ptr, base_g, n, Tn, C, BC, ACC)
    rows = (base_g + t)[:, None]
    c = tl.sum(Lb * a[None, :], 1)
    Qk = tl.zeros([BC, BC], dtype=ACC)
    kM = tl.zeros([BC, BV], dtype=ACC)
    y = tl.zeros([BC, BV], dtype=ACC)
    for k0 in range(0, DK, BK):
        ok = k0 + tl.arange(0, BK)
        mk = ok < DK
        mtk = mt[:, None] & mk[None, :]
        mkv = mk[:, None] & mv[None, :]
        q = tl.load(q_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
        k = tl.load(k_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
        st = base_n + ok[:, None] * DV + ov[None, :]
        M = tl.load(Mst_ptr + st, mask=mkv, other=0.).to(ACC)
        S = tl.load(Sst_ptr + st, mask=mkv, other=0.).to(ACC)
        Qk += tl.dot(q, tl.trans(k), input_precision=PREC)
        kM += tl.dot(k, M, input_precision=PREC)
        y += b[:, None] * tl.dot(q, M, input_precision=PREC) + c[:, None] * tl.dot(q, S, input_precision=PREC)
    D = tl.dot(Lb, La, input_precision=PREC)
    P = Qk * D * th[None, :]
    v = tl.load(v_ptr + rows * DV + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.).to(ACC)
    y -= tl.dot(P, 2. * (kM - v), input_precision=PREC)
    tl.store(y_ptr + rows * DV + ov[None, :], y.to(y_ptr.dtype.element_ty), mask=mt[:, None] & mv[None, :])


@triton.jit
def _titans_bwd_state_kernel(q_ptr, k_ptr, th_ptr, le_ptr, lk_ptr, dy_ptr, dMT_ptr, dST_ptr, dMh_ptr,
                             dMst_ptr, dSst_ptr, dM0_ptr, dS0_ptr, cu_seqlens, chunk_offsets,
                             T, H, NCH, DK, DV, C,
                             BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                             ACC: tl.constexpr, PREC: tl.constexpr):
    """The serial half of the backward: one program per (block of d_v columns, sequence·head)
    sweeps the sequence's chunks in reverse and writes, per chunk, the gradients (∂M_C, ∂S_C) at
    its end (what the chunk-parallel ``_titans_bwd_kernel`` reads), and (∂M₀, ∂S₀) of the
    sequence. ∂M̂ joins ∂M at the start of a partial last chunk (M̂ is that memory), else at the
    end (M̂ = M_T). Through one chunk (∂δ needs no M₀: δ enters the chunk's outputs linearly)

        ∂δ  = −Pᵀ ∂O − diag(u) k ∂M_C − diag(w) k ∂S_C,   u = D[C, :] θ, w = e^{A_C − A} θ
        ∂M₀ = 2 kᵀ ∂δ + qᵀ diag(b) ∂O + b_C ∂M_C,   ∂S₀ = qᵀ diag(c) ∂O + c_C ∂M_C + a_C ∂S_C.

    As in the forward, (∂M_C, ∂S_C) are read back from what this program stored, in blocks of BK
    rows: once to sum k ∂M_C, k ∂S_C and q kᵀ over d_k, once to write the previous chunk's."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < DV
    base_s = i_nh.to(tl.int64) * DK * DV
    base_g, Tn, slot0 = _seq_rows(cu_seqlens, chunk_offsets, i_nh // H, i_nh % H, T, H, NCH, IS_VARLEN)
    base_0 = slot0 * DK * DV
    NT = tl.cdiv(Tn, C)
    tail = Tn % C != 0
    for k0 in range(0, DK, BK):
        ok = k0 + tl.arange(0, BK)
        mkv = (ok < DK)[:, None] & mv[None, :]
        off = ok[:, None] * DV + ov[None, :]
        dM = (tl.load(dMT_ptr + base_s + off, mask=mkv, other=0.).to(ACC)
              + tl.where(tail, 0., tl.load(dMh_ptr + base_s + off, mask=mkv, other=0.).to(ACC)))
        dS = tl.load(dST_ptr + base_s + off, mask=mkv, other=0.).to(ACC)
        if NT > 0:
            base_l = base_0 + (NT - 1) * DK * DV
            tl.store(dMst_ptr + base_l + off, dM.to(dMst_ptr.dtype.element_ty), mask=mkv)
            tl.store(dSst_ptr + base_l + off, dS.to(dSst_ptr.dtype.element_ty), mask=mkv)
        else:   # an empty sequence passes its state through
            tl.store(dM0_ptr + base_s + off, dM.to(dM0_ptr.dtype.element_ty), mask=mkv)
            tl.store(dS0_ptr + base_s + off, dS.to(dS0_ptr.dtype.element_ty), mask=mkv)
    tl.debug_barrier()  # the stores are read back by other threads of the program
    for i in range(NT):
        n = NT - 1 - i
        base_n = base_0 + n * DK * DV
        th, le_raw, lk_raw, t, mt, low, La, Lb, a, b, A_L, B_L, La_last, Lb_last = _chunk_coefs(
            th_ptr, le_ptr, lk_ptr, base_g, n, Tn, C, BC, ACC)
        rows = (base_g + t)[:, None]
        Qk = tl.zeros([BC, BC], dtype=ACC)
        kdM = tl.zeros([BC, BV], dtype=ACC)
        kdS = tl.zeros([BC, BV], dtype=ACC)
        for k0 in range(0, DK, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < DK
            mtk = mt[:, None] & mk[None, :]
            mkv = mk[:, None] & mv[None, :]
            off = ok[:, None] * DV + ov[None, :]
            q = tl.load(q_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
            k = tl.load(k_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
            dM = tl.load(dMst_ptr + base_n + off, mask=mkv, other=0.).to(ACC)
            dS = tl.load(dSst_ptr + base_n + off, mask=mkv, other=0.).to(ACC)
            Qk += tl.dot(q, tl.trans(k), input_precision=PREC)
            kdM += tl.dot(k, dM, input_precision=PREC)
            kdS += tl.dot(k, dS, input_precision=PREC)
        dy = tl.load(dy_ptr + rows * DV + ov[None, :], mask=mt[:, None] & mv[None, :], other=0.).to(ACC)
        P = Qk * tl.dot(Lb, La, input_precision=PREC) * th[None, :]
        u = tl.sum(Lb_last[:, None] * La, 0) * th
        w = La_last * th
        c = tl.sum(Lb * a[None, :], 1)
        c_L = tl.sum(Lb_last * a, 0)
        ddelta2 = 2. * (-tl.dot(tl.trans(P), dy, input_precision=PREC)
                        - u[:, None] * kdM - w[:, None] * kdS)
        b_dy = b[:, None] * dy
        c_dy = c[:, None] * dy
        for k0 in range(0, DK, BK):
            ok = k0 + tl.arange(0, BK)
            mk = ok < DK
            mtk = mt[:, None] & mk[None, :]
            mkv = mk[:, None] & mv[None, :]
            off = ok[:, None] * DV + ov[None, :]
            qt = tl.trans(tl.load(q_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC))
            kt = tl.trans(tl.load(k_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC))
            dM = tl.load(dMst_ptr + base_n + off, mask=mkv, other=0.).to(ACC)
            dS = tl.load(dSst_ptr + base_n + off, mask=mkv, other=0.).to(ACC)
            dM_new = (tl.dot(kt, ddelta2, input_precision=PREC) + tl.dot(qt, b_dy, input_precision=PREC)
                      + tl.exp(B_L) * dM)
            dS_new = tl.dot(qt, c_dy, input_precision=PREC) + c_L * dM + tl.exp(A_L) * dS
            # the returned anchor M̂ is the memory at the start of a partial last chunk
            if tail & (n == NT - 1):
                dM_new += tl.load(dMh_ptr + base_s + off, mask=mkv, other=0.).to(ACC)
            if n > 0:
                tl.store(dMst_ptr + base_n - DK * DV + off, dM_new.to(dMst_ptr.dtype.element_ty), mask=mkv)
                tl.store(dSst_ptr + base_n - DK * DV + off, dS_new.to(dSst_ptr.dtype.element_ty), mask=mkv)
            else:
                tl.store(dM0_ptr + base_s + off, dM_new.to(dM0_ptr.dtype.element_ty), mask=mkv)
                tl.store(dS0_ptr + base_s + off, dS_new.to(dS0_ptr.dtype.element_ty), mask=mkv)
        tl.debug_barrier()


@triton.jit
def _titans_bwd_kernel(q_ptr, k_ptr, v_ptr, th_ptr, le_ptr, lk_ptr, Mst_ptr, Sst_ptr, dMst_ptr, dSst_ptr,
                       dy_ptr, dq_ptr, dk_ptr, dv_ptr, gD_ptr, gv_ptr, cu_seqlens, chunk_indices,
                       T, NCH, DK, DV, BH, C,
                       BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                       ACC: tl.constexpr, PREC: tl.constexpr):
    """The chunk-parallel half of the backward: one program per (chunk slot, block of d_v columns,
    batch·head) reads the chunk's starting (M₀, S₀) and the gradients (∂M_C, ∂S_C) at its end,
    recomputes the chunk and writes the gradients of its q, k and v (those of q and k as partial
    sums over its d_v columns) and, as partial sums too, what the gate gradients are linear in:
    the tile ∂(D diag θ) = ∂P ∘ (q kᵀ), ∂u, ∂w, ∂b, ∂c and ∂b_C, ∂c_C, ∂a_C
    (``_titans_bwd_gates_kernel`` finishes them once summed over the d_v blocks).

    Two passes over blocks of BK rows of the memory tiles (BK columns of q, k): the first sums
    the products over d_k (q kᵀ, k M₀, q M₀, q S₀, k ∂M_C, k ∂S_C), the second writes ∂q, ∂k block
    by block, so no [C, d_k] operand or [d_k, BV] tile is held whole."""
    i_c = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2)
    oc = tl.arange(0, BC)
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < DV
    n, base_g, Tn, slot = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_bh, T, NCH, IS_VARLEN)
    base_n = slot * DK * DV
    # per-d_v-block partial sums of the gradients shared by all columns
    base_p = i_v.to(tl.int64) * BH * T + base_g
    th, le_raw, lk_raw, t, mt, low, La, Lb, a, b, A_L, B_L, La_last, Lb_last = _chunk_coefs(
        th_ptr, le_ptr, lk_ptr, base_g, n, Tn, C, BC, ACC)
    rows = (base_g + t)[:, None]
    mtv = mt[:, None] & mv[None, :]

    # pass 1: products over d_k
    Qk = tl.zeros([BC, BC], dtype=ACC)
    kM = tl.zeros([BC, BV], dtype=ACC)
    qM = tl.zeros([BC, BV], dtype=ACC)
    qS = tl.zeros([BC, BV], dtype=ACC)
    kdM = tl.zeros([BC, BV], dtype=ACC)
    kdS = tl.zeros([BC, BV], dtype=ACC)
    db_L = tl.zeros([BV], dtype=ACC)
    dc_L = tl.zeros([BV], dtype=ACC)
    da_L = tl.zeros([BV], dtype=ACC)
    for k0 in range(0, DK, BK):
        ok = k0 + tl.arange(0, BK)
        mk = ok < DK
        mtk = mt[:, None] & mk[None, :]
        mkv = mk[:, None] & mv[None, :]
        q = tl.load(q_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
        k = tl.load(k_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
        st = base_n + ok[:, None] * DV + ov[None, :]
        M = tl.load(Mst_ptr + st, mask=mkv, other=0.).to(ACC)
        S = tl.load(Sst_ptr + st, mask=mkv, other=0.).to(ACC)
        dM = tl.load(dMst_ptr + st, mask=mkv, other=0.).to(ACC)
        dS = tl.load(dSst_ptr + st, mask=mkv, other=0.).to(ACC)
        Qk += tl.dot(q, tl.trans(k), input_precision=PREC)
        kM += tl.dot(k, M, input_precision=PREC)
        qM += tl.dot(q, M, input_precision=PREC)
        qS += tl.dot(q, S, input_precision=PREC)
        kdM += tl.dot(k, dM, input_precision=PREC)
        kdS += tl.dot(k, dS, input_precision=PREC)
        db_L += tl.sum(dM * M, 0)
        dc_L += tl.sum(dM * S, 0)
        da_L += tl.sum(dS * S, 0)

    # the chunk's tiles and their gradients
    D = tl.dot(Lb, La, input_precision=PREC)
    Dth = D * th[None, :]
    P = Qk * Dth
    v = tl.load(v_ptr + rows * DV + ov[None, :], mask=mtv, other=0.).to(ACC)
    dy = tl.load(dy_ptr + rows * DV + ov[None, :], mask=mtv, other=0.).to(ACC)
    delta = 2. * (kM - v)
    u = tl.sum(Lb_last[:, None] * La, 0) * th
    w = La_last * th
    c = tl.sum(Lb * a[None, :], 1)
    ddelta = (-tl.dot(tl.trans(P), dy, input_precision=PREC)
              - u[:, None] * kdM - w[:, None] * kdS)
    tl.store(dv_ptr + rows * DV + ov[None, :], (-2. * ddelta).to(dv_ptr.dtype.element_ty), mask=mtv)
    dP = tl.where(low, -tl.dot(dy, tl.trans(delta), input_precision=PREC), 0.)
    du = -tl.sum(kdM * delta, 1)
    dw = -tl.sum(kdS * delta, 1)
    dQk = dP * Dth
    dDth = dP * Qk
    db = tl.sum(dy * qM, 1)
    dc = tl.sum(dy * qS, 1)
    base_gn = (i_v.to(tl.int64) * BH * NCH + slot) * BC
    tl.store(gD_ptr + (base_gn + oc[:, None]) * BC + oc[None, :], dDth)
    tl.store(gv_ptr + (base_gn * 8 + 0 * BC) + oc, du)
    tl.store(gv_ptr + (base_gn * 8 + 1 * BC) + oc, dw)
    tl.store(gv_ptr + (base_gn * 8 + 2 * BC) + oc, db)
    tl.store(gv_ptr + (base_gn * 8 + 3 * BC) + oc, dc)
    tl.store(gv_ptr + (base_gn * 8 + 4 * BC), tl.sum(db_L, 0))
    tl.store(gv_ptr + (base_gn * 8 + 5 * BC), tl.sum(dc_L, 0))
    tl.store(gv_ptr + (base_gn * 8 + 6 * BC), tl.sum(da_L, 0))

    # pass 2: ∂q, ∂k block by block
    b_dy = b[:, None] * dy
    c_dy = c[:, None] * dy
    u_delta = u[:, None] * delta
    w_delta = w[:, None] * delta
    prow = (base_p + t)[:, None]
    for k0 in range(0, DK, BK):
        ok = k0 + tl.arange(0, BK)
        mk = ok < DK
        mtk = mt[:, None] & mk[None, :]
        mkv = mk[:, None] & mv[None, :]
        q = tl.load(q_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
        k = tl.load(k_ptr + rows * DK + ok[None, :], mask=mtk, other=0.).to(ACC)
        st = base_n + ok[:, None] * DV + ov[None, :]
        M = tl.load(Mst_ptr + st, mask=mkv, other=0.).to(ACC)
        S = tl.load(Sst_ptr + st, mask=mkv, other=0.).to(ACC)
        dM = tl.load(dMst_ptr + st, mask=mkv, other=0.).to(ACC)
        dS = tl.load(dSst_ptr + st, mask=mkv, other=0.).to(ACC)
        dq = (tl.dot(dQk, k, input_precision=PREC)
              + tl.dot(b_dy, tl.trans(M), input_precision=PREC)
              + tl.dot(c_dy, tl.trans(S), input_precision=PREC))
        dk = (tl.dot(tl.trans(dQk), q, input_precision=PREC)
              + 2. * tl.dot(ddelta, tl.trans(M), input_precision=PREC)
              - tl.dot(u_delta, tl.trans(dM), input_precision=PREC)
              - tl.dot(w_delta, tl.trans(dS), input_precision=PREC))
        tl.store(dq_ptr + prow * DK + ok[None, :], dq.to(dq_ptr.dtype.element_ty), mask=mtk)
        tl.store(dk_ptr + prow * DK + ok[None, :], dk.to(dk_ptr.dtype.element_ty), mask=mtk)


@triton.jit
def _titans_bwd_gates_kernel(th_ptr, le_ptr, lk_ptr, gD_ptr, gv_ptr, dth_ptr, dle_ptr, dlk_ptr,
                             cu_seqlens, chunk_indices, T, NCH, C,
                             BC: tl.constexpr, IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """Gradients of θ, log η and log(1 − α) of one chunk (one program per (chunk slot, batch·head)) from
    the partial sums of ``_titans_bwd_kernel`` summed over the d_v blocks: through D = L_b L_a,
    c = L_b a and the chunk's last rows, then the within-chunk cumulative sums A, B."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    oc = tl.arange(0, BC)
    n, base_g, Tn, slot = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_bh, T, NCH, IS_VARLEN)
    th, le_raw, lk_raw, t, mt, low, La, Lb, a, b, A_L, B_L, La_last, Lb_last = _chunk_coefs(
        th_ptr, le_ptr, lk_ptr, base_g, n, Tn, C, BC, ACC)
    base_gn = slot * BC
    dDth = tl.load(gD_ptr + (base_gn + oc[:, None]) * BC + oc[None, :]).to(ACC)
    du = tl.load(gv_ptr + (base_gn * 8 + 0 * BC) + oc).to(ACC)
    dw = tl.load(gv_ptr + (base_gn * 8 + 1 * BC) + oc).to(ACC)
    db = tl.load(gv_ptr + (base_gn * 8 + 2 * BC) + oc).to(ACC)
    dc = tl.load(gv_ptr + (base_gn * 8 + 3 * BC) + oc).to(ACC)
    db_L = tl.load(gv_ptr + (base_gn * 8 + 4 * BC)).to(ACC)
    dc_L = tl.load(gv_ptr + (base_gn * 8 + 5 * BC)).to(ACC)
    da_L = tl.load(gv_ptr + (base_gn * 8 + 6 * BC)).to(ACC)
    D = tl.dot(Lb, La, input_precision=PREC)
    D_last = tl.sum(Lb_last[:, None] * La, 0)
    a_L = tl.exp(A_L)
    b_L = tl.exp(B_L)

    # gate gradients: through D = L_b L_a, c = L_b a, the last rows, then the cumulative sums
    dth = tl.sum(dDth * D, 0) + du * D_last + dw * La_last
    dD = dDth * th[None, :]
    dD_last = du * th
    dLb = tl.dot(dD, tl.trans(La), input_precision=PREC) + dc[:, None] * a[None, :]
    dLa = tl.dot(tl.trans(Lb), dD, input_precision=PREC) + Lb_last[:, None] * dD_last[None, :]
    dLb_last = tl.sum(La * dD_last[None, :], 1) + dc_L * a
    da = tl.sum(Lb * dc[:, None], 0) + dc_L * Lb_last
    G = dLa * La
    g = dw * th * La_last
    dA = da * a + tl.sum(G, 1) - tl.sum(G, 0) - g
    dA_L = tl.sum(g, 0) + da_L * a_L
    Hb = dLb * Lb
    h = dLb_last * Lb_last
    dB = db * b + tl.sum(Hb, 1) - tl.sum(Hb, 0) - h
    dB_L = tl.sum(h, 0) + db_L * b_L
    # A_i = Σ_{l≤i} log η_l, A_L = Σ_l log η_l: reverse cumulative sums
    up = oc[None, :] >= oc[:, None]
    dle = tl.sum(tl.where(up, dA[None, :], 0.), 1) + dA_L
    dlk = tl.sum(tl.where(up, dB[None, :], 0.), 1) + dB_L
    dle = tl.where(le_raw >= _LOG_MIN, dle, 0.)
    dlk = tl.where(lk_raw >= _LOG_MIN, dlk, 0.)

    tl.store(dth_ptr + base_g + t, dth.to(dth_ptr.dtype.element_ty), mask=mt)
    tl.store(dle_ptr + base_g + t, dle.to(dle_ptr.dtype.element_ty), mask=mt)
    tl.store(dlk_ptr + base_g + t, dlk.to(dlk_ptr.dtype.element_ty), mask=mt)


def _tile(C: int) -> int:
    # tl.dot needs every block dim ≥ 16; shorter chunks sit in the first C rows of the tile
    return max(16, triton.next_power_of_2(C))


#: software pipelining of the chunk loop's loads would keep extra copies of every tile in shared
#: memory; the loop is bound by its serial dependence on (M, S), not by the loads
NUM_STAGES = 1
#: the d_k rows of the memory one program touches at a time (every product over d_k is summed over
#: blocks of this many rows) and the widest d_v block
BK_MAX = 32
BV_MAX = 32


def launch_meta(dk: int, dv: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH) -> dict:
    """Tiles and warps of the five kernels for head dims (d_k, d_v), input dtype and launch-config
    family ``arch`` (90 or 80, ``device_arch``): the one place the launches and ``compile_cases.py`` read
    them from. ``BK``/``BV`` are the d_k block and d_v block of the serial kernels
    (``_titans_fwd_state_kernel``, ``_titans_bwd_state_kernel``), ``BK_chunk``/``BV_chunk`` those
    of the chunk-parallel ones (``_titans_fwd_kernel``, ``_titans_bwd_kernel``); ``warps_*`` the
    warps of each.

    What ptxas reported (``python -m kernels.compile_report``) chose them. With C = 16 every
    product whose left operand is a [16, d_k] tile (q, k) holds that whole operand in each warp
    (one 16-row MMA tile), 64 registers per thread at d_k = 128 in float32, twice that split for
    TF32×3: the kernels that held [16, d_k] operands and [d_k, BV] memory tiles whole spilled
    0.1–47 KB at every BV and warp count tried. Summing over blocks of 32 rows of d_k, with
    d_v blocks of 32, nothing spills at d = 64 or 128, bf16 or float32, sm_90 or sm_80; the
    chunk-parallel backward needs 8 warps for float32 at d = 128 (4 spilled 24 B on sm_90) and
    takes them everywhere. Both families take the same config today."""
    pow2 = lambda n: max(16, triton.next_power_of_2(n))  # tl.dot needs every block dim ≥ 16
    BK, BV = min(pow2(dk), BK_MAX), min(pow2(dv), BV_MAX)
    return dict(BK=BK, BV=BV, BK_chunk=BK, BV_chunk=BV, warps_state=4, warps_fwd=4, warps_bwd=8,
                warps_gates=4, PREC=_precision(dtype))


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision. Half inputs: TF32 products (their own rounding, 2^-9, exceeds TF32's).
    float32: TF32×3, three TF32 products on tensor cores with about float32 accuracy — IEEE
    float32 products are scalar FMA loops, and with them the backward at chunk 64 (B2 H4 T1000
    d64 on an H100) did not finish compiling in 110 s. float64: IEEE."""
    if dtype in (torch.float16, torch.bfloat16):
        return "tf32"
    return "tf32x3" if dtype == torch.float32 else "ieee"


def _layout(B: int, T: int, C: int, cu_seqlens: Optional[torch.Tensor]):
    """(sequences, chunk slots per batch·head row NCH, per-sequence first chunk slot, (sequence,
    chunk) per slot). Without ``cu_seqlens``: B sequences of T tokens, NCH = ⌈T / C⌉. With it the
    tables are built on the device, with no copy to the host: NCH = ⌊T / C⌋ + N bounds the
    Σ ⌈T_i / C⌉ chunks of the packed sequences (Σ ⌊T_i / C⌋ ≤ ⌊T / C⌋, plus at most one partial
    chunk each), and the spare slots past the last chunk are marked sequence −1."""
    if cu_seqlens is None:
        return B, triton.cdiv(T, C), None, None
    return packed_chunk_tables(T, C, cu_seqlens)


# The op is a PyTorch custom op (torch.library): torch.compile (model.compile) captures it as one
# opaque node of the block's graph, with shapes from the fake implementations and the backward
# registered below, instead of tracing the Triton launches or breaking the graph. With
# ``cu_seqlens`` every kernel is launched once over the packed batch (chunk tables: ``_layout``).
@torch.library.custom_op("kernels::titans_linear_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, log_eta: torch.Tensor,
            log_keep: torch.Tensor, M0: torch.Tensor, S0: torch.Tensor, chunk_size: int,
            cu_seqlens: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, θ, log η, log(1 − α), M₀, S₀) → (O, M_T, S_T, M̂, and the chunk-start M, S the
    backward reads) for a call whose sequences start at a chunk boundary: B of them, or the N
    packed ones of ``cu_seqlens``, with M₀, S₀ [B or N, H, d_k, d_v] in the accumulation dtype.
    M̂ is M_T when a sequence's length is a multiple of C, else the memory at the start of its
    last chunk."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    Nseq, NCH, chunk_offsets, chunk_indices = _layout(B, T, C, cu_seqlens)
    acc = M0.dtype
    q, k, v, theta, log_eta, log_keep = (t.contiguous() for t in (q, k, v, theta, log_eta, log_keep))
    M0, S0 = M0.contiguous(), S0.contiguous()
    mt = launch_meta(dk, dv, v.dtype, device_arch(v.device))
    y = torch.empty(B, H, T, dv, dtype=v.dtype, device=v.device)
    Mst = torch.empty(B, H, NCH, dk, dv, dtype=acc, device=v.device)
    Sst = torch.empty_like(Mst)
    MT = torch.empty(Nseq, H, dk, dv, dtype=acc, device=v.device)
    ST = torch.empty_like(MT)
    Mh = torch.empty_like(MT)
    common = dict(BC=_tile(C), IS_VARLEN=cu_seqlens is not None,
                  ACC=tl.float64 if acc == torch.float64 else tl.float32, PREC=mt["PREC"], num_stages=NUM_STAGES)
    _titans_fwd_state_kernel[(triton.cdiv(dv, mt["BV"]), Nseq * H)](
        k, v, theta, log_eta, log_keep, M0, S0, Mst, Sst, MT, ST, Mh, cu_seqlens, chunk_offsets,
        T, H, NCH, dk, dv, C, BK=mt["BK"], BV=mt["BV"], num_warps=mt["warps_state"], **common)
    _titans_fwd_kernel[(NCH, triton.cdiv(dv, mt["BV_chunk"]), B * H)](
        q, k, v, theta, log_eta, log_keep, Mst, Sst, y, cu_seqlens, chunk_indices, T, NCH, dk, dv, C,
        BK=mt["BK_chunk"], BV=mt["BV_chunk"], num_warps=mt["warps_fwd"], **common)
    return y, MT, ST, Mh, Mst, Sst


@_fwd_op.register_fake
def _(q, k, v, theta, log_eta, log_keep, M0, S0, chunk_size, cu_seqlens=None):
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    Nseq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NCH = triton.cdiv(T, chunk_size) if cu_seqlens is None else T // chunk_size + Nseq
    MT = M0.new_empty(Nseq, H, dk, dv)
    Mst = M0.new_empty(B, H, NCH, dk, dv)
    return (v.new_empty(B, H, T, dv), MT, torch.empty_like(MT), torch.empty_like(MT), Mst, torch.empty_like(Mst))


@torch.library.custom_op("kernels::titans_linear_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, log_eta: torch.Tensor,
            log_keep: torch.Tensor, Mst: torch.Tensor, Sst: torch.Tensor, dy: Optional[torch.Tensor],
            dMT: Optional[torch.Tensor], dST: Optional[torch.Tensor], dMh: Optional[torch.Tensor], C: int,
            M0_dtype: torch.dtype, S0_dtype: torch.dtype, cu_seqlens: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor]:
    """Gradients of the eight tensor inputs of ``_fwd_op``."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    Nseq, NCH, chunk_offsets, chunk_indices = _layout(B, T, C, cu_seqlens)
    acc = Mst.dtype
    z = torch.zeros(Nseq, H, dk, dv, dtype=acc, device=v.device)
    dy = torch.zeros_like(v) if dy is None else dy.contiguous()
    dMT, dST, dMh = (z if g is None else g.to(acc).contiguous() for g in (dMT, dST, dMh))
    mt = launch_meta(dk, dv, v.dtype, device_arch(v.device))
    NV = triton.cdiv(dv, mt["BV_chunk"])
    pd = torch.float64 if acc == torch.float64 else torch.float32
    dq = torch.empty(NV, B, H, T, dk, dtype=pd, device=v.device)
    dk_ = torch.empty_like(dq)
    dv_ = torch.empty(B, H, T, dv, dtype=pd, device=v.device)
    dMst = torch.empty_like(Mst)
    dSst = torch.empty_like(Mst)
    dM0 = torch.empty(Nseq, H, dk, dv, dtype=acc, device=v.device)
    dS0 = torch.empty_like(dM0)
    BC = _tile(C)
    gD = torch.empty(NV, B * H, NCH, BC, BC, dtype=pd, device=v.device)
    gv = torch.empty(NV, B * H, NCH, 8, BC, dtype=pd, device=v.device)
    ACC = tl.float64 if acc == torch.float64 else tl.float32
    common = dict(BC=BC, IS_VARLEN=cu_seqlens is not None, ACC=ACC, PREC=mt["PREC"], num_stages=NUM_STAGES)
    _titans_bwd_state_kernel[(triton.cdiv(dv, mt["BV"]), Nseq * H)](
        q, k, theta, log_eta, log_keep, dy, dMT, dST, dMh, dMst, dSst, dM0, dS0, cu_seqlens, chunk_offsets,
        T, H, NCH, dk, dv, C, BK=mt["BK"], BV=mt["BV"], num_warps=mt["warps_state"], **common)
    _titans_bwd_kernel[(NCH, NV, B * H)](
        q, k, v, theta, log_eta, log_keep, Mst, Sst, dMst, dSst, dy, dq, dk_, dv_, gD, gv, cu_seqlens,
        chunk_indices, T, NCH, dk, dv, B * H, C, BK=mt["BK_chunk"], BV=mt["BV_chunk"],
        num_warps=mt["warps_bwd"], **common)
    # the gate gradients are linear in these partial sums: add the d_v blocks, then finish them
    gD, gv = (gD[0], gv[0]) if NV == 1 else (gD.sum(0), gv.sum(0))
    dth = torch.empty(B, H, T, dtype=pd, device=v.device)
    dle = torch.empty_like(dth)
    dlk = torch.empty_like(dth)
    _titans_bwd_gates_kernel[(NCH, B * H)](theta, log_eta, log_keep, gD, gv, dth, dle, dlk, cu_seqlens,
                                           chunk_indices, T, NCH, C, num_warps=mt["warps_gates"], **common)
    return (dq.sum(0).to(q.dtype), dk_.sum(0).to(k.dtype), dv_.to(v.dtype), dth.to(theta.dtype),
            dle.to(log_eta.dtype), dlk.to(log_keep.dtype), dM0.to(M0_dtype),
            dS0.to(S0_dtype))


@_bwd_op.register_fake
def _(q, k, v, theta, log_eta, log_keep, Mst, Sst, dy, dMT, dST, dMh, C, M0_dtype, S0_dtype, cu_seqlens=None):
    B, H, T, dk = k.shape
    Nseq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dM0 = Mst.new_empty(Nseq, H, dk, v.shape[-1], dtype=M0_dtype)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(theta),
            torch.empty_like(log_eta), torch.empty_like(log_keep), dM0, torch.empty_like(dM0, dtype=S0_dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, theta, log_eta, log_keep, M0, S0, C, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, theta, log_eta, log_keep, output[4], output[5], cu_seqlens)
    ctx.mark_non_differentiable(output[4], output[5])
    ctx.meta = (C, M0.dtype, S0.dtype)


def _backward_rule(ctx, dy, dMT, dST, dMh, *_):
    C, M0_dtype, S0_dtype = ctx.meta
    *saved, cu_seqlens = ctx.saved_tensors
    return (*_bwd_op(*saved, dy, dMT, dST, dMh, C, M0_dtype, S0_dtype, cu_seqlens), None, None)


_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


def _check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, B: int, T: int, device) -> torch.Tensor:
    """The packed batch's offsets, checked on the device (one flag read back), as int32 on
    ``device``."""
    if B != 1:
        raise ValueError(f"{name}: cu_seqlens needs packed input with B = 1, got B = {B}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.is_floating_point():
        raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    if bool((cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: cu_seqlens must rise from 0 to T = {T} without decreasing, "
                         f"got {cu_seqlens.tolist()}")
    return cu


def titans_linear_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                         log_eta: torch.Tensor, log_keep: torch.Tensor,
                         initial_state: Optional[Sequence[torch.Tensor]] = None,
                         output_final_state: bool = False, chunk_size: int = 16, offset: int = 0,
                         cu_seqlens: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Same contract as ``titans_linear_reference``; a first partial chunk (offset % C ≠ 0)
    runs in PyTorch. A chunk of C tokens occupies a tile of max(16, 2^⌈log₂ C⌉) rows, so C below
    16 (C = 1 included) is exact but wastes most of each tile.

    ``cu_seqlens`` (int32 [N+1], B = 1): the N packed sequences run in one launch of each kernel,
    each from its row of ``initial_state`` ((M, S[, M̂]) each [N, H, d_k, d_v]; M̂ is not read,
    every sequence starting at a chunk boundary, so ``offset`` must be a multiple of C), with
    chunks that never straddle two sequences; the final (M, S, M̂) are [N, H, d_k, d_v]."""
    C = chunk_size
    n_states = None
    if cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        n_states = cu_seqlens.numel() - 1
    check_titans_inputs("titans_linear_triton", q, k, v, theta, log_eta, log_keep, initial_state,
                        chunk_size, offset, n_states)
    check_triton_device("titans_linear_triton", q, k, v, theta, log_eta, log_keep,
                        *(initial_state or ()))
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    like = _acc(k[..., :0])
    if cu_seqlens is not None:
        cu = _check_cu_seqlens("titans_linear_triton", cu_seqlens, B, T, k.device)
        if offset % C:
            raise ValueError(f"titans_linear_triton: with cu_seqlens every sequence must start at a chunk "
                             f"boundary (offset a multiple of chunk_size = {C}), got offset = {offset}")
        # at a chunk boundary the anchor M̂ is M itself, so a given M̂ is never read
        M, S, _ = _initial(None if initial_state is None else tuple(initial_state[:2]), cu.numel() - 1, H,
                           dk, dv, like)
        q, k, v, theta, log_eta, log_keep, M, S = (t.contiguous() for t in (q, k, v, theta, log_eta, log_keep, M, S))
        y, M, S, Mh = _fwd_op(q, k, v, theta, log_eta, log_keep, M, S, C, cu)[:4]
        return y, ((M, S, Mh) if output_final_state else None)
    head = min((C - offset % C) % C, T)
    if head == T:  # the whole call lies inside one chunk started before it (or T = 0)
        return titans_linear_chunk_torch(q, k, v, theta, log_eta, log_keep, initial_state,
                                         output_final_state, C, offset)
    M, S, Mh = _initial(initial_state, B, H, dk, dv, like)
    y_head = None
    if head:
        y_head, (M, S, Mh) = titans_linear_chunk_torch(
            q[:, :, :head], k[:, :, :head], v[:, :, :head], theta[:, :, :head], log_eta[:, :, :head],
            log_keep[:, :, :head], (M, S, Mh), True, C, offset)
        q, k, v, theta, log_eta, log_keep = (t[:, :, head:] for t in (q, k, v, theta, log_eta, log_keep))
    q, k, v, theta, log_eta, log_keep, M, S = (t.contiguous() for t in (q, k, v, theta, log_eta, log_keep, M, S))
    y, M, S, Mh = _fwd_op(q, k, v, theta, log_eta, log_keep, M, S, C)[:4]
    if y_head is not None:
        y = torch.cat([y_head, y], 2)
    return y, ((M, S, Mh) if output_final_state else None)
