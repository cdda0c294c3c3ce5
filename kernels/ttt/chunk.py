r"""TTT-Linear dual form in Triton, forward and backward (Sun et al. 2024), with the inner
LayerNorm and its L2-loss gradient fused into the kernel.

For a mini-batch of b tokens with rows K, Q, V ∈ R^{b×d}, per-token η ∈ R^b, τ = token_idx ∈ R^b
and W_0 = (W1, b1) at its start (notation of ``torch_chunk.py``):

    Z = K W1 + b1,   Γ = ∂/∂Z ½‖LN_γβ(Z) − (V − K)‖²                    (row by row)
    M = tril(E ⊙ (Q Kᵀ + 1)),   E_ij = τ_i η_j
    Z̄ = Q W1 + b1 − M Γ,        out = Q + LN_γβ(Z̄)
    W1 ← W1 − τ_{b−1} Kᵀ (η ⊙ Γ),   b1 ← b1 − τ_{b−1} Σ_j η_j Γ_j

(M Γ = (E ⊙ tril(Q Kᵀ)) Γ + tril(E) Γ, the two dual-form terms in one b×b product.)

Only Z, Γ and the update are sequential; Z̄ and the output of a mini-batch follow from its start
weights and Γ. The forward is two kernels, as flash-linear-attention's chunk_ttt_linear splits it:
``_ttt_linear_state_kernel``, one program per (batch, head), walks the full mini-batches in order
(b1 [1, d] in registers, W1 [d, d] in global memory, see Registers below), computes Z, Γ and the
update, and stores W1, b1 at the start of every mini-batch (d² + d numbers per mini-batch and
head) and Γ (b × d); ``_ttt_linear_out_kernel``, one program per (batch, head, mini-batch, row
block), all in parallel, computes M, Z̄ and out from them, so the chunk-parallel work does not wait on, nor
depend for its occupancy on, batch × heads. Without autograd the two run over windows of
``_linear_window`` mini-batches, the state carried from one window to the next, so that the stored
start weights stay bounded in T. The backward is two kernels.
``_ttt_linear_bwd_mb_kernel`` (one program per (batch, head, mini-batch), all in parallel)
recomputes M, Z̄ from the stored start weights and Γ and back-propagates out through Z̄ and M — everything that does not depend on the gradient carried
from later mini-batches: ∂XQ, and the first parts of ∂XK, ∂η, ∂τ, ∂γ, ∂β and ∂Γ, with ∂Z̄, go to
global memory (in two passes over its row blocks: by rows of ∂Z̄, then by columns of M). ``_ttt_linear_bwd_kernel`` then walks the mini-batches in reverse, recomputes Z and Γ,
and carries (dW1, db1), the gradient with respect to the weights at the end of the current
mini-batch; through the update, dW1_start = dW1_end + Qᵀ dZ̄ + Kᵀ dZ (dZ from differentiating Γ,
i.e. the second derivative of the LayerNorm-fused loss).

Coverage of the kernel: every token from a mini-batch boundary (pos = 0), a trailing partial
mini-batch included, any b ≤ 64 and any head dim d (b and d padded to powers of two ≥ 16 with
masks; padded rows carry τ = η = 0, so they reach no real row; b ∈ {16, 32, 64} need no row
padding). The last mini-batch of a launch has LAST ≤ b valid rows, a runtime value: its rows
≥ LAST are masked (η = 0, ∂out = 0, nothing stored), and when LAST < b it makes no update — the
end state is its start weights W1, b1 with the sums grad_W1 = Kᵀ(η⊙Γ), grad_b1 = Σ η Γ (unscaled
by τ) and pos = LAST, the state contract's mid-mini-batch state — and the backward takes the
gradients of those sums.

The head (``_linear_head``): the tokens that complete a mini-batch begun by ``initial_state``
(pos = p > 0, start weights θ_0, carried sums G, Gb) run in a launch of their own before the rest,
as one mini-batch of p + n rows whose first p are absent — zero rows with η = 0, inert like the
padded rows (they reach no sum and no other row; their outputs are dropped), which puts the head's
tokens at positions p … p + n − 1. G enters linearly, through a few PyTorch ops around the launch
(autograd takes their gradients): the output kernel adds the row offset ZH_i = −τ_{p+i} (q_i G + Gb)
([p + n, d] per head) to Z̄ before the LayerNorm, and ZH's gradient is ∂Z̄ (which the backward
already computes); the end state is the kernels' minus τ_{b−1} (G, Gb) (a completed mini-batch) or
the kernels' sums plus (G, Gb) (p + n < b). Γ, the LayerNorms, M Γ, the outputs and the update all
run in the kernels.
Every gradient (XQ, XK, XV, η, token_idx, ln_weight, ln_bias, W1, b1 and the tensors of
``initial_state``) flows through both launches.

Packed batches (``cu_seqlens``, B = 1, ``ttt_linear_triton_packed``): one launch of each kernel for
all N sequences, with VARLEN = True. ``packed_chunk_tables`` builds on the device the ⌊T/b⌋ + N
mini-batch slots (each sequence's first slot; (sequence, mini-batch) per slot, spare slots marked
−1). The serial kernels (state pass, backward carry) run one program per (sequence, head), each
walking its sequence's ⌈L/b⌉ mini-batches from its own start weights (``initial_state`` row n, or
the shared weights expanded to [N, H, …]); the per-mini-batch kernels (output, per-mini-batch
backward) one per (head, slot[, row block]), a spare slot with every row masked. Each sequence's
last mini-batch has its own valid row count L − (⌈L/b⌉ − 1) b in place of LAST (an empty sequence
runs nothing: its end state is its start state). Only the program-id → offsets mapping at the top
of each kernel differs (``_packed_serial``, ``_packed_slot``): it moves the base pointers so that
the kernel body's offsets land on the sequence's rows and slots. The end state is [N, H, …] with
"pos" per sequence; the gradients of every input and of ``initial_state`` flow through the
backward. Without autograd a packed forward stores every start weight (no windows: a window of
mini-batches cuts across sequences), d/b times the size of XQ, as a forward under autograd does.

Precision (``_precision``, ``_dot``): everything is carried and accumulated in float32 (float64
for float64 inputs); the tl.dot operands are bfloat16 for bfloat16/float16 inputs (bf16 tensor-core
MMA, fp32 accumulator), 3×TF32 for float32 inputs (tensor cores, error within a few fp32 ulps:
float32 tolerances unchanged; the interpreter multiplies exactly, only a GPU checks it), exact for float64.
The bf16 operands round every product's inputs to 8 mantissa bits: the bfloat16 tests' 3e-2 of
each tensor's scale, set for bfloat16 inputs and outputs, covers it unchanged. For bfloat16
inputs the per-mini-batch start weights and Γ that the output kernel and the backward read are
stored in bfloat16 — they enter only tl.dot there, whose operands are rounded to bfloat16 anyway. Outputs come back in the
input dtype, the state in float32 (float64 for float64 inputs), as in ``torch_chunk.py``.

Registers (``python -m kernels.compile_report --op ttt``): W1 (state pass) and dW1 (backward carry)
are not carried in registers from one mini-batch to the next. They live in two global slots per
(batch, head): the weights of mini-batch n in slot n % 2, the update added to the other slot row
block by row block (below), one barrier per row block. No [d, d] tile is held whole in any
kernel: every product with a weight operand (K W1, Q W1, ∂Z̄ W1ᵀ, ∂Z W1ᵀ, K dW1, the updates
Kᵀ(η⊙Γ), Qᵀ∂Z̄ + Kᵀ∂Z) runs BC columns of the weight at a time in a runtime loop (not unrolled,
so the compiler cannot hoist every tile's loads), writing each update as a [BC, d] tile (a product
of BC rows). An [RB, d] operand or product needed by column tiles, or produced by them, passes
through small per-program scratch tiles in global memory (float32; ``_xw_cols``). The state
pass builds its index, mask and pointer tensors inside the loop (``_loop_index``) instead of
letting them be hoisted out of it. A product over d with an [RB, RB] or [RB, BC] result reads
both operands from global memory in [RB, BC] column tiles (``_rows_dot_t``, see Row blocks). Warps
and BC per GPU family in ``_LINEAR_WARPS`` and ``_LINEAR_BC``.

Row blocks: every kernel walks a mini-batch in blocks of RB = 16 rows (``_LINEAR_RB``; b padded to
BT, a multiple of 16), so that only [16, d] and [16, 16] tiles are live whatever b is. Z = K W1 + b1,
Γ, the LayerNorm and its derivatives are row by row; rows meet only (i) in M Γ, lower-triangular:
Z̄ of block i sums M_ij Γ_j over the blocks j ≤ i (``_zbar_block``), and its backward gives ∂Q_i,
∂τ_i by rows (j ≤ i) and ∂Γ_j, ∂K_j, ∂η_j by columns (i ≥ j), two passes of
``_ttt_linear_bwd_mb_kernel`` with ∂Z̄ in global memory between them; (ii) in sums over rows —
the update Kᵀ(η⊙Γ), Σ η Γ, dW1's Qᵀ∂Z̄ + Kᵀ∂Z, ∂b1, ∂τ, ∂γ, ∂β — which each block adds to the other
weight slot (the first block starting it from the current weights), to a per-program scratch row,
or to per-(mini-batch, row block) partial sums that PyTorch adds up. A product over d whose
result is small ([RB, RB]: Q Kᵀ, ∂Z̄ Γᵀ; [RB, BC]: K dW1 in the backward carry) does not take a
whole [RB, d] operand from registers, which would put all of it (its three TF32 parts for float32)
in every warp: its operands are read from global memory in [RB, BC] column tiles
(``_rows_dot_t``). The rows of a block past the valid rows (nv = LAST in the last mini-batch) are
read as row nv − 1 (in bounds, no [RB, d] row mask) and carry τ = η = 0 and ∂out = 0; only
stores are masked by row. Every TTT-Linear case of the gate passes (no spills, both archs).

TTT-MLP (``ttt_mlp_triton``) is in ``mlp_chunk.py``; it shares ``_dot``, ``_ln_stats``, ``_ln_bwd`` and
``_precision`` with this file.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import (INTERPRET_ARCH, check_triton_device, device_arch, is_interpreting,
                                   packed_chunk_tables)
from kernels.ttt.torch_chunk import LN_EPS, acc_dtype, make_state

#: the largest mini-batch the kernels take (the gate compiles b = 16 and 64; a mini-batch runs in
#: row blocks of 16, so larger b would compile, only its M Γ walks more blocks)
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
def _xw_cols(x, WP, S, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """x @ W for x [BT, BD] in registers and W [D, D] at ``WP`` (row-major), BC columns of W at a
    time: each [BT, BC] column tile of the product goes to the scratch tile ``S`` [BT, BD] (float32,
    row-major), which is read back whole after a barrier. Only a [BD, BC] tile of W is live at once."""
    rows = tl.arange(0, BT)
    wr = tl.arange(0, BD)
    for c in range(BD // BC):
        cc = c * BC + tl.arange(0, BC)
        w = tl.load(WP + wr[:, None] * D + cc[None, :], mask=(wr[:, None] < D) & (cc[None, :] < D), other=0.0)
        tl.store(S + rows[:, None] * BD + cc[None, :], _dot(x, w, PREC))
    tl.debug_barrier()
    return tl.load(S + rows[:, None] * BD + wr[None, :])


@triton.jit
def _mini_batch_grad_cols(k, v, WP, S, bb, gamma, beta, cmask, D: tl.constexpr, BD: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, eps, PREC: tl.constexpr):
    """Z = K W1 + b1 (BC columns of W1 at a time, ``_xw_cols``) and Γ of one mini-batch, with the
    LayerNorm pieces the backward reuses: x̂, 1/σ of Z and the residual r = γ x̂ + β − (V − K)
    (ĝ = γ r)."""
    Z = _xw_cols(k, WP, S, D, BD, BT, BC, PREC) + bb[None, :]
    xh, rstd = _ln_stats(Z, cmask, D, eps)
    r = gamma[None, :] * xh + beta[None, :] - (v - k)
    G = _ln_bwd(r * gamma[None, :], xh, rstd, cmask, D)                   # Γ
    return xh, rstd, r, G


@triton.jit
def _packed_serial(CU, CS, pid, h, T, H, NC, D: tl.constexpr, MB: tl.constexpr):
    """Packed batches (``cu_seqlens``), the serial kernels (grid: sequences × heads, pid =
    sequence * H + h): the sequence's mini-batches NMB = ⌈L / b⌉ (L its tokens) and the valid rows
    LAST = L − (NMB − 1) b of its last one (b when L = 0: nothing runs, the end state is the start
    state), and the shifts that move the kernel body's offsets onto the sequence: ``xs`` for a
    [·, H, T, d] tensor (the body's row offset ``pid * T * D`` lands on row ``bos`` of head h),
    ``es`` for a [·, H, T] one, ``ms`` in mini-batches (the body's ``pid * NMB + n`` lands on slot
    ``CS[seq] + n`` of head h, of NC). The body's int32 products are subtracted as the same int32
    products, so they cancel exactly. (The backward carry adds ``es`` to its token index instead of
    moving its [·, H, T, …] pointers: xs = es·d.)"""
    seq = pid // H
    bos = tl.load(CU + seq)
    L = tl.load(CU + seq + 1) - bos
    NMB = (L + MB - 1) // MB
    LAST = L - (NMB - 1) * MB
    xs = (h * T + bos).to(tl.int64) * D - (pid * T * D).to(tl.int64)
    es = (h * T + bos).to(tl.int64) - (pid * T).to(tl.int64)
    ms = (h * NC + tl.load(CS + seq)).to(tl.int64) - (pid * NMB).to(tl.int64)
    return xs, es, ms, NMB, LAST


@triton.jit
def _packed_slot(CU, CI, slot, h, NC, MB: tl.constexpr):
    """Packed batches, the per-mini-batch kernels (grid: heads × slots[ × row blocks]): slot ``slot``
    of ``CI`` holds (sequence, mini-batch c); returns the sequence's first token, c, its mini-batch
    count NMB, the valid rows LAST of its last mini-batch, and the shift ms (in mini-batches) that
    moves the kernel body's mini-batch index ``h * NMB + c`` to slot ``h * NC + slot``. A spare slot
    (sequence −1) gets L = 0, NMB = 1, LAST = 0 and first token 1: every row masked, nothing stored
    but its own scratch and zero partial sums."""
    seq = tl.load(CI + 2 * slot)
    c = tl.load(CI + 2 * slot + 1)
    sq = tl.maximum(seq, 0)
    bos = tl.load(CU + sq)
    L = tl.where(seq < 0, 0, tl.load(CU + sq + 1) - bos)
    # a spare slot's body reads row "LAST − 1" = −1 of its first token (rows past the valid ones
    # re-read the last valid row); starting it at token 1 keeps that read on token 0, inside the
    # inputs (T ≥ 1: an all-empty packed batch does not reach the kernels)
    bos = tl.where(seq < 0, 1, bos)
    NMB = tl.maximum((L + MB - 1) // MB, 1)
    LAST = L - (NMB - 1) * MB
    ms = (h * NC + slot - c).to(tl.int64) - (h * NMB).to(tl.int64)
    return bos.to(tl.int64), c, NMB, LAST, ms


# LAST (the valid rows of the last mini-batch) is a runtime value: a launch whose LAST is 1 (a
# prompt piece one token past a mini-batch) must not make it a constexpr, which turns
# ``LAST < MB`` into a Python bool (the compile fails: the gate's captured decode launches)
@triton.jit(do_not_specialize=["LAST"])
def _ttt_linear_state_kernel(XK, XV, ETA, TAU, LNW, LNB, W0, B0, WS, BS, GS, WF, BF, GWF, GBF, WT, SCR,
                             CU, CS, CI, T, NMB, LAST, H, NC, eps,
                             D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                             BC: tl.constexpr, RB: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The sequential part of the forward: one program per batch·head walks the mini-batches in
    order, computes Z = K W1 + b1, Γ and the update, and stores the start weights (W1, b1) of every
    mini-batch (WS, BS) and its Γ (GS), from which ``_ttt_linear_out_kernel`` computes the
    outputs of all mini-batches in parallel. The last mini-batch has LAST ≤ b valid rows (the rows
    beyond are masked); when LAST < b it is partial: no update (the end weights WF, BF are its start
    weights) and its gradient sums Kᵀ(η⊙Γ), Σ η Γ (unscaled by τ) go to GWF, GBF (zero-filled by
    the caller)."""
    pid = tl.program_id(0)                      # = b_idx * H + h_idx (packed: sequence * H + h_idx)
    h = pid % H
    if VARLEN:
        xs, es, ms, NMB, LAST = _packed_serial(CU, CS, pid, h, T, H, NC, D, MB)
        XK, XV, GS, ETA, WS, BS = XK + xs, XV + xs, GS + xs, ETA + es, WS + ms * D * D, BS + ms * D
    cdt = W0.dtype.element_ty
    cols = tl.arange(0, BD)
    cmask = cols < D
    wmask = cmask[:, None] & cmask[None, :]
    woff = cols[:, None] * D + cols[None, :]
    # W1 lives in global memory, not in registers: the weights at the start of mini-batch n in
    # slot n % 2 of WT [2, d, d], read BC columns at a time where a product needs them; the update
    # is written to the other slot, tile by tile, row block by row block. An [RB, d] product or
    # operand needed by column tiles passes through one of two [RB, BD] scratch tiles in SCR (per
    # program; float32); a third holds the row blocks' sums Σ η Γ
    WT = WT + pid * 2 * D * D
    S_Z = SCR + pid * 3 * RB * BD               # K W1 (read back whole)
    S_E = S_Z + RB * BD                         # η⊙Γ (read by column tiles)
    S_B = S_E + RB * BD                         # Σ η Γ over each row block's rows
    tl.store(WT + woff, tl.load(W0 + pid * D * D + woff, mask=wmask, other=0.0).to(cdt), mask=wmask)
    bb = tl.load(B0 + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)
    tl.debug_barrier()

    for n in range(NMB):
        rl, cols = _loop_index(n, NMB, RB, BD)
        cmask = cols < D
        WP = WT + (n % 2) * D * D
        WQ = WT + ((n + 1) % 2) * D * D
        # valid rows of this mini-batch; a partial last one updates nothing: the other slot gets
        # its gradient sum Kᵀ(η⊙Γ) instead (start 0, scale −1), and its start weights stay in WP
        nv = tl.where(n == NMB - 1, LAST, MB)
        part = nv < MB
        s = tl.where(part, -1.0, tau_last)
        w0 = tl.where(part, 0.0, 1.0)
        tl.store(BS + (pid * NMB + n) * D + cols, bb, mask=cmask)
        # the mini-batch in blocks of RB rows: Z and Γ are row by row, the update sums over rows,
        # so each block adds its share to the other W1 slot (the first block starts it from W1)
        # and to Σ η Γ (its rows' sum kept in the scratch, one row per block)
        for rb in range(BT // RB):
            rows = rb * RB + rl
            rmask = rows < nv
            xmask = rmask[:, None] & cmask[None, :]
            gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
            beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
            t_off = n * MB + rows
            xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
            k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
            v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
            # padded and invalid rows get η = 0, so they reach no update
            e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
            xh, rstd, r, G = _mini_batch_grad_cols(k, v, WP, S_Z, bb, gamma, beta, cmask, D, BD, RB, BC, eps, PREC)
            tl.store(GS + xoff, G, mask=xmask)
            eG = e[:, None] * G
            tl.store(S_B + rb * BD + cols, tl.sum(eG, axis=0))
            tl.store(S_E + rl[:, None] * BD + cols[None, :], eG)
            tl.debug_barrier()
            # W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ), BC columns of W1 at a time, each as a [BC, d] tile (the
            # product (η⊙Γ)[:, cols]ᵀ K of BC rows); the start weights stored on the way
            for c in range(BD // BC):
                cc = c * BC + tl.arange(0, BC)
                wc = cc[:, None] + cols[None, :] * D
                wcm = (cc[:, None] < D) & cmask[None, :]
                w = tl.load(WP + wc, mask=wcm, other=0.0)
                tl.store(WS + (pid * NMB + n) * D * D + wc, w, mask=wcm & (rb == 0))
                acc = tl.load(WQ + wc, mask=wcm & (rb > 0), other=0.0)
                updT = _dot(tl.trans(tl.load(S_E + rl[:, None] * BD + cc[None, :])), k, PREC)
                tl.store(WQ + wc, tl.where(rb > 0, acc, w0 * w) - s * updT, mask=wcm)
            tl.debug_barrier()                  # the next block adds to the slot written above
        bsum = tl.load(S_B + rl[:, None] * BD + cols[None, :], mask=(rl[:, None] < BT // RB) & cmask[None, :], other=0.0)
        bsum = tl.sum(bsum, axis=0)
        tl.store(GBF + pid * D + cols, bsum, mask=cmask & ((cols * 0 + nv) < MB))
        bb = bb - w0 * s * bsum
        tl.debug_barrier()                      # the next mini-batch reads the slot written above

    cols = tl.arange(0, BD)
    cmask = cols < D
    # after a partial last mini-batch, slot NMB % 2 holds its sums and the other its start weights;
    # copied out BC columns at a time
    part = (LAST < MB).to(tl.int32)
    for c in range(BD // BC):
        cc = c * BC + tl.arange(0, BC)
        wo = cols[:, None] * D + cc[None, :]
        wm = cmask[:, None] & (cc[None, :] < D)
        tl.store(WF + pid * D * D + wo, tl.load(WT + ((NMB + part) % 2) * D * D + wo, mask=wm, other=0.0), mask=wm)
        tl.store(GWF + pid * D * D + wo, tl.load(WT + (NMB % 2) * D * D + wo, mask=wm, other=0.0),
                 mask=wm & ((wo * 0 + part) > 0))
    tl.store(BF + pid * D + cols, bb, mask=cmask)


@triton.jit
def _rows_dot_t(acc, PA, oa, PB, ob, D: tl.constexpr, BD: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """acc + A Bᵀ for two row blocks A, B [RB, D] in global memory (rows at offsets ``oa``, ``ob``
    [RB] from PA, PB; row-major, D per row), BC columns at a time: only [RB, BC] operand tiles are
    live, not the [RB, d] ones (a product over d with a small [RB, RB] result puts a whole operand
    in every warp)."""
    for c in range(BD // BC):
        cc = c * BC + tl.arange(0, BC)
        ccm = cc < D
        a = tl.load(PA + oa[:, None] + cc[None, :], mask=ccm[None, :], other=0.0).to(acc.dtype)
        b = tl.load(PB + ob[:, None] + cc[None, :], mask=ccm[None, :], other=0.0).to(acc.dtype)
        acc += _dot(a, tl.trans(b), PREC)
    return acc


@triton.jit
def _zbar_block(q, XQ, tau_i, rows_i, nb, XK, ETA, GS, WP, S, bb, x0, e0, cmask, NV, ZH, NZ, D: tl.constexpr,
                BD: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Z̄ of one row block i (rows ``rows_i``, its Q rows ``q`` [RB, BD], τ of its rows ``tau_i``):
    Q_i W1 + b1 − Σ_{j ≤ i} M_ij Γ_j with M_ij = tril(τ_i η_jᵀ ⊙ (Q_i K_jᵀ + 1)), the sum over the
    ``nb`` = i + 1 row blocks j ≤ i (K_j, η_j, Γ_j read from XK, ETA, GS at the mini-batch's
    offsets ``x0``, ``e0``; rows ≥ ``NV`` carry η = 0); Q_i W1 BC columns of W1 at a time through
    the scratch tile ``S``; Q_i K_jᵀ from XQ, XK in column tiles (``_rows_dot_t``). The rows
    < ``NZ`` add their row of ``ZH`` (the head's −τ_i (q_i G + Gb), same layout as XQ; NZ ≤ 0: none)."""
    rl = tl.arange(0, RB)
    cols = tl.arange(0, BD)
    acc = _xw_cols(q, WP, S, D, BD, RB, BC, PREC) + bb[None, :]
    acc += tl.load(ZH + x0 + rows_i[:, None] * D + cols[None, :], mask=(rows_i < NZ)[:, None] & cmask[None, :],
                   other=0.0).to(acc.dtype)
    oq = x0 + tl.minimum(rows_i, NV - 1) * D
    for j in range(nb):
        rows_j = j * RB + rl
        rmask_j = rows_j < NV
        # rows ≥ NV read row NV − 1 again (in bounds, no [RB, d] mask) and carry η = 0
        ok = x0 + tl.minimum(rows_j, NV - 1) * D
        G = tl.load(GS + ok[:, None] + cols[None, :], mask=cmask[None, :], other=0.0).to(acc.dtype)
        e = tl.load(ETA + e0 + rows_j, mask=rmask_j, other=0.0).to(acc.dtype)
        A = _rows_dot_t(tl.zeros([RB, RB], dtype=acc.dtype), XQ, oq, XK, ok, D, BD, BC, PREC)
        M = tl.where(rows_j[None, :] <= rows_i[:, None], tau_i[:, None] * e[None, :] * (A + 1.0), 0.0)
        acc -= _dot(M, G, PREC)
    return acc


@triton.jit
def _ttt_linear_out_kernel(XQ, XK, ETA, TAU, LNW, LNB, WS, BS, GS, OUT, SCR, ZH,
                           CU, CS, CI, T, NMB, LAST, H, NC, NZH, eps,
                           D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                           BC: tl.constexpr, RB: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The chunk-parallel part of the forward: one program per (batch·head, mini-batch, row block
    of RB rows), all in parallel, after ``_ttt_linear_state_kernel``. From the stored start weights
    W1, b1 and Γ: Z̄ = Q W1 + b1 − M Γ, out = Q + LN_γβ(Z̄) for the block's rows (row i of Z̄ reads
    the rows j ≤ i of K, η, Γ: ``_zbar_block``), Q W1 BC columns of W1 at a time through an
    [RB, BD] scratch tile in SCR (per program; float32). The last mini-batch has LAST valid rows.
    The first NZH tokens add their row of ZH to Z̄ (the head's carried sums, ``_linear_head``; NZH = 0
    and a placeholder ZH otherwise)."""
    pid = tl.program_id(0)
    n = tl.program_id(1)
    i = tl.program_id(2)
    h = pid % H
    if VARLEN:                                  # grid (H, slots, row blocks): pid = head, n = slot
        bos, n, NMB, LAST, ms = _packed_slot(CU, CI, n, pid, NC, MB)
        XQ, XK, ETA, GS, OUT = XQ + bos * D, XK + bos * D, ETA + bos, GS + bos * D, OUT + bos * D
        WS, BS, SCR = WS + ms * D * D, BS + ms * D, SCR + ms * BT * BD
    cdt = BS.dtype.element_ty
    rows = i * RB + tl.arange(0, RB)
    cols = tl.arange(0, BD)
    cmask = cols < D
    nv = tl.where(n == NMB - 1, LAST, MB)
    rmask = rows < nv
    xmask = rmask[:, None] & cmask[None, :]
    # padded rows (MB < BT) get τ = η = 0, and invalid rows (≥ nv) η = 0 and no output, so they
    # enter no product that reaches a real row
    tau = tl.load(TAU + rows, mask=rows < MB, other=0.0).to(cdt)
    WP = WS + (pid * NMB + n) * D * D
    bb = tl.load(BS + (pid * NMB + n) * D + cols, mask=cmask, other=0.0).to(cdt)
    x0 = pid * T * D + n * MB * D
    xoff = x0 + rows[:, None] * D + cols[None, :]
    q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
    S = SCR + ((pid * NMB + n) * (BT // RB) + i) * RB * BD
    Zb = _zbar_block(q, XQ, tau, rows, i + 1, XK, ETA, GS, WP, S, bb, x0, pid * T + n * MB, cmask, nv,
                     ZH, NZH - n * MB, D, BD, RB, BC, PREC)
    xhb, rstdb = _ln_stats(Zb, cmask, D, eps)
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    out = q + gamma[None, :] * xhb + beta[None, :]
    tl.store(OUT + xoff, out.to(OUT.dtype.element_ty), mask=xmask)


@triton.jit
def _ttt_linear_bwd_mb_kernel(XQ, XK, ETA, TAU, LNW, LNB, WS, BS, GS, DOUT,
                              DXQ, DKP, DEP, DG0, DZB, DTAUP, DLNWP, DLNBP, SCR, ZH,
                              CU, CS, CI, T, NMB, LAST, H, NC, NZH, eps,
                              D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                              BC: tl.constexpr, RB: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The part of the backward local to one mini-batch (no dependence on the carried dW1, db1):
    one program per (batch·head, mini-batch), all in parallel. Recomputes the forward from the
    stored start weights, back-propagates out through Z̄ and M, and stores ∂XQ (final), the parts
    of ∂XK, ∂η, ∂Γ that do not involve the carry, ∂Z̄, and sums for ∂τ, ∂γ, ∂β.

    In row blocks of RB rows, in two passes, so that only [RB, d] and [RB, RB] tiles are live.
    Pass 1, block i: Z̄_i (``_zbar_block``), ∂Z̄_i (stored to DZB), ∂γ, ∂β of its rows, and, over
    the blocks j ≤ i, ∂M_ij = −∂Z̄_i Γ_jᵀ (lower-triangular) with ∂Q_i += ∂A_ij K_j, ∂τ_i += Σ_j ∂E_ij η_j;
    then ∂Q_i += ∂Z̄_i W1ᵀ. Pass 2, block j, over the blocks i ≥ j (∂Z̄_i read back from DZB):
    ∂Γ_j = −Σ_i M_ijᵀ ∂Z̄_i, ∂K_j = Σ_i ∂A_ijᵀ Q_i, ∂η_j = Σ_i ∂E_ijᵀ τ_i. The last mini-batch has
    LAST valid rows (the rows beyond: η = 0, ∂out = 0, nothing stored). Z̄ of the first NZH tokens
    includes their row of ZH, as in the forward; ∂ZH = ∂Z̄ (DZB)."""
    pid = tl.program_id(0)
    n = tl.program_id(1)
    h = pid % H
    if VARLEN:                                  # grid (H, slots): pid = head, n = slot
        bos, n, NMB, LAST, ms = _packed_slot(CU, CI, n, pid, NC, MB)
        XQ, XK, GS, DOUT, DXQ = XQ + bos * D, XK + bos * D, GS + bos * D, DOUT + bos * D, DXQ + bos * D
        DKP, DG0, DZB, ETA, DEP = DKP + bos * D, DG0 + bos * D, DZB + bos * D, ETA + bos, DEP + bos
        WS, BS, SCR, DTAUP = WS + ms * D * D, BS + ms * D, SCR + ms * RB * BD, DTAUP + ms * MB
        DLNWP, DLNBP = DLNWP + ms * (BT // RB) * D, DLNBP + ms * (BT // RB) * D
    cdt = DKP.dtype.element_ty
    NRB: tl.constexpr = BT // RB
    rl = tl.arange(0, RB)
    cols = tl.arange(0, BD)
    cmask = cols < D
    WP = WS + (pid * NMB + n) * D * D
    x0 = pid * T * D + n * MB * D
    e0 = pid * T + n * MB
    S = SCR + (pid * NMB + n) * RB * BD
    nv = tl.where(n == NMB - 1, LAST, MB)
    # the rows ≥ nv (padding, or past the end of a partial last mini-batch) carry τ = η = 0 and
    # ∂out = 0, so they reach no real row; their Q, K, Γ, ∂Z̄ loads read row nv − 1 again (in
    # bounds, no [RB, d] row mask), and only the stores are masked

    for i in range(NRB):
        rows_i = i * RB + rl
        rmask_i = rows_i < nv
        xm_i = rmask_i[:, None] & cmask[None, :]
        xo_i = x0 + rows_i[:, None] * D + cols[None, :]
        xl_i = x0 + tl.minimum(rows_i, nv - 1)[:, None] * D + cols[None, :]
        tau_i = tl.load(TAU + rows_i, mask=rmask_i, other=0.0).to(cdt)
        bb = tl.load(BS + (pid * NMB + n) * D + cols, mask=cmask, other=0.0).to(cdt)
        q = tl.load(XQ + xl_i, mask=cmask[None, :], other=0.0).to(cdt)
        Zb = _zbar_block(q, XQ, tau_i, rows_i, i + 1, XK, ETA, GS, WP, S, bb, x0, e0, cmask, nv, ZH, NZH - n * MB,
                         D, BD, RB, BC, PREC)
        xhb, rstdb = _ln_stats(Zb, cmask, D, eps)
        # out = Q + γ x̂(Z̄) + β
        do = tl.load(DOUT + xo_i, mask=xm_i, other=0.0).to(cdt)
        gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
        po = (pid * NMB + n) * NRB + i
        tl.store(DLNWP + po * D + cols, tl.sum(do * xhb, axis=0), mask=cmask)
        tl.store(DLNBP + po * D + cols, tl.sum(do, axis=0), mask=cmask)
        dZb = _ln_bwd(do * gamma[None, :], xhb, rstdb, cmask, D)
        tl.store(DZB + xo_i, dZb, mask=xm_i)
        tl.debug_barrier()                      # ∂Z̄_i is read back below
        # Z̄ = Q W1 + b1 − M Γ, M = tril(E ⊙ (A + 1)), E_ij = τ_i η_j, A = Q Kᵀ: the blocks j ≤ i
        # (A and ∂Z̄ Γᵀ from Q, K, ∂Z̄, Γ in global memory, ``_rows_dot_t``); ∂out, the first term
        # of ∂Q, is read again at the end, not held through these loops
        dq = tl.zeros([RB, BD], dtype=cdt)
        dtau = tl.zeros([RB], dtype=cdt)
        ol_i = x0 + tl.minimum(rows_i, nv - 1) * D
        for j in range(i + 1):
            rows_j = j * RB + rl
            ol_j = x0 + tl.minimum(rows_j, nv - 1) * D
            e = tl.load(ETA + e0 + rows_j, mask=rows_j < nv, other=0.0).to(cdt)
            A = _rows_dot_t(tl.zeros([RB, RB], dtype=cdt), XQ, ol_i, XK, ol_j, D, BD, BC, PREC)
            # (rows i ≥ nv read ∂Z̄ of row nv − 1: masked here, so that their ∂τ is 0)
            dM = tl.where((rows_j[None, :] <= rows_i[:, None]) & rmask_i[:, None],
                          -_rows_dot_t(tl.zeros([RB, RB], dtype=cdt), DZB, ol_i, GS, ol_j, D, BD, BC, PREC), 0.0)
            dtau += tl.sum(dM * (A + 1.0) * e[None, :], axis=1)
            k = tl.load(XK + ol_j[:, None] + cols[None, :], mask=cmask[None, :], other=0.0).to(cdt)
            dq += _dot(dM * (tau_i[:, None] * e[None, :]), k, PREC)
        tl.store(DTAUP + (pid * NMB + n) * MB + rows_i, dtau, mask=rows_i < MB)     # 0 past nv
        # ∂Z̄ W1ᵀ, BC columns of W1 (and of ∂Z̄, read back from DZB) at a time
        for c in range(BD // BC):
            cc = c * BC + tl.arange(0, BC)
            ccm = cc < D
            dZbc = tl.load(DZB + x0 + tl.minimum(rows_i, nv - 1)[:, None] * D + cc[None, :], mask=ccm[None, :],
                           other=0.0)
            dq += _dot(dZbc, tl.load(WP + cc[:, None] + cols[None, :] * D, mask=ccm[:, None] & cmask[None, :], other=0.0), PREC)
        dq += tl.load(DOUT + xo_i, mask=xm_i, other=0.0).to(cdt)
        tl.store(DXQ + xo_i, dq.to(DXQ.dtype.element_ty), mask=xm_i)

    tl.debug_barrier()                          # pass 2 reads every block's ∂Z̄
    for j in range(NRB):
        rows_j = j * RB + rl
        rmask_j = rows_j < nv
        xm_j = rmask_j[:, None] & cmask[None, :]
        xo_j = x0 + rows_j[:, None] * D + cols[None, :]
        ol_j = x0 + tl.minimum(rows_j, nv - 1) * D
        e = tl.load(ETA + e0 + rows_j, mask=rmask_j, other=0.0).to(cdt)
        dG = tl.zeros([RB, BD], dtype=cdt)
        dk = tl.zeros([RB, BD], dtype=cdt)
        de = tl.zeros([RB], dtype=cdt)
        for i in range(j, NRB):
            rows_i = i * RB + rl
            ol_i = x0 + tl.minimum(rows_i, nv - 1) * D
            tau_i = tl.load(TAU + rows_i, mask=rows_i < nv, other=0.0).to(cdt)
            A = _rows_dot_t(tl.zeros([RB, RB], dtype=cdt), XQ, ol_i, XK, ol_j, D, BD, BC, PREC)
            tril = rows_j[None, :] <= rows_i[:, None]
            Ev = tau_i[:, None] * e[None, :]
            M = tl.where(tril, Ev * (A + 1.0), 0.0)
            dM = tl.where(tril, -_rows_dot_t(tl.zeros([RB, RB], dtype=cdt), DZB, ol_i, GS, ol_j, D, BD, BC, PREC), 0.0)
            de += tl.sum(dM * (A + 1.0) * tau_i[:, None], axis=0)
            dZb = tl.load(DZB + ol_i[:, None] + cols[None, :], mask=cmask[None, :], other=0.0).to(cdt)
            dG -= _dot(tl.trans(M), dZb, PREC)
            q = tl.load(XQ + ol_i[:, None] + cols[None, :], mask=cmask[None, :], other=0.0).to(cdt)
            dk += _dot(tl.trans(dM * Ev), q, PREC)
        tl.store(DG0 + xo_j, dG, mask=xm_j)
        tl.store(DKP + xo_j, dk, mask=xm_j)
        tl.store(DEP + e0 + rows_j, de, mask=rmask_j)


@triton.jit
def _ttt_linear_bwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, WS, BS, DWF, DBF, DGWF, DGBF, DKP, DEP, DG0, DZB,
                           DXK, DXV, DETA, DTAU, DLNW, DLNB, DW0, DB0, DWT, SCR,
                           CU, CS, CI, T, NMB, LAST, H, NC, eps,
                           D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                           BC: tl.constexpr, RB: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr):
    """The part of the backward that carries (dW1, db1) from the last mini-batch to the first:
    one program per batch·head, after ``_ttt_linear_bwd_mb_kernel``, whose partial ∂XK, ∂η, ∂Γ
    and ∂Z̄ it completes through the update W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ) and Γ's dependence on Z.
    Within a mini-batch every row is independent given the carried (dW1, db1) at its end (Z, Γ,
    P = K dW1 + db1, the LayerNorm's second derivative, ∂Z, ∂K are row by row); the rows meet only
    in sums (the update Qᵀ∂Z̄ + Kᵀ∂Z of dW1, and ∂b1, ∂τ, ∂γ, ∂β). So a mini-batch runs in blocks
    of RB rows: each block's [RB, d] LayerNorm intermediates are computed, used and dropped, and
    its share of the sums is added to the other dW1 slot (the first block adds it to dW1 itself).
    Every product with a [d, d] operand (W1, dW1, the update) runs BC columns of it at a time; the
    [RB, BC] column tiles of a product or of a [RB, d] operand pass through four [RB, BD] scratch
    tiles in ``SCR`` (per program; float32; a fifth holds the row blocks' parts of ∂b1), so at most
    a [BD, BC] tile of a weight is live.

    A partial last mini-batch (LAST < b valid rows) has no update: its end weights are its start
    weights (dW1 carries through unchanged but for Qᵀ∂Z̄ + Kᵀ∂Z) and its gradient sums
    U = Kᵀ(η⊙Γ), Σ η Γ are outputs, with gradients DGWF, DGBF. Both cases are one rule: with
    Y = dW1_end, y = db1_end, c = −τ_{b−1} for an update and Y = ∂U, y = ∂(Σ η Γ), c = 1 for the sums,
    P = K Y + y, ∂(η⊙Γ) = c P, ∂K += c (η⊙Γ) Yᵀ."""
    pid = tl.program_id(0)                             # = b_idx * H + h_idx (packed: sequence * H + h_idx)
    h = pid % H
    ts = 0                                             # token shift (packed: onto the sequence's rows)
    if VARLEN:
        xs, es, ms, NMB, LAST = _packed_serial(CU, CS, pid, h, T, H, NC, D, MB)
        # the [·, H, T, d] and [·, H, T] tensors are reached by shifting the body's token index by
        # es (xs = es·d; int32 is exact: N·H·T·d < 2^31, checked by the wrapper), not by moving
        # their eleven base pointers, held in registers through the kernel (with those, float32 at
        # d = 128, b = 64 spilled 32 B on sm_80)
        ts = es.to(tl.int32)
        WS, BS = WS + ms * D * D, BS + ms * D
        DLNW, DLNB = DLNW + ms * (BT // RB) * D, DLNB + ms * (BT // RB) * D
    cdt = DW0.dtype.element_ty
    cols = tl.arange(0, BD)
    cmask = cols < D
    wmask = cmask[:, None] & cmask[None, :]
    woff = cols[:, None] * D + cols[None, :]
    rl = tl.arange(0, RB)                              # rows within a row block
    soff = rl[:, None] * BD + cols[None, :]            # a whole scratch tile
    tau_last = tl.load(TAU + MB - 1).to(cdt)
    S_Z = SCR + pid * 4 * RB * BD                      # Z = K W1 (read back whole)
    S_P = S_Z + RB * BD                                # P = K dW1 (read back whole)
    S_E = S_P + RB * BD                                # η⊙Γ (read by column tiles)
    S_X = S_E + RB * BD                                # ∂Z (read by column tiles)
    S_B = S_X + RB * BD                                # each row block's part of ∂b1 (one row each)

    # gradients with respect to the weights at the END of the current mini-batch; dW1 lives in the
    # two slots of DWT [2, d, d] (global memory), not in registers: read in slot i % 2 where a
    # product needs it, the update written to the other slot during the mini-batch
    DWT = DWT + pid * 2 * D * D
    # a partial last mini-batch (the first walked) reads ∂U as "Y" from slot 0 and adds its
    # Qᵀ∂Z̄ + Kᵀ∂Z to dW1_end, put in slot 1 (see above)
    lpart = (woff * 0 + LAST) < MB
    dWF_t = tl.load(DWF + pid * D * D + woff, mask=wmask, other=0.0).to(cdt)
    tl.store(DWT + woff, tl.where(lpart, tl.load(DGWF + pid * D * D + woff, mask=wmask, other=0.0).to(cdt), dWF_t),
             mask=wmask)
    tl.store(DWT + D * D + woff, dWF_t, mask=wmask)
    dbb = tl.load(DBF + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    dtau = tl.sum(tl.zeros([BD], dtype=cdt), axis=0)   # ∂τ_{b−1} (the update's scale)
    tl.debug_barrier()

    for i in range(NMB):
        n = NMB - 1 - i
        dWP = DWT + (i % 2) * D * D
        dWQ = DWT + ((i + 1) % 2) * D * D
        WP = WS + (pid * NMB + n) * D * D
        nv = tl.where(n == NMB - 1, LAST, MB)           # valid rows
        part = nv < MB                                 # a partial last mini-batch: sums, no update
        cf = tl.where(part, 1.0, -tau_last)
        for rb in range(BT // RB):
            # γ, β, b1 loaded per row block: not held through the block's LayerNorm
            gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
            beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
            bb = tl.load(BS + (pid * NMB + n) * D + cols, mask=cmask, other=0.0).to(cdt)
            rows = rb * RB + rl
            rmask = rows < nv
            xmask = rmask[:, None] & cmask[None, :]
            t_off = n * MB + rows + ts
            xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
            k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
            v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
            e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
            xh, rstd, r, G = _mini_batch_grad_cols(k, v, WP, S_Z, bb, gamma, beta, cmask, D, BD, RB, BC, eps, PREC)

            # end-of-mini-batch update W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ), b1' = b1 − τ_{b−1} Σ η Γ (or the
            # sums of a partial one): P = K Y + y and ∂K through it, c (η⊙Γ) Yᵀ, column tile by
            # column tile (Y = dW1 or ∂U, see above)
            # (K's [RB, BC] column tiles read from XK: a product over d with a [RB, BC] result from
            # the whole [RB, d] K in registers would put all of K in every warp)
            tl.store(S_E + soff, e[:, None] * G)
            for c in range(BD // BC):
                cc = c * BC + tl.arange(0, BC)
                pc = tl.zeros([RB, BC], dtype=cdt)
                for kk in range(BD // BC):
                    kc = kk * BC + tl.arange(0, BC)
                    kt = tl.load(XK + pid * T * D + t_off[:, None] * D + kc[None, :],
                                 mask=rmask[:, None] & (kc[None, :] < D), other=0.0).to(cdt)
                    Yc = tl.load(dWP + kc[:, None] * D + cc[None, :], mask=(kc[:, None] < D) & (cc[None, :] < D), other=0.0)
                    pc += _dot(kt, Yc, PREC)
                tl.store(S_P + rl[:, None] * BD + cc[None, :], pc)
            tl.debug_barrier()
            yb = tl.where(part, tl.load(DGBF + pid * D + cols, mask=cmask & ((cols * 0 + nv) < MB), other=0.0).to(cdt), dbb)
            P = tl.load(S_P + soff) + yb[None, :]
            GP = tl.sum(G * P, axis=1)
            dG = tl.load(DG0 + xoff, mask=xmask, other=0.0).to(cdt) + cf * e[:, None] * P
            de = tl.load(DEP + pid * T + t_off, mask=rmask, other=0.0).to(cdt) + cf * GP
            tl.store(DETA + pid * T + t_off, de.to(DETA.dtype.element_ty), mask=rmask)
            dtau += tl.where(part, 0.0, -tl.sum(e * GP, axis=0))
            # Γ = (ĝ − mean ĝ − x̂ mean(ĝ x̂)) / σ with ĝ = γ r, r = γ x̂ + β − (V − K), x̂, σ of Z
            dgh = _ln_bwd(dG, xh, rstd, cmask, D)
            c2 = tl.sum(gamma[None, :] * r * xh, axis=1) / D
            mux = tl.sum(dG * xh, axis=1) / D
            dxh = (-(dG * c2[:, None] + gamma[None, :] * r * mux[:, None]) * rstd[:, None]
                   + gamma[None, :] * gamma[None, :] * dgh)
            dsig = -tl.sum(dG * G, axis=1) * rstd
            # ∂γ, ∂β: one partial sum per (mini-batch, row block), summed outside (not carried)
            po = (pid * NMB + n) * (BT // RB) + rb
            tl.store(DLNW + po * D + cols, tl.sum(dgh * (gamma[None, :] * xh + r), axis=0), mask=cmask)
            tl.store(DLNB + po * D + cols, tl.sum(dgh * gamma[None, :], axis=0), mask=cmask)
            dtgt = -gamma[None, :] * dgh
            tl.store(DXV + xoff, dtgt.to(DXV.dtype.element_ty), mask=xmask)          # target = V − K
            dZ = _ln_bwd(dxh, xh, rstd, cmask, D) + tl.where(cmask[None, :], dsig[:, None] * xh / D, 0.0)
            dZb = tl.load(DZB + xoff, mask=xmask, other=0.0).to(cdt)
            # ∂b1 of this row block, summed over the blocks once the mini-batch is done (not carried)
            tl.store(S_B + rb * BD + cols, tl.sum(dZb, axis=0) + tl.sum(dZ, axis=0))
            # ∂K: the per-mini-batch part, through the update (with dW1 of the end of this
            # mini-batch), through Z (∂Z W1ᵀ) and through the target
            dk = -dtgt
            # Z = K W1 + b1, Z̄ = Q W1 + b1 − M Γ: dW1_start = dW1_end + Qᵀ ∂Z̄ + Kᵀ ∂Z (this row
            # block's share), and ∂Z W1ᵀ, one BC-column tile of W1, ∂Z and ∂Z̄ at a time (∂Z through
            # the scratch, ∂Z̄ from DZB)
            tl.store(S_X + soff, dZ)
            tl.debug_barrier()
            q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
            k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)     # read again: not held through the LayerNorm
            for c in range(BD // BC):
                cc = c * BC + tl.arange(0, BC)
                ccm = cc < D
                dZc = tl.load(S_X + rl[:, None] * BD + cc[None, :])
                dZbc = tl.load(DZB + pid * T * D + t_off[:, None] * D + cc[None, :], mask=rmask[:, None] & ccm[None, :],
                               other=0.0).to(cdt)
                # the update's columns cc as [BC, d] rows (a product of BC rows, not d)
                updT = _dot(tl.trans(dZbc), q, PREC) + _dot(tl.trans(dZc), k, PREC)
                wc = cc[:, None] + cols[None, :] * D
                wcm = ccm[:, None] & cmask[None, :]
                Yt = tl.load(dWP + wc, mask=wcm, other=0.0)       # dW1_end (∂U for a partial one)
                # the first row block starts the other slot from dW1_end, later ones add to it
                # the first row block of a full mini-batch starts the other slot from dW1_end
                first = (rb == 0) & (nv == MB)
                acc = tl.load(dWQ + wc, mask=wcm & ((wc * 0 + first.to(tl.int32)) == 0), other=0.0)
                tl.store(dWQ + wc, tl.where(first, Yt, acc) + updT, mask=wcm)
                # last, so that the loop's last tl.dot, whose warp layout every product takes, is a [RB, d] one
                dk += (_dot(dZc, tl.load(WP + wc, mask=wcm, other=0.0), PREC)
                       + cf * _dot(tl.load(S_E + rl[:, None] * BD + cc[None, :]), Yt, PREC))
            dk += tl.load(DKP + xoff, mask=xmask, other=0.0).to(cdt)
            tl.store(DXK + xoff, dk.to(DXK.dtype.element_ty), mask=xmask)
            tl.debug_barrier()                  # the next row block reuses the scratch, adds to dWQ
        dbb += tl.sum(tl.load(S_B + soff, mask=(rl[:, None] < BT // RB) & cmask[None, :], other=0.0), axis=0)
        tl.debug_barrier()

    tl.store(DW0 + pid * D * D + woff, tl.load(DWT + (NMB % 2) * D * D + woff, mask=wmask, other=0.0), mask=wmask)
    tl.store(DB0 + pid * D + cols, dbb, mask=cmask)
    rows = tl.arange(0, BT)
    tl.store(DTAU + pid * MB + rows, tl.where(rows == MB - 1, dtau, 0.0), mask=rows < MB)


# ---- autograd -----------------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` mode for inputs of ``dtype`` (see ``_dot``)."""
    if dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return "tf32x3"
    return "bf16_emulated" if is_interpreting() else "bf16"


#: num_warps of the TTT-Linear kernels per GPU family (``device_arch``): (arch, kernel, bf16
#: operands, BD, BT) -> warps, kernel one of ``_LINEAR_KERNELS``.
#: Triton gives every tl.dot of a kernel the warp layout it picks for the last one, which for
#: chained products puts all warps along one dimension of the [b, d] tile (rows when b ≥ d,
#: columns otherwise): at b = 16 the warps split the columns, and more warps hold less of each
#: tile (the state pass at d = 64, and on sm_80 at d = 128, fits 4); at b = d = 64 they split the
#: 64 rows (16 per warp at 4 warps; 8 duplicate the tiles of an sm_80 MMA, whose warps take 16
#: rows each). Checked by ``python -m kernels.compile_report --op ttt``; 16 warps (at most 128
#: registers a thread) spill more than 8 wherever 8 spill. The bf16 per-mini-batch backward at
#: d = 128, b = 64 on sm_90 takes 4: with the head's Z̄ offset (ZH, ``_zbar_block``) it spilled
#: 12 B with 8 warps (255 registers; 180 without that load), none with 4 (187 registers).
_LINEAR_WARPS = {
    (90, "out", False, 64, 16): 4, (90, "out", False, 64, 64): 4,
    (90, "state", True, 64, 16): 4, (80, "state", True, 64, 16): 4,
    (80, "state", True, 128, 16): 4, (80, "state", False, 128, 16): 4,
    (90, "bwd_mb", True, 128, 64): 4,
}


#: the TTT-Linear kernels by launch-config name: forward state pass, forward output, backward
#: per mini-batch, backward carry
_LINEAR_KERNELS = ("state", "out", "bwd_mb", "bwd")
#: the kernels whose products with a [d, d] operand run BC columns of it at a time (all of them)
_COLUMN_TILED = _LINEAR_KERNELS
#: the kernels that walk a mini-batch in blocks of ``_LINEAR_RB`` rows (its [RB, d] LayerNorm
#: intermediates live in registers, not the [b, d] ones)
_ROW_BLOCKED = _LINEAR_KERNELS
#: rows per row block (tl.dot needs ≥ 16; BT is a multiple of it)
_LINEAR_RB = 16
#: BC per (arch, kernel, bf16 operands, BD, BT), 16 where it names none: 32 where 16 spills and
#: 32 does not (by the compile gate): float32 at d = 128 — the state pass on sm_80, the
#: per-mini-batch backward on sm_80 and at b = 64 on sm_90, and the backward carry on both — and
#: the bf16 per-mini-batch backward at d = 128, b = 64 on both
_LINEAR_BC = {(80, "state", False, 128, 16): 32, (80, "state", False, 128, 64): 32,
              (90, "bwd_mb", False, 128, 64): 32, (80, "bwd_mb", False, 128, 16): 32,
              (80, "bwd_mb", False, 128, 64): 32,
              (90, "bwd_mb", True, 128, 64): 32, (80, "bwd_mb", True, 128, 64): 32,
              (90, "bwd", False, 128, 16): 32, (80, "bwd", False, 128, 16): 32,
              (90, "bwd", False, 128, 64): 32, (80, "bwd", False, 128, 64): 32}


#: the weight column tile BC of the packed variants where it differs from ``_LINEAR_BC``: the bf16
#: per-mini-batch backward at d = 128, b = 64 on sm_90 spilled 8 B with 32 columns, none with 64
_LINEAR_BC_PACKED = {(90, "bwd_mb", True, 128, 64): 64}
#: num_warps of the packed (``cu_seqlens``) variants where they differ from ``_LINEAR_WARPS``: the
#: float32 output kernel at d = 64 on sm_80 spilled 4 B with 8 warps (the slot-table lookup's
#: registers on top of the fixed-length kernel's), none with 4; the bf16 per-mini-batch backward at
#: d = 128, b = 64 on sm_90 keeps 8 when packed (with its 64 columns: 36 B spilled with 4)
_LINEAR_WARPS_PACKED = {(80, "out", False, 64, 16): 4, (80, "out", False, 64, 64): 4,
                        (90, "bwd_mb", True, 128, 64): 8}


def _launch_cfg(d: int, b: int, kernel: str = "state", half: bool = True, arch: int = INTERPRET_ARCH,
                packed: bool = False):
    """Padded tile sizes (tl.dot needs every block dim ≥ 16) and launch options of TTT-Linear
    ``kernel`` (one of ``_LINEAR_KERNELS``) for GPU family ``arch`` (90 or 80, ``device_arch``; ``half``:
    bf16 operands, False for 3×TF32 with float32 inputs). num_warps from ``_LINEAR_WARPS``, 8 where
    it names none (W1 and dW1 live in global memory, the [b, d] and [b, b] tiles in registers); the
    weight column tile BC from ``_LINEAR_BC`` (16 under the interpreter)."""
    if kernel not in _LINEAR_KERNELS:
        raise ValueError(f"_launch_cfg: unknown TTT-Linear kernel {kernel!r}")
    BD = max(16, triton.next_power_of_2(d))
    BT = max(16, triton.next_power_of_2(b))
    bc = (_LINEAR_BC_PACKED.get((arch, kernel, half, BD, BT)) if packed else None) or _LINEAR_BC.get((arch, kernel, half, BD, BT), 16)
    tiles = {"BC": min(BD, bc)} if kernel in _COLUMN_TILED else {}
    if kernel in _ROW_BLOCKED:
        tiles["RB"] = _LINEAR_RB
    if is_interpreting():                   # 16 columns, so that the tests at d = 32 walk two tiles
        return BD, BT, {k: 16 for k in tiles}
    key = (arch, kernel, half, BD, BT)
    warps = _LINEAR_WARPS_PACKED.get(key) if packed else None
    warps = warps or _LINEAR_WARPS.get(key, 8)
    return BD, BT, {"num_warps": warps, "num_stages": 1, **tiles}


# The ops are PyTorch custom ops (torch.library): torch.compile (model.compile) captures each as one
# opaque node of the block's graph, with shapes from the fake implementations and the backward
# registered below, instead of tracing the Triton launches or breaking the graph.
def _linear_window() -> int:
    """Mini-batches per state-pass/output window of a forward without autograd (``_linear_fwd_op``):
    2 under the interpreter, so that the tests run several windows."""
    return 2 if is_interpreting() else 64


def _linear_mini_batch_buffers(XQ, NMB: int):
    """Empty buffers for what the state pass stores per mini-batch: the start weights (WS, BS) and
    Γ (GS), read by the output kernel and the backward."""
    B, H, T, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    # the stored start weights and Γ enter the output kernel and the backward only as tl.dot
    # operands: with bf16 operands they are stored in bfloat16 (the same rounding the products
    # see; half the registers and traffic)
    ws_dt = torch.bfloat16 if _precision(XQ.dtype).startswith("bf16") else cdt
    return (XQ.new_empty(B, H, NMB, d, d, dtype=ws_dt), XQ.new_empty(B, H, NMB, d, dtype=cdt),
            XQ.new_empty(B, H, T, d, dtype=ws_dt))


def _zh_arg(zh: Optional[torch.Tensor], XQ: torch.Tensor):
    """The output kernels' ZH pointer and its row count NZH: ``zh`` (checked, contiguous) and its T,
    or, without a head, a one-element placeholder of the same dtype and 0 (a pointer either way,
    so that both launches are the one compiled variant the gate checks)."""
    cdt = acc_dtype(XQ.dtype)
    if zh is None:
        return torch.empty(1, dtype=cdt, device=XQ.device), 0      # never read (NZH = 0)
    if zh.shape != XQ.shape or zh.dtype != cdt:
        raise ValueError(f"ttt_linear_triton: zh must be {tuple(XQ.shape)} {cdt}, got {tuple(zh.shape)} {zh.dtype}")
    return zh.contiguous(), XQ.shape[2]


@torch.library.custom_op("kernels::ttt_linear_fwd", mutates_args=())
def _linear_fwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                   ln_w: torch.Tensor, ln_b: torch.Tensor, W0: torch.Tensor, b0: torch.Tensor,
                   mini_batch_size: int, save: bool, cu_seqlens: Optional[torch.Tensor] = None,
                   zh: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    """T ≥ 1 tokens from a mini-batch boundary: (XQ, XK, XV, η, τ, γ, β, W1_0 [B,H,d,d], b1_0
    [B,H,1,d]) → (out [B,H,T,d], W1_end, b1_end, grad_W1_end, grad_b1_end, and the per-mini-batch
    start weights WS, BS and Γ (GS) that the output kernel and the backward read). When T is not a
    multiple of b the last mini-batch is partial: W1_end, b1_end are its start weights and
    grad_W1_end, grad_b1_end its sums Σ η_s ∇ℓ_s (the state contract's mid-mini-batch state);
    otherwise the sums are zero.

    With ``save`` the start weights of every mini-batch are kept for the backward (one state pass
    and one output launch over the whole sequence); without it the sequence runs in windows of
    ``_linear_window`` mini-batches, the state carried from one window to the next in the
    final-weight buffers, so the stored start weights stay bounded in T (the returned WS, BS are
    then the last window's scratch, which nothing reads).

    With ``zh`` (the shape of XQ, in the accumulation dtype) row t of it is added to Z̄_t before the
    output LayerNorm: the head (``ttt_linear_triton``) passes −τ_t (q_t G + Gb) for the sums G, Gb
    carried in its state; its gradient is ∂Z̄ (``_linear_bwd_op``).

    With ``cu_seqlens`` (int32 [N+1], checked by the caller; B = 1) the N packed sequences run in
    one launch of each kernel (``_linear_fwd_packed``): W0, b0 and the end states are [N, H, …]."""
    if cu_seqlens is not None:
        return _linear_fwd_packed(XQ, XK, XV, eta, tau, ln_w, ln_b, W0, b0, mini_batch_size, cu_seqlens)
    B, H, T, d = XQ.shape
    bsz = mini_batch_size
    NMB = -(-T // bsz)
    LAST = T - (NMB - 1) * bsz                  # valid rows of the last mini-batch
    NW = NMB if save else min(NMB, _linear_window())
    cdt = acc_dtype(XQ.dtype)
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    W0c = W0.to(cdt).contiguous()
    b0c = b0.to(cdt).contiguous()
    out = torch.empty_like(XQ)
    prec = _precision(XQ.dtype)
    WS, BS, GS = _linear_mini_batch_buffers(XQ, NW)
    WF = torch.empty(B, H, d, d, dtype=cdt, device=XQ.device)
    BF = torch.empty(B, H, 1, d, dtype=cdt, device=XQ.device)
    GWF = torch.zeros(B, H, d, d, dtype=cdt, device=XQ.device)       # the sums of a partial last
    GBF = torch.zeros(B, H, 1, d, dtype=cdt, device=XQ.device)       # mini-batch (zero otherwise)
    WT = torch.empty(B, H, 2, d, d, dtype=cdt, device=XQ.device)     # the state pass' two W1 slots
    half, arch = XQ.dtype in (torch.bfloat16, torch.float16), device_arch(XQ.device)
    BDs, BTs, kws = _launch_cfg(d, bsz, "state", half=half, arch=arch)
    SCR = torch.empty(B, H, 3, kws["RB"], BDs, dtype=cdt, device=XQ.device)  # its [RB, d] scratch tiles
    BDo, BTo, kwo = _launch_cfg(d, bsz, "out", half=half, arch=arch)
    SCRO = torch.empty(B, H, NW, BTo, BDo, dtype=cdt, device=XQ.device)   # [RB, BD] per row block
    ZH, NZH = _zh_arg(zh, XQ)
    w_in, b_in = W0c, b0c
    for n0 in range(0, NMB, max(NW, 1)):
        nw = min(NW, NMB - n0)
        # views from the window's first token: the kernels index rows within a head with stride d
        # and heads with stride T·d, so a view at an offset needs no copy (GS has the inputs' layout)
        t0 = n0 * bsz
        q_w, k_w, v_w, e_w, g_w, o_w = (x[:, :, t0:] for x in (XQ, XK, XV, eta, GS, out))
        z_w = ZH[:, :, t0:] if NZH else ZH
        # the state pass reads its start weights (W0, B0) before it writes the end ones (WF, BF), so
        # a window may start from the previous window's end buffers
        last = LAST if n0 + nw == NMB else bsz
        _ttt_linear_state_kernel[(B * H,)](
            k_w, v_w, e_w, tau_c, lw, lb, w_in, b_in, WS, BS, g_w, WF, BF, GWF, GBF, WT, SCR,
            None, None, None, T, nw, last, H, 0, LN_EPS, D=d, BD=BDs, MB=bsz, BT=BTs, PREC=prec, VARLEN=False, **kws)
        _ttt_linear_out_kernel[(B * H, nw, BTo // kwo["RB"])](
            q_w, k_w, e_w, tau_c, lw, lb, WS, BS, g_w, o_w, SCRO, z_w,
            None, None, None, T, nw, last, H, 0, max(NZH - t0, 0), LN_EPS, D=d, BD=BDo, MB=bsz, BT=BTo, PREC=prec, VARLEN=False, **kwo)
        w_in, b_in = WF, BF
    return out, WF, BF, GWF, GBF, WS, BS, GS


def _linear_fwd_packed(XQ, XK, XV, eta, tau, ln_w, ln_b, W0, b0, bsz: int, cu_seqlens):
    """The forward of a packed batch, one launch of each kernel: the state pass one program per
    (sequence, head), walking that sequence's mini-batches from its own start weights (W0, b0
    [N, H, …]); the output kernel one program per (head, mini-batch slot, row block) over the
    ⌊T/b⌋ + N slots of ``packed_chunk_tables`` (spare slots masked). Every start weight is stored
    (no windows: a window of mini-batches would cut across sequences); they take d/b times the
    memory of XQ (H · (⌊T/b⌋ + N) · d² numbers), the same as a forward under autograd."""
    _, H, T, d = XQ.shape
    N, NC, CS, CI = packed_chunk_tables(T, bsz, cu_seqlens)
    cdt = acc_dtype(XQ.dtype)
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    W0c, b0c = W0.to(cdt).contiguous(), b0.to(cdt).contiguous()
    out = torch.empty_like(XQ)
    prec = _precision(XQ.dtype)
    WS, BS, GS = _linear_mini_batch_buffers(XQ, NC)
    # the spare slots (past the last mini-batch) are read by the masked programs of the output
    # kernel and the backward but written by no one: zeros, so that their partial sums are zero
    WS.zero_()
    BS.zero_()
    dev = XQ.device
    WF = torch.empty(N, H, d, d, dtype=cdt, device=dev)
    BF = torch.empty(N, H, 1, d, dtype=cdt, device=dev)
    GWF = torch.zeros(N, H, d, d, dtype=cdt, device=dev)
    GBF = torch.zeros(N, H, 1, d, dtype=cdt, device=dev)
    WT = torch.empty(N, H, 2, d, d, dtype=cdt, device=dev)
    half, arch = XQ.dtype in (torch.bfloat16, torch.float16), device_arch(dev)
    BDs, BTs, kws = _launch_cfg(d, bsz, "state", half=half, arch=arch)
    SCR = torch.empty(N, H, 3, kws["RB"], BDs, dtype=cdt, device=dev)
    BDo, BTo, kwo = _launch_cfg(d, bsz, "out", half=half, arch=arch, packed=True)
    SCRO = torch.empty(1, H, NC, BTo, BDo, dtype=cdt, device=dev)
    _ttt_linear_state_kernel[(N * H,)](
        XK, XV, eta, tau_c, lw, lb, W0c, b0c, WS, BS, GS, WF, BF, GWF, GBF, WT, SCR,
        cu_seqlens, CS, CI, T, 0, 0, H, NC, LN_EPS, D=d, BD=BDs, MB=bsz, BT=BTs, PREC=prec, VARLEN=True, **kws)
    _ttt_linear_out_kernel[(H, NC, BTo // kwo["RB"])](
        XQ, XK, eta, tau_c, lw, lb, WS, BS, GS, out, SCRO, _zh_arg(None, XQ)[0],
        cu_seqlens, CS, CI, T, 0, 0, H, NC, 0, LN_EPS, D=d, BD=BDo, MB=bsz, BT=BTo, PREC=prec, VARLEN=True, **kwo)
    return out, WF, BF, GWF, GBF, WS, BS, GS


@_linear_fwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, W0, b0, mini_batch_size, save, cu_seqlens=None, zh=None):
    B, H, T, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    NMB = -(-T // mini_batch_size)
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
        WS, BS, GS = _linear_mini_batch_buffers(XQ, T // mini_batch_size + B)
    else:
        WS, BS, GS = _linear_mini_batch_buffers(XQ, NMB if save else min(NMB, _linear_window()))
    return (torch.empty_like(XQ), XQ.new_empty(B, H, d, d, dtype=cdt), XQ.new_empty(B, H, 1, d, dtype=cdt),
            XQ.new_empty(B, H, d, d, dtype=cdt), XQ.new_empty(B, H, 1, d, dtype=cdt), WS, BS, GS)


@torch.library.custom_op("kernels::ttt_linear_bwd", mutates_args=())
def _linear_bwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                   ln_w: torch.Tensor, ln_b: torch.Tensor, WS: torch.Tensor, BS: torch.Tensor, GS: torch.Tensor,
                   dout: Optional[torch.Tensor], dWF: Optional[torch.Tensor], dBF: Optional[torch.Tensor],
                   dGWF: Optional[torch.Tensor], dGBF: Optional[torch.Tensor],
                   mini_batch_size: int, W_dt: torch.dtype, b_dt: torch.dtype,
                   cu_seqlens: Optional[torch.Tensor] = None, zh: Optional[torch.Tensor] = None
                   ) -> List[torch.Tensor]:
    """Gradients of the nine tensor inputs of ``_linear_fwd_op``, then ∂Z̄ (the gradient of its
    ``zh``; every row of a fixed-length call is written). With ``cu_seqlens`` (packed,
    B = 1): the per-mini-batch kernel one program per (head, slot), the carry one per (sequence,
    head), each sequence from the gradient of its own end state; ∂W0, ∂b0 are [N, H, …]."""
    bsz, tau_dt, lw_dt, lb_dt = mini_batch_size, tau.dtype, ln_w.dtype, ln_b.dtype
    cdt = BS.dtype
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    _, H, T, d = XQ.shape
    if cu_seqlens is None:
        B, NMB, CU, CS, CI, NC = XQ.shape[0], -(-T // bsz), None, None, None, 0
        grid_mb, grid_carry = (B * H, NMB), (B * H,)
    else:                   # NMB: the slots, as the buffers of per-mini-batch partial sums count them
        B, NC, CS, CI = packed_chunk_tables(T, bsz, cu_seqlens)
        CU, NMB = cu_seqlens, NC
        grid_mb, grid_carry = (H, NC), (B * H,)
    LAST = T - (NMB - 1) * bsz
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))    # the kernels index rows with stride d
    cdt = BS.dtype
    dev = XQ.device
    dout = torch.zeros_like(XQ) if dout is None else dout.contiguous()
    dWF = torch.zeros(B, H, d, d, dtype=cdt, device=dev) if dWF is None else dWF.to(cdt).contiguous()
    dBF = torch.zeros(B, H, 1, d, dtype=cdt, device=dev) if dBF is None else dBF.to(cdt).contiguous()
    dGWF = torch.zeros(B, H, d, d, dtype=cdt, device=dev) if dGWF is None else dGWF.to(cdt).contiguous()
    dGBF = torch.zeros(B, H, 1, d, dtype=cdt, device=dev) if dGBF is None else dGBF.to(cdt).contiguous()
    dXQ, dXK, dXV = (torch.empty_like(XQ) for _ in range(3))
    Bx = XQ.shape[0]                                                  # 1 when packed
    dETA = torch.empty_like(eta)
    dTAU = torch.empty(B, H, bsz, dtype=cdt, device=dev)
    NRB = max(16, triton.next_power_of_2(bsz)) // _LINEAR_RB       # row blocks per mini-batch
    # packed: the carry writes the row blocks of the slots in use only (the spare slots stay zero)
    new = torch.empty if cu_seqlens is None else torch.zeros
    dLNW = new(Bx, H, NMB * NRB, d, dtype=cdt, device=dev)
    dLNB = new(Bx, H, NMB * NRB, d, dtype=cdt, device=dev)
    dW0 = torch.empty(B, H, d, d, dtype=cdt, device=dev)
    dB0 = torch.empty(B, H, 1, d, dtype=cdt, device=dev)
    dWT = torch.empty(B, H, 2, d, d, dtype=cdt, device=dev)           # the second kernel's two dW1 slots
    # what the per-mini-batch kernel hands to the carrying one (float32; float64 for float64 inputs)
    dKP, dG0, dZB = (torch.empty(Bx, H, T, d, dtype=cdt, device=dev) for _ in range(3))
    dEP = torch.empty(Bx, H, T, dtype=cdt, device=dev)
    dTAUP = torch.empty(Bx, H, NMB, bsz, dtype=cdt, device=dev)
    half = XQ.dtype in (torch.bfloat16, torch.float16)
    arch, prec = device_arch(XQ.device), _precision(XQ.dtype)
    ZH, NZH = _zh_arg(zh, XQ)
    BD, BT, kw = _launch_cfg(d, bsz, "bwd_mb", half=half, arch=arch)
    dLNWP = torch.empty(Bx, H, NMB * (BT // kw["RB"]), d, dtype=cdt, device=dev)   # per row block
    dLNBP = torch.empty(Bx, H, NMB * (BT // kw["RB"]), d, dtype=cdt, device=dev)
    _ttt_linear_bwd_mb_kernel[grid_mb](
        XQ, XK, eta, tau_c, lw, lb, WS, BS, GS, dout,
        dXQ, dKP, dEP, dG0, dZB, dTAUP, dLNWP, dLNBP, torch.empty(Bx, H, NMB, kw["RB"], BD, dtype=cdt, device=dev),
        ZH, CU, CS, CI, T, NMB, LAST, H, NC, NZH, LN_EPS, D=d, BD=BD, MB=bsz, BT=BT, PREC=prec, VARLEN=CU is not None, **kw)
    BD, BT, kw = _launch_cfg(d, bsz, "bwd", half=half, arch=arch)
    SCR = torch.empty(B, H, 5, kw["RB"], BD, dtype=cdt, device=dev)   # its [RB, d] scratch tiles
    _ttt_linear_bwd_kernel[grid_carry](
        XQ, XK, XV, eta, tau_c, lw, lb, WS, BS, dWF, dBF, dGWF, dGBF, dKP, dEP, dG0, dZB,
        dXK, dXV, dETA, dTAU, dLNW, dLNB, dW0, dB0, dWT, SCR,
        CU, CS, CI, T, NMB, LAST, H, NC, LN_EPS, D=d, BD=BD, MB=bsz, BT=BT, PREC=prec, VARLEN=CU is not None, **kw)
    return [dXQ, dXK, dXV, dETA, (dTAU.sum((0, 1)) + dTAUP.sum((0, 1, 2))).to(tau_dt),
            (dLNW.sum((0, 2)) + dLNWP.sum((0, 2))).to(lw_dt), (dLNB.sum((0, 2)) + dLNBP.sum((0, 2))).to(lb_dt),
            dW0.to(W_dt), dB0.to(b_dt), dZB]


@_linear_bwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, WS, BS, GS, dout, dWF, dBF, dGWF, dGBF, mini_batch_size, W_dt, b_dt,
      cu_seqlens=None, zh=None):
    B, H, T, d = XQ.shape
    if cu_seqlens is not None:
        B = cu_seqlens.shape[0] - 1
    return [torch.empty_like(XQ), torch.empty_like(XK), torch.empty_like(XV), torch.empty_like(eta),
            torch.empty_like(tau), torch.empty_like(ln_w), torch.empty_like(ln_b),
            XQ.new_empty(B, H, d, d, dtype=W_dt), XQ.new_empty(B, H, 1, d, dtype=b_dt),
            XQ.new_empty(XQ.shape[0], H, T, d, dtype=acc_dtype(XQ.dtype))]


def _linear_setup_context(ctx, inputs, output):
    XQ, XK, XV, eta, tau, ln_w, ln_b, W0, b0, bsz, _, cu, zh = (tuple(inputs) + (None, None))[:13]
    ctx.save_for_backward(XQ, XK, XV, eta, tau, ln_w, ln_b, *output[5:], cu, zh)
    ctx.mark_non_differentiable(*output[5:])
    ctx.meta = (bsz, W0.dtype, b0.dtype)


def _linear_backward_rule(ctx, dout, dWF, dBF, dGWF, dGBF, *_):
    *saved, cu, zh = ctx.saved_tensors
    *grads, dzh = _linear_bwd_op(*saved, dout, dWF, dBF, dGWF, dGBF, *ctx.meta, cu, zh)
    return (*grads, None, None, None, dzh if zh is not None else None)


_linear_fwd_op.register_autograd(_linear_backward_rule, setup_context=_linear_setup_context)


# ---- public -------------------------------------------------------------------------------------
def _linear_head(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, bsz: int, st: dict, n: int):
    """The head in the kernels: the first n = min(b − p, T) tokens, completing the mini-batch begun
    in the state ``st`` at pos = p > 0 with start weights θ_0 = (W1, b1) and carried sums
    G = grad_W1, Gb = grad_b1 (Σ η_s ∇ℓ_s over its first p rows). One launch of the kernels over a
    single mini-batch of p + n rows, the first p absent: zero rows with η = 0 (so they enter no sum
    and no other row; their outputs are dropped), which puts the head's tokens at positions
    p … p + n − 1 (their τ). The carried sums enter twice, both linear in G: the output rows through
    ``zh`` = −τ_{p+i} (q_i G + Gb), added to Z̄ in the output kernel (its gradient ∂Z̄ comes back
    from the backward), and the end state: a completed mini-batch (p + n = b) ends at
    θ_0 − τ_{b−1} (G + Σ_head η ∇ℓ), i.e. the kernels' end weights − τ_{b−1} (G, Gb); a head that
    ends the call first (p + n < b) keeps θ_0 with the sums G + Σ_head η ∇ℓ and pos = p + n."""
    p = st["pos"]
    B, H, _, d = XQ.shape
    dt = acc_dtype(XQ.dtype)

    def pad(x):
        return torch.cat([x.new_zeros(*x.shape[:2], p, *x.shape[3:]), x[:, :, :n]], dim=2)

    xs = [pad(x) for x in (XQ, XK, XV, eta)]
    G, Gb = st["grad_W1"], st["grad_b1"]
    tau = token_idx.to(dt)
    tau_h = torch.cat([tau.new_zeros(p), tau[p:p + n]])            # 0 on the absent rows
    zh = -tau_h[:, None] * (xs[0].to(dt) @ G + Gb)
    ins = xs + [token_idx, ln_weight, ln_bias, st["W1"], st["b1"]]
    save = torch.is_grad_enabled() and any(x.requires_grad for x in ins + [zh])
    o, Wf, bf, gW, gb = _linear_fwd_op(*ins, bsz, save, None, zh)[:5]
    if p + n == bsz:
        st = {"W1": Wf - tau[bsz - 1] * G, "b1": bf - tau[bsz - 1] * Gb,
              "grad_W1": torch.zeros_like(gW), "grad_b1": torch.zeros_like(gb), "pos": 0}
    else:
        st = {"W1": Wf, "b1": bf, "grad_W1": gW + G, "grad_b1": gb + Gb, "pos": p + n}
    return o[:, :, p:], st


def ttt_linear_triton(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size=16,
                      initial_state: Optional[dict] = None, output_final_state: bool = False
                      ) -> Tuple[torch.Tensor, Optional[dict]]:
    """Same contract as ``kernels.ttt.ttt_linear``. Everything runs in the Triton kernels: the head
    (the tokens completing a mini-batch begun in ``initial_state``, pos > 0; ``_linear_head``) in
    one launch of them, then everything from the next mini-batch boundary in another, a trailing
    partial mini-batch included (its end state: its start weights and the sums Σ η_s ∇ℓ_s, pos =
    its length), chained through autograd."""
    if not 1 <= mini_batch_size <= _MAX_MB:
        raise ValueError(f"ttt_linear_triton: mini_batch_size must be in [1, {_MAX_MB}], got {mini_batch_size}")
    check_triton_device("ttt_linear_triton", XQ, XK, XV, eta)
    B, H, T, d = XQ.shape
    bsz = mini_batch_size
    dt = acc_dtype(XQ.dtype)
    st = make_state({"W1": W1, "b1": b1}, B, dt, initial_state)
    outs, t = [], 0
    if st["pos"] > 0 and T > 0:
        t = min(bsz - st["pos"], T)
        o, st = _linear_head(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, bsz, st, t)
        outs.append(o)
    if t < T:
        xs = [x[:, :, t:].contiguous() for x in (XQ, XK, XV, eta)]
        ins = xs + [token_idx, ln_weight, ln_bias, st["W1"], st["b1"]]
        # the per-mini-batch start weights serve the backward: without autograd they are kept for a
        # window of mini-batches at a time only
        save = torch.is_grad_enabled() and any(x.requires_grad for x in ins)
        o, Wf, bf, gW, gb = _linear_fwd_op(*ins, bsz, save)[:5]
        outs.append(o)
        st = {"W1": Wf, "b1": bf, "grad_W1": gW, "grad_b1": gb, "pos": (T - t) % bsz}
    out = torch.cat(outs, dim=2) if len(outs) > 1 else (outs[0] if outs else XQ.clone())
    return out, (st if output_final_state else None)


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """The packed batch's offsets as int32 on ``device``, checked there: one flag read back (the
    only copy to the host before the launches)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    if bool((cu[0] != 0) | (cu[-1] != T) | (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: cu_seqlens must rise from 0 to T = {T} without decreasing, got {cu_seqlens.tolist()}")
    return cu


def packed_launch_limit(H: int, T: int, d: int, N: int) -> Optional[str]:
    """Why one packed launch cannot take N sequences of T tokens in all (H heads of width d),
    or None when it can: it indexes (sequence, head) rows with int32 offsets."""
    if N * H * T * d >= 2 ** 31:
        return (f"a packed launch indexes (sequence, head) rows with int32 offsets: "
                f"N·H·T·d = {N * H * T * d} must be < 2^31; split the batch")
    return None


def ttt_linear_triton_packed(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size,
                             initial_state: Optional[dict], output_final_state: bool, cu_seqlens: torch.Tensor
                             ) -> Tuple[torch.Tensor, Optional[dict]]:
    """``kernels.ttt.ttt_linear`` with ``cu_seqlens`` (B = 1; the caller checks the weights' and
    ``initial_state``'s shapes and that every "pos" is 0): the N packed sequences in one launch of
    each kernel, each from its own start weights (``initial_state`` row n, or the weights
    arguments [H, …] / [1, H, …] for all), each ending in a partial mini-batch per its own length.
    The final state holds every tensor stacked [N, H, …] and "pos" as a list of N ints (read back
    after the launches)."""
    if not 1 <= mini_batch_size <= _MAX_MB:
        raise ValueError(f"ttt_linear_triton: mini_batch_size must be in [1, {_MAX_MB}], got {mini_batch_size}")
    check_triton_device("ttt_linear_triton", XQ, XK, XV, eta)
    _, H, T, d = XQ.shape
    cu = check_cu_seqlens("ttt_linear_triton", cu_seqlens, T, XQ.device)
    N = cu.numel() - 1
    why = packed_launch_limit(H, T, d, N)
    if why is not None:
        raise ValueError(f"ttt_linear_triton: {why}")
    if initial_state is not None:
        W0, b0 = initial_state["W1"], initial_state["b1"]
    else:
        W0, b0 = W1.reshape(1, H, d, d).expand(N, H, d, d), b1.reshape(1, H, 1, d).expand(N, H, 1, d)
    out, Wf, bf, gW, gb = _linear_fwd_op(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W0, b0,
                                         mini_batch_size, True, cu)[:5]
    if not output_final_state:
        return out, None
    pos = ((cu[1:] - cu[:-1]) % mini_batch_size).tolist()
    return out, {"W1": Wf, "b1": bf, "grad_W1": gW, "grad_b1": gb, "pos": pos}


__all__ = ["packed_launch_limit", "ttt_linear_triton", "ttt_linear_triton_packed"]
