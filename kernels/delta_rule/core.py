r"""The delta-rule family's chunked Triton kernels, forward and backward: one set of kernels for
the delta rule (``kernels.delta_rule``), the gated delta rule (``kernels.gated_delta_rule``),
Mamba-2's SSD (``kernels.ssd``, the gated rule without the delta term: ``USE_DELTA`` off) and
KDA (``kernels.kda``), the same recurrence with no decay, a scalar one or one per key channel (the model is flash-linear-attention's
``ops/common/chunk_delta_h.py``, one state kernel serving its delta-rule ops). Each op's
``chunk.py`` is a thin entry over this module: its input checks, its launch configuration
(``launch_meta``) and its custom op, built here by :func:`make_op`.

Recurrence (per sequence and head, state S ∈ R^{d_k×d_v}, the layout of the ops' ``reference.py``):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ q_t,     α_t = exp(g_t)

Compile-time switches (``tl.constexpr``) of every kernel:

* ``USE_G``: a scalar log decay g [B, H, T] per head and token (Gated DeltaNet). When False the
  g pointers (g, and the backward's dg_part and dg) are ``None`` and unused, every decay factor
  below is 1 and the kernels are the delta rule's (Yang et al. 2024).
* ``USE_GK``: a per-channel log decay g [B, H, T, d_k] (KDA), which turns the scalar factors
  e^{γ_i} below into diagonal matrices over d_k (see "Per-channel decay" below). ``USE_G`` and
  ``USE_GK`` are never both on; with USE_GK off its pointers are ``None`` too.
* ``USE_DELTA`` (default True; ``_fwd_state``, ``_bwd_state``, ``_bwd_dqk``): the delta term
  −β_t k_t k_tᵀ. Off (Mamba-2's SSD, ``kernels.ssd``: S_t = e^{g_t} S_{t−1} + β_t k_t v_tᵀ) the
  WY part drops out: T = I, W = 0, Ṽ = U = diag(β) V, which ``_fwd_state`` reads from v and β;
  ``_wy_inv`` and ``_wy_fwd`` are not launched (Tm and W are empty), the backward has no terms
  through W or T (``_bwd_state`` no −Wᵀ dṼ, ``_bwd_dqk`` no dW) and ``_bwd_beta`` replaces
  ``_bwd_wy``: dv = diag(β) dṼ, dβ = rowsum(dṼ ∘ V), dk = dk_part, dg = the reverse cumulative
  sum of dg_part. With it on, the pointers it adds (v, β of ``_fwd_state``) are ``None``; with it
  off, W, U, Tm and dw are. Used with USE_G (or neither decay), never with USE_GK.
* ``IS_VARLEN`` (packed batches), ``USE_H0`` / ``STORE_HT`` / ``USE_DHT`` / ``STORE_DH0``
  (initial and final states), the tiles, the chunk C and the precisions.

Per chunk of C tokens (K, Q ∈ R^{C×d_k}, V ∈ R^{C×d_v}, β, g ∈ R^C, chunk-start state S_n), with
γ = cumsum(g) inside the chunk, Γ_ij = exp(γ_i − γ_j) (i ≥ j; every exponent ≤ 0) and γ_C its
last entry (without USE_G: γ = 0, Γ = 1):

    L  = tril(diag(β) (K Kᵀ ∘ Γ), −1),   T = (I + L)⁻¹            (unit lower triangular)
    W  = T diag(β e^{γ}) K,               U = T diag(β) V,          Ṽ = U − W S_n
    O  = diag(e^{γ}) Q S_n + (M ∘ Γ ∘ Q Kᵀ) Ṽ                       (M = tril(1), diagonal included)
    S_{n+1} = e^{γ_C} S_n + K_dᵀ Ṽ,       K_d = diag(e^{γ_C − γ}) K

Kernels, forward (γ is recomputed from g wherever it is needed, a cumulative sum over the chunk's
C entries, so no γ tensor is stored):
  ``_wy_inv``     grid (chunks, H): T by blocked forward substitution — the 16 × 16 diagonal
                  blocks by 15-step substitution, the blocks below from them (``_wy_inv``'s
                  docstring); stored for the backward.
  ``_wy_fwd``     grid (chunks, H, column blocks of d_k and d_v): W and U.
  ``_fwd_state``  grid (d_v blocks, sequences·H): the sequential sweep over chunks, only
                  Ṽ = U − W S_n and S_{n+1} = e^{γ_C} S_n + K_dᵀ Ṽ; stores every S_n, Ṽ and the
                  final state.
  ``_fwd_o``      grid (chunks, H, d_v blocks), chunk-parallel: O from the stored S_n and Ṽ
                  (flash-linear-attention's split of ``chunk_gated_delta_rule_fwd_h`` and
                  ``chunk_fwd_o``).
Backward, with dS the gradient of the state at the end of the chunk being processed:
  ``_bwd_dv_local`` grid (chunks, H, d_v blocks), chunk-parallel: the chunk-local part of dṼ,
                  (M ∘ Γ ∘ Q Kᵀ)ᵀ dO (fla's ``chunk_bwd_dv_local``), stored in dṼ's buffer.
  ``_bwd_state``  grid (d_v blocks, sequences·H), chunks in reverse, adds the state's part:
                  dṼ = (M ∘ Γ ∘ Q Kᵀ)ᵀ dO + K_d dS;  dS ← e^{γ_C} dS + (diag(e^{γ}) Q)ᵀ dO − Wᵀ dṼ
  ``_bwd_dqk``, ``_bwd_wy``  grid (chunks, H; ``_bwd_dqk`` also d_k blocks), everything else,
                  chunk-local, split in two so that each keeps fewer tiles live (the first ends
                  at dQ, dW and the dK terms through the state, per d_k block, its part of the
                  scalar dγ stored per block; the second goes through W, U and T):
                  dP = M ∘ Γ ∘ dO Ṽᵀ,  dQ = diag(e^{γ}) dO S_nᵀ + dP K,
                  dK ∋ dPᵀ Q + diag(e^{γ_C − γ}) Ṽ dSᵀ,  dW = −dṼ S_nᵀ,  dU = dṼ;
                  through W, U:  dT = dW (β e^{γ} K)ᵀ + dU (βV)ᵀ;
                  through T = (I + L)⁻¹:  dL = −tril(Tᵀ dT Tᵀ, −1),  dG = diag(β) dL ∘ Γ (G = K Kᵀ),
                  dK ∋ (dG + dGᵀ) K,  dβ ∋ rowsum(dL ∘ G ∘ Γ).
                  With USE_G, the gradient of γ collects (``_bwd_dqk``, then ``_bwd_wy``):
                  e^{γ_i} q_i·(S_n dO_i); rowsum − colsum of dP ∘ Q Kᵀ; −e^{γ_C−γ_i} k_i·(dS Ṽ_i)
                  and, on the chunk's last row, e^{γ_C} ⟨S_n, dS⟩ + Σ_i e^{γ_C−γ_i} k_i·(dS Ṽ_i);
                  rowsum − colsum of diag(β) dL ∘ K Kᵀ ∘ Γ; β_i e^{γ_i} k_i·(Tᵀ dW)_i; then
                  dg = the reverse cumulative sum of dγ over the chunk (γ_i = Σ_{s≤i} g_s).

Per-channel decay (``USE_GK``). γ = cumsum(g) is [C, d_k]; ``_gk_cumsum`` stores it and every
kernel reads it where g was. The factors become W = T diag(β) (K ∘ e^{γ}), O ∋ (Q ∘ e^{γ}) S_n,
S_{n+1} = Diag(e^{γ_C}) S_n + K_dᵀ Ṽ with K_d = K ∘ e^{γ_C − γ}, and Γ ∘ X Kᵀ becomes the decayed
scores P(X)_ij = Σ_c x_ic k_jc e^{γ_ic − γ_jc} (j ≤ i). Written as (X ∘ e^{γ})(K ∘ e^{−γ})ᵀ they
would need e^{−γ}, e^{+1280} for decays of −20 per token over 64; ``_gk_scores`` builds them in
blocks of 16 rows instead: for block a against the columns of earlier blocks, one product
(X_a ∘ e^{γ_a − γ_r})(K ∘ e^{γ_r − γ})ᵀ about the block's first row r (between every such i and j,
so both factors ≤ 1), and the diagonal 16 × 16 block per pair, column by column (the split of
flash-linear-attention's ``chunk_kda``). It stores Aqk = M ∘ P(Q) and Akk = tril(P(K), −1), which
``_wy_inv`` (L = diag(β) Akk), ``_fwd_o`` and ``_bwd_dv_local`` read. Backward: ``_bwd_dqk`` keeps
the state's terms (dq ∋ e^{γ} ∘ dO S_nᵀ, dK_d, per-channel dγ including the last row's
e^{γ_C} ∘ rowsum(S_n ∘ dS)) and stores dP; ``_bwd_wy`` the terms through W and T, dβ from Akk,
and stores dG = diag(β) dL; ``_gk_bwd_intra`` the gradients through the scores, for P(X, Y) with
gradient D: dX = Σ_j D_ij y_j e^{γ_i − γ_j}, dY = Σ_i D_ij x_i e^{γ_i − γ_j}, dγ ∋ X ∘ dX − Y ∘ dY
(blocked as the scores, the reference row between the two blocks), then dg, the reverse cumulative
sum of dγ over the chunk, per channel. Every exponent is ≤ 0 (masked entries clamped at 0), so
nothing overflows; the scores are recomputed in the backward rather than saved.

Variable-length batches: with ``cu_seqlens`` (int32 [N+1]) the input is one packed row
(B = 1, T = cu_seqlens[-1]) and the state restarts at every sequence start (from
``initial_state[i]`` for sequence i when given); chunks never straddle two sequences. Every
kernel is launched once for the whole batch. The chunk-gridded ones (``_wy_inv``, ``_wy_fwd``,
``_fwd_o``, ``_bwd_dv_local``, ``_bwd_dqk``, ``_bwd_wy``) take one program per chunk slot, whose
(sequence, chunk) they read from a table built on the device (``_layout``: ⌊T / C⌋ + N slots
bound the Σ ⌈T_i / C⌉ chunks; the spare ones, sequence −1, get length 0 and every load and store
of theirs that touches a token row is masked), and the chunk states Hs / dHs have a row per slot.
The state passes (``_fwd_state``, ``_bwd_state``, one program per d_v block and sequence·head)
read only their sequence's first slot. So the launches need nothing from the host; the entry
reads back one flag, the check that the offsets rise from 0 to T. An empty sequence passes its
initial state through.

Precision (``_mm``): accumulation in float32 (float64 for float64 inputs); every product runs
on tensor cores. Products of two inputs (Q Kᵀ, K Kᵀ) take the inputs' own type (bf16/fp16);
products with a float32 intermediate (the states S and dS, Ṽ, W, T and their gradients) take
TF32 operands for half inputs — rounding those to bf16 instead made outputs and dk miss the
bf16 tolerances of the tests — and TF32×3 (about float32 accuracy) for float32 inputs. Under
the interpreter bf16 operands are emulated (``_mm``). The kernel chunk is a power of two in
[16, 64] (``tl.dot`` needs tiles of at least 16), capped per dtype, head dim and GPU family by
the op's ``launch_meta`` (chosen so that ptxas spills nothing): the result does not depend on
it, only the speed does.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import is_interpreting, packed_chunk_tables


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


# ---- helpers the kernels share ------------------------------------------------------------------

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
def _mm(a, b, PREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b accumulated in float32 (float64 for PREC = "fp64").

    PREC: "bf16" / "fp16" — both operands rounded to that type (the inputs' own type), tensor
    cores, float32 accumulation; "tf32x3" — float32 operands split into three TF32 products on
    tensor cores (about float32 accuracy); "tf32" — one TF32 product; "fp64" — IEEE float64.
    EMU (the Triton interpreter): its ``tl.dot`` multiplies the bit patterns of bf16 operands,
    so there the operands are rounded to bf16/fp16 and multiplied in float32 instead — the
    same rounding as on the GPU."""
    if PREC == "fp64":
        return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee", out_dtype=tl.float64)
    elif PREC == "bf16":
        if EMU:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                          input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif PREC == "fp16":
        if EMU:
            return tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32),
                          input_precision="ieee")
        return tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _unit_lower_inverse16(L):
    """(I + L)⁻¹ for strictly lower triangular L [16, 16] by forward substitution on rows:
    X_i = −L_i − Σ_{j<i} L_ij X_j for the off-diagonal part, rows j < i already final
    (15 steps on a 16 × 16 tile)."""
    o = tl.arange(0, 16)
    X = -L
    for i in tl.static_range(1, 16):
        row = tl.sum(tl.where(o[:, None] == i, X, 0.0), 0)
        row = row + tl.sum(row[:, None] * X, 0)
        X = tl.where(o[:, None] == i, row[None, :], X)
    return X + tl.where(o[:, None] == o[None, :], 1.0, 0.0).to(X.dtype)


@triton.jit
def _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    """Chunk slot i_c at head h: the chunk's index c inside its sequence, the sequence's first
    packed row, its length and its first global chunk. Packed slots read (sequence, chunk) from
    ``chunk_indices``; a spare slot (sequence −1, chunk 0) gets length 0, so every load and store
    masked by the token rows is off, and its state loads (masked by columns only) read the first
    sequence's first slot, in bounds."""
    if IS_VARLEN:
        n = tl.load(chunk_indices + 2 * i_c)
        c = tl.load(chunk_indices + 2 * i_c + 1)
        row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, tl.maximum(n, 0), h, T, H, C, IS_VARLEN)
        Tn = tl.where(n >= 0, Tn, 0)
    else:
        NT = tl.cdiv(T, C)
        c = i_c % NT
        row0, Tn, coff = _seq_info(cu_seqlens, chunk_offsets, i_c // NT, h, T, H, C, IS_VARLEN)
    return c, row0, Tn, coff


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
def _kblock(beta, g, row0, Tn, c, i: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr, USE_G: tl.constexpr):
    """Rows 16i … 16i+15 of chunk c: β [16] (masked past the sequence) and, with USE_G, γ [16]
    (the sums over the chunk's g up to each row; zeros without)."""
    o_t = c * C + i * 16 + tl.arange(0, 16)
    m_t = o_t < Tn
    b_b = tl.load(beta + row0 + o_t, mask=m_t, other=0.0).to(ACC)
    gam = tl.zeros([16], dtype=ACC)
    if USE_G:
        o_c = tl.arange(0, C)
        o_ct = c * C + o_c
        b_g = tl.load(g + row0 + o_ct, mask=o_ct < Tn, other=0.0).to(ACC)
        r = i * 16 + tl.arange(0, 16)
        gam = tl.sum(tl.where(o_c[None, :] <= r[:, None], b_g[None, :], 0.0), 1)
    return b_b, gam


@triton.jit
def _lblock(k, row0, Tn, c, i: tl.constexpr, j: tl.constexpr, b_i, g_i, g_j, C: tl.constexpr, DK: tl.constexpr,
            BK: tl.constexpr, PK: tl.constexpr, EMU: tl.constexpr, USE_G: tl.constexpr):
    """Block (i, j) of diag(β) (K Kᵀ ∘ Γ), unmasked (every entry of a block i > j is below the
    diagonal): K_i K_jᵀ summed over d_k in blocks of BK columns, the [16, BK] rows of K loaded
    per block pair (held across the blocks, the four [16, d_k] row blocks of a 64-chunk spilled
    at d_k = 128)."""
    o_i = c * C + i * 16 + tl.arange(0, 16)
    o_j = c * C + j * 16 + tl.arange(0, 16)
    kk = tl.zeros([16, 16], dtype=b_i.dtype)
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k[None, :] < DK
        k_i = tl.load(k + (row0 + o_i)[:, None] * DK + o_k[None, :], mask=(o_i < Tn)[:, None] & m_k, other=0.0)
        k_j = tl.load(k + (row0 + o_j)[:, None] * DK + o_k[None, :], mask=(o_j < Tn)[:, None] & m_k, other=0.0)
        kk += _mm(k_i, tl.trans(k_j), PK, EMU)
    x = b_i[:, None] * kk
    if USE_G:
        x = x * _decay(g_i, g_j)
    return x


@triton.jit
def _lb(k, b_i, g_i, g_j, Akk, row0, Tn, c, i: tl.constexpr, j: tl.constexpr, C: tl.constexpr, DK: tl.constexpr,
        BK: tl.constexpr, PK: tl.constexpr, EMU: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """Block (i, j) of L's matrix diag(β) (K Kᵀ ∘ Γ): computed (``_lblock``), or with USE_GK read
    from the per-channel decayed scores Akk (P(K), ``_gk_scores``) and scaled by β."""
    if USE_GK:
        o_t = c * C + i * 16 + tl.arange(0, 16)
        o_j = j * 16 + tl.arange(0, 16)
        x = tl.load(Akk + (row0 + o_t)[:, None] * C + o_j[None, :], mask=(o_t < Tn)[:, None], other=0.0)
        x = b_i[:, None] * x.to(b_i.dtype)
    else:
        x = _lblock(k, row0, Tn, c, i, j, b_i, g_i, g_j, C, DK, BK, PK, EMU, USE_G)
    return x


@triton.jit
def _store_block(Tm, X, row0, Tn, c, i: tl.constexpr, j: tl.constexpr, C: tl.constexpr):
    o_t = c * C + i * 16 + tl.arange(0, 16)
    o_j = j * 16 + tl.arange(0, 16)
    tl.store(Tm + (row0 + o_t)[:, None] * C + o_j[None, :], X.to(Tm.dtype.element_ty), mask=(o_t < Tn)[:, None])


# ---- per-channel decay (USE_GK): γ, the decayed scores and their gradients --------------------

@triton.jit
def _gk_last(g, row0, Tn, c, C: tl.constexpr, DK: tl.constexpr, o_k, ACC: tl.constexpr):
    """γ_C [BK] with USE_GK: the row of the cumulative decay g ([.., d_k], ``_gk_cumsum``'s) at
    the chunk's last token (zeros for a spare slot)."""
    last = tl.minimum(Tn - c * C, C) - 1 + tl.zeros_like(o_k)
    return tl.load(g + (row0 + c * C + last) * DK + o_k, mask=(o_k < DK) & (last >= 0), other=0.0).to(ACC)


@triton.jit
def _gk_rows(p, rb, Tc, r0, R: tl.constexpr, o_k, DK: tl.constexpr, ACC: tl.constexpr):
    """Rows r0 … r0+R−1 of the chunk (first row rb, Tc valid rows) of a [.., DK] tensor, columns
    o_k, as [R, BK] in ACC (zeros outside)."""
    r = r0 + tl.arange(0, R)
    m = (r < Tc)[:, None] & (o_k[None, :] < DK)
    return tl.load(p + (rb + r)[:, None] * DK + o_k[None, :], mask=m, other=0.0).to(ACC)


@triton.jit
def _gk_row(p, rb, Tc, r, o_k, DK: tl.constexpr, ACC: tl.constexpr):
    """Row r of the chunk of a [.., DK] tensor, columns o_k, as [BK] in ACC (zeros outside)."""
    rr = r + tl.zeros_like(o_k)
    m = (o_k < DK) & (rr >= 0) & (rr < Tc)
    return tl.load(p + (rb + r) * DK + o_k, mask=m, other=0.0).to(ACC)


@triton.jit
def _gk_cumsum(g, gam, cu_seqlens, chunk_offsets, chunk_indices, T, H,
               DK: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr):
    """USE_GK: γ = the cumulative sum of the per-channel log decay g [.., d_k] inside each chunk
    (grid: chunks, H, d_k blocks), stored for the other kernels, which read γ where g was."""
    i_c, h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    rb = row0 + c * C
    b_g = _gk_rows(g, rb, Tn - c * C, 0, C, o_k, DK, ACC)
    r = tl.arange(0, C)
    m = (r < Tn - c * C)[:, None] & (o_k[None, :] < DK)
    tl.store(gam + (rb + r)[:, None] * DK + o_k[None, :], tl.cumsum(b_g, 0).to(gam.dtype.element_ty), mask=m)


@triton.jit
def _gk_scores(q, k, g, Aqk, Akk, cu_seqlens, chunk_offsets, chunk_indices, T, H,
               DK: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """USE_GK: the decayed scores of one chunk (grid: chunks, H), with γ from ``_gk_cumsum`` (g),

        P(X)_ij = Σ_c x_ic k_jc e^{γ_ic − γ_jc}   (j ≤ i),     Aqk = M ∘ P(Q),   Akk = tril(P(K), −1),

    summed over d_k in blocks of BK, every exponent ≤ 0. Rows in blocks of 16: for block a and
    the columns of the earlier blocks, with r = 16a (its first row, after every such column),
    e^{γ_i − γ_j} = e^{γ_i − γ_r} e^{γ_r − γ_j}, so that part is one product
    (X_a ∘ e^{γ_a − γ_r}) (K ∘ e^{γ_r − γ})ᵀ of factors ≤ 1; the diagonal 16 × 16 block takes
    its exponents per pair, column by column (flash-linear-attention's ``chunk_kda`` splits its
    intra-chunk scores the same way)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    rb = row0 + c * C
    Tc = Tn - c * C
    o16 = tl.arange(0, 16)
    o_c = tl.arange(0, C)
    for a in tl.static_range(C // 16):
        r_a = a * 16 + o16
        Pq = tl.zeros([16, C], dtype=ACC)
        Pk = tl.zeros([16, C], dtype=ACC)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            q_a = _gk_rows(q, rb, Tc, a * 16, 16, o_k, DK, ACC)
            k_a = _gk_rows(k, rb, Tc, a * 16, 16, o_k, DK, ACC)
            g_a = _gk_rows(g, rb, Tc, a * 16, 16, o_k, DK, ACC)
            if a > 0:
                g_r = _gk_row(g, rb, Tc, a * 16, o_k, DK, ACC)
                e_a = tl.exp(tl.minimum(g_a - g_r[None, :], 0.0))
                ks = _gk_rows(k, rb, Tc, 0, C, o_k, DK, ACC) * \
                    tl.exp(tl.minimum(g_r[None, :] - _gk_rows(g, rb, Tc, 0, C, o_k, DK, ACC), 0.0))
                before = o_c[None, :] < a * 16
                Pq += tl.where(before, _mm(q_a * e_a, tl.trans(ks), PREC, EMU), 0.0)
                Pk += tl.where(before, _mm(k_a * e_a, tl.trans(ks), PREC, EMU), 0.0)
            for jj in range(16):   # a loop, not unrolled: 16 steps per block made the compile slow
                k_j = _gk_row(k, rb, Tc, a * 16 + jj, o_k, DK, ACC)
                g_j = _gk_row(g, rb, Tc, a * 16 + jj, o_k, DK, ACC)
                kje = k_j[None, :] * tl.exp(tl.minimum(g_a - g_j[None, :], 0.0))
                at_j = o_c[None, :] == a * 16 + jj
                Pq += tl.where(at_j, tl.sum(q_a * kje, 1)[:, None], 0.0)
                Pk += tl.where(at_j, tl.sum(k_a * kje, 1)[:, None], 0.0)
        m_a = (r_a < Tc)[:, None]
        off = (rb + r_a)[:, None] * C + o_c[None, :]
        tl.store(Aqk + off, tl.where(o_c[None, :] <= r_a[:, None], Pq, 0.0).to(Aqk.dtype.element_ty), mask=m_a)
        tl.store(Akk + off, tl.where(o_c[None, :] < r_a[:, None], Pk, 0.0).to(Akk.dtype.element_ty), mask=m_a)


@triton.jit
def _gk_bwd_intra(q, k, g, dAqk, dAkk, dq_part, dk_part, dg_part, dq, dk, dg,
                  cu_seqlens, chunk_offsets, chunk_indices, T, H,
                  DK: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                  ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr):
    """USE_GK: the gradients through the decayed scores, and the final dq, dk, dg of one chunk and
    one block of BK key channels (grid: chunks, H, d_k blocks). For scores P(X, Y)_ij =
    Σ_c x_ic y_jc e^{γ_ic − γ_jc} with gradient D (dAqk = dP for X = Q, Y = K; dAkk = dG for X = Y = K):

        dx_ic = Σ_{j≤i} D_ij y_jc e^{γ_ic − γ_jc},   dy_jc = Σ_{i≥j} D_ij x_ic e^{γ_ic − γ_jc},
        dγ ∋ X ∘ dX − Y ∘ dY,

    in blocks of 16 rows as ``_gk_scores`` (a reference row between the blocks, the diagonal
    block per pair). dq = dq_part + dQ, dk = dk_part + dK (both scores), and dg = the reverse
    cumulative sum over the chunk of dγ = dg_part + these terms, walking the blocks from the last."""
    i_c, h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    rb = row0 + c * C
    Tc = Tn - c * C
    o_k = i_k * BK + tl.arange(0, BK)
    o16 = tl.arange(0, 16)
    o_c = tl.arange(0, C)
    carry = tl.zeros([BK], dtype=ACC)
    NB: tl.constexpr = C // 16
    for a in tl.static_range(NB - 1, -1, -1):   # the last block first (dg's sum runs backwards)
        r_a = a * 16 + o16
        m_a = r_a < Tc
        q_a = _gk_rows(q, rb, Tc, a * 16, 16, o_k, DK, ACC)
        k_a = _gk_rows(k, rb, Tc, a * 16, 16, o_k, DK, ACC)
        g_a = _gk_rows(g, rb, Tc, a * 16, 16, o_k, DK, ACC)
        dqa = tl.zeros([16, BK], dtype=ACC)    # Σ_j dP_ij k_j e^{γ_i − γ_j}
        dkl = tl.zeros([16, BK], dtype=ACC)    # Σ_j dG_ij k_j e^{γ_i − γ_j}
        dkp = tl.zeros([16, BK], dtype=ACC)    # Σ_i dP_ij q_i e^{γ_i − γ_j}
        dkr = tl.zeros([16, BK], dtype=ACC)    # Σ_i dG_ij k_i e^{γ_i − γ_j}
        if a > 0:   # columns of the earlier blocks, about r = 16a
            g_r = _gk_row(g, rb, Tc, a * 16, o_k, DK, ACC)
            ks = _gk_rows(k, rb, Tc, 0, C, o_k, DK, ACC) * \
                tl.exp(tl.minimum(g_r[None, :] - _gk_rows(g, rb, Tc, 0, C, o_k, DK, ACC), 0.0))
            off = (rb + r_a)[:, None] * C + o_c[None, :]
            m_off = m_a[:, None] & (o_c[None, :] < a * 16)
            dP_a = tl.load(dAqk + off, mask=m_off, other=0.0).to(ACC)
            dG_a = tl.load(dAkk + off, mask=m_off, other=0.0).to(ACC)
            e_a = tl.exp(tl.minimum(g_a - g_r[None, :], 0.0))
            dqa += e_a * _mm(dP_a, ks, PS, EMU)
            dkl += e_a * _mm(dG_a, ks, PS, EMU)
        if a < NB - 1:   # rows of the later blocks, about r = the block's last valid row
            rr = tl.minimum(a * 16 + 15, Tc - 1)
            g_r = _gk_row(g, rb, Tc, rr, o_k, DK, ACC)
            e_all = tl.exp(tl.minimum(_gk_rows(g, rb, Tc, 0, C, o_k, DK, ACC) - g_r[None, :], 0.0))
            offt = (rb + o_c)[None, :] * C + r_a[:, None]    # [16 (j), C (i)]: D_ij
            m_t = (r_a[:, None] >= 0) & (o_c[None, :] < Tc) & (o_c[None, :] >= a * 16 + 16)
            dPt = tl.load(dAqk + offt, mask=m_t, other=0.0).to(ACC)
            dGt = tl.load(dAkk + offt, mask=m_t, other=0.0).to(ACC)
            e_b = tl.exp(tl.minimum(g_r[None, :] - g_a, 0.0))
            dkp += e_b * _mm(dPt, _gk_rows(q, rb, Tc, 0, C, o_k, DK, ACC) * e_all, PS, EMU)
            dkr += e_b * _mm(dGt, _gk_rows(k, rb, Tc, 0, C, o_k, DK, ACC) * e_all, PS, EMU)
        for jj in range(16):   # the diagonal block, per pair (a loop: unrolled, it compiled for minutes)
            j = a * 16 + jj
            m_j = m_a & (j + tl.zeros_like(r_a) < Tc)
            k_j = _gk_row(k, rb, Tc, j, o_k, DK, ACC)
            q_j = _gk_row(q, rb, Tc, j, o_k, DK, ACC)
            g_j = _gk_row(g, rb, Tc, j, o_k, DK, ACC)
            # column j of the block: D_ij for rows i of block a (i ≥ j)
            dP_c = tl.load(dAqk + (rb + r_a) * C + j, mask=m_j, other=0.0).to(ACC)
            dG_c = tl.load(dAkk + (rb + r_a) * C + j, mask=m_j, other=0.0).to(ACC)
            e_c = tl.exp(tl.minimum(g_a - g_j[None, :], 0.0))      # e^{γ_i − γ_j}, i in block a
            dqa += dP_c[:, None] * k_j[None, :] * e_c
            dkl += dG_c[:, None] * k_j[None, :] * e_c
            # row j of the block: D_jl for columns l of block a (l ≤ j)
            dP_r = tl.load(dAqk + (rb + j) * C + r_a, mask=m_j, other=0.0).to(ACC)
            dG_r = tl.load(dAkk + (rb + j) * C + r_a, mask=m_j, other=0.0).to(ACC)
            e_r = tl.exp(tl.minimum(g_j[None, :] - g_a, 0.0))      # e^{γ_j − γ_l}, l in block a
            dkp += dP_r[:, None] * q_j[None, :] * e_r
            dkr += dG_r[:, None] * k_j[None, :] * e_r
        m = m_a[:, None] & (o_k[None, :] < DK)
        off_k = (rb + r_a)[:, None] * DK + o_k[None, :]
        b_dq = tl.load(dq_part + off_k, mask=m, other=0.0).to(ACC) + dqa
        b_dk = tl.load(dk_part + off_k, mask=m, other=0.0).to(ACC) + dkl + dkp + dkr
        dgam = (tl.load(dg_part + off_k, mask=m, other=0.0).to(ACC)
                + q_a * dqa + k_a * (dkl - dkp - dkr))
        dgam = tl.where(m, dgam, 0.0)
        # γ_i = Σ_{s≤i} g_s  ⇒  dg_s = Σ_{i≥s} dγ_i (the later blocks' sum in carry)
        tot = tl.sum(dgam, 0)
        b_dg = carry[None, :] + tot[None, :] - tl.cumsum(dgam, 0) + dgam
        carry += tot
        tl.store(dq + off_k, b_dq.to(dq.dtype.element_ty), mask=m)
        tl.store(dk + off_k, b_dk.to(dk.dtype.element_ty), mask=m)
        tl.store(dg + off_k, b_dg.to(dg.dtype.element_ty), mask=m)


# ---- forward --------------------------------------------------------------------------------------

@triton.jit
def _wy_inv(k, beta, g, Tm, Akk, cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
            ACC: tl.constexpr, PK: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr, USE_G: tl.constexpr,
            USE_GK: tl.constexpr):
    """T = (I + L)⁻¹ of one chunk by blocked forward substitution on 16 × 16 blocks: the
    diagonal blocks by 15-step substitution, then, block row by block row,

        T_ii = (I + L_ii)⁻¹,      T_ij = −T_ii Σ_{m=j}^{i−1} L_im T_mj     (i > j),

    (from (I + L) T = I), at most 4 × 4 blocks (C = 64), L's blocks carrying their Γ with USE_G;
    with USE_GK they are β_i times the decayed scores ``Akk`` that ``_gk_scores`` stored.
    Blocks above the diagonal are stored as zeros. PK: precision of K Kᵀ (the inputs' type);
    PS: of the products of the float32 blocks of L and T."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o = tl.arange(0, 16)
    low = o[:, None] > o[None, :]
    zero = tl.zeros([16, 16], dtype=ACC)
    # every block of L first (each summed over d_k blocks of BK, ``_lblock``), then the inverses
    b0, g0 = _kblock(beta, g, row0, Tn, c, 0, C, ACC, USE_G)
    L00 = tl.where(low, _lb(k, b0, g0, g0, Akk, row0, Tn, c, 0, 0, C, DK, BK, PK, EMU, USE_G, USE_GK), 0.0)
    if C > 16:
        b1, g1 = _kblock(beta, g, row0, Tn, c, 1, C, ACC, USE_G)
        L11 = tl.where(low, _lb(k, b1, g1, g1, Akk, row0, Tn, c, 1, 1, C, DK, BK, PK, EMU, USE_G, USE_GK), 0.0)
        L10 = _lb(k, b1, g1, g0, Akk, row0, Tn, c, 1, 0, C, DK, BK, PK, EMU, USE_G, USE_GK)
        if C > 32:
            b2, g2 = _kblock(beta, g, row0, Tn, c, 2, C, ACC, USE_G)
            L22 = tl.where(low, _lb(k, b2, g2, g2, Akk, row0, Tn, c, 2, 2, C, DK, BK, PK, EMU, USE_G, USE_GK), 0.0)
            L20 = _lb(k, b2, g2, g0, Akk, row0, Tn, c, 2, 0, C, DK, BK, PK, EMU, USE_G, USE_GK)
            L21 = _lb(k, b2, g2, g1, Akk, row0, Tn, c, 2, 1, C, DK, BK, PK, EMU, USE_G, USE_GK)
            b3, g3 = _kblock(beta, g, row0, Tn, c, 3, C, ACC, USE_G)
            L33 = tl.where(low, _lb(k, b3, g3, g3, Akk, row0, Tn, c, 3, 3, C, DK, BK, PK, EMU, USE_G, USE_GK), 0.0)
            L30 = _lb(k, b3, g3, g0, Akk, row0, Tn, c, 3, 0, C, DK, BK, PK, EMU, USE_G, USE_GK)
            L31 = _lb(k, b3, g3, g1, Akk, row0, Tn, c, 3, 1, C, DK, BK, PK, EMU, USE_G, USE_GK)
            L32 = _lb(k, b3, g3, g2, Akk, row0, Tn, c, 3, 2, C, DK, BK, PK, EMU, USE_G, USE_GK)
    T00 = _unit_lower_inverse16(L00)
    _store_block(Tm, T00, row0, Tn, c, 0, 0, C)
    if C > 16:
        T11 = _unit_lower_inverse16(L11)
        T10 = -_mm(T11, _mm(L10, T00, PS, EMU), PS, EMU)
        _store_block(Tm, T10, row0, Tn, c, 1, 0, C)
        _store_block(Tm, T11, row0, Tn, c, 1, 1, C)
        _store_block(Tm, zero, row0, Tn, c, 0, 1, C)
        if C > 32:
            T22 = _unit_lower_inverse16(L22)
            T21 = -_mm(T22, _mm(L21, T11, PS, EMU), PS, EMU)
            T20 = -_mm(T22, _mm(L20, T00, PS, EMU) + _mm(L21, T10, PS, EMU), PS, EMU)
            T33 = _unit_lower_inverse16(L33)
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
def _wy_fwd(k, v, beta, g, Tm, W, U, cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr,
            USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """W = T (β e^{γ} K) and U = T (βV) for one chunk and one block of BK key / BV value columns
    (grid: chunks, H, column blocks of d_k then of d_v); with USE_GK, W = T diag(β) (K ∘ e^{γ}),
    γ [C, d_k] read from g (the chunk-local cumulative decay ``_gk_cumsum`` stored)."""
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
        b_bw = b_b
        if USE_G:
            gam, gC = _gamma(g, rows, m_t, ACC)
            b_bw = b_b * tl.exp(gam)
        o_k = i_b * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k[None, :] < DK)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_k, other=0.0).to(ACC)
        if USE_GK:
            gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_k, other=0.0).to(ACC)
            b_w = _mm(X, b_bw[:, None] * tl.exp(gam_k) * b_k, PS, EMU)
        else:
            b_w = _mm(X, b_bw[:, None] * b_k, PS, EMU)
        tl.store(W + rows[:, None] * DK + o_k[None, :], b_w.to(W.dtype.element_ty), mask=m_k)
    else:
        o_v = (i_b - NK) * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v[None, :] < DV)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_v, other=0.0).to(ACC)
        b_u = _mm(X, b_b[:, None] * b_v, PS, EMU)
        tl.store(U + rows[:, None] * DV + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_v)


@triton.jit
def _fwd_state(k, v, beta, g, W, U, Hs, VN, h0, ht, cu_seqlens, chunk_offsets, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr, USE_G: tl.constexpr,
               USE_GK: tl.constexpr, USE_DELTA: tl.constexpr):
    """The chunk recurrence for one block of d_v columns of one (sequence, head): per chunk
    Ṽ = U − W S and S ← e^{γ_C} S + K_dᵀ Ṽ (USE_GK: Diag(e^{γ_C}) S, K_d = K ∘ e^{γ_C − γ}), writing each chunk's starting S to Hs and Ṽ to VN (the
    outputs are ``_fwd_o``'s, chunk-parallel). The state is not carried in registers: each chunk
    reads its S back from Hs (written by this program, cache-resident) in blocks of BK rows, once
    to sum W S over d_k and once to write the next chunk's S, so no [C, d_k] operand or [d_k, BV]
    tile is held whole. Without USE_DELTA, Ṽ = diag(β) V is read from v and beta (W and U are None;
    with USE_DELTA, v and beta are)."""
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
        if USE_G:
            gam, gC = _gamma(g, rows, m_t, ACC)
            dec_end = tl.exp(gC - gam)
        if USE_DELTA:
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
        else:   # T = I, W = 0: Ṽ = U = diag(β) V
            b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
            b_vn = b_b[:, None] * tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        tl.store(VN + rows[:, None] * DV + o_v[None, :], b_vn.to(VN.dtype.element_ty), mask=m_tv)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            kv_off = o_k[:, None] * DV + o_v[None, :]
            b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            S = tl.load(hs_c + kv_off, mask=m_kv, other=0.0).to(ACC)
            if USE_G:
                b_k = b_k.to(ACC) * dec_end[:, None]
                S = tl.exp(gC) * S
            if USE_GK:
                gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
                gC_k = _gk_last(g, row0, Tn, c, C, DK, o_k, ACC)
                b_k = b_k.to(ACC) * tl.exp(tl.minimum(gC_k[None, :] - gam_k, 0.0))
                S = tl.exp(gC_k)[:, None] * S
            S = S + _mm(tl.trans(b_k), b_vn, PS, EMU)
            if c + 1 < NT:
                tl.store(hs_c + H * DK * DV + kv_off, S.to(Hs.dtype.element_ty), mask=m_kv)
            elif STORE_HT:
                tl.store(ht + h0_base + kv_off, S.to(ht.dtype.element_ty), mask=m_kv)
        tl.debug_barrier()


@triton.jit
def _fwd_o(q, k, g, VN, Hs, o, Aqk, cu_seqlens, chunk_offsets, chunk_indices, T, H,
           DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
           IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
           EMU: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """O = diag(e^{γ}) Q S_n + (M ∘ Γ ∘ Q Kᵀ) Ṽ for one chunk, one head and one block of BV value
    columns (grid: chunks, H, d_v blocks), from the chunk-start state S_n (Hs) and the
    pseudo-values Ṽ (VN) that ``_fwd_state`` stored; Q S_n and Q Kᵀ are summed over d_k in blocks
    of BK. With USE_GK: O = (Q ∘ e^{γ}) S_n + Aqk Ṽ, the decayed scores Aqk = M ∘ P(Q) read from
    where ``_gk_scores`` stored them."""
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
    if USE_GK:
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            S = tl.load(hs_c + o_k[:, None] * DV + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
            b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            QS += _mm(b_q * tl.exp(gam_k), S, PS, EMU)
        P = tl.load(Aqk + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0).to(ACC)
    else:
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
        if USE_G:
            gam, gC = _gamma(g, rows, m_t, ACC)
            QK = QK * _decay(gam, gam)
            QS = QS * tl.exp(gam)[:, None]
        P = tl.where(o_c[:, None] >= o_c[None, :], QK, 0.0)
    b_vn = tl.load(VN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
    b_o = QS + _mm(P, b_vn, PS, EMU)
    tl.store(o + rows[:, None] * DV + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


# ---- backward -------------------------------------------------------------------------------------

@triton.jit
def _bwd_dv_local(q, k, g, do, dVN, Aqk, cu_seqlens, chunk_offsets, chunk_indices, T, H,
                  DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
                  EMU: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """The chunk-local part of dṼ, (M ∘ Γ ∘ Q Kᵀ)ᵀ dO, for one chunk, one head and one block of BV
    value columns (grid: chunks, H, d_v blocks), written to dVN for ``_bwd_state`` to add K_d dS
    to; Q Kᵀ is summed over d_k in blocks of BK (USE_GK: the scores M ∘ P(Q) read from Aqk)."""
    i_c, h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    m_v = o_v < DV
    o_t = c * C + o_c
    m_t = o_t < Tn
    rows = row0 + o_t
    m_tv = m_t[:, None] & m_v[None, :]
    if USE_GK:
        P = tl.load(Aqk + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0).to(ACC)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
    else:
        QK = tl.zeros([C, C], dtype=ACC)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            QK += _mm(b_q, tl.trans(b_k), PREC, EMU)
        if USE_G:
            gam, gC = _gamma(g, rows, m_t, ACC)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        if USE_G:
            QK = QK * _decay(gam, gam)
        P = tl.where(o_c[:, None] >= o_c[None, :], QK, 0.0)
    b_dvn = _mm(tl.trans(P), b_do, PS, EMU)
    tl.store(dVN + rows[:, None] * DV + o_v[None, :], b_dvn.to(dVN.dtype.element_ty), mask=m_tv)


@triton.jit
def _bwd_state(q, k, g, W, do, dht, dHs, dVN, dh0, cu_seqlens, chunk_offsets, T, H,
               DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
               ACC: tl.constexpr, PS: tl.constexpr, EMU: tl.constexpr, USE_G: tl.constexpr,
               USE_GK: tl.constexpr, USE_DELTA: tl.constexpr):
    """The reverse recurrence of the state gradient for one block of d_v columns: per chunk, from
    the gradient dS at its end, dṼ = dṼ_local + K_d dS (dṼ_local = (M ∘ Γ ∘ Q Kᵀ)ᵀ dO, read from
    dVN where ``_bwd_dv_local`` stored it, overwritten with the full dṼ) and
    dS ← e^{γ_C} dS + (diag(e^{γ}) Q)ᵀ dO − Wᵀ dṼ (USE_GK: Diag(e^{γ_C}) dS, Q ∘ e^{γ} and
    K_d = K ∘ e^{γ_C − γ}), writing each chunk's end gradient to dHs. Like
    ``_fwd_state``, dS is read back from dHs in blocks of BK rows instead of being carried in
    registers. Without USE_DELTA there is no −Wᵀ dṼ term (W is None)."""
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
        # dHs[c] holds the gradient of the state at the end of chunk c
        dhs_c = dHs + ((coff + c) * H + h) * DK * DV
        o_t = c * C + o_c
        m_t = o_t < Tn
        rows = row0 + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        if USE_G:
            gam, gC = _gamma(g, rows, m_t, ACC)
            dec_end = tl.exp(gC - gam)
        b_dvn = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            dS = tl.load(dhs_c + o_k[:, None] * DV + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
            b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            if USE_G:
                b_k = b_k.to(ACC) * dec_end[:, None]
            if USE_GK:
                gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
                gC_k = _gk_last(g, row0, Tn, c, C, DK, o_k, ACC)
                b_k = b_k.to(ACC) * tl.exp(tl.minimum(gC_k[None, :] - gam_k, 0.0))
            b_dvn += _mm(b_k, dS, PS, EMU)
        b_do = tl.load(do + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        tl.store(dVN + rows[:, None] * DV + o_v[None, :], b_dvn.to(dVN.dtype.element_ty), mask=m_tv)
        for k0 in range(0, DK, BK):
            o_k = k0 + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k[None, :] < DK)
            m_kv = (o_k[:, None] < DK) & m_v[None, :]
            kv_off = o_k[:, None] * DV + o_v[None, :]
            b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            if USE_DELTA:
                b_w = tl.load(W + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            dS = tl.load(dhs_c + kv_off, mask=m_kv, other=0.0).to(ACC)
            if USE_G:
                b_q = b_q.to(ACC) * tl.exp(gam)[:, None]
                dS = tl.exp(gC) * dS
            if USE_GK:
                gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
                gC_k = _gk_last(g, row0, Tn, c, C, DK, o_k, ACC)
                b_q = b_q.to(ACC) * tl.exp(gam_k)
                dS = tl.exp(gC_k)[:, None] * dS
            if USE_DELTA:
                dS = dS + _mm(tl.trans(b_q), b_do, PS, EMU) - _mm(tl.trans(b_w), b_dvn, PS, EMU)
            else:
                dS = dS + _mm(tl.trans(b_q), b_do, PS, EMU)
            if c > 0:
                tl.store(dhs_c - H * DK * DV + kv_off, dS.to(dHs.dtype.element_ty), mask=m_kv)
            elif STORE_DH0:
                tl.store(dh0 + s_base + kv_off, dS.to(dh0.dtype.element_ty), mask=m_kv)
        tl.debug_barrier()


@triton.jit
def _bwd_dqk(q, k, g, VN, do, dVN, Hs, dHs, dq, dk_part, dw, dg_part, dAqk,
             cu_seqlens, chunk_offsets, chunk_indices, T, H,
             DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
             EMU: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_DELTA: tl.constexpr,
             NKD: tl.constexpr = 1):
    """Chunk-local gradients through the state and the intra-chunk attention, summed over d_v
    blocks: dP = M ∘ Γ ∘ dO Ṽᵀ, dQ = diag(e^{γ}) dO S_nᵀ + dP K, dK ∋ dPᵀ Q + K_d's terms (stored as
    dk_part), dW = −dṼ S_nᵀ (stored for ``_bwd_wy``) and, with USE_G, the gradient of γ from these
    terms (dg_part; module docstring). With USE_GK the terms through the decayed scores are left
    to ``_gk_bwd_intra``: dq gets the state's part (Q ∘ e^{γ}) only, dP is stored to dAqk, and
    dg_part is the per-channel dγ [C, d_k] of the state terms. Without USE_DELTA there is no W
    (dw is None and dW is not formed).

    Grid (chunks, H, NKD): program i_k takes the d_k columns i_k·BK … i_k·BK + BK − 1 of dQ, dK,
    dW (and S_n, dS rows), recomputing dP (over d_v) as flash-linear-attention's
    ``chunk_bwd_dqkwg`` does; every term of the scalar dγ (USE_G) is a sum over d_k (q·(S_n dO),
    rowsum − colsum of dP ∘ Q Kᵀ with Q Kᵀ = Σ_blocks Q_b K_bᵀ, k·(dS Ṽ), ⟨S_n, dS⟩), so each
    program stores its block's part to dg_part [.., NKD] and the next kernel sums the NKD parts.
    With USE_GK only program 0 stores dP."""
    i_c, h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    hs_off = ((coff + c) * H + h) * DK * DV
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_k = i_k * BK + tl.arange(0, BK)
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
        if USE_DELTA:
            b_dw -= _mm(b_du, tl.trans(S), PS, EMU)
        if USE_G:
            sdS += tl.sum(S.to(ACC) * dS.to(ACC), 1)
        if USE_GK:
            sdS += tl.sum(S.to(ACC) * dS.to(ACC), 1)
    if USE_DELTA:
        tl.store(dw + rows[:, None] * DK + o_k[None, :], b_dw.to(dw.dtype.element_ty), mask=m_tk)
    if USE_GK:
        b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        gam = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        gC_k = _gk_last(g, row0, Tn, c, C, DK, o_k, ACC)
        # O ∋ (Q ∘ e^{γ}) S_n
        b_dq = b_dq * tl.exp(gam)
        dgam = b_q * b_dq
        tl.store(dq + rows[:, None] * DK + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        # O ∋ (M ∘ P(Q)) Ṽ: dP for ``_gk_bwd_intra``
        dP = tl.where(o_c[:, None] >= o_c[None, :], dP, 0.0)
        if i_k == 0:
            tl.store(dAqk + rows[:, None] * C + o_c[None, :], dP.to(dAqk.dtype.element_ty), mask=m_t[:, None])
        # S_{n+1} ∋ Diag(e^{γ_C}) S_n + K_dᵀ Ṽ,  K_d = K ∘ e^{γ_C − γ}
        b_dk = b_dk * tl.exp(tl.minimum(gC_k[None, :] - gam, 0.0))
        kd = b_dk * b_k
        dgam -= kd
        dgC = tl.exp(gC_k) * sdS + tl.sum(kd, 0)
        last = tl.minimum(Tn - c * C, C) - 1
        dgam += tl.where(o_c[:, None] == last, dgC[None, :], 0.0)
        tl.store(dk_part + rows[:, None] * DK + o_k[None, :], b_dk.to(dk_part.dtype.element_ty), mask=m_tk)
        tl.store(dg_part + rows[:, None] * DK + o_k[None, :], dgam.to(dg_part.dtype.element_ty), mask=m_tk)
    else:
        # the two branches keep their own order of loads and products: merged into one order, ptxas
        # gave the USE_G kernel up to 16 more registers and 4 KB more shared memory in some configs
        if USE_G:
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
        else:
            dP = tl.where(o_c[:, None] >= o_c[None, :], dP, 0.0)
            b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_dq += _mm(dP, b_k, PS, EMU)
        tl.store(dq + rows[:, None] * DK + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_tk)
        if USE_G:
            # S_{n+1} ∋ e^{γ_C} S_n + K_dᵀ Ṽ
            kd = tl.sum(b_dk * b_k.to(ACC), 1) * dec_end
            dgam -= kd
            dgC = tl.exp(gC) * tl.sum(sdS, 0) + tl.sum(kd, 0)
            last = tl.minimum(Tn - c * C, C) - 1
            dgam += tl.where(o_c == last, dgC, 0.0)
            b_dk = b_dk * dec_end[:, None] + _mm(tl.trans(dP), b_q, PS, EMU)
        else:
            b_q = tl.load(q + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            b_dk += _mm(tl.trans(dP), b_q, PS, EMU)
        tl.store(dk_part + rows[:, None] * DK + o_k[None, :], b_dk.to(dk_part.dtype.element_ty), mask=m_tk)
        if USE_G:
            tl.store(dg_part + rows * NKD + i_k, dgam.to(dg_part.dtype.element_ty), mask=m_t)


@triton.jit
def _bwd_wy(k, v, beta, g, Tm, dVN, dk_part, dw, dg_part, dk, dv, dbeta, dg, Akk, dAkk, Ms,
            cu_seqlens, chunk_offsets, chunk_indices, T, H,
            DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            IS_VARLEN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, PS: tl.constexpr,
            EMU: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, NKD: tl.constexpr = 1,
            STAGE_DL: tl.constexpr = False):
    """Gradients through U = T (βV), W = T (β e^{γ} K) and T = (I + L)⁻¹ (module docstring), given
    dU = dṼ and dW from ``_bwd_dqk``: writes dv, dβ, dk = dk_part + β e^{γ} Tᵀ dW + (dG + dGᵀ) K
    and, with USE_G, dg = the reverse cumulative sum of dγ (dg_part plus the terms here). With
    USE_GK, W = T diag(β) (K ∘ e^{γ}), G = P(K) is read from Akk, dG = diag(β) dL is stored to dAkk,
    and dk and dg (pointers to float32 [.., d_k] buffers) get the terms so far, dk_part +
    β e^{γ} ∘ Tᵀ dW and dg_part + β k ∘ e^{γ} ∘ Tᵀ dW, for ``_gk_bwd_intra`` to finish.

    STAGE_DL: of the two products of dL = −Tᵀ dT Tᵀ, the first one's [C, C] result is written to
    ``Ms`` (float32 [.., T, C], as Tm) and read back, and T is read again from Tm, so that the
    operands of the two products are not live at once (at C = 64 on sm_80, where mma.sync holds
    every operand in registers, the chained products spilled 0.3–0.8 KB)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    o_c = tl.arange(0, C)
    b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
    b_bw = b_b   # W's row scale, β e^{γ}
    if USE_G:
        gam, gC = _gamma(g, rows, m_t, ACC)
        eg = tl.exp(gam)
        b_bw = b_b * eg
    X = tl.load(Tm + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
    dX = tl.zeros([C, C], dtype=ACC)
    b_db = tl.zeros([C], dtype=ACC)
    if USE_G:   # the NKD d_k-block parts ``_bwd_dqk`` stored
        dgam = tl.zeros([C], dtype=ACC)
        for i_k in tl.static_range(NKD):
            dgam += tl.load(dg_part + rows * NKD + i_k, mask=m_t, other=0.0).to(ACC)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_du = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0)
        # U = T (βV)
        dX += _mm(b_du, tl.trans(b_b[:, None] * b_v), PS, EMU)
        b_dvb = _mm(tl.trans(X), b_du, PS, EMU)
        tl.store(dv + rows[:, None] * DV + o_v[None, :], (b_b[:, None] * b_dvb).to(dv.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_dvb * b_v, 1)
    # W = T (β e^{γ} K) and G = K Kᵀ: products over d_k, summed over blocks of BK columns of K
    G = tl.zeros([C, C], dtype=ACC)
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        if USE_GK:
            gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            ek = tl.exp(gam_k) * b_k.to(ACC)
            dX += _mm(b_dw, tl.trans(b_b[:, None] * ek), PS, EMU)
            b_db += tl.sum(_mm(tl.trans(X), b_dw, PS, EMU) * ek, 1)
        else:
            dX += _mm(b_dw, tl.trans(b_bw[:, None] * b_k.to(ACC)), PS, EMU)
            r = tl.sum(_mm(tl.trans(X), b_dw, PS, EMU) * b_k.to(ACC), 1)
            if USE_G:
                r = r * eg
                dgam += b_b * r
            b_db += r
            G += _mm(b_k, tl.trans(b_k), PREC, EMU)
    # T = (I + L)⁻¹  ⇒  dL = −Tᵀ dT Tᵀ, kept on the strictly lower part where L lives
    if STAGE_DL:
        tl.store(Ms + rows[:, None] * C + o_c[None, :], _mm(tl.trans(X), dX, PS, EMU), mask=m_t[:, None])
        tl.debug_barrier()
        M = tl.load(Ms + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
        X = tl.load(Tm + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0)
        dL = _mm(M, tl.trans(X), PS, EMU)
    else:
        dL = _mm(_mm(tl.trans(X), dX, PS, EMU), tl.trans(X), PS, EMU)
    dL = tl.where(o_c[:, None] > o_c[None, :], -dL, 0.0)
    if USE_GK:
        G = tl.load(Akk + rows[:, None] * C + o_c[None, :], mask=m_t[:, None], other=0.0).to(ACC)
    if USE_G:
        Gam = _decay(gam, gam)
        G = G * Gam
    b_db += tl.sum(dL * G, 1)
    dG = b_b[:, None] * dL
    if USE_G:
        Bm = dG * G
        dgam += tl.sum(Bm, 1) - tl.sum(Bm, 0)
        dG = dG * Gam
    if USE_GK:
        tl.store(dAkk + rows[:, None] * C + o_c[None, :], dG.to(dAkk.dtype.element_ty), mask=m_t[:, None])
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        b_k = tl.load(k + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_dw = tl.load(dw + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        if USE_GK:
            gam_k = tl.load(g + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
            bw = b_b[:, None] * tl.exp(gam_k)
            XdW = bw * _mm(tl.trans(X), b_dw, PS, EMU)
            b_dk = XdW + tl.load(dk_part + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            b_dgk = XdW * b_k.to(ACC) + tl.load(dg_part + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
            tl.store(dg + rows[:, None] * DK + o_k[None, :], b_dgk.to(dg.dtype.element_ty), mask=m_tk)
        else:
            b_dk = (b_bw[:, None] * _mm(tl.trans(X), b_dw, PS, EMU)
                    + _mm(dG, b_k, PS, EMU) + _mm(tl.trans(dG), b_k, PS, EMU))
            b_dk += tl.load(dk_part + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        tl.store(dk + rows[:, None] * DK + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + rows, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if USE_G:
        # γ_i = Σ_{s≤i} g_s  ⇒  dg_s = Σ_{i≥s} dγ_i
        b_dg = tl.sum(dgam, 0) - tl.cumsum(dgam, 0) + dgam
        tl.store(dg + rows, b_dg.to(dg.dtype.element_ty), mask=m_t)


@triton.jit
def _bwd_beta(v, beta, dVN, dk_part, dg_part, dk, dv, dbeta, dg, cu_seqlens, chunk_offsets, chunk_indices, T, H,
              DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              IS_VARLEN: tl.constexpr, ACC: tl.constexpr, USE_G: tl.constexpr, NKD: tl.constexpr = 1):
    """``_bwd_wy`` without USE_DELTA (T = I, W = 0, Ṽ = diag(β) V): for one chunk (grid: chunks,
    H), dv = diag(β) dṼ, dβ = rowsum(dṼ ∘ V), dk = dk_part (``_bwd_dqk``'s terms are all of it)
    and, with USE_G, dg = the reverse cumulative sum of dg_part over the chunk. No products."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    c, row0, Tn, coff = _chunk_info(cu_seqlens, chunk_offsets, chunk_indices, i_c, h, T, H, C, IS_VARLEN)
    o_t = c * C + tl.arange(0, C)
    m_t = o_t < Tn
    rows = row0 + o_t
    b_b = tl.load(beta + rows, mask=m_t, other=0.0).to(ACC)
    b_db = tl.zeros([C], dtype=ACC)
    for v0 in range(0, DV, BV):
        o_v = v0 + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < DV)
        b_v = tl.load(v + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        b_du = tl.load(dVN + rows[:, None] * DV + o_v[None, :], mask=m_tv, other=0.0).to(ACC)
        tl.store(dv + rows[:, None] * DV + o_v[None, :], (b_b[:, None] * b_du).to(dv.dtype.element_ty), mask=m_tv)
        b_db += tl.sum(b_du * b_v, 1)
    tl.store(dbeta + rows, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    for k0 in range(0, DK, BK):
        o_k = k0 + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k[None, :] < DK)
        b_dk = tl.load(dk_part + rows[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        tl.store(dk + rows[:, None] * DK + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    if USE_G:   # the NKD d_k-block parts ``_bwd_dqk`` stored
        dgam = tl.zeros([C], dtype=ACC)
        for i_k in tl.static_range(NKD):
            dgam += tl.load(dg_part + rows * NKD + i_k, mask=m_t, other=0.0).to(ACC)
        b_dg = tl.sum(dgam, 0) - tl.cumsum(dgam, 0) + dgam
        tl.store(dg + rows, b_dg.to(dg.dtype.element_ty), mask=m_t)


# ---- host side: layout, precisions, launches -------------------------------------------------------

def _layout(B: int, T: int, C: int, cu_seqlens: Optional[torch.Tensor]):
    """(sequences N, chunk slots NC, per-sequence first chunk slot, (sequence, chunk) per slot).

    Without ``cu_seqlens``: B sequences of ⌈T / C⌉ chunks each, NC = B·⌈T / C⌉, no tables. With
    it the tables are built on the device, with no copy to the host: NC = ⌊T / C⌋ + N slots bound
    the Σ ⌈T_i / C⌉ chunks of the packed sequences (Σ ⌊T_i / C⌋ ≤ ⌊T / C⌋, plus at most one
    partial chunk each); the spare slots past the last chunk are marked sequence −1 (chunk 0) and
    the chunk-gridded kernels give them length 0, so every load and store of theirs is masked."""
    if cu_seqlens is None:
        return B, B * triton.cdiv(T, C), None, None
    return packed_chunk_tables(T, C, cu_seqlens)


def _check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """The packed batch's offsets as int32 on ``device``, checked there: one flag read back (the
    only copy to the host of a packed launch)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    if bool((cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: cu_seqlens must rise from 0 to T = {T} without decreasing, "
                         f"got {cu_seqlens.tolist()}")
    return cu


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


_TL = {torch.float32: tl.float32, torch.float64: tl.float64}
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: tl.dot operand precision by input dtype (see ``_mm``): half inputs go to the tensor cores as
#: they are, float32 as three TF32 products, float64 stays IEEE
_PREC = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32x3", torch.float64: "fp64"}
#: precision of the products between float32 intermediates (blocks of L and T = (I + L)⁻¹):
#: TF32 for half inputs, whose own rounding (2^-9) is coarser than TF32's (2^-11)
_PREC_SOLVE = {torch.bfloat16: "tf32", torch.float16: "tf32", torch.float32: "tf32x3", torch.float64: "fp64"}


def _gk_prep(mt: dict, q, k, g, cu, chunk_offsets, chunk_indices, NC: int, C: int, common: dict):
    """USE_GK: γ (``_gk_cumsum``) and the decayed scores Aqk, Akk (``_gk_scores``) of every chunk."""
    B, H, T, DK = k.shape
    acc = g.dtype
    gam = torch.empty_like(g)
    Aqk = torch.empty(B, H, T, C, dtype=acc, device=k.device)
    Akk = torch.empty_like(Aqk)
    BKG = mt["BKG"]
    cx = dict(C=C, IS_VARLEN=common["IS_VARLEN"], ACC=common["ACC"], num_stages=mt["stages"])
    _gk_cumsum[(NC, H, triton.cdiv(DK, BKG))](g, gam, cu, chunk_offsets, chunk_indices, T, H, DK=DK, BK=BKG,
                                              num_warps=mt["warps_gk"], **cx)
    _gk_scores[(NC, H)](q, k, gam, Aqk, Akk, cu, chunk_offsets, chunk_indices, T, H, DK=DK, BK=BKG,
                        PREC=mt["PREC"], EMU=common["EMU"], num_warps=mt["warps_gk"], **cx)
    return gam, Aqk, Akk


def chunk_fwd(mt: dict, q, k, v, g, beta, initial_state, cu_seqlens, C: int, output_final_state: bool,
              use_delta: bool = True):
    """The forward launches for launch config ``mt`` (an op's ``launch_meta``); g None is the
    delta rule (USE_G = False), g [B, H, T] the gated one (USE_G), g [B, H, T, d_k] KDA (USE_GK,
    γ and the decayed scores from ``_gk_prep`` first). Returns o, final state ([0] when not asked for), and what the
    backward reads: Tm, W, VN, Hs. ``use_delta`` False (USE_DELTA off, the SSD): no ``_wy_inv`` or
    ``_wy_fwd``, Tm and W are empty ([0])."""
    B, H, T, DK = k.shape
    DV = v.shape[-1]
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    acc = _acc_dtype(k)
    N, NC, chunk_offsets, chunk_indices = _layout(B, T, C, cu_seqlens)
    BK, BV = mt["BK"], mt["BV"]
    NV = triton.cdiv(DV, BV)
    use_gk = g is not None and g.dim() == 4
    common = dict(C=C, IS_VARLEN=cu_seqlens is not None, ACC=_TL[acc], EMU=is_interpreting(),
                  USE_G=g is not None and not use_gk, USE_GK=use_gk, num_stages=mt["stages"])
    Aqk = Akk = None
    if use_gk and B * T > 0:   # g becomes γ, the chunk-local cumulative decay
        g, Aqk, Akk = _gk_prep(mt, q, k, g, cu_seqlens, chunk_offsets, chunk_indices, NC, C, common)
    if use_delta:
        Tm = torch.empty(B, H, T, C, dtype=acc, device=k.device)
        W = torch.empty(B, H, T, DK, dtype=acc, device=k.device)
        U = torch.empty(B, H, T, DV, dtype=acc, device=k.device)
    else:
        Tm, W, U = (k.new_empty(0, dtype=acc) for _ in range(3))
    VN = torch.empty(B, H, T, DV, dtype=acc, device=k.device)
    Hs = torch.empty(max(NC, 1), H, DK, DV, dtype=acc, device=k.device)
    o = torch.empty(B, H, T, DV, dtype=v.dtype, device=v.device)
    h0 = None if initial_state is None else initial_state.to(acc).contiguous()
    ht = torch.empty(N, H, DK, DV, dtype=acc, device=k.device) if output_final_state else None
    cu = cu_seqlens
    if B * T > 0 and use_delta:   # some chunk holds tokens
        _wy_inv[(NC, H)](k, beta, g, Tm, Akk, cu, chunk_offsets, chunk_indices, T, H, DK=DK, BK=mt["BK_inv"],
                         PK=mt["PREC"], PS=mt["PS"], num_warps=mt["warps_inv"], **common)
        BKW, BVW = mt["BKW"], mt["BVW"]
        _wy_fwd[(NC, H, triton.cdiv(DK, BKW) + triton.cdiv(DV, BVW))](
            k, v, beta, g, Tm, W, U, cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV, BK=BKW, BV=BVW,
            PS=mt["PS"], num_warps=mt["warps_wy"], **common)
    vb = (None, None) if use_delta else (v, beta)
    WU = (W, U) if use_delta else (None, None)
    _fwd_state[(NV, N * H)](k, *vb, g, *WU, Hs, VN, h0, ht, cu, chunk_offsets, T, H,
                            DK=DK, DV=DV, BK=mt["BKS"], BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None,
                            PS=mt["PS"], USE_DELTA=use_delta, num_warps=mt["warps_state"], **common)
    if B * T > 0:   # some chunk holds tokens
        _fwd_o[(NC, H, NV)](q, k, g, VN, Hs, o, Aqk, cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV,
                            BK=mt["BKS"], BV=BV, PREC=mt["PREC"], PS=mt["PS"], num_warps=mt["warps_o"], **common)
    if ht is None:
        ht = o.new_empty(0, dtype=acc)
    return o, ht, Tm, W, VN, Hs


def chunk_bwd(mt: dict, q, k, v, g, beta, Tm, W, VN, Hs, do, dht, cu_seqlens, C: int, h0_dtype,
              use_delta: bool = True):
    """The backward launches: dq, dk, dv, dg ([0] without g), dbeta, d initial_state ([0] when
    there is none); each input's gradient in that input's memory layout (strides), as the fake
    implementation and autograd expect. ``use_delta`` False: ``_bwd_beta`` instead of ``_bwd_wy``
    (Tm and W are unused)."""
    cu = cu_seqlens
    given = (q, k, v, g, beta)
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    use_g = g is not None
    g = g.contiguous() if use_g else None
    use_gk = use_g and g.dim() == 4
    BK, BV = mt["BK"], mt["BV"]
    B, H, T, DK = k.shape
    DV = v.shape[-1]
    N, NC, chunk_offsets, chunk_indices = _layout(B, T, C, cu)
    NV = triton.cdiv(DV, BV)
    has_h0 = h0_dtype is not None
    common = dict(C=C, IS_VARLEN=cu is not None, ACC=_TL[Hs.dtype], EMU=is_interpreting(),
                  USE_G=use_g and not use_gk, USE_GK=use_gk, num_stages=mt["stages"])
    gam, Aqk, Akk = g, None, None
    if use_gk and B * T > 0:   # recomputed, not saved: γ and the scores cost one chunk-parallel pass
        gam, Aqk, Akk = _gk_prep(mt, q, k, g, cu, chunk_offsets, chunk_indices, NC, C, common)
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()
    dHs = torch.empty_like(Hs)
    dVN = torch.empty_like(VN)
    dh0 = torch.empty(N, H, DK, DV, dtype=Hs.dtype, device=k.device) if has_h0 else None
    if B * T > 0:   # some chunk holds tokens
        _bwd_dv_local[(NC, H, NV)](q, k, gam, do, dVN, Aqk, cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV,
                                   BK=mt["BKS"], BV=BV, PREC=mt["PREC"], PS=mt["PS"],
                                   num_warps=mt["warps_dv_local"], **common)
    _bwd_state[(NV, N * H)](q, k, gam, W if use_delta else None, do, dht, dHs, dVN, dh0, cu, chunk_offsets, T, H,
                            DK=DK, DV=DV, BK=mt["BKS"], BV=BV, USE_DHT=dht is not None, STORE_DH0=has_h0,
                            PS=mt["PS"], USE_DELTA=use_delta, num_warps=mt["warps_state"], **common)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = torch.empty_like(g) if use_g else q.new_empty(0)
    dbeta = torch.empty_like(beta)
    if B * T > 0:   # some chunk holds tokens
        acc = Hs.dtype
        dk_part = torch.empty(B, H, T, DK, dtype=acc, device=k.device)
        dw = torch.empty_like(dk_part) if use_delta else None
        BKQ = mt["BK_dqk"]
        NKD = triton.cdiv(DK, BKQ)
        # the scalar decay's dγ comes in NKD parts, one per d_k block of ``_bwd_dqk``
        dg_part = (None if not use_g else torch.empty(g.shape, dtype=acc, device=k.device) if use_gk else
                   torch.empty(*g.shape, NKD, dtype=acc, device=k.device))
        NKD = 1 if use_gk else NKD
        # USE_GK: _bwd_dqk and _bwd_wy leave dq, dk and dγ in float32 buffers, dP and dG in
        # dAqk and dAkk, for _gk_bwd_intra to finish
        dq1, dk1, dg1, dAqk, dAkk = dq, dk, (dg if use_g else None), None, None
        if use_gk:
            dq1, dk1, dg1 = (torch.empty_like(dk_part) for _ in range(3))
            dAqk, dAkk = torch.empty_like(Aqk), torch.empty_like(Akk)
        _bwd_dqk[(NC, H, triton.cdiv(DK, BKQ))](
                          q, k, gam, VN, do, dVN, Hs, dHs, dq1, dk_part, dw, dg_part, dAqk, cu, chunk_offsets,
                          chunk_indices, T, H, DK=DK, DV=DV, BK=BKQ, BV=mt["BV_dqk"], PREC=mt["PREC"], PS=mt["PS"],
                          NKD=NKD, USE_DELTA=use_delta, num_warps=mt["warps_dqk"], **common)
        if not use_delta:
            _bwd_beta[(NC, H)](v, beta, dVN, dk_part, dg_part, dk, dv, dbeta, dg if use_g else None, cu,
                               chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV, BK=mt["BKS"], BV=BV, C=C,
                               IS_VARLEN=common["IS_VARLEN"], ACC=common["ACC"], USE_G=common["USE_G"], NKD=NKD,
                               num_warps=mt["warps_beta"], num_stages=mt["stages"])
        else:
            Ms = torch.empty_like(Tm) if mt["stage_dl"] else None   # _bwd_wy's STAGE_DL scratch
            _bwd_wy[(NC, H)](k, v, beta, gam, Tm, dVN, dk_part, dw, dg_part, dk1, dv, dbeta, dg1, Akk, dAkk, Ms,
                             cu, chunk_offsets, chunk_indices, T, H, DK=DK, DV=DV, BK=mt["BK_bwd_wy"], BV=mt["BV_bwd_wy"],
                             PREC=mt["PREC"], PS=mt["PS"], NKD=NKD, STAGE_DL=mt["stage_dl"],
                             num_warps=mt["warps_bwd_wy"], **common)
        if use_gk:
            BKG = mt["BKG"]
            _gk_bwd_intra[(NC, H, triton.cdiv(DK, BKG))](
                q, k, gam, dAqk, dAkk, dq1, dk1, dg1, dq, dk, dg, cu, chunk_offsets, chunk_indices, T, H,
                DK=DK, C=C, BK=BKG, IS_VARLEN=common["IS_VARLEN"], ACC=common["ACC"], PS=mt["PS"],
                EMU=common["EMU"], num_warps=mt["warps_gk"], num_stages=mt["stages"])
    dh0 = dh0.to(h0_dtype) if dh0 is not None else q.new_empty(0)
    grads = [dq, dk, dv, dg, dbeta]
    for i, (x, d) in enumerate(zip(given, grads)):
        if x is not None and not x.is_contiguous():
            grads[i] = torch.empty_like(x).copy_(d)
    return (*grads, dh0)


def make_op(name: str, launch_meta: Callable[[int, int, torch.dtype, int], dict], use_delta: bool = True):
    """The PyTorch custom op ``kernels::<name>_fwd`` (with its backward ``kernels::<name>_bwd``
    registered as its autograd): torch.compile (model.compile) captures it as one opaque node of
    the block's graph, with shapes from the fake implementations, instead of tracing the Triton
    launches or breaking the graph. Its arguments are (q, k, v, g or None, beta, initial_state,
    cu_seqlens, C, arch, output_final_state); the launch config is recomputed inside from
    ``launch_meta(d_k, d_v, dtype, arch)`` (called at each launch, so the op's module attribute
    is what counts), the varlen chunk tables from cu_seqlens, on the device (``_layout``), their
    size ⌊T / C⌋ + N known without reading the offsets. ``use_delta`` False: the kernels with
    USE_DELTA off (no delta term: T = I, W = 0; the SSD's), whose Tm and W outputs are empty."""

    @torch.library.custom_op(f"kernels::{name}_fwd", mutates_args=())
    def fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], beta: torch.Tensor,
               initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], C: int, arch: int,
               output_final_state: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor, torch.Tensor]:
        mt = launch_meta(k.shape[-1], v.shape[-1], q.dtype, arch)
        return chunk_fwd(mt, q, k, v, g, beta, initial_state, cu_seqlens, C, output_final_state, use_delta)

    @fwd_op.register_fake
    def _(q, k, v, g, beta, initial_state, cu_seqlens, C, arch, output_final_state):
        B, H, T, DK = k.shape
        DV = v.shape[-1]
        acc = _acc_dtype(k)
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        NC = B * triton.cdiv(T, C) if cu_seqlens is None else T // C + N   # chunk slots, as ``_layout``
        Tm = k.new_empty(B, H, T, C, dtype=acc) if use_delta else k.new_empty(0, dtype=acc)
        W = k.new_empty(B, H, T, DK, dtype=acc) if use_delta else k.new_empty(0, dtype=acc)
        U = k.new_empty(B, H, T, DV, dtype=acc)
        Hs = k.new_empty(torch.sym_max(NC, 1), H, DK, DV, dtype=acc)
        ht = k.new_empty(N, H, DK, DV, dtype=acc) if output_final_state else k.new_empty(0, dtype=acc)
        return v.new_empty(B, H, T, DV), ht, Tm, W, U, Hs   # contiguous, as the real o

    @torch.library.custom_op(f"kernels::{name}_bwd", mutates_args=())
    def bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], beta: torch.Tensor,
               Tm: torch.Tensor, W: torch.Tensor, VN: torch.Tensor, Hs: torch.Tensor, do: torch.Tensor,
               dht: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], C: int, arch: int,
               h0_dtype: Optional[torch.dtype]
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mt = launch_meta(k.shape[-1], v.shape[-1], q.dtype, arch)
        return chunk_bwd(mt, q, k, v, g, beta, Tm, W, VN, Hs, do, dht, cu_seqlens, C, h0_dtype, use_delta)

    @bwd_op.register_fake
    def _(q, k, v, g, beta, Tm, W, VN, Hs, do, dht, cu_seqlens, C, arch, h0_dtype):
        B, H, T, DK = k.shape
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dh0 = k.new_empty(N, H, DK, v.shape[-1], dtype=h0_dtype) if h0_dtype is not None else q.new_empty(0)
        dg = torch.empty_like(g) if g is not None else q.new_empty(0)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dg, torch.empty_like(beta), dh0)

    def setup_context(ctx, inputs, output):
        q, k, v, g, beta, h0, cu_seqlens, C, arch, output_final_state = inputs
        _, _, Tm, W, VN, Hs = output
        ctx.save_for_backward(q, k, v, g, beta, Tm, W, VN, Hs, cu_seqlens)
        ctx.mark_non_differentiable(Tm, W, VN, Hs)
        ctx.meta = (C, arch, output_final_state, None if h0 is None else h0.dtype)

    def backward(ctx, do, dht, *_):
        q, k, v, g, beta, Tm, W, VN, Hs, cu_seqlens = ctx.saved_tensors
        C, arch, output_final_state, h0_dtype = ctx.meta
        dht = dht if output_final_state else None
        dq, dk, dv, dg, dbeta, dh0 = bwd_op(q, k, v, g, beta, Tm, W, VN, Hs, do, dht, cu_seqlens, C, arch, h0_dtype)
        return (dq, dk, dv, (dg if g is not None else None), dbeta, (dh0 if h0_dtype is not None else None),
                None, None, None, None)

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op


def run(name: str, fwd_op, launch_meta, arch: int, q, k, v, g, beta, initial_state, output_final_state: bool,
        chunk_size: int, cu_seqlens: Optional[torch.Tensor]):
    """An op entry's launch, after its input checks: the offsets checked on the device, the kernel
    chunk ``min(launch_meta(...)["C"], chunk_size rounded up to a power of two)``, g read in the
    accumulation dtype (made contiguous inside the op, so its gradient keeps g's layout).
    Returns (o, final state or None)."""
    T = k.shape[2]
    if cu_seqlens is not None:
        cu_seqlens = _check_cu_seqlens(name, cu_seqlens, T, k.device)
    C = min(launch_meta(k.shape[-1], v.shape[-1], q.dtype, arch)["C"], _pow2(chunk_size))
    if g is not None:
        g = g.to(_acc_dtype(k))
    o, ht = fwd_op(q, k, v, g, beta, initial_state, cu_seqlens, C, arch, output_final_state)[:2]
    return o, (ht if output_final_state else None)


# ---- the compile gate ------------------------------------------------------------------------------

def gate_launches(mt: dict, arch: int, dt: str, dk: int, dv: int, C: int, varlen: bool, use_g: bool,
                  use_gk: bool = False, use_delta: bool = True) -> List[dict]:
    """The eight kernels' launches at launch config ``mt`` (an op's ``launch_meta``) for an op's
    ``compile_cases.py``: input dtype ``dt`` ("bf16", "fp32"), head dims, kernel chunk C, fixed-length or
    packed (``cu_seqlens``, configs named "varlen"), with an initial and a final state; with
    ``use_g`` the decay's pointers are float32 and the configs are named "USE_G", without they are
    constexpr None; with ``use_gk`` (the per-channel decay, configs named "USE_GK") the decay's
    and the scores' pointers are float32, as are the dq, dk and dg buffers the USE_GK backward
    leaves to ``_gk_bwd_intra``, and the three USE_GK kernels are added. With ``use_delta`` False
    (configs named "NO_DELTA", the SSD's) ``_wy_inv`` and ``_wy_fwd`` are not launched,
    ``_bwd_beta`` replaces ``_bwd_wy``, W, U, Tm and dw are constexpr None and β, dβ float32. One
    dict per launch, in the form ``kernels.compile_report.cases_from_launches`` takes."""
    io = lambda *names: {n: "*" + dt for n in names}     # noqa: E731
    acc = lambda *names: {n: "*fp32" for n in names}      # noqa: E731
    ints = {"T": "i32", "H": "i32"}
    # the decay's pointers, and the scores' of USE_GK: float32 when switched on, else constexpr None
    ptr_on = {**{n: use_g or use_gk for n in ("g", "dg_part", "dg")},
              **{n: use_gk for n in ("Aqk", "Akk", "dAqk", "dAkk")},
              **{n: use_delta for n in ("W", "U", "Tm", "dw")}, "Ms": use_delta and mt["stage_dl"]}
    base = dict(C=C, IS_VARLEN=False, ACC=tl.float32, EMU=False, USE_G=use_g, USE_GK=use_gk, cu_seqlens=None,
                chunk_offsets=None)
    io_gk = acc if use_gk else io   # dq of _bwd_dqk, dk of _bwd_wy
    if not use_delta:   # the SSD's β is its step Δ, kept in float32
        io = lambda *names: {n: ("*fp32" if n in ("beta", "dbeta") else "*" + dt) for n in names}   # noqa: E731
    dl = dict(USE_DELTA=use_delta)
    nkd = 1 if use_gk else triton.cdiv(dk, mt["BK_dqk"])   # the parts of the scalar decay's dγ
    fwd_state_io = ({**io("k"), **acc("W", "U", "Hs", "VN", "h0", "ht")} if use_delta else
                    {**io("k", "v", "beta"), **acc("Hs", "VN", "h0", "ht")})
    wy = [
        (_wy_inv, {**io("k", "beta"), **acc("Tm"), **ints},
         dict(base, chunk_indices=None, DK=dk, BK=mt["BK_inv"], PK=mt["PREC"], PS=mt["PS"]), mt["warps_inv"]),
        (_wy_fwd, {**io("k", "v", "beta"), **acc("Tm", "W", "U"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKW"], BV=mt["BVW"], PS=mt["PS"]), mt["warps_wy"]),
    ] if use_delta else []
    entries = wy + [
        (_fwd_state, {**fwd_state_io, **ints},
         dict(base, **dl, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], USE_H0=True, STORE_HT=True, PS=mt["PS"],
              **({"v": None, "beta": None} if use_delta else {})), mt["warps_state"]),
        (_fwd_o, {**io("q", "k"), **acc("VN", "Hs"), **io("o"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_o"]),
        (_bwd_dv_local, {**io("q", "k", "do"), **acc("dVN"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_dv_local"]),
        (_bwd_state, {**io("q", "k", "do"), **acc(*(("W",) if use_delta else ()), "dht", "dHs", "dVN", "dh0"), **ints},
         dict(base, **dl, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], USE_DHT=True, STORE_DH0=True, PS=mt["PS"]),
         mt["warps_state"]),
        (_bwd_dqk, {**io("q", "k", "do"), **io_gk("dq"),
                    **acc("VN", "dVN", "Hs", "dHs", "dk_part", *(("dw",) if use_delta else ())), **ints},
         dict(base, **dl, chunk_indices=None, DK=dk, DV=dv, BK=mt["BK_dqk"], BV=mt["BV_dqk"], PREC=mt["PREC"],
              PS=mt["PS"], NKD=nkd), mt["warps_dqk"]),
    ]
    if use_delta:
        entries.append(
            (_bwd_wy, {**io("k", "v", "beta", "dv", "dbeta"), **io_gk("dk"), **acc("Tm", "dVN", "dk_part", "dw"),
                       **ints},
             dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BK_bwd_wy"], BV=mt["BV_bwd_wy"], PREC=mt["PREC"],
                  PS=mt["PS"], NKD=nkd, STAGE_DL=mt["stage_dl"]), mt["warps_bwd_wy"]))
    else:
        entries.append(
            (_bwd_beta, {**io("v", "beta", "dk", "dv", "dbeta"), **acc("dVN", "dk_part"), **ints},
             dict(C=C, IS_VARLEN=False, ACC=tl.float32, USE_G=use_g, cu_seqlens=None, chunk_offsets=None,
                  chunk_indices=None, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], NKD=nkd), mt["warps_beta"]))
    if use_gk:
        gk = dict(C=C, IS_VARLEN=False, ACC=tl.float32, cu_seqlens=None, chunk_offsets=None, chunk_indices=None,
                  DK=dk, BK=mt["BKG"])
        entries += [
            (_gk_cumsum, {**acc("g", "gam"), **ints}, gk, mt["warps_gk"]),
            (_gk_scores, {**io("q", "k"), **acc("g", "Aqk", "Akk"), **ints},
             dict(gk, PREC=mt["PREC"], EMU=False), mt["warps_gk"]),
            (_gk_bwd_intra, {**io("q", "k", "dq", "dk"), **acc("g", "dAqk", "dAkk", "dq_part", "dk_part",
                                                               "dg_part", "dg"), **ints},
             dict(gk, PS=mt["PS"], EMU=False), mt["warps_gk"]),
        ]
    from kernels.compile_report import arg_names

    out = []
    for fn, sig, cex, warps in entries:
        names = arg_names(fn)
        present = [n for n in ptr_on if n in names and n not in sig]
        sig = {**sig, **{n: "*fp32" for n in present if ptr_on[n]}}
        cex = {**cex, **{n: None for n in present if not ptr_on[n]}}
        if varlen:   # packed batches pass the offsets and chunk tables (int32) that are None above
            tables = [n for n in ("cu_seqlens", "chunk_offsets", "chunk_indices") if n in cex]
            sig = {**sig, **{n: "*i32" for n in tables}}
            cex = {n: v for n, v in cex.items() if n not in tables} | {"IS_VARLEN": True}
        # every argument in the kernel's order (the report maps names, but a reader compares them)
        sig = {n: sig[n] for n in names if n in sig}
        cfg = (f"{'' if use_delta else 'NO_DELTA '}{'USE_G ' if use_g else ''}{'USE_GK ' if use_gk else ''}{dt} "
               f"dk={dk} dv={dv} C={C}{' varlen' if varlen else ''} sm_{arch}")
        out.append(dict(name=f"{fn.__name__}[{cfg}]", kernel=fn, config=cfg, signature=sig,
                        constexprs=cex, num_warps=warps, num_stages=mt["stages"], archs=(arch,)))
    return out
