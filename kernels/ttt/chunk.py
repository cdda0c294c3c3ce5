r"""TTT-Linear dual form in Triton, forward and backward (Sun et al. 2024), with the inner
LayerNorm and its L2-loss gradient fused into the kernel.

One program per (batch, head) walks the full mini-batches of b tokens in order, b1 [1, d] in
registers and W1 [d, d] in global memory (see Registers below). For a mini-batch with rows K, Q, V ∈ R^{b×d}, per-token η ∈ R^b,
τ = token_idx ∈ R^b and W_0 = (W1, b1) at its start (notation of ``torch_chunk.py``):

    Z = K W1 + b1,   Γ = ∂/∂Z ½‖LN_γβ(Z) − (V − K)‖²                    (row by row)
    M = tril(E ⊙ (Q Kᵀ + 1)),   E_ij = τ_i η_j
    Z̄ = Q W1 + b1 − M Γ,        out = Q + LN_γβ(Z̄)
    W1 ← W1 − τ_{b−1} Kᵀ (η ⊙ Γ),   b1 ← b1 − τ_{b−1} Σ_j η_j Γ_j

(M Γ = (E ⊙ tril(Q Kᵀ)) Γ + tril(E) Γ, the two dual-form terms in one b×b product.)

The forward stores W1, b1 at the start of every mini-batch (d² + d numbers per mini-batch and
head). The backward is two kernels. ``_ttt_linear_bwd_mb_kernel`` (one program per (batch, head,
mini-batch), all in parallel) recomputes Z, Γ, M, Z̄ from the stored start weights and
back-propagates out through Z̄ and M — everything that does not depend on the gradient carried
from later mini-batches: ∂XQ, and the first parts of ∂XK, ∂η, ∂τ, ∂γ, ∂β and ∂Γ, with ∂Z̄, go to
global memory. ``_ttt_linear_bwd_kernel`` then walks the mini-batches in reverse, recomputes Z and Γ,
and carries (dW1, db1), the gradient with respect to the weights at the end of the current
mini-batch; through the update, dW1_start = dW1_end + Qᵀ dZ̄ + Kᵀ dZ (dZ from differentiating Γ,
i.e. the second derivative of the LayerNorm-fused loss).

Coverage of the kernel: full mini-batches that start at a mini-batch boundary (pos = 0), any
b ≤ 64 and any head dim d (b and d padded to powers of two ≥ 16 with masks; padded rows carry
τ = η = 0, so they reach no real row; b ∈ {16, 32, 64} need no row padding). The public
``ttt_linear_triton`` covers everything else exactly with the PyTorch dual form, chained through
autograd: the tokens that complete a mini-batch begun by ``initial_state`` (pos > 0) run before
the kernel, a trailing partial mini-batch (T − pos not a multiple of b) runs after it. Every
gradient (XQ, XK, XV, η, token_idx, ln_weight, ln_bias, W1, b1 and the tensors of
``initial_state``) flows through both parts.

Precision (``_precision``, ``_dot``): everything is carried and accumulated in float32 (float64
for float64 inputs); the tl.dot operands are bfloat16 for bfloat16/float16 inputs (bf16 tensor-core
MMA, fp32 accumulator), 3×TF32 for float32 inputs (tensor cores, error within a few fp32 ulps:
float32 tolerances unchanged; the interpreter multiplies exactly, only a GPU checks it), exact for float64.
The bf16 operands round every product's inputs to 8 mantissa bits: the bfloat16 tests' 3e-2 of
each tensor's scale, set for bfloat16 inputs and outputs, covers it unchanged. For bfloat16
inputs the per-mini-batch start weights that the backward re-reads are stored in bfloat16 — they
enter only tl.dot there, whose operands are rounded to bfloat16 anyway. Outputs come back in the
input dtype, the state in float32 (float64 for float64 inputs), as in ``torch_chunk.py``.

Registers (``python -m kernels.compile_report --op ttt``): W1 (forward) and dW1 (backward) are
not carried in registers from one mini-batch to the next. They live in two global slots per
(batch, head): the weights of mini-batch n in slot n % 2, read where a product needs them, the
update written to the other slot at the end of the mini-batch, one barrier per mini-batch. The
backward reads W1ᵀ from the stored start weights as a transposed tile. The forward builds its
index, mask and pointer tensors inside the loop (``_loop_index``) instead of letting them be
hoisted out of it. Triton gives every tl.dot of a kernel the warp layout of the last one, so the
loops end with a [b, d] product; warps per GPU family in ``_LINEAR_WARPS``.

``ttt_mlp_triton`` (TTT-MLP, same structure and coverage) follows below the TTT-Linear part.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import INTERPRET_ARCH, check_triton_device, device_arch, is_interpreting
from kernels.ttt.torch_chunk import LN_EPS, acc_dtype, make_state, ttt_linear_chunk, ttt_mlp_chunk

#: b×b and b×d tiles live in registers; beyond 64 they spill
_MAX_MB = 64


# ---- in-kernel pieces -------------------------------------------------------------------------
@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with a float32 (float64) accumulator. PREC = "bf16": both operands rounded to
    bfloat16 (the tensor cores' bf16 MMA; for bfloat16/float16 inputs); "tf32x3": float32
    operands split into three TF32 products (tensor cores, error close to float32's; for float32
    inputs); "ieee": exact products on the CUDA cores (float64 inputs)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif PREC == "bf16_emulated":
        # under the interpreter (Triton 3.9) a tl.dot of bfloat16 tiles returns garbage: the same
        # operand rounding, with the (exact) products accumulated in float32
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _ln_stats(z, cmask, D: tl.constexpr, eps):
    """Centered, normalized rows x̂ (zero in padded columns) and 1/σ of z [BT, BD]."""
    mu = tl.sum(z, axis=1) / D
    zc = tl.where(cmask[None, :], z - mu[:, None], 0.0)
    var = tl.sum(zc * zc, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    return zc * rstd[:, None], rstd


@triton.jit
def _ln_bwd(dy_hat, x_hat, rstd, cmask, D: tl.constexpr):
    """∂/∂z given ∂/∂x̂ (the LayerNorm Jacobian applied row by row)."""
    m1 = tl.sum(dy_hat, axis=1) / D
    m2 = tl.sum(dy_hat * x_hat, axis=1) / D
    dz = (dy_hat - m1[:, None] - x_hat * m2[:, None]) * rstd[:, None]
    return tl.where(cmask[None, :], dz, 0.0)


@triton.jit
def _loop_index(n, NMB, BT: tl.constexpr, BD: tl.constexpr):
    """Row and column indices of mini-batch ``n``'s tiles, tied to the loop index: ``n // NMB`` is 0
    for every n in range(NMB), which the compiler cannot prove, so the [b, d] and [d, d] index,
    mask, pointer and broadcast tensors built from these are computed in the loop where they are
    used and die there, instead of being hoisted out of the loop and held in registers through
    every mini-batch (tens of registers per thread each)."""
    z = tl.multiple_of(n // NMB, 16)
    return tl.arange(0, BT) + z, tl.arange(0, BD) + z


@triton.jit
def _mini_batch_grad(k, v, WP, woff, wmask, bb, gamma, beta, cmask, D: tl.constexpr, eps, PREC: tl.constexpr):
    """Z = K W1 + b1 and Γ of one mini-batch, with the LayerNorm pieces the backward reuses: x̂, 1/σ
    of Z and the residual r = γ x̂ + β − (V − K) (ĝ = γ r). W1 is read from global memory
    (``WP + woff``) where the product needs it, not held in registers through the mini-batch."""
    Z = _dot(k, tl.load(WP + woff, mask=wmask, other=0.0), PREC) + bb[None, :]
    xh, rstd = _ln_stats(Z, cmask, D, eps)
    r = gamma[None, :] * xh + beta[None, :] - (v - k)
    G = _ln_bwd(r * gamma[None, :], xh, rstd, cmask, D)                   # Γ
    return xh, rstd, r, G


@triton.jit
def _mini_batch_out(q, k, e, tau, G, WP, woff, wmask, bb, cmask, tril, D: tl.constexpr, eps, PREC: tl.constexpr):
    """M, Z̄ = Q W1 + b1 − M Γ and its LayerNorm statistics, given Γ."""
    A = _dot(q, tl.trans(k), PREC)
    Ev = tau[:, None] * e[None, :]
    M = tl.where(tril, Ev * (A + 1.0), 0.0)
    Zb = _dot(q, tl.load(WP + woff, mask=wmask, other=0.0), PREC) + bb[None, :] - _dot(M, G, PREC)
    xhb, rstdb = _ln_stats(Zb, cmask, D, eps)
    return A, Ev, M, xhb, rstdb


@triton.jit
def _ttt_linear_fwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, W0, B0, OUT, WS, BS, WF, BF, WT,
                           T, NMB, H, eps,
                           D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                           SAVE: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)                      # = b_idx * H + h_idx
    h = pid % H
    cdt = W0.dtype.element_ty
    cols = tl.arange(0, BD)
    cmask = cols < D
    wmask = cmask[:, None] & cmask[None, :]
    woff = cols[:, None] * D + cols[None, :]
    # W1 lives in global memory, not in registers: the weights at the start of mini-batch n in
    # slot n % 2 of WT [2, d, d], read where a product needs them; the update is written to the
    # other slot at the end of the mini-batch, one barrier per mini-batch
    WT = WT + pid * 2 * D * D
    tl.store(WT + woff, tl.load(W0 + pid * D * D + woff, mask=wmask, other=0.0).to(cdt), mask=wmask)
    bb = tl.load(B0 + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)
    tl.debug_barrier()

    for n in range(NMB):
        rows, cols = _loop_index(n, NMB, BT, BD)
        cmask = cols < D
        rmask = rows < MB
        wmask = cmask[:, None] & cmask[None, :]
        xmask = rmask[:, None] & cmask[None, :]
        tril = rows[None, :] <= rows[:, None]
        woff = cols[:, None] * D + cols[None, :]
        WP = WT + (n % 2) * D * D
        gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
        beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
        # padded rows (MB < BT) get τ = η = 0, so they enter no product that reaches a real row
        tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
        if SAVE:
            tl.store(WS + (pid * NMB + n) * D * D + woff, tl.load(WP + woff, mask=wmask, other=0.0), mask=wmask)
            tl.store(BS + (pid * NMB + n) * D + cols, bb, mask=cmask)
        t_off = n * MB + rows
        xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
        xh, rstd, r, G = _mini_batch_grad(k, v, WP, woff, wmask, bb, gamma, beta, cmask, D, eps, PREC)
        q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
        # the update's product first (written to the other slot at the end): Triton gives every
        # tl.dot of the loop the warp layout it picks for the last one, which should be a [b, d] one
        eG = e[:, None] * G
        upd = _dot(tl.trans(k), eG, PREC)
        bb_next = bb - tau_last * tl.sum(eG, axis=0)
        A, Ev, M, xhb, rstdb = _mini_batch_out(q, k, e, tau, G, WP, woff, wmask, bb, cmask, tril, D, eps, PREC)
        out = q + gamma[None, :] * xhb + beta[None, :]
        tl.store(OUT + xoff, out.to(OUT.dtype.element_ty), mask=xmask)
        tl.store(WT + ((n + 1) % 2) * D * D + woff, tl.load(WP + woff, mask=wmask, other=0.0) - tau_last * upd,
                 mask=wmask)
        bb = bb_next
        tl.debug_barrier()                      # the next mini-batch reads the slot written above

    cols = tl.arange(0, BD)
    cmask = cols < D
    wmask = cmask[:, None] & cmask[None, :]
    woff = cols[:, None] * D + cols[None, :]
    tl.store(WF + pid * D * D + woff, tl.load(WT + (NMB % 2) * D * D + woff, mask=wmask, other=0.0), mask=wmask)
    tl.store(BF + pid * D + cols, bb, mask=cmask)


@triton.jit
def _ttt_linear_bwd_mb_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, WS, BS, DOUT,
                              DXQ, DKP, DEP, DG0, DZB, DTAUP, DLNWP, DLNBP,
                              T, NMB, H, eps,
                              D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                              PREC: tl.constexpr):
    """The part of the backward local to one mini-batch (no dependence on the carried dW1, db1):
    one program per (batch·head, mini-batch), all in parallel. Recomputes the forward from the
    stored start weights, back-propagates out through Z̄ and M, and stores ∂XQ (final), the parts
    of ∂XK, ∂η, ∂Γ that do not involve the carry, ∂Z̄, and per-mini-batch sums for ∂τ, ∂γ, ∂β."""
    pid = tl.program_id(0)
    n = tl.program_id(1)
    h = pid % H
    cdt = DKP.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    cmask = cols < D
    rmask = rows < MB
    wmask = cmask[:, None] & cmask[None, :]
    xmask = rmask[:, None] & cmask[None, :]
    tril = rows[None, :] <= rows[:, None]
    woff = cols[:, None] * D + cols[None, :]
    wtoff = cols[:, None] + cols[None, :] * D          # the transposed tile
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    # padded rows (MB < BT) get τ = η = 0, so they enter no product that reaches a real row
    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    WP = WS + (pid * NMB + n) * D * D
    bb = tl.load(BS + (pid * NMB + n) * D + cols, mask=cmask, other=0.0).to(cdt)
    t_off = n * MB + rows
    xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
    q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
    k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
    v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
    e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
    do = tl.load(DOUT + xoff, mask=xmask, other=0.0).to(cdt)
    xh, rstd, r, G = _mini_batch_grad(k, v, WP, woff, wmask, bb, gamma, beta, cmask, D, eps, PREC)
    A, Ev, M, xhb, rstdb = _mini_batch_out(q, k, e, tau, G, WP, woff, wmask, bb, cmask, tril, D, eps, PREC)

    # out = Q + γ x̂(Z̄) + β
    tl.store(DLNWP + (pid * NMB + n) * D + cols, tl.sum(do * xhb, axis=0), mask=cmask)
    tl.store(DLNBP + (pid * NMB + n) * D + cols, tl.sum(do, axis=0), mask=cmask)
    dZb = _ln_bwd(do * gamma[None, :], xhb, rstdb, cmask, D)
    tl.store(DZB + xoff, dZb, mask=xmask)
    # Z̄ = Q W1 + b1 − M Γ
    dM = tl.where(tril, -_dot(dZb, tl.trans(G), PREC), 0.0)
    tl.store(DG0 + xoff, -_dot(tl.trans(M), dZb, PREC), mask=xmask)
    # M = tril(E ⊙ (A + 1)), E_ij = τ_i η_j, A = Q Kᵀ
    dE = dM * (A + 1.0)
    dA = dM * Ev
    tl.store(DKP + xoff, _dot(tl.trans(dA), q, PREC), mask=xmask)
    tl.store(DEP + pid * T + t_off, tl.sum(dE * tau[:, None], axis=0), mask=rmask)
    tl.store(DTAUP + (pid * NMB + n) * MB + rows, tl.sum(dE * e[None, :], axis=1), mask=rmask)
    dq = do + _dot(dA, k, PREC) + _dot(dZb, tl.load(WP + wtoff, mask=wmask, other=0.0), PREC)
    tl.store(DXQ + xoff, dq.to(DXQ.dtype.element_ty), mask=xmask)


@triton.jit
def _ttt_linear_bwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, WS, BS, DWF, DBF, DKP, DEP, DG0, DZB,
                           DXK, DXV, DETA, DTAU, DLNW, DLNB, DW0, DB0, DWT,
                           T, NMB, H, eps,
                           D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                           PREC: tl.constexpr):
    """The part of the backward that carries (dW1, db1) from the last mini-batch to the first:
    one program per batch·head, after ``_ttt_linear_bwd_mb_kernel``, whose partial ∂XK, ∂η, ∂Γ
    and ∂Z̄ it completes through the update W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ) and Γ's dependence on Z."""
    pid = tl.program_id(0)
    h = pid % H
    cdt = DW0.dtype.element_ty
    # index tensors built once, outside the loop (unlike the forward's ``_loop_index``: here that
    # takes fewer registers, by the compile gate)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    cmask = cols < D
    rmask = rows < MB
    wmask = cmask[:, None] & cmask[None, :]
    xmask = rmask[:, None] & cmask[None, :]
    woff = cols[:, None] * D + cols[None, :]
    wtoff = cols[:, None] + cols[None, :] * D          # the transposed tile
    tau_last = tl.load(TAU + MB - 1).to(cdt)

    # gradients with respect to the weights at the END of the current mini-batch; dW1 lives in the
    # two slots of DWT [2, d, d] (global memory), not in registers: read in slot i % 2 where a
    # product needs it, the update written to the other slot at the end of the mini-batch
    DWT = DWT + pid * 2 * D * D
    tl.store(DWT + woff, tl.load(DWF + pid * D * D + woff, mask=wmask, other=0.0).to(cdt), mask=wmask)
    dbb = tl.load(DBF + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    dgamma = tl.zeros([BD], dtype=cdt)
    dbeta = tl.zeros([BD], dtype=cdt)
    dtau = tl.zeros([BT], dtype=cdt)
    tl.debug_barrier()

    for i in range(NMB):
        n = NMB - 1 - i
        dWP = DWT + (i % 2) * D * D
        gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
        beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
        WP = WS + (pid * NMB + n) * D * D
        bb = tl.load(BS + (pid * NMB + n) * D + cols, mask=cmask, other=0.0).to(cdt)
        t_off = n * MB + rows
        xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
        xh, rstd, r, G = _mini_batch_grad(k, v, WP, woff, wmask, bb, gamma, beta, cmask, D, eps, PREC)

        # end-of-mini-batch update W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ), b1' = b1 − τ_{b−1} Σ η Γ
        dW = tl.load(dWP + woff, mask=wmask, other=0.0)   # one read of dW1 for both products
        P = _dot(k, dW, PREC) + dbb[None, :]
        dkW = -tau_last * _dot(e[:, None] * G, tl.trans(dW), PREC)
        GP = tl.sum(G * P, axis=1)
        dG = tl.load(DG0 + xoff, mask=xmask, other=0.0).to(cdt) - tau_last * e[:, None] * P
        de = tl.load(DEP + pid * T + t_off, mask=rmask, other=0.0).to(cdt) - tau_last * GP
        tl.store(DETA + pid * T + t_off, de.to(DETA.dtype.element_ty), mask=rmask)
        dtau += tl.where(rows == MB - 1, -tl.sum(e * GP, axis=0), 0.0)
        # Γ = (ĝ − mean ĝ − x̂ mean(ĝ x̂)) / σ with ĝ = γ r, r = γ x̂ + β − (V − K), x̂, σ of Z
        dgh = _ln_bwd(dG, xh, rstd, cmask, D)
        c2 = tl.sum(gamma[None, :] * r * xh, axis=1) / D
        mux = tl.sum(dG * xh, axis=1) / D
        dxh = (-(dG * c2[:, None] + gamma[None, :] * r * mux[:, None]) * rstd[:, None]
               + gamma[None, :] * gamma[None, :] * dgh)
        dsig = -tl.sum(dG * G, axis=1) * rstd
        dgamma += tl.sum(dgh * (gamma[None, :] * xh + r), axis=0)
        dbeta += tl.sum(dgh * gamma[None, :], axis=0)
        dtgt = -gamma[None, :] * dgh
        tl.store(DXV + xoff, dtgt.to(DXV.dtype.element_ty), mask=xmask)          # target = V − K
        dZ = _ln_bwd(dxh, xh, rstd, cmask, D) + tl.where(cmask[None, :], dsig[:, None] * xh / D, 0.0)
        # Z = K W1 + b1, Z̄ = Q W1 + b1 − M Γ: dW1 += Qᵀ dZ̄ + Kᵀ dZ (before the products below, so
        # that the loop's last tl.dot, whose warp layout every product takes, is a [b, d] one)
        dZb = tl.load(DZB + xoff, mask=xmask, other=0.0).to(cdt)
        q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
        upd = _dot(tl.trans(q), dZb, PREC) + _dot(tl.trans(k), dZ, PREC)
        dbb += tl.sum(dZb, axis=0) + tl.sum(dZ, axis=0)
        # ∂K: the per-mini-batch part, through the update (dW1 of the end of this mini-batch, still
        # in slot i % 2), through Z (W1ᵀ read from the stored start weights as a transposed tile)
        # and through the target
        dk = (tl.load(DKP + xoff, mask=xmask, other=0.0).to(cdt) + dkW
              + _dot(dZ, tl.load(WP + wtoff, mask=wmask, other=0.0), PREC) - dtgt)
        tl.store(DXK + xoff, dk.to(DXK.dtype.element_ty), mask=xmask)
        tl.store(DWT + ((i + 1) % 2) * D * D + woff, tl.load(dWP + woff, mask=wmask, other=0.0) + upd, mask=wmask)
        tl.debug_barrier()                      # the next mini-batch reads the slot written above

    tl.store(DW0 + pid * D * D + woff, tl.load(DWT + (NMB % 2) * D * D + woff, mask=wmask, other=0.0), mask=wmask)
    tl.store(DB0 + pid * D + cols, dbb, mask=cmask)
    tl.store(DLNW + pid * D + cols, dgamma, mask=cmask)
    tl.store(DLNB + pid * D + cols, dbeta, mask=cmask)
    tl.store(DTAU + pid * MB + rows, dtau, mask=rmask)


# ---- autograd -----------------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` mode for inputs of ``dtype`` (see ``_dot``)."""
    if dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return "tf32x3"
    return "bf16_emulated" if is_interpreting() else "bf16"


#: num_warps of the TTT-Linear kernels per GPU family (``device_arch``): (arch, kernel, bf16
#: operands, BD, BT) -> warps, kernel "fwd", "bwd_mb" (``_ttt_linear_bwd_mb_kernel``) or "bwd".
#: Triton gives every tl.dot of a kernel the warp layout it picks for the last one, which for
#: chained products puts all warps along one dimension of the [b, d] tile (rows when b ≥ d,
#: columns otherwise): at b = 16 the warps split the columns, and more warps hold less of each
#: tile (the forward at d = 64 fits 4); at b = d = 64 they split the 64 rows (16 per warp at 4
#: warps; 8 duplicate the tiles of an sm_80 MMA, whose warps take 16 rows each). Checked by
#: ``python -m kernels.compile_report --op ttt``; b = 64 and d = 128 still spill at 4 and 8.
_LINEAR_WARPS = {
    (90, "fwd", True, 64, 16): 4, (80, "fwd", True, 64, 16): 4,
}


def _launch_cfg(d: int, b: int, kernel: str = "fwd", half: bool = True, arch: int = INTERPRET_ARCH):
    """Padded tile sizes (tl.dot needs every block dim ≥ 16) and launch options of TTT-Linear
    ``kernel`` ("fwd", "bwd_mb", "bwd") for GPU family ``arch`` (90 or 80, ``device_arch``; ``half``:
    bf16 operands, False for 3×TF32 with float32 inputs). num_warps from ``_LINEAR_WARPS``, 8 where
    it names none (W1 and dW1 live in global memory, the [b, d] and [b, b] tiles in registers)."""
    if kernel not in ("fwd", "bwd_mb", "bwd"):
        raise ValueError(f"_launch_cfg: unknown TTT-Linear kernel {kernel!r}")
    BD = max(16, triton.next_power_of_2(d))
    BT = max(16, triton.next_power_of_2(b))
    if is_interpreting():
        return BD, BT, {}
    warps = _LINEAR_WARPS.get((arch, kernel, half, BD, BT), 8)
    return BD, BT, {"num_warps": warps, "num_stages": 1}


# The ops are PyTorch custom ops (torch.library): torch.compile (model.compile) captures each as one
# opaque node of the block's graph, with shapes from the fake implementations and the backward
# registered below, instead of tracing the Triton launches or breaking the graph.
def _linear_start_weights(XQ, NMB: int, save: bool):
    """Empty buffers for the per-mini-batch start weights (WS, BS) the forward stores."""
    B, H, _, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    # the stored start weights enter the backward only as tl.dot operands: with bf16 operands
    # they are stored in bfloat16 (the same rounding the forward's products saw; half the
    # registers and traffic)
    ws_dt = torch.bfloat16 if _precision(XQ.dtype).startswith("bf16") else cdt
    return (XQ.new_empty(B, H, NMB if save else 1, d, d, dtype=ws_dt),
            XQ.new_empty(B, H, NMB if save else 1, d, dtype=cdt))


@torch.library.custom_op("kernels::ttt_linear_fwd", mutates_args=())
def _linear_fwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                   ln_w: torch.Tensor, ln_b: torch.Tensor, W0: torch.Tensor, b0: torch.Tensor,
                   mini_batch_size: int, save: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full mini-batches from a boundary: (XQ, XK, XV, η, τ, γ, β, W1_0 [B,H,d,d], b1_0 [B,H,1,d])
    → (out [B,H,T,d], W1_end, b1_end, and the start weights WS, BS the backward reads, stored
    when ``save``)."""
    B, H, T, d = XQ.shape
    bsz = mini_batch_size
    NMB = T // bsz
    cdt = acc_dtype(XQ.dtype)
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    W0c = W0.to(cdt).contiguous()
    b0c = b0.to(cdt).contiguous()
    out = torch.empty_like(XQ)
    prec = _precision(XQ.dtype)
    WS, BS = _linear_start_weights(XQ, NMB, save)
    WF = torch.empty(B, H, d, d, dtype=cdt, device=XQ.device)
    BF = torch.empty(B, H, 1, d, dtype=cdt, device=XQ.device)
    WT = torch.empty(B, H, 2, d, d, dtype=cdt, device=XQ.device)     # the kernel's two W1 slots
    BD, BT, kw = _launch_cfg(d, bsz, half=XQ.dtype in (torch.bfloat16, torch.float16), arch=device_arch(XQ.device))
    _ttt_linear_fwd_kernel[(B * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, W0c, b0c, out, WS, BS, WF, BF, WT,
        T, NMB, H, LN_EPS, D=d, BD=BD, MB=bsz, BT=BT, SAVE=save, PREC=prec, **kw)
    return out, WF, BF, WS, BS


@_linear_fwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, W0, b0, mini_batch_size, save):
    B, H, T, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    WS, BS = _linear_start_weights(XQ, T // mini_batch_size, save)
    return torch.empty_like(XQ), XQ.new_empty(B, H, d, d, dtype=cdt), XQ.new_empty(B, H, 1, d, dtype=cdt), WS, BS


@torch.library.custom_op("kernels::ttt_linear_bwd", mutates_args=())
def _linear_bwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                   ln_w: torch.Tensor, ln_b: torch.Tensor, WS: torch.Tensor, BS: torch.Tensor,
                   dout: Optional[torch.Tensor], dWF: Optional[torch.Tensor], dBF: Optional[torch.Tensor],
                   mini_batch_size: int, W_dt: torch.dtype, b_dt: torch.dtype) -> List[torch.Tensor]:
    """Gradients of the nine tensor inputs of ``_linear_fwd_op``."""
    bsz, tau_dt, lw_dt, lb_dt = mini_batch_size, tau.dtype, ln_w.dtype, ln_b.dtype
    cdt = BS.dtype
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    B, H, T, d = XQ.shape
    NMB = T // bsz
    cdt = BS.dtype
    dev = XQ.device
    dout = torch.zeros_like(XQ) if dout is None else dout.contiguous()
    dWF = torch.zeros(B, H, d, d, dtype=cdt, device=dev) if dWF is None else dWF.to(cdt).contiguous()
    dBF = torch.zeros(B, H, 1, d, dtype=cdt, device=dev) if dBF is None else dBF.to(cdt).contiguous()
    dXQ, dXK, dXV = (torch.empty_like(XQ) for _ in range(3))
    dETA = torch.empty_like(eta)
    dTAU = torch.empty(B, H, bsz, dtype=cdt, device=dev)
    dLNW = torch.empty(B, H, d, dtype=cdt, device=dev)
    dLNB = torch.empty(B, H, d, dtype=cdt, device=dev)
    dW0 = torch.empty(B, H, d, d, dtype=cdt, device=dev)
    dB0 = torch.empty(B, H, 1, d, dtype=cdt, device=dev)
    dWT = torch.empty(B, H, 2, d, d, dtype=cdt, device=dev)           # the second kernel's two dW1 slots
    # what the per-mini-batch kernel hands to the carrying one (float32; float64 for float64 inputs)
    dKP, dG0, dZB = (torch.empty(B, H, T, d, dtype=cdt, device=dev) for _ in range(3))
    dEP = torch.empty(B, H, T, dtype=cdt, device=dev)
    dTAUP = torch.empty(B, H, NMB, bsz, dtype=cdt, device=dev)
    dLNWP = torch.empty(B, H, NMB, d, dtype=cdt, device=dev)
    dLNBP = torch.empty(B, H, NMB, d, dtype=cdt, device=dev)
    half = XQ.dtype in (torch.bfloat16, torch.float16)
    arch, prec = device_arch(XQ.device), _precision(XQ.dtype)
    BD, BT, kw = _launch_cfg(d, bsz, "bwd_mb", half=half, arch=arch)
    _ttt_linear_bwd_mb_kernel[(B * H, NMB)](
        XQ, XK, XV, eta, tau_c, lw, lb, WS, BS, dout,
        dXQ, dKP, dEP, dG0, dZB, dTAUP, dLNWP, dLNBP,
        T, NMB, H, LN_EPS, D=d, BD=BD, MB=bsz, BT=BT, PREC=prec, **kw)
    BD, BT, kw = _launch_cfg(d, bsz, "bwd", half=half, arch=arch)
    _ttt_linear_bwd_kernel[(B * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, WS, BS, dWF, dBF, dKP, dEP, dG0, dZB,
        dXK, dXV, dETA, dTAU, dLNW, dLNB, dW0, dB0, dWT,
        T, NMB, H, LN_EPS, D=d, BD=BD, MB=bsz, BT=BT, PREC=prec, **kw)
    return [dXQ, dXK, dXV, dETA, (dTAU.sum((0, 1)) + dTAUP.sum((0, 1, 2))).to(tau_dt),
            (dLNW.sum(0) + dLNWP.sum((0, 2))).to(lw_dt), (dLNB.sum(0) + dLNBP.sum((0, 2))).to(lb_dt),
            dW0.to(W_dt), dB0.to(b_dt)]


@_linear_bwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, WS, BS, dout, dWF, dBF, mini_batch_size, W_dt, b_dt):
    B, H, T, d = XQ.shape
    return [torch.empty_like(XQ), torch.empty_like(XK), torch.empty_like(XV), torch.empty_like(eta),
            torch.empty_like(tau), torch.empty_like(ln_w), torch.empty_like(ln_b),
            XQ.new_empty(B, H, d, d, dtype=W_dt), XQ.new_empty(B, H, 1, d, dtype=b_dt)]


def _linear_setup_context(ctx, inputs, output):
    XQ, XK, XV, eta, tau, ln_w, ln_b, W0, b0, bsz, _ = inputs
    ctx.save_for_backward(XQ, XK, XV, eta, tau, ln_w, ln_b, output[3], output[4])
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.meta = (bsz, W0.dtype, b0.dtype)


def _linear_backward_rule(ctx, dout, dWF, dBF, *_):
    return (*_linear_bwd_op(*ctx.saved_tensors, dout, dWF, dBF, *ctx.meta), None, None)


_linear_fwd_op.register_autograd(_linear_backward_rule, setup_context=_linear_setup_context)


# ---- public -------------------------------------------------------------------------------------
def ttt_linear_triton(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size=16,
                      initial_state: Optional[dict] = None, output_final_state: bool = False
                      ) -> Tuple[torch.Tensor, Optional[dict]]:
    """Same contract as ``kernels.ttt.ttt_linear``. The full mini-batches from a boundary run in
    the Triton kernel; the head (completing a mini-batch begun in ``initial_state``) and the
    tail (a trailing partial mini-batch) run in the PyTorch dual form."""
    if not 1 <= mini_batch_size <= _MAX_MB:
        raise ValueError(f"ttt_linear_triton: mini_batch_size must be in [1, {_MAX_MB}], got {mini_batch_size}")
    check_triton_device("ttt_linear_triton", XQ, XK, XV, eta)
    B, H, T, d = XQ.shape
    bsz = mini_batch_size
    dt = acc_dtype(XQ.dtype)
    st = make_state({"W1": W1, "b1": b1}, B, dt, initial_state)
    pos = st["pos"]
    outs, t = [], 0

    def torch_part(t0, t1, st):
        return ttt_linear_chunk(XQ[:, :, t0:t1], XK[:, :, t0:t1], XV[:, :, t0:t1], eta[:, :, t0:t1],
                                token_idx, ln_weight, ln_bias, W1, b1, bsz, st, True)

    if pos > 0 and T > 0:
        t = min(bsz - pos, T)
        o, st = torch_part(0, t, st)
        outs.append(o)
    n_full = (T - t) // bsz * bsz
    if n_full > 0:
        sl = slice(t, t + n_full)
        ins = [t.contiguous() for t in (XQ[:, :, sl], XK[:, :, sl], XV[:, :, sl], eta[:, :, sl], token_idx,
                                         ln_weight, ln_bias, st["W1"], st["b1"])]
        # the per-mini-batch start weights serve only the backward
        save = torch.is_grad_enabled() and any(t.requires_grad for t in ins)
        o, Wf, bf = _linear_fwd_op(*ins, bsz, save)[:3]
        outs.append(o)
        # the kernel starts at a boundary, where the carried sums are zero by construction
        st = {"W1": Wf, "b1": bf, "grad_W1": torch.zeros_like(Wf), "grad_b1": torch.zeros_like(bf), "pos": 0}
        t += n_full
    if t < T:
        o, st = torch_part(t, T, st)
        outs.append(o)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else (outs[0] if outs else XQ.clone())
    return out, (st if output_final_state else None)


# =================================================================================================
# TTT-MLP (math and coverage in ttt_mlp_triton's docstring)
# =================================================================================================

@triton.jit
def _gelu_tanh3(x):
    """GELU_tanh(x), GELU'(x) and GELU''(x) (c = √(2/π), a = 0.044715, u = c(x + a x³))."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    s = 1.0 - t * t
    g = 0.5 * x * (1.0 + t)
    dg = 0.5 * (1.0 + t) + 0.5 * x * s * du
    ddg = s * (du - x * t * du * du + 3.0 * 0.7978845608028654 * 0.044715 * x * x)
    return g, dg, ddg


@triton.jit
def _ln_l2_bwd_bwd(dG, G, gh, xh, rstd, gamma, beta, tgt, cmask, D: tl.constexpr):
    """Backward of Γ = ∂/∂Z ½‖γ x̂ + β − tgt‖² (x̂, σ of Z): given ∂/∂Γ, return ∂/∂Z, ∂/∂tgt and
    the row-summed contributions to ∂/∂γ, ∂/∂β (ĝ = γ(γ x̂ + β − tgt))."""
    dgh = _ln_bwd(dG, xh, rstd, cmask, D)
    c2 = tl.sum(gh * xh, axis=1) / D
    mux = tl.sum(dG * xh, axis=1) / D
    dxh = -(dG * c2[:, None] + gh * mux[:, None]) * rstd[:, None] + gamma[None, :] * gamma[None, :] * dgh
    dsig = -tl.sum(dG * G, axis=1) * rstd
    dgamma = tl.sum(dgh * (2.0 * gamma[None, :] * xh + beta[None, :] - tgt), axis=0)
    dbeta = tl.sum(dgh * gamma[None, :], axis=0)
    dtgt = -gamma[None, :] * dgh
    dZ = _ln_bwd(dxh, xh, rstd, cmask, D) + tl.where(cmask[None, :], dsig[:, None] * xh / D, 0.0)
    return dZ, dtgt, dgamma, dbeta


@triton.jit
def _mlp_mini_batch_fwd(q, k, v, e, tau, W1, b1, W2, b2, gamma, beta, cmask, rmask, tril,
                        D: tl.constexpr, eps, PREC: tl.constexpr):
    """Everything of one TTT-MLP mini-batch that the forward and the backward both need."""
    Z1 = _dot(k, W1, PREC) + b1[None, :]
    X2, gp, gpp = _gelu_tanh3(Z1)
    # padded rows (zero k) would give X2 = GELU(b1) ≠ 0; they carry η = 0, zero them anyway
    X2 = tl.where(rmask[:, None], X2, 0.0)
    Z2 = _dot(X2, W2, PREC) + b2[None, :]
    xh, rstd = _ln_stats(Z2, cmask, D, eps)
    tgt = v - k
    gh = (gamma[None, :] * xh + beta[None, :] - tgt) * gamma[None, :]
    G2 = _ln_bwd(gh, xh, rstd, cmask, D)                                    # Γ2
    S = _dot(G2, tl.trans(W2), PREC)
    G1 = S * gp                                                             # Γ1
    Ev = tau[:, None] * e[None, :]
    A1 = _dot(q, tl.trans(k), PREC)
    M1 = tl.where(tril, Ev * (A1 + 1.0), 0.0)
    Z1b = _dot(q, W1, PREC) + b1[None, :] - _dot(M1, G1, PREC)
    X2b, gpb, _unused = _gelu_tanh3(Z1b)
    A2 = _dot(X2b, tl.trans(X2), PREC)
    M2 = tl.where(tril, Ev * (A2 + 1.0), 0.0)
    Z2b = _dot(X2b, W2, PREC) + b2[None, :] - _dot(M2, G2, PREC)
    xhb, rstdb = _ln_stats(Z2b, cmask, D, eps)
    return X2, gp, gpp, xh, rstd, tgt, gh, G2, S, G1, Ev, A1, M1, X2b, gpb, A2, M2, xhb, rstdb


@triton.jit
def _ttt_mlp_fwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, W10, B10, W20, B20, OUT,
                        W1S, B1S, W2S, B2S, W1F, B1F, W2F, B2F,
                        T, NMB, H, eps,
                        D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
                        MB: tl.constexpr, BT: tl.constexpr, SAVE: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)                      # = b_idx * H + h_idx
    h = pid % H
    cdt = W10.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    hcols = tl.arange(0, BM)
    cmask = cols < D
    hmask = hcols < M
    rmask = rows < MB
    xmask = rmask[:, None] & cmask[None, :]
    w1mask = cmask[:, None] & hmask[None, :]
    w2mask = hmask[:, None] & cmask[None, :]
    w1off = cols[:, None] * M + hcols[None, :]
    w2off = hcols[:, None] * D + cols[None, :]
    tril = rows[None, :] <= rows[:, None]

    W1 = tl.load(W10 + pid * D * M + w1off, mask=w1mask, other=0.0).to(cdt)
    b1 = tl.load(B10 + pid * M + hcols, mask=hmask, other=0.0).to(cdt)
    W2 = tl.load(W20 + pid * M * D + w2off, mask=w2mask, other=0.0).to(cdt)
    b2 = tl.load(B20 + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    # padded rows (MB < BT) get τ = η = 0, so they enter no product that reaches a real row
    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)

    for n in range(NMB):
        if SAVE:
            s = pid * NMB + n
            tl.store(W1S + s * D * M + w1off, W1, mask=w1mask)
            tl.store(B1S + s * M + hcols, b1, mask=hmask)
            tl.store(W2S + s * M * D + w2off, W2, mask=w2mask)
            tl.store(B2S + s * D + cols, b2, mask=cmask)
        t_off = n * MB + rows
        xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
        q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
        X2, gp, gpp, xh, rstd, tgt, gh, G2, S, G1, Ev, A1, M1, X2b, gpb, A2, M2, xhb, rstdb = \
            _mlp_mini_batch_fwd(q, k, v, e, tau, W1, b1, W2, b2, gamma, beta, cmask, rmask, tril, D, eps, PREC)
        out = q + gamma[None, :] * xhb + beta[None, :]
        tl.store(OUT + xoff, out.to(OUT.dtype.element_ty), mask=xmask)
        eG1 = e[:, None] * G1
        eG2 = e[:, None] * G2
        W1 = W1 - tau_last * _dot(tl.trans(k), eG1, PREC)
        b1 = b1 - tau_last * tl.sum(eG1, axis=0)
        W2 = W2 - tau_last * _dot(tl.trans(X2), eG2, PREC)
        b2 = b2 - tau_last * tl.sum(eG2, axis=0)

    tl.store(W1F + pid * D * M + w1off, W1, mask=w1mask)
    tl.store(B1F + pid * M + hcols, b1, mask=hmask)
    tl.store(W2F + pid * M * D + w2off, W2, mask=w2mask)
    tl.store(B2F + pid * D + cols, b2, mask=cmask)


@triton.jit
def _ttt_mlp_bwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, W1S, B1S, W2S, B2S, DOUT,
                        DW1F, DB1F, DW2F, DB2F,
                        DXQ, DXK, DXV, DETA, DTAU, DLNW, DLNB, DW10, DB10, DW20, DB20,
                        T, NMB, H, eps,
                        D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
                        MB: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % H
    cdt = W1S.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    hcols = tl.arange(0, BM)
    cmask = cols < D
    hmask = hcols < M
    rmask = rows < MB
    xmask = rmask[:, None] & cmask[None, :]
    w1mask = cmask[:, None] & hmask[None, :]
    w2mask = hmask[:, None] & cmask[None, :]
    w1off = cols[:, None] * M + hcols[None, :]
    w2off = hcols[:, None] * D + cols[None, :]
    tril = rows[None, :] <= rows[:, None]

    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)
    is_last = rows == MB - 1

    # gradients with respect to the weights at the END of the current mini-batch
    dW1 = tl.load(DW1F + pid * D * M + w1off, mask=w1mask, other=0.0).to(cdt)
    db1 = tl.load(DB1F + pid * M + hcols, mask=hmask, other=0.0).to(cdt)
    dW2 = tl.load(DW2F + pid * M * D + w2off, mask=w2mask, other=0.0).to(cdt)
    db2 = tl.load(DB2F + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    dgamma = tl.zeros([BD], dtype=cdt)
    dbeta = tl.zeros([BD], dtype=cdt)
    dtau = tl.zeros([BT], dtype=cdt)

    for i in range(NMB):
        n = NMB - 1 - i
        s = pid * NMB + n
        W1 = tl.load(W1S + s * D * M + w1off, mask=w1mask, other=0.0)
        b1 = tl.load(B1S + s * M + hcols, mask=hmask, other=0.0)
        W2 = tl.load(W2S + s * M * D + w2off, mask=w2mask, other=0.0)
        b2 = tl.load(B2S + s * D + cols, mask=cmask, other=0.0)
        t_off = n * MB + rows
        xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
        q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
        do = tl.load(DOUT + xoff, mask=xmask, other=0.0).to(cdt)
        X2, gp, gpp, xh, rstd, tgt, gh, G2, S, G1, Ev, A1, M1, X2b, gpb, A2, M2, xhb, rstdb = \
            _mlp_mini_batch_fwd(q, k, v, e, tau, W1, b1, W2, b2, gamma, beta, cmask, rmask, tril, D, eps, PREC)

        # end-of-mini-batch update, read with the end-weight gradients before they are extended:
        # W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ1), W2' = W2 − τ_{b−1} X2ᵀ(η⊙Γ2), biases likewise
        P1 = _dot(k, dW1, PREC) + db1[None, :]
        P2 = _dot(X2, dW2, PREC) + db2[None, :]
        GP = tl.sum(G1 * P1, axis=1) + tl.sum(G2 * P2, axis=1)
        dG1 = -tau_last * e[:, None] * P1
        dG2 = -tau_last * e[:, None] * P2
        de = -tau_last * GP
        dtau += tl.where(is_last, -tl.sum(e * GP, axis=0), 0.0)
        dk = -tau_last * _dot(e[:, None] * G1, tl.trans(dW1), PREC)
        dX2 = -tau_last * _dot(e[:, None] * G2, tl.trans(dW2), PREC)

        # out = Q + γ x̂(Z̄2) + β
        dgamma += tl.sum(do * xhb, axis=0)
        dbeta += tl.sum(do, axis=0)
        dZ2b = _ln_bwd(do * gamma[None, :], xhb, rstdb, cmask, D)
        # Z̄2 = X̄2 W2 + b2 − M2 Γ2,  M2 = tril(E ⊙ (X̄2 X2ᵀ + 1))
        dX2b = _dot(dZ2b, tl.trans(W2), PREC)
        dW2 += _dot(tl.trans(X2b), dZ2b, PREC)
        db2 += tl.sum(dZ2b, axis=0)
        dM2 = tl.where(tril, -_dot(dZ2b, tl.trans(G2), PREC), 0.0)
        dG2 += -_dot(tl.trans(M2), dZ2b, PREC)
        dE = dM2 * (A2 + 1.0)
        dA2 = dM2 * Ev
        dX2b += _dot(dA2, X2, PREC)
        dX2 += _dot(tl.trans(dA2), X2b, PREC)
        # X̄2 = GELU(Z̄1),  Z̄1 = Q W1 + b1 − M1 Γ1,  M1 = tril(E ⊙ (Q Kᵀ + 1))
        dZ1b = dX2b * gpb
        dq = do + _dot(dZ1b, tl.trans(W1), PREC)
        dW1 += _dot(tl.trans(q), dZ1b, PREC)
        db1 += tl.sum(dZ1b, axis=0)
        dM1 = tl.where(tril, -_dot(dZ1b, tl.trans(G1), PREC), 0.0)
        dG1 += -_dot(tl.trans(M1), dZ1b, PREC)
        dE += dM1 * (A1 + 1.0)
        dA1 = dM1 * Ev
        dq += _dot(dA1, k, PREC)
        dk += _dot(tl.trans(dA1), q, PREC)
        # E_ij = τ_i η_j
        de += tl.sum(dE * tau[:, None], axis=0)
        dtau += tl.sum(dE * e[None, :], axis=1)
        # Γ1 = (Γ2 W2ᵀ) ⊙ GELU'(Z1)
        dS = dG1 * gp
        dZ1 = dG1 * S * gpp
        dG2 += _dot(dS, W2, PREC)
        dW2 += _dot(tl.trans(dS), G2, PREC)
        # Γ2 from Z2 and the target V − K
        dZ2, dtgt, dg, dbt = _ln_l2_bwd_bwd(dG2, G2, gh, xh, rstd, gamma, beta, tgt, cmask, D)
        dgamma += dg
        dbeta += dbt
        # Z2 = X2 W2 + b2,  X2 = GELU(Z1),  Z1 = K W1 + b1
        dX2 += _dot(dZ2, tl.trans(W2), PREC)
        dW2 += _dot(tl.trans(X2), dZ2, PREC)
        db2 += tl.sum(dZ2, axis=0)
        dZ1 += tl.where(rmask[:, None], dX2 * gp, 0.0)
        dk += _dot(dZ1, tl.trans(W1), PREC) - dtgt
        dW1 += _dot(tl.trans(k), dZ1, PREC)
        db1 += tl.sum(dZ1, axis=0)

        tl.store(DXQ + xoff, dq.to(DXQ.dtype.element_ty), mask=xmask)
        tl.store(DXK + xoff, dk.to(DXK.dtype.element_ty), mask=xmask)
        tl.store(DXV + xoff, dtgt.to(DXV.dtype.element_ty), mask=xmask)
        tl.store(DETA + pid * T + t_off, de.to(DETA.dtype.element_ty), mask=rmask)

    tl.store(DW10 + pid * D * M + w1off, dW1, mask=w1mask)
    tl.store(DB10 + pid * M + hcols, db1, mask=hmask)
    tl.store(DW20 + pid * M * D + w2off, dW2, mask=w2mask)
    tl.store(DB20 + pid * D + cols, db2, mask=cmask)
    tl.store(DLNW + pid * D + cols, dgamma, mask=cmask)
    tl.store(DLNB + pid * D + cols, dbeta, mask=cmask)
    tl.store(DTAU + pid * MB + rows, dtau, mask=rmask)


def _mlp_launch_cfg(d: int, m: int, b: int):
    """Padded tile sizes (every tl.dot block dim ≥ 16) and launch options for TTT-MLP."""
    BD = max(16, triton.next_power_of_2(d))
    BM = max(16, triton.next_power_of_2(m))
    BT = max(16, triton.next_power_of_2(b))
    if is_interpreting():
        return BD, BM, BT, {}
    # four weight tiles of BD×BM live at once: beyond small heads they spill to local memory
    return BD, BM, BT, {"num_warps": 4 if BD * BM <= 32 * 128 else 8, "num_stages": 1}


def _mlp_weight_buffers(XQ, m: int, n: Optional[int]):
    """Empty (W1, b1, W2, b2) in the accumulation dtype: per mini-batch start ([B, H, n, ...]) or
    final ([B, H, ...], n = None)."""
    B, H, _, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    if n is None:
        return [XQ.new_empty(B, H, *s, dtype=cdt) for s in ((d, m), (1, m), (m, d), (1, d))]
    return [XQ.new_empty(B, H, n, *s, dtype=cdt) for s in ((d, m), (m,), (m, d), (d,))]


@torch.library.custom_op("kernels::ttt_mlp_fwd", mutates_args=())
def _mlp_fwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                ln_w: torch.Tensor, ln_b: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor,
                b2: torch.Tensor, mini_batch_size: int, save: bool) -> List[torch.Tensor]:
    """Full mini-batches from a boundary: (XQ, XK, XV, η, τ, γ, β, W1_0 [B,H,d,m], b1_0 [B,H,1,m],
    W2_0 [B,H,m,d], b2_0 [B,H,1,d]) → [out [B,H,T,d], W1_end, b1_end, W2_end, b2_end, and the
    start weights W1S, B1S, W2S, B2S the backward reads, stored when ``save``]."""
    B, H, T, d = XQ.shape
    m = W1.shape[-1]
    bsz = mini_batch_size
    NMB = T // bsz
    cdt = acc_dtype(XQ.dtype)
    dev = XQ.device
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    W1c, b1c, W2c, b2c = (w.to(cdt).contiguous() for w in (W1, b1, W2, b2))
    out = torch.empty_like(XQ)
    W1S, B1S, W2S, B2S = _mlp_weight_buffers(XQ, m, NMB if save else 1)
    W1F, B1F, W2F, B2F = _mlp_weight_buffers(XQ, m, None)
    BD, BM, BT, kw = _mlp_launch_cfg(d, m, bsz)
    _ttt_mlp_fwd_kernel[(B * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, W1c, b1c, W2c, b2c, out,
        W1S, B1S, W2S, B2S, W1F, B1F, W2F, B2F,
        T, NMB, H, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, SAVE=save, PREC=_precision(XQ.dtype), **kw)
    return [out, W1F, B1F, W2F, B2F, W1S, B1S, W2S, B2S]


@_mlp_fwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, W1, b1, W2, b2, mini_batch_size, save):
    m = W1.shape[-1]
    return ([torch.empty_like(XQ)] + _mlp_weight_buffers(XQ, m, None)
            + _mlp_weight_buffers(XQ, m, XQ.shape[2] // mini_batch_size if save else 1))


@torch.library.custom_op("kernels::ttt_mlp_bwd", mutates_args=())
def _mlp_bwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                ln_w: torch.Tensor, ln_b: torch.Tensor, W1S: torch.Tensor, B1S: torch.Tensor, W2S: torch.Tensor,
                B2S: torch.Tensor, dout: Optional[torch.Tensor], dW1F: Optional[torch.Tensor],
                dB1F: Optional[torch.Tensor], dW2F: Optional[torch.Tensor], dB2F: Optional[torch.Tensor],
                mini_batch_size: int, W1_dt: torch.dtype, b1_dt: torch.dtype, W2_dt: torch.dtype,
                b2_dt: torch.dtype) -> List[torch.Tensor]:
    """Gradients of the eleven tensor inputs of ``_mlp_fwd_op``."""
    bsz, tau_dt, lw_dt, lb_dt = mini_batch_size, tau.dtype, ln_w.dtype, ln_b.dtype
    tau_c = tau.to(W1S.dtype).contiguous()
    lw, lb = ln_w.to(W1S.dtype).contiguous(), ln_b.to(W1S.dtype).contiguous()
    B, H, T, d = XQ.shape
    m = W1S.shape[-1]
    NMB = T // bsz
    cdt = W1S.dtype
    dev = XQ.device

    def grad_or_zero(g, *shape):
        return torch.zeros(*shape, dtype=cdt, device=dev) if g is None else g.to(cdt).contiguous()

    dout = torch.zeros_like(XQ) if dout is None else dout.contiguous()
    dW1F, dB1F = grad_or_zero(dW1F, B, H, d, m), grad_or_zero(dB1F, B, H, 1, m)
    dW2F, dB2F = grad_or_zero(dW2F, B, H, m, d), grad_or_zero(dB2F, B, H, 1, d)
    dXQ, dXK, dXV = (torch.empty_like(XQ) for _ in range(3))
    dETA = torch.empty_like(eta)
    dTAU = torch.empty(B, H, bsz, dtype=cdt, device=dev)
    dLNW = torch.empty(B, H, d, dtype=cdt, device=dev)
    dLNB = torch.empty(B, H, d, dtype=cdt, device=dev)
    dW10 = torch.empty(B, H, d, m, dtype=cdt, device=dev)
    dB10 = torch.empty(B, H, 1, m, dtype=cdt, device=dev)
    dW20 = torch.empty(B, H, m, d, dtype=cdt, device=dev)
    dB20 = torch.empty(B, H, 1, d, dtype=cdt, device=dev)
    BD, BM, BT, kw = _mlp_launch_cfg(d, m, bsz)
    _ttt_mlp_bwd_kernel[(B * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, W1S, B1S, W2S, B2S, dout, dW1F, dB1F, dW2F, dB2F,
        dXQ, dXK, dXV, dETA, dTAU, dLNW, dLNB, dW10, dB10, dW20, dB20,
        T, NMB, H, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, PREC=_precision(XQ.dtype), **kw)
    return [dXQ, dXK, dXV, dETA, dTAU.sum((0, 1)).to(tau_dt), dLNW.sum(0).to(lw_dt),
            dLNB.sum(0).to(lb_dt), dW10.to(W1_dt), dB10.to(b1_dt), dW20.to(W2_dt), dB20.to(b2_dt)]


@_mlp_bwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, W1S, B1S, W2S, B2S, dout, dW1F, dB1F, dW2F, dB2F, mini_batch_size,
      W1_dt, b1_dt, W2_dt, b2_dt):
    ws = _mlp_weight_buffers(XQ, W1S.shape[-1], None)
    return ([torch.empty_like(t) for t in (XQ, XK, XV, eta, tau, ln_w, ln_b)]
            + [torch.empty_like(w, dtype=dt) for w, dt in zip(ws, (W1_dt, b1_dt, W2_dt, b2_dt))])


def _mlp_setup_context(ctx, inputs, output):
    XQ, XK, XV, eta, tau, ln_w, ln_b, W1, b1, W2, b2, bsz, _ = inputs
    ctx.save_for_backward(XQ, XK, XV, eta, tau, ln_w, ln_b, *output[5:])
    ctx.mark_non_differentiable(*output[5:])
    ctx.meta = (bsz, W1.dtype, b1.dtype, W2.dtype, b2.dtype)


def _mlp_backward_rule(ctx, grads):
    return (*_mlp_bwd_op(*ctx.saved_tensors, *grads[:5], *ctx.meta), None, None)


_mlp_fwd_op.register_autograd(_mlp_backward_rule, setup_context=_mlp_setup_context)


def ttt_mlp_triton(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size=16,
                   initial_state: Optional[dict] = None, output_final_state: bool = False
                   ) -> Tuple[torch.Tensor, Optional[dict]]:
    r"""Same contract as ``kernels.ttt.ttt_mlp``. The full mini-batches from a boundary run in the
    Triton kernel; the head (completing a mini-batch begun in ``initial_state``) and the tail (a
    trailing partial mini-batch) run in the PyTorch dual form.

    TTT-MLP dual form (f(x) = GELU_tanh(x W1 + b1) W2 + b2, W1 [d, m], W2 [m, d], m = 4d in the
    paper). One program per (batch, head) walks the full mini-batches with (W1, b1, W2, b2) in
    registers. For a mini-batch with rows K, Q, V ∈ R^{b×d}, η, τ as for TTT-Linear and the weights
    at its start:

        Z1 = K W1 + b1,   X2 = GELU(Z1),   Z2 = X2 W2 + b2
        Γ2 = ∂/∂Z2 ½‖LN_γβ(Z2) − (V − K)‖²,   Γ1 = (Γ2 W2ᵀ) ⊙ GELU'(Z1)          (gradients at W_0)
        M1 = tril(E ⊙ (Q Kᵀ + 1)),        Z̄1 = Q W1 + b1 − M1 Γ1,   X̄2 = GELU(Z̄1)
        M2 = tril(E ⊙ (X̄2 X2ᵀ + 1)),      Z̄2 = X̄2 W2 + b2 − M2 Γ2,  out = Q + LN_γβ(Z̄2)
        W1 ← W1 − τ_{b−1} Kᵀ(η ⊙ Γ1),  b1 ← b1 − τ_{b−1} Σ_j η_j Γ1_j      (same for W2, b2 with X2, Γ2)

    The forward stores the four weights at the start of every mini-batch (2dm + m + d numbers per
    mini-batch and head); the backward walks the mini-batches in reverse from them, carrying the
    gradient with respect to the weights at the end of the current mini-batch, as for TTT-Linear.
    The GELU''(Z1) term enters through Γ1's dependence on Z1. Coverage is that of the TTT-Linear
    kernel (full mini-batches from pos = 0 in Triton, b ≤ 64, any d and m padded to powers of two
    ≥ 16; head and tail in the PyTorch dual form through autograd). tanh is written with exp
    (tanh u = 1 − 2/(e^{2u} + 1), exact at ±∞), which behaves the same in float32 and float64.
    Precision as for TTT-Linear: float64 inputs in float64, others in float32 with IEEE products.
    At d = 64, m = 256 the two weight tiles alone are 32K float32 per program: expect register
    spills on a GPU (a hidden-dimension split of the tiles is the next step for speed).
    """
    if not 1 <= mini_batch_size <= _MAX_MB:
        raise ValueError(f"ttt_mlp_triton: mini_batch_size must be in [1, {_MAX_MB}], got {mini_batch_size}")
    check_triton_device("ttt_mlp_triton", XQ, XK, XV, eta)
    B, H, T, d = XQ.shape
    bsz = mini_batch_size
    dt = acc_dtype(XQ.dtype)
    st = make_state({"W1": W1, "b1": b1, "W2": W2, "b2": b2}, B, dt, initial_state)
    pos = st["pos"]
    outs, t = [], 0

    def torch_part(t0, t1, st):
        return ttt_mlp_chunk(XQ[:, :, t0:t1], XK[:, :, t0:t1], XV[:, :, t0:t1], eta[:, :, t0:t1],
                             token_idx, ln_weight, ln_bias, W1, b1, W2, b2, bsz, st, True)

    if pos > 0 and T > 0:
        t = min(bsz - pos, T)
        o, st = torch_part(0, t, st)
        outs.append(o)
    n_full = (T - t) // bsz * bsz
    if n_full > 0:
        sl = slice(t, t + n_full)
        ins = [t.contiguous() for t in (XQ[:, :, sl], XK[:, :, sl], XV[:, :, sl], eta[:, :, sl], token_idx,
                                         ln_weight, ln_bias, st["W1"], st["b1"], st["W2"], st["b2"])]
        # the per-mini-batch start weights serve only the backward
        save = torch.is_grad_enabled() and any(t.requires_grad for t in ins)
        o, *ws = _mlp_fwd_op(*ins, bsz, save)[:5]
        outs.append(o)
        # the kernel starts at a boundary, where the carried sums are zero by construction
        st = {"pos": 0}
        for name, w in zip(("W1", "b1", "W2", "b2"), ws):
            st[name], st["grad_" + name] = w, torch.zeros_like(w)
        t += n_full
    if t < T:
        o, st = torch_part(t, T, st)
        outs.append(o)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else (outs[0] if outs else XQ.clone())
    return out, (st if output_final_state else None)


__all__ = ["ttt_linear_triton", "ttt_mlp_triton"]
