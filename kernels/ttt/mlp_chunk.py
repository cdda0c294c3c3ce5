r"""TTT-MLP dual form in Triton, forward and backward (Sun et al. 2024), with the inner LayerNorm
and its L2-loss gradient fused into the kernel.

f(x) = GELU_tanh(x W1 + b1) W2 + b2, W1 [d, m], W2 [m, d] (m = 4d in the paper). For a mini-batch
with rows K, Q, V ∈ R^{b×d}, per-token η ∈ R^b, τ = token_idx ∈ R^b and the weights at its start
(notation of ``torch_chunk.py``):

    Z1 = K W1 + b1,   X2 = GELU(Z1),   Z2 = X2 W2 + b2
    Γ2 = ∂/∂Z2 ½‖LN_γβ(Z2) − (V − K)‖²,   Γ1 = (Γ2 W2ᵀ) ⊙ GELU'(Z1)          (gradients at W_0)
    M1 = tril(E ⊙ (Q Kᵀ + 1)),        Z̄1 = Q W1 + b1 − M1 Γ1,   X̄2 = GELU(Z̄1)      E_ij = τ_i η_j
    M2 = tril(E ⊙ (X̄2 X2ᵀ + 1)),      Z̄2 = X̄2 W2 + b2 − M2 Γ2,  out = Q + LN_γβ(Z̄2)
    W1 ← W1 − τ_{b−1} Kᵀ(η ⊙ Γ1),  b1 ← b1 − τ_{b−1} Σ_j η_j Γ1_j      (same for W2, b2 with X2, Γ2)

Hidden tiles. The state (W1, b1, W2) is 2dm + m numbers per head — 32K floats at d = 64 — more than
one program's registers hold. It lives in global memory (per (batch, head), small enough to stay in
L2) and is streamed in tiles of BM hidden units: columns j of W1 and b1, rows j of W2. Everything
of width m is separable over j (Z1, X2, Γ1, Z̄1, X̄2 and their gradients are column-wise in j), and
everything else is a sum over tiles:

    Z2  = Σ_j X2_j W2_j + b2                   (pass 1: needs every tile before Γ2 exists)
    Γ1_j = (Γ2 W2_jᵀ) ⊙ GELU'(Z1_j)            (pass 2, with the update of tile j)
    Z̄1_j, X̄2_j,  A2 = X̄2 X2ᵀ = Σ_j X̄2_j X2_jᵀ,  X̄2 W2 = Σ_j X̄2_j W2_j    (the output's tile loop)

The forward is two kernels, as flash-linear-attention splits chunk_ttt_linear:

    ``_ttt_mlp_fwd_kernel`` (the state pass, one program per (batch, head), mini-batches in order):
        stores the start weights (W1, b1, W2, b2) of the mini-batch (2dm + m + d numbers per
        mini-batch and head), makes pass 1 (Z2, then Γ2, stored [b, d]) and pass 2 (per tile:
        X2_j, Γ1_j, stored [b, m], and the tile's update, which overwrites its old weights once
        every thread has read them; b2 [d] stays in registers);
    ``_ttt_mlp_out_kernel`` (one program per (batch, head, mini-batch), all in parallel, so its
        occupancy does not depend on batch × heads): from the stored start weights, Γ1 and Γ2,
        per tile X2_j = GELU(K W1_j + b1_j) (recomputed), Z̄1_j, X̄2_j, A2 += X̄2_j X2_jᵀ and
        X̄2 W2 += X̄2_j W2_j; then Z̄2, the LayerNorm and out.

Both sum their products with a [b, d] operand (K W1_j, Q W1_j, Γ2 W2_jᵀ, Q Kᵀ, and the updates
Kᵀ(η ⊙ Γ1_j), X2_jᵀ(η ⊙ Γ2)) over column blocks of BK (``_rows_w``, ``_mlp_col_block``): no
[b, d] tile is a tl.dot operand whole (each warp would hold all of it). The start weights serve
the output kernel, and the backward reads them again (all NMB of them are kept when autograd needs
them); without autograd the wrapper runs the two kernels over windows of 16 mini-batches
(``_mlp_window``), the state carried between windows, so that scratch stays bounded in T.

The backward is two kernels, split as TTT-Linear's (``chunk.py``) is:

    ``_ttt_mlp_bwd_mb_kernel`` (one program per (batch, head, mini-batch), all in parallel):
        everything that does not depend on the gradient carried from later mini-batches. From the
        stored start weights, Γ1 and Γ2 it repeats the output's tile loop (X2_j recomputed; Z̄1_j,
        X̄2_j, A2, Z̄2), back-propagates ∂out through the LayerNorm to ∂Z̄2, through
        Z̄2 = X̄2 W2 + b2 − M2 Γ2 to ∂M2 (so ∂A2 and ∂E) and ∂Γ2's Z̄ term −M2ᵀ∂Z̄2, then per tile
        ∂X̄2_j = ∂Z̄2 W2_jᵀ + ∂A2 X2_j, ∂Z̄1_j = ∂X̄2_j ⊙ GELU'(Z̄1_j), Σ_j ∂Z̄1_j Γ1_jᵀ (for ∂M1),
        ∂Γ1_j's Z̄ term −M1ᵀ∂Z̄1_j, ∂Z1_j's A2 term (∂A2ᵀ X̄2_j) ⊙ GELU'(Z1_j) and ∂Q's
        Σ_j ∂Z̄1_j W1_jᵀ; then ∂M1, ∂Q (complete) and the M-side parts of ∂K, ∂η, ∂τ, ∂γ, ∂β. It
        writes ∂Z̄1, X̄2 and the two [b, m] partials per mini-batch, ∂Z̄2 and ∂Γ2's partial [b, d].
    ``_ttt_mlp_bwd_kernel`` (the carry, one program per (batch, head), mini-batches in reverse):
        carries (dW1, db1, dW2, db2), the gradient with respect to the weights at the end of the
        current mini-batch, in global memory (the output buffers, which the wrapper fills with the
        final-state gradients). The update W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ1), W2' = W2 − τ_{b−1}
        X2ᵀ(η⊙Γ2) (biases likewise) gives, from the end gradients, per tile:
          pass A1: P2 = X2 dW2 + db2 (Σ over tiles), ∂X2_j's update term (η⊙Γ2) dW2_jᵀ;
          pass A2: P1_j = K dW1_j + db1_j, ∂Γ1_j = (its Z̄ term) − τ_{b−1} η ⊙ P1_j, and through
            Γ1 = S ⊙ GELU'(Z1), S = Γ2 W2ᵀ: ∂S_j = ∂Γ1_j ⊙ GELU'(Z1_j), ∂Z1_j += ∂Γ1_j ⊙ S_j ⊙
            GELU''(Z1_j), ∂Γ2 += ∂S_j W2_j;
        then ∂Γ2 is complete: ∂Z2 (the LayerNorm-fused loss's second derivative, from the stored
        Z2), ∂V, ∂η, ∂τ, ∂γ, ∂β, db2 += Σ(∂Z̄2 + ∂Z2);
          pass B: ∂Z1_j += (∂Z2 W2_jᵀ) ⊙ GELU'(Z1_j), ∂K += ∂Z1_j W1_jᵀ − τ_{b−1} (η⊙Γ1_j) dW1_jᵀ,
            db1_j += Σ(∂Z1_j + ∂Z̄1_j);
          pass C (column blocks of BK): dW1_j += Kᵀ∂Z1_j + Qᵀ∂Z̄1_j, dW2_j += ∂S_jᵀΓ2 + X̄2_jᵀ∂Z̄2
            + X2_jᵀ∂Z2.
        Passes A1 and A2 read the end gradients before pass C extends them.

The GELU''(Z1) term enters through Γ1's dependence on Z1. The passes exchange data through global
memory (the per-mini-batch buffers and small per-program scratch), ordered by ``tl.debug_barrier()``
(a CTA barrier, which also makes the program's global writes visible to all its threads). The
state pass stores Z2 beside Γ2 for the carry's LayerNorm pieces.

Coverage: everything from a mini-batch boundary (pos = 0) on, a trailing partial mini-batch of
r < b tokens included, b ≤ 64, any d and m (d padded to a power of two ≥ 16, m to a multiple of
the tile width; padded rows carry τ = η = 0 and X2 = 0). The partial mini-batch is zero-padded to
b rows by the wrapper, with η = 0 in the padding: the padding adds nothing to the gradient sums
and, the dual form being causal, reaches no real row. Its end state (``kernels/ttt/__init__.py``)
is not an update: W1 … b2 = its start weights, grad_* = Σ_{s<r} η_s ∇ℓ_s, pos = r. The state pass
takes r (R) and, for that mini-batch, writes keep·W − c·Σ with (keep, c) = (0, −1), i.e. the sums,
where a full one writes (1, τ_{b−1}); the carry runs it in a launch of its own with the scale −1
in place of τ_{b−1} (``_mlp_bwd_op``), then adds the start weights' gradient from the state.
``ttt_mlp_triton`` runs the head that completes a mini-batch begun in ``initial_state`` (pos > 0)
in a launch of the kernels of its own, chained through autograd (``_mlp_head``, "The head" below). tanh is written with exp (tanh u = 1 −
2/(e^{2u} + 1), exact at ±∞).

The head. A state at pos = p > 0 holds the start weights θ_0 = (W1, b1, W2, b2) of a mini-batch and the
sums G = (G_W1, G_b1, G_W2, G_b2) = Σ_{s<p} η_s ∇ℓ_s of its first p rows, unscaled by τ. The call's
first n = min(b − p, T) tokens complete it: token i at position p + i uses θ_i = θ_0 − τ_{p+i} (G +
Σ_{s≤i} η_s ∇ℓ_s), every ∇ℓ at θ_0. As for TTT-Linear (``_linear_head`` in ``chunk.py``), one
launch over a single mini-batch of p + n rows, the first p absent (zeros, η = 0), puts the head's
tokens at positions p … p + n − 1 (their τ) and leaves Γ1, Γ2, X2, Z2 (all at θ_0, so the state pass)
untouched by G. With τ_i = τ_{p+i}, the dual form of the head's rows gains one term per layer:

    Z̄1_i = Q_i W1 + b1 − (M1 Γ1)_i − τ_i (Q_i G_W1 + G_b1)
    X̄2_i = GELU(Z̄1_i)
    Z̄2_i = X̄2_i W2 + b2 − (M2 Γ2)_i − τ_i (X̄2_i G_W2 + G_b2)

The layer-1 term ZH1 = −τ ⊙ (Q G_W1 + G_b1) [b, m] is a row offset computed in PyTorch before the
launch (linear in G; its gradient is ∂Z̄1, which the per-mini-batch backward stores), as
TTT-Linear's ``zh``. The layer-2 term is not: X̄2 is the kernel's own layer-1 result, corrected by
ZH1. Per hidden tile it is −(τ ⊙ X̄2_j) G_W2_j, a second product beside X̄2_j W2_j in the tile loop,
so the kernels take GW2 = (G_W2; G_b2) [m + 1, d] per head as an extra weight tile, read only in a
head launch: the output kernel when its runtime row count NZH > 0 (every launch is the same
compiled variant, NZH = 0 without a head), the per-mini-batch backward in a variant of its own
(HEAD = True, its own column block and warps, ``_mlp_head_bwd_cfg``: with the extra products the
shared configuration spilled 4-84 B). Backward: ∂X̄2_j gains −τ ⊙ (∂Z̄2 G_W2_jᵀ) in the per-mini-batch
backward's tile loop, and everything after ∂X̄2_j is unchanged; ∂G_W2 = −X̄2ᵀ(τ ⊙ ∂Z̄2),
∂G_b2 = −Σ_i τ_i ∂Z̄2_i and τ's extra −Σ_c (X̄2_i G_W2 + G_b2)_c ∂Z̄2_ic follow in PyTorch from the
stored X̄2 and ∂Z̄2. The carry is untouched (G does not enter the update: Γ1, Γ2 are at θ_0). End
state, as TTT-Linear's: a completed mini-batch (p + n = b) ends at the kernels' end weights
− τ_{b−1} G; a head that ends the call (p + n < b, a partial mini-batch of the launch, zero rows
after the head) keeps θ_0 with sums = the kernels' sums + G, pos = p + n. The PyTorch dual form
does not run for any part of a call.

Packed batches (``cu_seqlens``, B = 1, ``ttt_mlp_triton_packed``): one launch of each kernel for
all N sequences, on the mini-batch tables of ``packed_chunk_tables`` (built on the device:
⌊T/b⌋ + N slots per head, each sequence's first slot, (sequence, mini-batch) per slot, spare
slots marked −1; nothing of ``cu_seqlens`` is copied to the host before the launches but the one
flag of ``check_cu_seqlens``). The wrapper pads per sequence on the device (``_packed_rows``): a
slot-major copy of XQ, XK, XV, η (and ∂out) holds each slot's b rows, zero past a sequence's end
and in the spare slots — each sequence's last mini-batch zero-padded with η = 0, exactly as the
fixed-length path pads its tail — and the outputs and input gradients are gathered back. On it
the output and per-mini-batch backward kernels are the fixed-length ones, one program per (head,
slot) (a spare slot computes on zeros: the per-slot buffers are zero-filled, its partial sums of
∂τ, ∂γ, ∂β are zero); only the serial kernels have packed variants (VARLEN = True), one program
per (sequence, head), each walking its own ⌈L/b⌉ slots from its own start weights
(``initial_state`` row n, or the shared weights expanded to [N, H, …]), its valid row count of
the last one read from ``cu_seqlens``. Each sequence ends in its own state: a partial last
mini-batch of r rows is not applied (the state pass writes its sums, keep = 0), the state holds
its start weights (gathered from its slot), the sums and pos = r; an empty sequence keeps its
initial state. The carry runs a partial last mini-batch in the same launch (a per-slot scale:
−1 and no ∂τ term for it), then adds Δ = ∂W_L − ∂W_end to the gradient of its start weights,
where the fixed-length path adds them between two launches. Every input's gradient flows, the
initial state's included. The padded copies cost O(T d) memory traffic per call.

Precision (``_precision``, ``_dot`` in ``chunk.py``): everything is carried and accumulated in
float32 (float64 for float64 inputs), the weights included (float32 masters); the tl.dot operands
are bfloat16 for bfloat16/float16 inputs (bf16 tensor-core MMA, fp32 accumulator; the float32
weight tiles are rounded to bfloat16 as they enter each product),
3×TF32 for float32 inputs (tensor cores, error within a few fp32 ulps), exact for float64. The forward's
stored Γ1, Γ2, Z2 and the backward's per-mini-batch buffers are in the accumulation dtype. Outputs come back in
the input dtype, the state in float32 (float64 for float64 inputs).

Launch configurations (``_mlp_launch_cfg``, ``_mlp_col_block``): BM = 16 on 8 warps everywhere;
BK = min(d, 32), except the per-mini-batch backward with 3×TF32 operands on the sm_80 family
(``device_arch``), which takes BK = 16. Compiled for sm_90 and sm_80 by
``python -m kernels.compile_report --op ttt -k _ttt_mlp_`` (the per-mini-batch backward one case
per arch, and one per arch of its head variant, configs named "head"). Registers: products with a [b, d] operand read it from global memory in column blocks
(``_rows_w``, ``_xt_blk``) rather than holding it across the tile loops. Triton gives every tl.dot
of a loop the warp layout of its last one, and a square [b, b] product with chained products picks
all warps along its b rows (each warp then holds the whole tile), so the tile loops end with a
[b, d] product. The carry kernel holds nothing of width d from one mini-batch to the next (db2,
∂γ, ∂β and ∂τ are added to global buffers per mini-batch), rebuilds its index tensors per section
(``_loop_index``) and per tile (``_tile_cols``) so that they are not hoisted and held, and keeps
P2 in scratch through pass A2. All four kernels compile clean (no spills, tensor cores) at d = 64
and d = 128, bfloat16 and float32, on both. The packed (VARLEN) state pass and carry take BK = 16
(``_mlp_col_block(packed=True)``: with 32 the packed state pass at d = 64, bf16, spilled 24 B on
sm_90 and the packed carry 4–56 B) and compile clean too. The packed bfloat16 carry also launches
with num_stages = 2 (``_mlp_carry_opts``, which the gate uses as well) and bounds its loop's index
ties by the slot count NC, an argument, rather than by the sequence's mini-batch count: with
neither it spilled 20 B at d = 128 on sm_90 (4 B with only the stages, 12 B with only the bound);
with both, 0 B at 254 registers. The float32 packed carry keeps one stage (it spills with 2 at
d = 64).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._triton_utils import (INTERPRET_ARCH, check_triton_device, device_arch, is_interpreting,
                                   packed_chunk_tables)
from kernels.ttt.chunk import _MAX_MB, _dot, _ln_bwd, _ln_stats, _loop_index, _precision, check_cu_seqlens
from kernels.ttt.torch_chunk import LN_EPS, acc_dtype, make_state


# ---- in-kernel pieces -------------------------------------------------------------------------
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
def _pick(a, b, VARLEN: tl.constexpr):
    """``a`` in the packed (VARLEN) variant of a kernel, ``b`` in the fixed-length one: the
    fixed-length kernels keep their own offset expressions (from the program id), so that their
    compiled code is the same as without the packed variant."""
    if VARLEN:
        return a
    else:
        return b


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
def _rows_w(XP, rmask, WP, j0, hc, RS: tl.constexpr, WK: tl.constexpr, WJ: tl.constexpr,
            D: tl.constexpr, M: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
            BK: tl.constexpr, PREC: tl.constexpr):
    """X W_j for the rows X [b, D] at XP (row stride RS) and the hidden tile j0 … j0 + BM − 1 of W
    [D, M] at WP (element (c, j) at c·WK + j·WJ: W1 is WK = M, WJ = 1; W2ᵀ is WK = 1, WJ = D),
    summed over column blocks of BK so that no [b, d] operand is live whole."""
    rows = tl.arange(0, BT)
    hcols = j0 + hc
    hmask = hcols < M
    acc = tl.zeros([BT, BM], dtype=tl.float64 if PREC == "ieee" else tl.float32)
    for c0 in range(0, BD, BK):
        kc = c0 + tl.arange(0, BK)
        km = kc < D
        x = tl.load(XP + rows[:, None] * RS + kc[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        w = tl.load(WP + kc[:, None] * WK + hcols[None, :] * WJ, mask=km[:, None] & hmask[None, :], other=0.0)
        acc += _dot(x.to(acc.dtype), w.to(acc.dtype), PREC)
    return acc


@triton.jit
def _z2_blocked(XP, rmask, W1P, B1P, W2P, b2, cols, hc, cmask, D: tl.constexpr, M: tl.constexpr,
                BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Pass 1 of the state pass: Z2 = GELU(K W1 + b1) W2 + b2 (K at XP, row stride D), summed over
    the hidden tiles, K W1_j over column blocks (``_rows_w``)."""
    Z2 = tl.zeros([BT, BD], dtype=b2.dtype)
    for j0 in range(0, M, BM):
        hcols = j0 + hc
        hmask = hcols < M
        b1 = tl.load(B1P + hcols, mask=hmask, other=0.0)
        W2 = tl.load(W2P + hcols[:, None] * D + cols[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)
        X2, gp, gpp = _gelu_tanh3(_rows_w(XP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC) + b1[None, :])
        # padded rows (zero k) would give X2 = GELU(b1) ≠ 0; they carry η = 0, zero them anyway
        X2 = tl.where(rmask[:, None], X2, 0.0)
        Z2 += _dot(X2, W2, PREC)
    return Z2 + b2[None, :]


@triton.jit
def _loss_grad(Z2, v, k, gamma, beta, cmask, D: tl.constexpr, eps):
    """x̂, 1/σ of Z2, the target V − K, ĝ and Γ2 (the LayerNorm-fused loss's gradient)."""
    xh, rstd = _ln_stats(Z2, cmask, D, eps)
    tgt = v - k
    gh = (gamma[None, :] * xh + beta[None, :] - tgt) * gamma[None, :]
    G2 = _ln_bwd(gh, xh, rstd, cmask, D)
    return xh, rstd, tgt, gh, G2


@triton.jit
def _ttt_mlp_fwd_kernel(XK, XV, ETA, TAU, LNW, LNB, B20,
                        W1S, B1S, W2S, B2S, G1S, G2S, W1F, B1F, W2F, B2F, CU, CS,
                        T, NMB, R, H, NC, eps,
                        D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
                        MB: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        VARLEN: tl.constexpr):
    """The serial state pass, one program per (batch, head): for every mini-batch, store its start
    weights (W1S, B1S, W2S, B2S), its inner gradients Γ1 [MB, M] (G1S) and Γ2 [MB, D], followed
    by Z2 [MB, D] (G2S; the backward's LayerNorm pieces read Z2), then apply the update. W1F [D, M],
    B1F [M], W2F [M, D] hold the initial weights on entry (the wrapper copies them in) and are
    updated in place, tile by tile, into the final ones; b2 is carried in registers. The last
    mini-batch has R real rows (R = MB: full; the rest is zero padding with η = 0); when it is
    partial (R < MB) it is not applied: W1F, B1F, W2F, B2F receive its η-weighted gradient sums
    instead (the state's grad_*), its start weights staying in W1S … B2S. The output is
    ``_ttt_mlp_out_kernel``'s.

    VARLEN (packed batch, ``cu_seqlens`` CU, first slots CS, NC slots per head): pid = sequence·H
    + head; the sequence's own NMB and R replace the arguments, and its mini-batches are the slots
    CS[seq] … of head h, whose rows the inputs hold slot by slot (the wrapper's zero-padded
    slot-major copy, T = NC·b rows per head)."""
    pid = tl.program_id(0)                      # = b_idx * H + h_idx (packed: sequence * H + h_idx)
    h = pid % H
    sb = pid * NMB                              # the program's first slot, row and η offsets
    xb = pid * T * D
    eb = pid * T
    if VARLEN:
        seq = pid // H
        L = tl.load(CU + seq + 1) - tl.load(CU + seq)
        NMB = (L + MB - 1) // MB
        R = L - (NMB - 1) * MB                  # MB for an empty sequence (nothing runs)
        sb = h * NC + tl.load(CS + seq)
        xb = sb * MB * D
        eb = sb * MB
    cdt = W1F.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    hc = tl.arange(0, BM)
    cmask = cols < D
    rmask = rows < MB
    xmask = rmask[:, None] & cmask[None, :]
    W1P = W1F + pid * D * M
    B1P = B1F + pid * M
    W2P = W2F + pid * M * D

    b2 = tl.load(B20 + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)

    for n in range(NMB):
        s = _pick(sb + n, pid * NMB + n, VARLEN)
        # the update W ← keep·W − cu·Σ: W − τ_{b−1}·Σ after a full mini-batch, the sums Σ
        # themselves after a partial last one (keep = 0, cu = −1; its rows ≥ R are zero, η = 0)
        part = ((n == NMB - 1) & (R < MB)).to(cdt)
        keep = 1.0 - part
        cu = tau_last * keep - part
        for j0 in range(0, M, BM):
            hcols = j0 + hc
            hmask = hcols < M
            w1o = cols[:, None] * M + hcols[None, :]
            w2o = hcols[:, None] * D + cols[None, :]
            w1m = cmask[:, None] & hmask[None, :]
            w2m = hmask[:, None] & cmask[None, :]
            tl.store(W1S + s * D * M + w1o, tl.load(W1P + w1o, mask=w1m, other=0.0), mask=w1m)
            tl.store(B1S + s * M + hcols, tl.load(B1P + hcols, mask=hmask, other=0.0), mask=hmask)
            tl.store(W2S + s * M * D + w2o, tl.load(W2P + w2o, mask=w2m, other=0.0), mask=w2m)
        tl.store(B2S + s * D + cols, b2, mask=cmask)
        t_off = n * MB + rows
        KP = XK + _pick(xb, pid * T * D, VARLEN) + n * MB * D   # the mini-batch's rows of K (row stride D)
        GP = G2S + s * 2 * MB * D               # its Γ2, then Z2 (row stride D)
        xoff = _pick(xb, pid * T * D, VARLEN) + t_off[:, None] * D + cols[None, :]
        goff = rows[:, None] * D + cols[None, :]
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + _pick(eb, pid * T, VARLEN) + t_off, mask=rmask, other=0.0).to(cdt)

        Z2 = _z2_blocked(KP, rmask, W1P, B1P, W2P, b2, cols, hc, cmask, D, M, BT, BD, BM, BK, PREC)
        tl.store(GP + MB * D + goff, Z2, mask=xmask)
        xh, rstd, tgt, gh, G2 = _loss_grad(Z2, v, k, gamma, beta, cmask, D, eps)
        tl.store(GP + goff, G2, mask=xmask)
        b2 = b2 * keep - cu * tl.sum(e[:, None] * G2, axis=0)
        tl.debug_barrier()                      # the tile loop reads Γ2 back
        for j0 in range(0, M, BM):
            hcols = j0 + hc
            hmask = hcols < M
            b1 = tl.load(B1P + hcols, mask=hmask, other=0.0)
            X2, gp, _gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                       + b1[None, :])
            X2 = tl.where(rmask[:, None], X2, 0.0)
            G1 = _rows_w(GP, rmask, W2P, j0, hc, D, 1, D, D, M, BT, BD, BM, BK, PREC) * gp   # Γ1_j = Γ2 W2_jᵀ ⊙ GELU'(Z1_j)
            tl.store(G1S + s * MB * M + rows[:, None] * M + hcols[None, :], G1,
                     mask=rmask[:, None] & hmask[None, :])
            # the tile's end-of-mini-batch update, from the float32 masters read again, in column
            # blocks of BK: W1_j −= τ_{b−1} Kᵀ(η ⊙ Γ1_j), W2_j −= τ_{b−1} X2_jᵀ(η ⊙ Γ2)
            eG1 = e[:, None] * G1
            tl.debug_barrier()                  # every thread has read the tile's old weights
            tl.store(B1P + hcols, b1 * keep - cu * tl.sum(eG1, axis=0), mask=hmask)
            for c0 in range(0, BD, BK):
                kc = c0 + tl.arange(0, BK)
                km = kc < D
                bm = rmask[:, None] & km[None, :]
                kb = tl.load(KP + rows[:, None] * D + kc[None, :], mask=bm, other=0.0).to(cdt)
                eG2 = e[:, None] * tl.load(GP + rows[:, None] * D + kc[None, :], mask=bm, other=0.0)
                w1o = kc[:, None] * M + hcols[None, :]
                w1m = km[:, None] & hmask[None, :]
                w2o = hcols[:, None] * D + kc[None, :]
                w2m = hmask[:, None] & km[None, :]
                tl.store(W1P + w1o, tl.load(W1P + w1o, mask=w1m, other=0.0) * keep
                         - cu * _dot(tl.trans(kb), eG1, PREC), mask=w1m)
                tl.store(W2P + w2o, tl.load(W2P + w2o, mask=w2m, other=0.0) * keep
                         - cu * _dot(tl.trans(X2), eG2, PREC), mask=w2m)
        tl.debug_barrier()                      # the new weights are visible to the next mini-batch

    tl.store(B2F + pid * D + cols, b2, mask=cmask)


@triton.jit
def _ttt_mlp_out_kernel(XQ, XK, ETA, TAU, LNW, LNB, W1S, B1S, W2S, B2S, G1S, G2S, OUT, ZH1, GW2,
                        T, NMB, H, NZH, eps,
                        D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
                        MB: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """The output, one program per (batch, head, mini-batch), all in parallel: Z̄1, X̄2, Z̄2, the
    LayerNorm and out from the mini-batch's start weights and Γ1, Γ2 stored by
    ``_ttt_mlp_fwd_kernel``; X2_j = GELU(K W1_j + b1_j) is recomputed per hidden tile. The products
    with a [b, d] operand run over column blocks of BK (``_rows_w``). A head launch (NZH > 0,
    ``_mlp_head``) adds the carried sums' terms: row t < NZH of ZH1 ([T, M] per head) to Z̄1, and
    −τ ⊙ (X̄2 G_W2 + G_b2) to Z̄2 from GW2 ([M + 1, D] per head: G_W2, then G_b2); NZH = 0 and
    placeholders otherwise (never read)."""
    pid = tl.program_id(0)                      # = (b_idx * H + h_idx) * NMB + n = the stored slot
    bh = pid // NMB
    n = pid % NMB
    h = bh % H
    cdt = W1S.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    hc = tl.arange(0, BM)
    cmask = cols < D
    rmask = rows < MB
    xmask = rmask[:, None] & cmask[None, :]
    tril = rows[None, :] <= rows[:, None]
    W1P = W1S + pid * D * M
    B1P = B1S + pid * M
    W2P = W2S + pid * M * D
    QP = XQ + bh * T * D + n * MB * D           # the mini-batch's rows of Q and K (row stride D)
    KP = XK + bh * T * D + n * MB * D
    t_off = n * MB + rows

    # padded rows (MB < BT) get τ = η = 0, so they enter no product that reaches a real row
    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    e = tl.load(ETA + bh * T + t_off, mask=rmask, other=0.0).to(cdt)
    Ev = tau[:, None] * e[None, :]
    QK = tl.zeros([BT, BT], dtype=cdt)
    for c0 in range(0, BD, BK):
        kc = c0 + tl.arange(0, BK)
        bm = rmask[:, None] & (kc < D)[None, :]
        qb = tl.load(QP + rows[:, None] * D + kc[None, :], mask=bm, other=0.0).to(cdt)
        kb = tl.load(KP + rows[:, None] * D + kc[None, :], mask=bm, other=0.0).to(cdt)
        QK += _dot(qb, tl.trans(kb), PREC)
    M1 = tl.where(tril, Ev * (QK + 1.0), 0.0)
    A2 = tl.zeros([BT, BT], dtype=cdt)
    Z2b = tl.zeros([BT, BD], dtype=cdt)
    for j0 in range(0, M, BM):
        hcols = j0 + hc
        hmask = hcols < M
        b1 = tl.load(B1P + hcols, mask=hmask, other=0.0)
        W2 = tl.load(W2P + hcols[:, None] * D + cols[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)
        G1 = tl.load(G1S + pid * MB * M + rows[:, None] * M + hcols[None, :],
                     mask=rmask[:, None] & hmask[None, :], other=0.0)
        X2, _gp, _gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                    + b1[None, :])
        X2 = tl.where(rmask[:, None], X2, 0.0)
        Z1b = (_rows_w(QP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC) + b1[None, :]
               - _dot(M1, G1, PREC) + _zh_tile(ZH1, bh, t_off, rmask, hcols, hmask, T, NZH, M))
        X2b, _gpb, _gppb = _gelu_tanh3(Z1b)
        A2 += _dot(X2b, tl.trans(X2), PREC)
        Z2b += _dot(X2b, W2, PREC)
        if NZH > 0:                             # the head's −τ X̄2 G_W2
            Z2b -= _dot(tau[:, None] * X2b, tl.load(GW2 + bh * (M + 1) * D + hcols[:, None] * D + cols[None, :],
                                                    mask=hmask[:, None] & cmask[None, :], other=0.0), PREC)
    M2 = tl.where(tril, Ev * (A2 + 1.0), 0.0)
    b2 = tl.load(B2S + pid * D + cols, mask=cmask, other=0.0)
    G2 = tl.load(G2S + pid * 2 * MB * D + rows[:, None] * D + cols[None, :], mask=xmask, other=0.0)
    gb2 = tl.load(GW2 + bh * (M + 1) * D + M * D + cols, mask=cmask & (cols * 0 < NZH), other=0.0)
    Z2b += b2[None, :] - _dot(M2, G2, PREC) - tau[:, None] * gb2[None, :]
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    xhb, rstdb = _ln_stats(Z2b, cmask, D, eps)
    xoff = bh * T * D + t_off[:, None] * D + cols[None, :]
    q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
    out = q + gamma[None, :] * xhb + beta[None, :]
    tl.store(OUT + xoff, out.to(OUT.dtype.element_ty), mask=xmask)


@triton.jit
def _zh_tile(ZH1, bh, t_off, rmask, hcols, hmask, T, NZH, M: tl.constexpr):
    """The hidden tile ``hcols`` of the head's layer-1 offset ZH1 ([T, M] per (batch, head)) for the
    rows at tokens ``t_off``: the rows t < NZH (none when NZH = 0), zero elsewhere."""
    msk = (rmask & (t_off < NZH))[:, None] & hmask[None, :]
    return tl.load(ZH1 + bh * T * M + t_off[:, None] * M + hcols[None, :], mask=msk, other=0.0)


@triton.jit
def _w_rows(WP, j0, hc, cols, cmask, WK: tl.constexpr, WJ: tl.constexpr, M: tl.constexpr):
    """The hidden tile j0 … j0 + BM − 1 of a weight as a [BM, BD] tile, element (j, c) at
    c·WK + j·WJ (W2 [M, D]: WK = 1, WJ = D; W1ᵀ of W1 [D, M]: WK = M, WJ = 1); zero outside."""
    hcols = j0 + hc
    hmask = hcols < M
    return tl.load(WP + cols[None, :] * WK + hcols[:, None] * WJ, mask=hmask[:, None] & cmask[None, :], other=0.0)


@triton.jit
def _tile_cols(j0, T, M: tl.constexpr, BD: tl.constexpr, D: tl.constexpr):
    """Column indices and mask of a [·, BD] tile, tied to the hidden-tile index j0: ``j0 // (M + T)``
    is 0 (j0 < M, T ≥ 1), which the compiler cannot prove, so the [BM, BD] weight-tile pointers
    built from them are computed in the tile loop instead of being hoisted out of it and held in
    registers through the loop (as ``_loop_index`` does for the mini-batch loop)."""
    cols = tl.arange(0, BD) + j0 // (M + T)
    return cols, cols < D


@triton.jit
def _m_tile(P, j0, hc, rows, rmask, M: tl.constexpr):
    """Rows 0 … MB − 1 of the hidden tile j0 … j0 + BM − 1 of a [MB, M] buffer at P (zero in
    padded rows and columns), and its offsets and mask for a store."""
    hcols = j0 + hc
    off = rows[:, None] * M + hcols[None, :]
    msk = rmask[:, None] & (hcols < M)[None, :]
    return tl.load(P + off, mask=msk, other=0.0), off, msk


@triton.jit
def _xt_blk(XP, rows, rmask, G, c0, D: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """X[:, c0 … c0 + BK − 1]ᵀ G [BK, BM] for X [MB, D] at XP (row stride D) and G [BT, BM]."""
    kc = c0 + tl.arange(0, BK)
    x = tl.load(XP + rows[:, None] * D + kc[None, :], mask=rmask[:, None] & (kc < D)[None, :], other=0.0)
    return _dot(tl.trans(x.to(G.dtype)), G, PREC)


@triton.jit
def _ttt_mlp_bwd_mb_kernel(XQ, XK, ETA, TAU, LNW, LNB, W1S, B1S, W2S, B2S, G1S, G2S, DOUT,
                           DZB1, XB2, DG1P, DZ1P, DZB2, DG2P, DKP, DEP,
                           DXQ, DTAU, DLNW, DLNB, ZH1, GW2,
                           T, NMB, H, NZH, eps,
                           D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
                           MB: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                           HEAD: tl.constexpr):
    """The backward through Z̄ and the dual-form products, one program per (batch, head,
    mini-batch), all in parallel: from the stored start weights, Γ1 and Γ2, it recomputes the
    output's tile loop (X2_j, Z̄1_j, X̄2_j, A2, Z̄2), back-propagates ∂out through the LayerNorm,
    Z̄2 = X̄2 W2 + b2 − M2 Γ2 and Z̄1 = Q W1 + b1 − M1 Γ1, and writes: ∂Q (complete); the
    parts through M1, M2 and the output of ∂K (DKP), ∂η (DEP), ∂τ (DTAU), ∂γ, ∂β (DLNW, DLNB, per
    program, which the carry kernel extends); and for the
    carry kernel, per mini-batch, ∂Z̄1 (DZB1), X̄2 (XB2), ∂Γ1's Z̄ term −M1ᵀ∂Z̄1 (DG1P), ∂Z1's A2
    term (∂A2ᵀ X̄2) ⊙ GELU'(Z1) (DZ1P), ∂Z̄2 (DZB2) and ∂Γ2's Z̄ term −M2ᵀ∂Z̄2 (DG2P). The head
    variant (HEAD = True, a head launch: its first NZH rows) has the output kernel's terms of ZH1 and GW2 in Z̄1 and Z̄2, and ∂X̄2 gains
    −τ ⊙ (∂Z̄2 G_W2ᵀ); the gradients of ZH1 (= ∂Z̄1), of G_W2, G_b2 and τ's part through them are
    taken from DZB1, XB2 and DZB2 by the wrapper."""
    pid = tl.program_id(0)                      # = (b_idx * H + h_idx) * NMB + n = the stored slot
    bh = pid // NMB
    n = pid % NMB
    h = bh % H
    cdt = W1S.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    hc = tl.arange(0, BM)
    cmask = cols < D
    rmask = rows < MB
    xmask = rmask[:, None] & cmask[None, :]
    tril = rows[None, :] <= rows[:, None]
    W1P = W1S + pid * D * M
    B1P = B1S + pid * M
    W2P = W2S + pid * M * D
    QP = XQ + bh * T * D + n * MB * D           # the mini-batch's rows of Q and K (row stride D)
    KP = XK + bh * T * D + n * MB * D
    G2P = G2S + pid * 2 * MB * D
    ZB2P = DZB2 + pid * MB * D
    t_off = n * MB + rows
    goff = rows[:, None] * D + cols[None, :]
    xoff = bh * T * D + t_off[:, None] * D + cols[None, :]

    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    e = tl.load(ETA + bh * T + t_off, mask=rmask, other=0.0).to(cdt)
    Ev = tau[:, None] * e[None, :]
    QK = tl.zeros([BT, BT], dtype=cdt)
    for c0 in range(0, BD, BK):
        kc = c0 + tl.arange(0, BK)
        bm = rmask[:, None] & (kc < D)[None, :]
        qb = tl.load(QP + rows[:, None] * D + kc[None, :], mask=bm, other=0.0).to(cdt)
        kb = tl.load(KP + rows[:, None] * D + kc[None, :], mask=bm, other=0.0).to(cdt)
        QK += _dot(qb, tl.trans(kb), PREC)
    M1 = tl.where(tril, Ev * (QK + 1.0), 0.0)
    # the output's tile loop (as in _ttt_mlp_out_kernel)
    A2 = tl.zeros([BT, BT], dtype=cdt)
    Z2b = tl.zeros([BT, BD], dtype=cdt)
    for j0 in range(0, M, BM):
        b1 = tl.load(B1P + j0 + hc, mask=(j0 + hc) < M, other=0.0)
        G1, zo, zm = _m_tile(G1S + pid * MB * M, j0, hc, rows, rmask, M)
        X2, _gp, _gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                    + b1[None, :])
        X2 = tl.where(rmask[:, None], X2, 0.0)
        Z1b = (_rows_w(QP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC) + b1[None, :]
               - _dot(M1, G1, PREC))
        if HEAD:
            Z1b += _zh_tile(ZH1, bh, t_off, rmask, j0 + hc, (j0 + hc) < M, T, NZH, M)
        X2b, _gpb, _gppb = _gelu_tanh3(Z1b)
        A2 += _dot(X2b, tl.trans(X2), PREC)
        Z2b += _dot(X2b, _w_rows(W2P, j0, hc, cols, cmask, 1, D, M), PREC)
        if HEAD:                                # the head's −τ X̄2 G_W2
            Z2b -= _dot(tau[:, None] * X2b, _w_rows(GW2 + bh * (M + 1) * D, j0, hc, cols, cmask, 1, D, M), PREC)
    M2 = tl.where(tril, Ev * (A2 + 1.0), 0.0)
    b2 = tl.load(B2S + pid * D + cols, mask=cmask, other=0.0)
    G2 = tl.load(G2P + goff, mask=xmask, other=0.0)
    Z2b += b2[None, :] - _dot(M2, G2, PREC)
    if HEAD:
        Z2b -= tau[:, None] * tl.load(GW2 + bh * (M + 1) * D + M * D + cols, mask=cmask, other=0.0)[None, :]
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    xhb, rstdb = _ln_stats(Z2b, cmask, D, eps)

    # out = Q + γ x̂(Z̄2) + β
    do = tl.load(DOUT + xoff, mask=xmask, other=0.0).to(cdt)
    tl.store(DLNW + pid * D + cols, tl.sum(do * xhb, axis=0), mask=cmask)
    tl.store(DLNB + pid * D + cols, tl.sum(do, axis=0), mask=cmask)
    dZ2b = _ln_bwd(do * gamma[None, :], xhb, rstdb, cmask, D)
    tl.store(ZB2P + goff, dZ2b, mask=xmask)
    # Z̄2 = X̄2 W2 + b2 − M2 Γ2,  M2 = tril(E ⊙ (X̄2 X2ᵀ + 1))
    tl.store(DG2P + pid * MB * D + goff, -_dot(tl.trans(M2), dZ2b, PREC), mask=xmask)
    tl.debug_barrier()                          # ∂Z̄2 is read back in column blocks
    dZG = tl.zeros([BT, BT], dtype=cdt)
    for c0 in range(0, BD, BK):
        kc = c0 + tl.arange(0, BK)
        bm = rmask[:, None] & (kc < D)[None, :]
        zb = tl.load(ZB2P + rows[:, None] * D + kc[None, :], mask=bm, other=0.0)
        gb = tl.load(G2P + rows[:, None] * D + kc[None, :], mask=bm, other=0.0)
        dZG += _dot(zb, tl.trans(gb), PREC)
    dM2 = tl.where(tril, -dZG, 0.0)
    dE = dM2 * (A2 + 1.0)
    dA2 = dM2 * Ev

    # per tile: X̄2 = GELU(Z̄1), Z̄1 = Q W1 + b1 − M1 Γ1; ∂Z̄1_j and the other [b, m] pieces out
    dMacc = tl.zeros([BT, BT], dtype=cdt)
    dq = tl.zeros([BT, BD], dtype=cdt)
    for j0 in range(0, M, BM):
        b1 = tl.load(B1P + j0 + hc, mask=(j0 + hc) < M, other=0.0)
        G1, zo, zm = _m_tile(G1S + pid * MB * M, j0, hc, rows, rmask, M)
        X2, gp, _gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                   + b1[None, :])
        X2 = tl.where(rmask[:, None], X2, 0.0)
        Z1b = (_rows_w(QP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC) + b1[None, :]
               - _dot(M1, G1, PREC))
        if HEAD:
            Z1b += _zh_tile(ZH1, bh, t_off, rmask, j0 + hc, (j0 + hc) < M, T, NZH, M)
        X2b, gpb, _gppb = _gelu_tanh3(Z1b)
        dX2b = _rows_w(ZB2P, rmask, W2P, j0, hc, D, 1, D, D, M, BT, BD, BM, BK, PREC) + _dot(dA2, X2, PREC)
        if HEAD:                             # the head's Z̄2 term −τ X̄2 G_W2
            dX2b -= tau[:, None] * _rows_w(ZB2P, rmask, GW2 + bh * (M + 1) * D, j0, hc, D, 1, D, D, M, BT, BD, BM,
                                           BK, PREC)
        dZ1b = tl.where(rmask[:, None], dX2b * gpb, 0.0)
        dMacc += _dot(dZ1b, tl.trans(G1), PREC)
        so = pid * MB * M + zo
        tl.store(DZB1 + so, dZ1b, mask=zm)
        tl.store(XB2 + so, X2b, mask=zm)
        tl.store(DG1P + so, -_dot(tl.trans(M1), dZ1b, PREC), mask=zm)
        tl.store(DZ1P + so, _dot(tl.trans(dA2), X2b, PREC) * gp, mask=zm)
        # last: Triton gives the loop's products the warp layout of its last one ([b, d] here)
        dq += _dot(dZ1b, _w_rows(W1P, j0, hc, cols, cmask, M, 1, M), PREC)
    # M1 = tril(E ⊙ (A1 + 1)), A1 = Q Kᵀ: ∂Q is complete here
    dM1 = tl.where(tril, -dMacc, 0.0)
    dE += dM1 * (QK + 1.0)
    dA1 = dM1 * Ev
    k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
    dq += do + _dot(dA1, k, PREC)
    tl.store(DXQ + xoff, dq.to(DXQ.dtype.element_ty), mask=xmask)
    q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
    tl.store(DKP + xoff, _dot(tl.trans(dA1), q, PREC), mask=xmask)
    # E_ij = τ_i η_j
    tl.store(DEP + bh * T + t_off, tl.sum(dE * tau[:, None], axis=0), mask=rmask)
    tl.store(DTAU + pid * MB + rows, tl.sum(dE * e[None, :], axis=1), mask=rmask)


@triton.jit
def _ttt_mlp_bwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, W1S, B1S, W2S, G1S, G2S,
                        DZB1, XB2, DG1P, DZ1P, DZB2, DG2P, DKP, DEP, SZ, SS, SX, SD,
                        DXK, DXV, DETA, DTAU, DLNW, DLNB, DW1, DB1, DW2, DB2, SC,
                        CU, CS, DL1, DLB1, DL2, DLB2, T, NMB, NS, H, NC, eps,
                        D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
                        MB: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        VARLEN: tl.constexpr):
    """The serial carry, one program per (batch, head), mini-batches in reverse: DW1 [D, M], DB1
    [M], DW2 [M, D], DB2 [D] hold the final-state gradients on entry (the wrapper copies them in)
    and are accumulated in place into the initial weights' gradients; DTAU [MB], DLNW, DLNB [D]
    per mini-batch hold ``_ttt_mlp_bwd_mb_kernel``'s parts, to which this adds its own (nothing of
    width d is carried in registers from one mini-batch to the next). Per mini-batch it
    adds the update's terms (they need the gradient at the mini-batch's end) to what
    ``_ttt_mlp_bwd_mb_kernel`` stored, back-propagates Γ1 = (Γ2 W2ᵀ) ⊙ GELU'(Z1) and the
    LayerNorm-fused loss gradient Γ2 through Z2 and Z1 to K, V and the weights, and finishes ∂K,
    ∂V, ∂η. SZ [MB, M] (∂Z1), SS [MB, M] (∂S), SX [MB, M] (X2) and SD [MB, D] (∂Z2) are the
    program's scratch between the tile loops. It walks NMB mini-batches, slot n at (pid·NS + n)
    of the per-mini-batch buffers (NS per (batch, head)); SC [1] is the update's scale, τ_{b−1}
    (the wrapper passes −1, with every pointer at the last slot, in a launch of its own for a
    partial last mini-batch, which the forward did not apply; see ``_mlp_bwd_op``).

    VARLEN (packed batch, ``cu_seqlens`` CU, first slots CS, NC slots per head; pid = sequence·H +
    head): the sequence's own mini-batches, the slots CS[seq] … of head h (the per-token tensors
    slot-major and zero-padded, as in ``_ttt_mlp_fwd_kernel``); SC [2, H, NC] holds per slot the
    update's scale and whether it has a ∂τ term (τ_{b−1}, 1; a partial last mini-batch −1, 0), so
    a partial last mini-batch runs in the same launch; once a sequence's last mini-batch is done,
    the gradient of its start weights gets DL1, DLB1, DL2, DLB2 ([N, H, …]: the state's W_L
    gradient minus the end gradient the carry started from, which for a partial one is the
    gradient of its sums; see ``_mlp_bwd_packed``)."""
    pid = tl.program_id(0)
    h = pid % H
    NTIE = NMB                                  # i // NTIE = 0 for every i (``_loop_index``)
    if VARLEN:
        NMB = (tl.load(CU + pid // H + 1) - tl.load(CU + pid // H) + MB - 1) // MB
        # the index ties divide by the slot count NC (≥ the sequence's NMB; an argument), so that
        # the sequence's own count is needed only by the loop bound and n (tied to it, the packed
        # bf16 carry at d = 128 spilled 20 B on sm_90)
        NTIE = NC
    cdt = W1S.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    hc = tl.arange(0, BM)
    cmask = cols < D
    rmask = rows < MB
    xmask = rmask[:, None] & cmask[None, :]
    is_last = rows == MB - 1
    goff = rows[:, None] * D + cols[None, :]
    GW1 = DW1 + pid * D * M
    GB1 = DB1 + pid * M
    GW2 = DW2 + pid * M * D
    ZS = SZ + pid * MB * M
    DSS = SS + pid * MB * M
    SX = SX + pid * MB * M
    SDZ = SD + pid * MB * D

    tau_last = tl.load(SC).to(cdt)

    for i in range(NMB):
        n = NMB - 1 - i
        s = pid * NS + n
        if VARLEN:
            # the sequence's first slot, read again per mini-batch (tied to i: i // (NTIE + T) = 0)
            # rather than held in a register through the loop
            s = h * NC + tl.load(CS + pid // H + i // (NTIE + T)) + n
        cun = tau_last                          # the update's scale
        if VARLEN:                              # per slot: −1 for a partial last mini-batch
            cun = tl.load(SC + s).to(cdt)
        # the index tensors are rebuilt per mini-batch and per section rather than held across
        # the tile loops (``_loop_index``; distinct expressions, so that they are not merged)
        rows, cols = _loop_index(i, NTIE, BT, BD)
        cmask = cols < D
        rmask = rows < MB
        W1P = W1S + s * D * M
        B1P = B1S + s * M
        W2P = W2S + s * M * D
        G2P = G2S + s * 2 * MB * D              # Γ2, then Z2
        # the mini-batch's rows of K and Q (row stride D); packed: slot s's rows of the slot-major copy
        KP = _pick(XK + s * MB * D, XK + pid * T * D + n * MB * D, VARLEN)
        QP = _pick(XQ + s * MB * D, XQ + pid * T * D + n * MB * D, VARLEN)
        e = tl.load(_pick(ETA + s * MB, ETA + pid * T + n * MB, VARLEN) + rows, mask=rmask, other=0.0).to(cdt)
        te = -cun * e                           # the update W' = W − τ_{b−1} (…)ᵀ(η ⊙ Γ)

        # pass A1 (per tile): X2 through the update of W2, P2 = X2 dW2 (dW2 at the end)
        P2 = tl.zeros([BT, BD], dtype=cdt)
        for j0 in range(0, M, BM):
            b1 = tl.load(B1P + j0 + hc, mask=(j0 + hc) < M, other=0.0)
            X2, gp, gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                      + b1[None, :])
            X2 = tl.where(rmask[:, None], X2, 0.0)
            dZ1, zo, zm = _m_tile(DZ1P + s * MB * M, j0, hc, rows, rmask, M)
            dX2 = te[:, None] * _rows_w(G2P, rmask, GW2, j0, hc, D, 1, D, D, M, BT, BD, BM, BK, PREC)
            tl.store(ZS + zo, dZ1 + dX2 * gp, mask=zm)
            P2 += _dot(X2, _w_rows(GW2, j0, hc, *_tile_cols(j0, T, M, BD, D), 1, D, M), PREC)
        # P2 waits in SD (∂Z2's scratch, free until then) rather than in registers through pass A2
        tl.store(SDZ + rows[:, None] * D + cols[None, :], P2, mask=rmask[:, None] & cmask[None, :])
        tl.debug_barrier()                      # pass A2 adds to the ∂Z1 tiles of pass A1

        # pass A2 (per tile): Γ1 through the update of W1, b1 and through S = Γ2 W2ᵀ
        GP = tl.zeros([BT], dtype=cdt)
        dG2 = tl.zeros([BT, BD], dtype=cdt)
        for j0 in range(0, M, BM):
            hm = (j0 + hc) < M
            b1 = tl.load(B1P + j0 + hc, mask=hm, other=0.0)
            X2, gp, gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                      + b1[None, :])
            G1, zo, zm = _m_tile(G1S + s * MB * M, j0, hc, rows, rmask, M)
            gb1 = tl.load(GB1 + j0 + hc, mask=hm, other=0.0)
            P1 = _rows_w(KP, rmask, GW1, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC) + gb1[None, :]
            GP += tl.sum(G1 * P1, axis=1)
            dG1 = tl.load(DG1P + s * MB * M + zo, mask=zm, other=0.0) + te[:, None] * P1
            S = _rows_w(G2P, rmask, W2P, j0, hc, D, 1, D, D, M, BT, BD, BM, BK, PREC)
            dS = tl.where(rmask[:, None], dG1 * gp, 0.0)
            tl.store(ZS + zo, tl.load(ZS + zo, mask=zm, other=0.0) + dG1 * S * gpp, mask=zm)
            tl.store(DSS + zo, dS, mask=zm)
            dG2 += _dot(dS, _w_rows(W2P, j0, hc, *_tile_cols(j0, T, M, BD, D), 1, D, M), PREC)

        # Γ2 from Z2 and the target V − K: the LayerNorm-fused loss's second derivative
        rows, cols = _loop_index(i + 1, NTIE + 1, BT, BD)
        cmask = cols < D
        rmask = rows < MB
        xmask = rmask[:, None] & cmask[None, :]
        is_last = rows == MB - 1
        goff = rows[:, None] * D + cols[None, :]
        t_off = n * MB + rows
        xoff = _pick(s * MB * D + rows[:, None] * D + cols[None, :], pid * T * D + t_off[:, None] * D + cols[None, :],
                     VARLEN)
        G2 = tl.load(G2P + goff, mask=xmask, other=0.0)
        # db2 at the END of the mini-batch (DB2 holds it between mini-batches)
        db2 = tl.load(DB2 + pid * D + cols, mask=cmask, other=0.0)
        P2 = tl.load(SDZ + goff, mask=xmask, other=0.0) + db2[None, :]
        GP += tl.sum(G2 * P2, axis=1)
        dG2 += tl.load(DG2P + s * MB * D + goff, mask=xmask, other=0.0) + te[:, None] * P2
        eo = _pick(s * MB + rows, pid * T + t_off, VARLEN)
        tl.store(DETA + eo, (tl.load(DEP + eo, mask=rmask, other=0.0) - cun * GP).to(DETA.dtype.element_ty),
                 mask=rmask)
        dto = s * MB + rows
        dtl = -tl.sum(e * GP, axis=0)
        if VARLEN:                              # 0 for a partial last mini-batch: its scale −1 has no τ
            dtl = dtl * tl.load(SC + H * NC + s).to(cdt)
        tl.store(DTAU + dto, tl.load(DTAU + dto, mask=rmask, other=0.0)
                 + tl.where(is_last, dtl, 0.0), mask=rmask)
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
        beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
        xh, rstd, tgt, gh, _G2 = _loss_grad(tl.load(G2P + MB * D + goff, mask=xmask, other=0.0),
                                            v, k, gamma, beta, cmask, D, eps)
        dZ2, dtgt, dg, dbt = _ln_l2_bwd_bwd(dG2, G2, gh, xh, rstd, gamma, beta, tgt, cmask, D)
        dZ2 = tl.where(rmask[:, None], dZ2, 0.0)
        lo = s * D + cols
        tl.store(DLNW + lo, tl.load(DLNW + lo, mask=cmask, other=0.0) + dg, mask=cmask)
        tl.store(DLNB + lo, tl.load(DLNB + lo, mask=cmask, other=0.0) + dbt, mask=cmask)
        db2 += tl.sum(tl.load(DZB2 + s * MB * D + goff, mask=xmask, other=0.0), axis=0) + tl.sum(dZ2, axis=0)
        tl.store(DB2 + pid * D + cols, db2, mask=cmask)
        tl.store(DXV + xoff, dtgt.to(DXV.dtype.element_ty), mask=xmask)
        tl.store(SDZ + goff, dZ2, mask=xmask)
        tl.store(DKP + xoff, tl.load(DKP + xoff, mask=xmask, other=0.0) - dtgt, mask=xmask)
        tl.debug_barrier()                      # pass B reads ∂Z2 and the tiles of passes A1, A2

        # pass B (per tile): Z2 = X2 W2 + b2, X2 = GELU(Z1), Z1 = K W1 + b1; every weight gradient
        # of the tile gets its terms of this mini-batch (passes A1, A2 read the end values)
        dk = tl.zeros([BT, BD], dtype=cdt)
        for j0 in range(0, M, BM):
            hm = (j0 + hc) < M
            b1 = tl.load(B1P + j0 + hc, mask=hm, other=0.0)
            X2, gp, gpp = _gelu_tanh3(_rows_w(KP, rmask, W1P, j0, hc, D, M, 1, D, M, BT, BD, BM, BK, PREC)
                                      + b1[None, :])
            X2 = tl.where(rmask[:, None], X2, 0.0)
            dZ1, zo, zm = _m_tile(ZS, j0, hc, rows, rmask, M)
            dZ1 += tl.where(rmask[:, None], _rows_w(SDZ, rmask, W2P, j0, hc, D, 1, D, D, M, BT, BD, BM, BK, PREC) * gp, 0.0)
            tl.store(ZS + zo, dZ1, mask=zm)
            tl.store(SX + zo, X2, mask=zm)
            dZ1b = tl.load(DZB1 + s * MB * M + zo, mask=zm, other=0.0)
            G1 = tl.load(G1S + s * MB * M + zo, mask=zm, other=0.0)
            # ∂K: through Z1 = K W1 + b1 and the update's Kᵀ(η⊙Γ1) (dW1 still at the end here)
            dk += _dot(dZ1, _w_rows(W1P, j0, hc, *_tile_cols(j0, T, M, BD, D), M, 1, M), PREC)
            dk += _dot(te[:, None] * G1, _w_rows(GW1, j0, hc, *_tile_cols(j0, T, M, BD, D), M, 1, M), PREC)
            # the tile's b1 gradient (pass C adds the W1, W2 ones)
            tl.store(GB1 + j0 + hc, tl.load(GB1 + j0 + hc, mask=hm, other=0.0)
                     + tl.sum(dZ1 + dZ1b, axis=0), mask=hm)
        rows, cols = _loop_index(i + 2, NTIE + 2, BT, BD)
        xmask = (rows < MB)[:, None] & (cols < D)[None, :]
        xoff = _pick(s * MB * D + rows[:, None] * D + cols[None, :],
                     pid * T * D + (n * MB + rows)[:, None] * D + cols[None, :], VARLEN)
        k = tl.load(DKP + xoff, mask=xmask, other=0.0) + dk
        tl.store(DXK + xoff, k.to(DXK.dtype.element_ty), mask=xmask)
        tl.debug_barrier()                      # pass C reads the ∂Z1 and X2 tiles of pass B

        # pass C (per tile, in column blocks): the weight gradients' terms of this mini-batch,
        # dW1 (c, j) += Kᵀ∂Z1 + Qᵀ∂Z̄1;  dW2 (j, c) += Γ2ᵀ∂S + ∂Z̄2ᵀX̄2 + ∂Z2ᵀX2 (as [c, j])
        for j0 in range(0, M, BM):
            hm = (j0 + hc) < M
            dZ1, zo, zm = _m_tile(ZS, j0, hc, rows, rmask, M)
            dZ1b = tl.load(DZB1 + s * MB * M + zo, mask=zm, other=0.0)
            for c0 in range(0, BD, BK):
                kc = c0 + tl.arange(0, BK)
                wm = (kc < D)[:, None] & hm[None, :]
                w1o = kc[:, None] * M + (j0 + hc)[None, :]
                tl.store(GW1 + w1o, tl.load(GW1 + w1o, mask=wm, other=0.0)
                         + _xt_blk(KP, rows, rmask, dZ1, c0, D, BK, PREC) + _xt_blk(QP, rows, rmask, dZ1b, c0, D, BK, PREC),
                         mask=wm)
            dS = tl.load(DSS + zo, mask=zm, other=0.0)
            X2b = tl.load(XB2 + s * MB * M + zo, mask=zm, other=0.0)
            X2 = tl.load(SX + zo, mask=zm, other=0.0)
            for c0 in range(0, BD, BK):
                kc = c0 + tl.arange(0, BK)
                wm = (kc < D)[:, None] & hm[None, :]
                w2o = kc[:, None] + (j0 + hc)[None, :] * D
                tl.store(GW2 + w2o, tl.load(GW2 + w2o, mask=wm, other=0.0)
                         + _xt_blk(G2P, rows, rmask, dS, c0, D, BK, PREC)
                         + _xt_blk(DZB2 + s * MB * D, rows, rmask, X2b, c0, D, BK, PREC)
                         + _xt_blk(SDZ, rows, rmask, X2, c0, D, BK, PREC), mask=wm)
        tl.debug_barrier()                      # the next mini-batch reads the gradients and scratch
        if VARLEN:
            if i == 0:                          # the last mini-batch's start weights: their own gradient
                # index vectors tied to n (n // (NTIE + T) = 0), so that they are not hoisted out of
                # the mini-batch loop and held through it (as ``_tile_cols``)
                z = n // (NTIE + T)
                for o0 in range(0, D * M, 32 * BM):
                    o = o0 + tl.arange(0, 32 * BM) + z
                    om = o < D * M
                    tl.store(GW1 + o, tl.load(GW1 + o, mask=om, other=0.0)
                             + tl.load(DL1 + pid * D * M + o, mask=om, other=0.0), mask=om)
                    tl.store(GW2 + o, tl.load(GW2 + o, mask=om, other=0.0)
                             + tl.load(DL2 + pid * D * M + o, mask=om, other=0.0), mask=om)
                for o0 in range(0, M, 32 * BM):
                    o = o0 + tl.arange(0, 32 * BM) + z
                    om = o < M
                    tl.store(GB1 + o, tl.load(GB1 + o, mask=om, other=0.0)
                             + tl.load(DLB1 + pid * M + o, mask=om, other=0.0), mask=om)
                c2 = tl.arange(0, BD) + z
                tl.store(DB2 + pid * D + c2, tl.load(DB2 + pid * D + c2, mask=c2 < D, other=0.0)
                         + tl.load(DLB2 + pid * D + c2, mask=c2 < D, other=0.0), mask=c2 < D)
                tl.debug_barrier()



# ---- autograd -----------------------------------------------------------------------------------
def _mlp_launch_cfg(d: int, m: int, b: int, packed: bool = False):
    """Padded tile sizes (every tl.dot block dim ≥ 16), the hidden tile width BM and launch
    options for TTT-MLP, the same on every GPU family. Under the interpreter BM = 16 as well, so
    that the tests' small m (32, and a padded 24) run several hidden tiles.

    Compiled for sm_90 and sm_80 (``python -m kernels.compile_report --op ttt -k _ttt_mlp_``):
    BM = 16 on 8 warps. Register pressure comes mostly from the [b, d] tiles that enter products
    as the left operand (each warp holds all b rows of such an operand, whatever the warp count)
    and stay live across the tile loop, not from the weight tiles: BM = 32 or 4 warps spill more.
    The packed variants (``packed``, VARLEN = True) take the same (their column block differs,
    ``_mlp_col_block``)."""
    BD = max(16, triton.next_power_of_2(d))
    BT = max(16, triton.next_power_of_2(b))
    if is_interpreting():
        return BD, 16, BT, {}
    return BD, 16, BT, {"num_warps": 8, "num_stages": 1}


def _mlp_col_block(BD: int, prec: str = "bf16", part: str = "fwd", arch: int = INTERPRET_ARCH,
                   packed: bool = False) -> int:
    """The column block BK of the kernels' products with a [b, d] operand (``_rows_w``,
    ``_xt_blk``): min(BD, 32), except in the per-mini-batch backward (``part="bwd_mb"``) with
    3×TF32 operands (``prec="tf32x3"``) on the sm_80 family (``arch``, ``device_arch``), where the
    split operands spill at 32 (d = 128) and BK = 16 (which spills at d = 64 on sm_90); 16 in the
    packed (``packed``, VARLEN) state pass and carry, whose per-sequence offsets and scale spilled
    4–56 B with 32; 16 under the interpreter, so that the tests' small d run several blocks."""
    if is_interpreting() or packed or (part == "bwd_mb" and prec == "tf32x3" and arch == 80):
        return 16
    return min(BD, 32)


def _mlp_carry_opts(kw: dict, BD: int, prec: str, packed: bool = False) -> dict:
    """Launch options of the carry (``_ttt_mlp_bwd_kernel``): those of ``_mlp_launch_cfg``, except
    the packed (VARLEN) bfloat16 variant, which takes num_stages = 2 on every GPU family (with 1,
    at 255 registers, it spilled 12-20 B at d = 128 and 8 B at d = 64 on sm_90; with 2 both
    compile without spills on sm_90 and sm_80; the float32 packed one spills with 2 at d = 64, so
    keeps 1). The interpreter takes none."""
    if kw and packed and prec == "bf16":
        return {**kw, "num_stages": 2}
    return kw


def _mlp_head_bwd_cfg(BD: int, prec: str, arch: int = INTERPRET_ARCH):
    """Column block BK and launch options of the per-mini-batch backward's head variant (HEAD =
    True, one launch per call from a state at pos > 0): its extra products −τ ⊙ (X̄2 G_W2) and
    −τ ⊙ (∂Z̄2 G_W2ᵀ) raise the register count, so it takes its own at BD = 128: with 3×TF32
    operands BK = 16 (32 spilled 76-84 B on sm_80); bfloat16 on the sm_90 family BK = 16 on 4
    warps (8 warps spilled 12-44 B with BK = 16, 32, 64; 16 warps more), on the sm_80 family 32
    (16 spilled 84 B). Otherwise min(BD, 32) on 8 warps. The interpreter takes BK = 16."""
    if is_interpreting():
        return 16, {}
    if BD < 128 or (prec == "bf16" and arch != 90):
        return min(BD, 32), {"num_warps": 8, "num_stages": 1}
    return 16, {"num_warps": 4 if prec == "bf16" else 8, "num_stages": 1}


def _mlp_window() -> int:
    """Mini-batches per state-pass/output window of a forward without autograd (``_mlp_fwd_op``):
    2 under the interpreter, so that the tests run several windows."""
    return 2 if is_interpreting() else 16


def _mlp_gamma_buffers(XQ, m: int, n: int, bsz: int):
    """Empty Γ1 [B, H, n, bsz, m] and (Γ2, Z2) [B, H, n, 2, bsz, d] in the accumulation dtype."""
    B, H, _, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    return [XQ.new_empty(B, H, n, bsz, m, dtype=cdt), XQ.new_empty(B, H, n, 2, bsz, d, dtype=cdt)]


def _mlp_weight_buffers(XQ, m: int, n: Optional[int]):
    """Empty (W1, b1, W2, b2) in the accumulation dtype: per mini-batch start ([B, H, n, ...]) or
    final ([B, H, ...], n = None)."""
    B, H, _, d = XQ.shape
    cdt = acc_dtype(XQ.dtype)
    if n is None:
        return [XQ.new_empty(B, H, *s, dtype=cdt) for s in ((d, m), (1, m), (m, d), (1, d))]
    return [XQ.new_empty(B, H, n, *s, dtype=cdt) for s in ((d, m), (m,), (m, d), (d,))]


def _head_args(zh1: Optional[torch.Tensor], gw2: Optional[torch.Tensor], XQ: torch.Tensor):
    """The output kernel's and the per-mini-batch backward's ZH1, GW2 pointers and their row count
    NZH: a head launch's ``zh1`` [B, H, T, m] and ``gw2`` [B, H, m + 1, d] (checked, contiguous)
    and T; placeholders (never read) and 0 without a head."""
    cdt = acc_dtype(XQ.dtype)
    if zh1 is None and gw2 is None:
        ph = torch.empty(1, dtype=cdt, device=XQ.device)
        return ph, ph, 0
    B, H, T, d = XQ.shape
    if zh1 is None or gw2 is None or zh1.dtype != cdt or gw2.dtype != cdt or zh1.shape[:3] != (B, H, T) \
            or gw2.shape[:2] != (B, H) or gw2.shape[3] != d or zh1.shape[3] + 1 != gw2.shape[2]:
        raise ValueError(f"ttt_mlp_triton: the head's zh1 must be [{B}, {H}, {T}, m] and gw2 [{B}, {H}, m + 1, {d}], "
                         f"both {cdt}; got {None if zh1 is None else (tuple(zh1.shape), zh1.dtype)} and "
                         f"{None if gw2 is None else (tuple(gw2.shape), gw2.dtype)}")
    return zh1.contiguous(), gw2.contiguous(), T


# The ops are PyTorch custom ops (torch.library): torch.compile (model.compile) captures each as one
# opaque node of the block's graph, with shapes from the fake implementations and the backward
# registered below, instead of tracing the Triton launches or breaking the graph.
@torch.library.custom_op("kernels::ttt_mlp_fwd", mutates_args=())
def _mlp_fwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                ln_w: torch.Tensor, ln_b: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor,
                b2: torch.Tensor, mini_batch_size: int, last_rows: int, save: bool,
                cu_seqlens: Optional[torch.Tensor] = None, zh1: Optional[torch.Tensor] = None,
                gw2: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Whole mini-batches from a boundary (T a multiple of b), the last of which has ``last_rows``
    = R ∈ [1, b] real rows, the rest zero padding with η = 0 (the wrapper pads): (XQ, XK, XV, η,
    τ, γ, β, W1_0 [B,H,d,m], b1_0 [B,H,1,m], W2_0 [B,H,m,d], b2_0 [B,H,1,d]) → [out [B,H,T,d], W1_end, b1_end, W2_end, b2_end (after a partial last
    mini-batch: its gradient sums grad_W1 … grad_b2 instead), the last mini-batch's start weights
    W1_L, b1_L, W2_L, b2_L (shaped as W1_0 …), and the per-mini-batch start weights W1S, B1S, W2S,
    B2S, Γ1, Γ2 and Z2, which the output kernel and the backward read].

    With ``save`` the start weights of every mini-batch are kept for the backward (one state pass
    and one output launch over the whole sequence); without it the sequence runs in windows of
    ``_mlp_window`` mini-batches, the state carried from one window to the next in the final-weight
    buffers, so the scratch stays bounded (the returned start weights are then the last window's
    scratch, which nothing reads).

    With ``cu_seqlens`` (int32 [N+1], checked by the caller; B = 1; XQ … η unpadded, T ≥ 1) the N
    packed sequences run in one launch of each kernel (``_mlp_fwd_packed``): W1_0 … b2_0 and the
    end and last-start weights are [N, H, …], ``last_rows`` and ``save`` are unused.

    A head launch (``_mlp_head``, fixed-length only) passes ``zh1`` [B, H, T, m], added to Z̄1, and
    ``gw2`` = (G_W2; G_b2) [B, H, m + 1, d], whose term −τ ⊙ (X̄2 G_W2 + G_b2) enters Z̄2."""
    if cu_seqlens is not None:
        return _mlp_fwd_packed(XQ, XK, XV, eta, tau, ln_w, ln_b, W1, b1, W2, b2, mini_batch_size, cu_seqlens)
    B, H, T, d = XQ.shape
    m = W1.shape[-1]
    bsz = mini_batch_size
    NMB = T // bsz
    R = last_rows
    NW = NMB if save else min(NMB, _mlp_window())
    cdt = acc_dtype(XQ.dtype)
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    b2c = b2.to(cdt).contiguous()
    ZH1, GW2, NZH = _head_args(zh1, gw2, XQ)
    out = torch.empty_like(XQ)
    W1S, B1S, W2S, B2S = _mlp_weight_buffers(XQ, m, NW)
    W1F, B1F, W2F, B2F = _mlp_weight_buffers(XQ, m, None)
    # Γ1, Γ2 and Z2 of every mini-batch of a window, from the state pass to the output kernel
    # (and the backward)
    G1S, G2S = _mlp_gamma_buffers(XQ, m, NW, bsz)
    # the state pass updates W1, b1, W2 in place in these (fresh copies: the inputs stay untouched)
    for dst, src in ((W1F, W1), (B1F, b1), (W2F, W2)):
        dst.copy_(src)
    BD, BM, BT, kw = _mlp_launch_cfg(d, m, bsz)
    BK = _mlp_col_block(BD)
    prec = _precision(XQ.dtype)
    b2_in = b2c
    for n0 in range(0, NMB, NW):
        nw = min(NW, NMB - n0)
        r = R if n0 + nw == NMB else bsz        # valid rows of the window's last mini-batch
        # views from the window's first token: the kernels index rows within a head with stride d
        # and heads with stride T·d, so a view at an offset needs no copy
        t0 = n0 * bsz
        q_w, k_w, v_w, e_w, o_w = (x[:, :, t0:] for x in (XQ, XK, XV, eta, out))
        zh_w = ZH1[:, :, t0:] if NZH else ZH1
        _ttt_mlp_fwd_kernel[(B * H,)](
            k_w, v_w, e_w, tau_c, lw, lb, b2_in,
            W1S, B1S, W2S, B2S, G1S, G2S, W1F, B1F, W2F, B2F, None, None,
            T, nw, r, H, 0, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, BK=BK, PREC=prec, VARLEN=False, **kw)
        _ttt_mlp_out_kernel[(B * H * nw,)](
            q_w, k_w, e_w, tau_c, lw, lb, W1S, B1S, W2S, B2S, G1S, G2S, o_w, zh_w, GW2,
            T, nw, H, max(NZH - t0, 0), LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, BK=BK, PREC=prec, **kw)
        b2_in = B2F
    # the last mini-batch's start weights: slot nw − 1 of the last window, whose nw slots per
    # (batch, head) the kernels pack at the front of the buffers (slot (b·H + h)·nw + n)
    def last_slot(S, shape):
        return S.reshape(-1)[:B * H * nw * S[0, 0, 0].numel()].view(B, H, nw, *S.shape[3:])[:, :, nw - 1].reshape(
            B, H, *shape).clone()
    last = [last_slot(W1S, (d, m)), last_slot(B1S, (1, m)), last_slot(W2S, (m, d)), last_slot(B2S, (1, d))]
    return [out, W1F, B1F, W2F, B2F, *last, W1S, B1S, W2S, B2S, G1S, G2S]


def _packed_seqs(cu_seqlens: torch.Tensor, bsz: int):
    """Per sequence of a packed batch, on the device: its mini-batch count, whether its last
    mini-batch is partial, whether it is empty."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return (lens + bsz - 1) // bsz, lens % bsz != 0, lens == 0


def _packed_rows(cu_seqlens: torch.Tensor, T: int, bsz: int, CS: torch.Tensor, CI: torch.Tensor):
    """The slot-major layout of a packed batch, built on the device: the NC mini-batch slots of
    ``packed_chunk_tables`` one after another, b rows each. Returns, per padded row, the token it
    holds (``idx`` [NC·b], 0 where none) and whether it holds one (``valid``: the rows past a
    sequence's end and every row of a spare slot do not), and per token its padded row (``pos``
    [T])."""
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    seq, c = CI[:, 0].long(), CI[:, 1].long()
    sq = seq.clamp(min=0)
    bos = cu[sq]
    within = c[:, None] * bsz + torch.arange(bsz, device=dev)[None, :]
    valid = (seq >= 0)[:, None] & (within < (cu[sq + 1] - bos)[:, None])
    idx = torch.where(valid, bos[:, None] + within, 0).reshape(-1)
    t = torch.arange(T, device=dev)
    ts = torch.searchsorted(cu[1:], t, right=True)          # the sequence of each token
    off = t - cu[ts]
    pos = (CS.long()[ts] + off // bsz) * bsz + off % bsz
    return idx, valid.reshape(-1), pos


def _pad_rows(x: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[1, H, T(, d)] → the slot-major [1, H, NC·b(, d)], zero in the rows that hold no token."""
    xp = x.index_select(2, idx)
    return torch.where(valid.view(-1, *([1] * (x.dim() - 3))), xp, torch.zeros((), dtype=x.dtype, device=x.device))


def _mlp_fwd_packed(XQ, XK, XV, eta, tau, ln_w, ln_b, W1, b1, W2, b2, bsz: int, cu_seqlens):
    """The forward of a packed batch, one launch of each kernel, on a slot-major copy of the inputs
    (``_packed_rows``: each sequence's mini-batches in its slots, its last one zero-padded to b rows
    with η = 0, as the fixed-length path pads its tail): the state pass one program per
    (sequence, head), walking that sequence's slots from its own start weights (W1 … b2 [N, H,
    …]); the output kernel, unchanged, one program per (head, slot) over the ⌊T/b⌋ + N slots (a
    spare slot computes on zero rows). Every start weight is stored (no windows); the per-slot
    buffers are zero-filled, so a spare slot reads zeros. The last mini-batch's start weights
    W_L of each sequence are gathered from its slot (an empty sequence's: its initial weights)."""
    _, H, T, d = XQ.shape
    m = W1.shape[-1]
    N, NC, CS, CI = packed_chunk_tables(T, bsz, cu_seqlens)
    idx, valid, pos = _packed_rows(cu_seqlens, T, bsz, CS, CI)
    TP = NC * bsz
    cdt = acc_dtype(XQ.dtype)
    dev = XQ.device
    XQ, XK, XV, eta = (_pad_rows(x, idx, valid) for x in (XQ, XK, XV, eta))
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    out = torch.empty_like(XQ)
    W1S, B1S, W2S, B2S = (x.zero_() for x in _mlp_weight_buffers(XQ, m, NC))
    G1S, G2S = (x.zero_() for x in _mlp_gamma_buffers(XQ, m, NC, bsz))
    # the state pass updates these in place from the start weights (fresh copies)
    W1F, B1F, W2F = (w.to(cdt).contiguous().clone() for w in (W1, b1, W2))
    b20 = b2.to(cdt).contiguous()
    B2F = torch.empty(N, H, 1, d, dtype=cdt, device=dev)
    BD, BM, BT, kw = _mlp_launch_cfg(d, m, bsz, packed=True)
    prec = _precision(XQ.dtype)
    BK = _mlp_col_block(BD, prec)
    _ttt_mlp_fwd_kernel[(N * H,)](
        XK, XV, eta, tau_c, lw, lb, b20, W1S, B1S, W2S, B2S, G1S, G2S, W1F, B1F, W2F, B2F, cu_seqlens, CS,
        TP, 0, 0, H, NC, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, BK=_mlp_col_block(BD, prec, packed=True),
        PREC=prec, VARLEN=True, **kw)
    _ttt_mlp_out_kernel[(H * NC,)](
        XQ, XK, eta, tau_c, lw, lb, W1S, B1S, W2S, B2S, G1S, G2S, out, *_head_args(None, None, XQ)[:2],
        TP, NC, H, 0, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, BK=BK, PREC=prec, **kw)
    nts, _part, empty = _packed_seqs(cu_seqlens, bsz)
    last_slot = (CS.long() + nts - 1).clamp(min=0)

    def last(S, W0):
        g = S[0].index_select(1, last_slot).transpose(0, 1).reshape(W0.shape)
        return torch.where(empty.view(N, 1, 1, 1), W0.to(cdt), g)
    lasts = [last(W1S, W1), last(B1S, b1), last(W2S, W2), last(B2S, b2)]
    return [out.index_select(2, pos), W1F, B1F, W2F, B2F, *lasts, W1S, B1S, W2S, B2S, G1S, G2S]


@_mlp_fwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, W1, b1, W2, b2, mini_batch_size, last_rows, save, cu_seqlens=None,
      zh1=None, gw2=None):
    m = W1.shape[-1]
    if cu_seqlens is not None:
        NC = XQ.shape[2] // mini_batch_size + cu_seqlens.shape[0] - 1
        ws = [torch.empty_like(w, dtype=acc_dtype(XQ.dtype)) for w in (W1, b1, W2, b2)]
        return ([torch.empty_like(XQ)] + ws + [torch.empty_like(w) for w in ws]
                + _mlp_weight_buffers(XQ, m, NC) + _mlp_gamma_buffers(XQ, m, NC, mini_batch_size))
    NMB = XQ.shape[2] // mini_batch_size
    NW = NMB if save else min(NMB, _mlp_window())
    return ([torch.empty_like(XQ)] + _mlp_weight_buffers(XQ, m, None) + _mlp_weight_buffers(XQ, m, None)
            + _mlp_weight_buffers(XQ, m, NW) + _mlp_gamma_buffers(XQ, m, NW, mini_batch_size))


@torch.library.custom_op("kernels::ttt_mlp_bwd", mutates_args=())
def _mlp_bwd_op(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
                ln_w: torch.Tensor, ln_b: torch.Tensor, W1S: torch.Tensor, B1S: torch.Tensor, W2S: torch.Tensor,
                B2S: torch.Tensor, G1S: torch.Tensor, G2S: torch.Tensor,
                dout: Optional[torch.Tensor], dW1F: Optional[torch.Tensor],
                dB1F: Optional[torch.Tensor], dW2F: Optional[torch.Tensor], dB2F: Optional[torch.Tensor],
                dW1L: Optional[torch.Tensor], dB1L: Optional[torch.Tensor], dW2L: Optional[torch.Tensor],
                dB2L: Optional[torch.Tensor], mini_batch_size: int, last_rows: int, W1_dt: torch.dtype,
                b1_dt: torch.dtype, W2_dt: torch.dtype, b2_dt: torch.dtype,
                cu_seqlens: Optional[torch.Tensor] = None, zh1: Optional[torch.Tensor] = None,
                gw2: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Gradients of the eleven tensor inputs of ``_mlp_fwd_op``: ``_ttt_mlp_bwd_mb_kernel`` over
    every (batch, head, mini-batch), then ``_ttt_mlp_bwd_kernel`` over every (batch, head), the
    last mini-batch in a launch of its own when it is partial (or its start weights W_L have a
    gradient). With ``cu_seqlens``: one launch of each (``_mlp_bwd_packed``). A head launch's
    (``zh1``, ``gw2``) add their two gradients at the end: ∂zh1 = ∂Z̄1; from Z̄2's −τ ⊙ (X̄2 G_W2
    + G_b2), ∂G_W2 = −X̄2ᵀ(τ ⊙ ∂Z̄2), ∂G_b2 = −Σ_t τ_t ∂Z̄2_t, and τ's part −Σ_c (X̄2 G_W2 + G_b2) ⊙ ∂Z̄2."""
    if cu_seqlens is not None:
        return _mlp_bwd_packed(XQ, XK, XV, eta, tau, ln_w, ln_b, W1S, B1S, W2S, B2S, G1S, G2S, dout,
                               (dW1F, dB1F, dW2F, dB2F), (dW1L, dB1L, dW2L, dB2L), mini_batch_size,
                               (W1_dt, b1_dt, W2_dt, b2_dt), cu_seqlens)
    bsz, tau_dt, lw_dt, lb_dt = mini_batch_size, tau.dtype, ln_w.dtype, ln_b.dtype
    tau_c = tau.to(W1S.dtype).contiguous()
    lw, lb = ln_w.to(W1S.dtype).contiguous(), ln_b.to(W1S.dtype).contiguous()
    B, H, T, d = XQ.shape
    m = W1S.shape[-1]
    NMB = T // bsz
    R = last_rows
    cdt = W1S.dtype
    dev = XQ.device

    def grad_init(g, *shape):
        """A fresh buffer holding the incoming gradient (zero when there is none): the kernel
        accumulates into it in place."""
        buf = torch.zeros(*shape, dtype=cdt, device=dev)
        return buf if g is None else buf.copy_(g)

    def empty(*shape):
        return torch.empty(*shape, dtype=cdt, device=dev)

    dout = torch.zeros_like(XQ) if dout is None else dout.contiguous()
    dW10, dB10, dW20 = grad_init(dW1F, B, H, d, m), grad_init(dB1F, B, H, 1, m), grad_init(dW2F, B, H, m, d)
    dB20 = grad_init(dB2F, B, H, 1, d)
    dXQ, dXK, dXV = (torch.empty_like(XQ) for _ in range(3))
    dETA = torch.empty_like(eta)
    # per mini-batch, from the parallel kernel to the carry: ∂Z̄1, X̄2, ∂Γ1 and ∂Z1 partials
    # [b, m], ∂Z̄2 and ∂Γ2's partial [b, d]; the partial ∂K, ∂η in the accumulation dtype
    DZB1, XB2, DG1P, DZ1P = (empty(B, H, NMB, bsz, m) for _ in range(4))
    DZB2, DG2P = (empty(B, H, NMB, bsz, d) for _ in range(2))
    DKP, DEP = empty(B, H, T, d), empty(B, H, T)
    # ∂τ, ∂γ, ∂β per (batch, head, mini-batch): both kernels add to them
    dTAU, dLNW, dLNB = empty(B, H, NMB, bsz), empty(B, H, NMB, d), empty(B, H, NMB, d)
    # the carry's per-program scratch: ∂Z1, ∂S, X2 [b, m] and ∂Z2 [b, d]
    SZ, SS, SX, SD = empty(B, H, bsz, m), empty(B, H, bsz, m), empty(B, H, bsz, m), empty(B, H, bsz, d)
    BD, BM, BT, kw = _mlp_launch_cfg(d, m, bsz)
    prec = _precision(XQ.dtype)
    BK = _mlp_col_block(BD, prec)
    XQ, XK, XV, eta = (x.contiguous() for x in (XQ, XK, XV, eta))
    ZH1, GW2, NZH = _head_args(zh1, gw2, XQ)
    if NZH:     # a head launch: the head variant, with its own column block and warps
        BK_mb, kw_mb = _mlp_head_bwd_cfg(BD, prec, device_arch(dev))
    else:
        BK_mb, kw_mb = _mlp_col_block(BD, prec, "bwd_mb", device_arch(dev)), kw
    _ttt_mlp_bwd_mb_kernel[(B * H * NMB,)](
        XQ, XK, eta, tau_c, lw, lb, W1S, B1S, W2S, B2S, G1S, G2S, dout,
        DZB1, XB2, DG1P, DZ1P, DZB2, DG2P, DKP, DEP, dXQ, dTAU, dLNW, dLNB, ZH1, GW2,
        T, NMB, H, NZH, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, BK=BK_mb, PREC=prec, HEAD=NZH > 0,
        **kw_mb)

    def carry(first, count, scale):
        """The carry over mini-batches first … first + count − 1 (in reverse), the update's scale
        ``scale`` [1]: the per-mini-batch and per-token pointers start at mini-batch ``first``."""
        if count == 0:
            return
        t0 = first * bsz
        _ttt_mlp_bwd_kernel[(B * H,)](
            XQ[:, :, t0:], XK[:, :, t0:], XV[:, :, t0:], eta[:, :, t0:], tau_c, lw, lb,
            *(x[:, :, first:] for x in (W1S, B1S, W2S, G1S, G2S, DZB1, XB2, DG1P, DZ1P, DZB2, DG2P)),
            DKP[:, :, t0:], DEP[:, :, t0:], SZ, SS, SX, SD,
            dXK[:, :, t0:], dXV[:, :, t0:], dETA[:, :, t0:], *(x[:, :, first:] for x in (dTAU, dLNW, dLNB)),
            dW10, dB10, dW20, dB20, scale, None, None, None, None, None, None,
            T, count, NMB, H, 0, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT, BK=BK, PREC=prec, VARLEN=False, **kw)

    ends, lasts = (dW1F, dB1F, dW2F, dB2F), (dW1L, dB1L, dW2L, dB2L)
    if R < bsz or any(g is not None for g in lasts):
        # The last mini-batch in a launch of its own. A partial one was not applied: its end values
        # are its gradient sums, so their gradients (the buffers' initial values) enter with the
        # scale −1 in place of −τ_{b−1}, τ_{b−1} gets no update term (its one spurious entry, the
        # last row's, is zeroed: that row is padding, with no term of its own), and its start
        # weights' gradient is the state's W_L gradient instead of the end gradient.
        part = R < bsz
        carry(NMB - 1, 1, torch.full((1,), -1.0, dtype=cdt, device=dev) if part else tau_c[bsz - 1:])
        if part:
            dTAU[:, :, NMB - 1, bsz - 1] = 0
        for buf, gl, ge in zip((dW10, dB10, dW20, dB20), lasts, ends):
            if gl is not None:
                buf += gl
            if part and ge is not None:
                buf -= ge
        carry(0, NMB - 1, tau_c[bsz - 1:])
    else:
        carry(0, NMB, tau_c[bsz - 1:])
    head = []
    if NZH:
        # the head's terms: Z̄1 += zh1, Z̄2 −= τ ⊙ (X̄2 G_W2 + G_b2), with X̄2, ∂Z̄1, ∂Z̄2 as stored
        dZ1b, X2b, dZ2b = DZB1.view(B, H, T, m), XB2.view(B, H, T, m), DZB2.view(B, H, T, d)
        tau_t = tau_c.repeat(NMB)[:, None]
        dGW = -torch.einsum("bhtm,bhtd->bhmd", X2b, tau_t * dZ2b)
        dGb = -(tau_t * dZ2b).sum(2, keepdim=True)
        h2 = X2b @ GW2[:, :, :m] + GW2[:, :, m:]
        dTAU -= (h2 * dZ2b).sum(-1).view(B, H, NMB, bsz)
        head = [dZ1b.clone(), torch.cat([dGW, dGb], dim=2)]
    return [dXQ, dXK, dXV, dETA, dTAU.sum((0, 1, 2)).to(tau_dt), dLNW.sum((0, 2)).to(lw_dt),
            dLNB.sum((0, 2)).to(lb_dt),
            dW10.to(W1_dt), dB10.to(b1_dt), dW20.to(W2_dt), dB20.to(b2_dt)] + head


def _mlp_bwd_packed(XQ, XK, XV, eta, tau, ln_w, ln_b, W1S, B1S, W2S, B2S, G1S, G2S, dout, ends, lasts,
                    bsz: int, dts, cu_seqlens):
    """The backward of a packed batch, one launch of each kernel on the slot-major copies (as
    ``_mlp_fwd_packed``; ∂out zero in the padding): the per-mini-batch kernel, unchanged, one
    program per (head, slot), the carry one per (sequence, head), each sequence from the gradient
    of its own end weights, its last mini-batch (partial: scale −1, no ∂τ term) in the same walk;
    once that is done the carry adds Δ = ∂W_L − [partial] ∂W_end (the start weights' own
    gradient; a partial one's end values are its sums, not a function of its start weights), and
    an empty sequence's gradient is ∂W_end + ∂W_L (both are its initial weights). ∂W1_0 … ∂b2_0
    are [N, H, …]; the input gradients are gathered back to the packed rows."""
    tau_dt, lw_dt, lb_dt = tau.dtype, ln_w.dtype, ln_b.dtype
    cdt = W1S.dtype
    dev = XQ.device
    tau_c = tau.to(cdt).contiguous()
    lw, lb = ln_w.to(cdt).contiguous(), ln_b.to(cdt).contiguous()
    _, H, T, d = XQ.shape
    m = W1S.shape[-1]
    N, NC, CS, CI = packed_chunk_tables(T, bsz, cu_seqlens)
    idx, valid, pos = _packed_rows(cu_seqlens, T, bsz, CS, CI)
    TP = NC * bsz
    _nts, part, empty = _packed_seqs(cu_seqlens, bsz)
    shapes = ((N, H, d, m), (N, H, 1, m), (N, H, m, d), (N, H, 1, d))

    def zeros(*shape):
        return torch.zeros(*shape, dtype=cdt, device=dev)

    def empty_buf(*shape):
        return torch.empty(*shape, dtype=cdt, device=dev)

    # the carry accumulates in place into the end weights' gradients (copies)
    dW0 = [zeros(*sh) if g is None else g.to(cdt).contiguous().clone() for g, sh in zip(ends, shapes)]
    delta = []
    for g, ge, sh in zip(lasts, ends, shapes):
        dl = zeros(*sh) if g is None else g.to(cdt).contiguous().clone()
        if ge is not None:
            dl -= torch.where(part.view(N, 1, 1, 1), ge.to(cdt), 0.0)
        delta.append(dl.contiguous())
    dout = torch.zeros_like(XQ) if dout is None else dout
    XQ, XK, XV, eta, dout = (_pad_rows(x, idx, valid) for x in (XQ, XK, XV, eta, dout))
    dXQ, dXK, dXV = (torch.empty_like(XQ) for _ in range(3))
    dETA = torch.empty_like(eta)
    DZB1, XB2, DG1P, DZ1P = (empty_buf(1, H, NC, bsz, m) for _ in range(4))
    DZB2, DG2P = (empty_buf(1, H, NC, bsz, d) for _ in range(2))
    DKP, DEP = empty_buf(1, H, TP, d), empty_buf(1, H, TP)
    dTAU, dLNW, dLNB = empty_buf(1, H, NC, bsz), empty_buf(1, H, NC, d), empty_buf(1, H, NC, d)
    SZ, SS, SX, SD = empty_buf(N, H, bsz, m), empty_buf(N, H, bsz, m), empty_buf(N, H, bsz, m), empty_buf(N, H, bsz, d)
    # per slot (for every head): the update's scale and whether τ_{b−1} enters it; a partial last
    # mini-batch (its end values are its sums) takes −1 and none
    seq, c = CI[:, 0].long(), CI[:, 1].long()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    plast = (seq >= 0) & ((c + 1) * bsz > lens[seq.clamp(min=0)])
    scale = torch.stack([torch.where(plast, -1.0, tau_c[bsz - 1]), (~plast).to(cdt)])
    scale = scale[:, None, :].expand(2, H, NC).contiguous()
    BD, BM, BT, kw = _mlp_launch_cfg(d, m, bsz, packed=True)
    prec = _precision(XQ.dtype)
    _ttt_mlp_bwd_mb_kernel[(H * NC,)](
        XQ, XK, eta, tau_c, lw, lb, W1S, B1S, W2S, B2S, G1S, G2S, dout,
        DZB1, XB2, DG1P, DZ1P, DZB2, DG2P, DKP, DEP, dXQ, dTAU, dLNW, dLNB, *_head_args(None, None, XQ)[:2],
        TP, NC, H, 0, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT,
        BK=_mlp_col_block(BD, prec, "bwd_mb", device_arch(dev)), PREC=prec, HEAD=False, **kw)
    _ttt_mlp_bwd_kernel[(N * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, W1S, B1S, W2S, G1S, G2S,
        DZB1, XB2, DG1P, DZ1P, DZB2, DG2P, DKP, DEP, SZ, SS, SX, SD,
        dXK, dXV, dETA, dTAU, dLNW, dLNB, *dW0, scale, cu_seqlens, CS, *delta,
        TP, 0, 0, H, NC, LN_EPS, D=d, BD=BD, M=m, BM=BM, MB=bsz, BT=BT,
        BK=_mlp_col_block(BD, prec, "bwd", packed=True), PREC=prec, VARLEN=True,
        **_mlp_carry_opts(kw, BD, prec, packed=True))
    for buf, gl in zip(dW0, lasts):
        if gl is not None:
            buf += torch.where(empty.view(N, 1, 1, 1), gl.to(cdt), 0.0)
    return [dXQ.index_select(2, pos), dXK.index_select(2, pos), dXV.index_select(2, pos),
            dETA.index_select(2, pos), dTAU.sum((0, 1, 2)).to(tau_dt), dLNW.sum((0, 2)).to(lw_dt),
            dLNB.sum((0, 2)).to(lb_dt)] + [g.to(dt) for g, dt in zip(dW0, dts)]


@_mlp_bwd_op.register_fake
def _(XQ, XK, XV, eta, tau, ln_w, ln_b, W1S, B1S, W2S, B2S, G1S, G2S, dout, dW1F, dB1F, dW2F, dB2F,
      dW1L, dB1L, dW2L, dB2L, mini_batch_size, last_rows, W1_dt, b1_dt, W2_dt, b2_dt, cu_seqlens=None,
      zh1=None, gw2=None):
    ws = _mlp_weight_buffers(XQ, W1S.shape[-1], None)
    head = [] if zh1 is None else [torch.empty_like(zh1), torch.empty_like(gw2)]
    if cu_seqlens is not None:
        N, H, d, m = cu_seqlens.shape[0] - 1, XQ.shape[1], XQ.shape[3], W1S.shape[-1]
        ws = [XQ.new_empty(N, H, *sh) for sh in ((d, m), (1, m), (m, d), (1, d))]
    return ([torch.empty_like(t) for t in (XQ, XK, XV, eta, tau, ln_w, ln_b)]
            + [torch.empty_like(w, dtype=dt) for w, dt in zip(ws, (W1_dt, b1_dt, W2_dt, b2_dt))] + head)


def _mlp_setup_context(ctx, inputs, output):
    XQ, XK, XV, eta, tau, ln_w, ln_b, W1, b1, W2, b2, bsz, last_rows, _, cu, zh1, gw2 = (
        tuple(inputs) + (None,) * 3)[:17]
    ctx.save_for_backward(XQ, XK, XV, eta, tau, ln_w, ln_b, *output[9:], cu, zh1, gw2)
    ctx.mark_non_differentiable(*output[9:])
    ctx.meta = (bsz, last_rows, W1.dtype, b1.dtype, W2.dtype, b2.dtype)
    # the op's inputs as autograd counts them: trailing arguments left at their defaults left out
    ctx.n_inputs = 17 if zh1 is not None else (15 if cu is not None else 14)


def _mlp_backward_rule(ctx, grads):
    *saved, cu, zh1, gw2 = ctx.saved_tensors
    g = _mlp_bwd_op(*saved, *grads[:9], *ctx.meta, cu, zh1, gw2)
    # no gradient for mini_batch_size, last_rows, save, cu_seqlens; a head's zh1, gw2 get theirs
    rest = [None] * (ctx.n_inputs - 11)
    if zh1 is not None:
        rest[4], rest[5] = g[11], g[12]
    return (*g[:11], *rest)


_mlp_fwd_op.register_autograd(_mlp_backward_rule, setup_context=_mlp_setup_context)


# ---- public -------------------------------------------------------------------------------------
def _mlp_head(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, bsz: int, st: dict, n: int):
    """The head in the kernels: the first n = min(b − p, T) tokens, completing the mini-batch begun
    in the state ``st`` at pos = p > 0 (start weights θ_0 = W1, b1, W2, b2; carried sums
    G = grad_W1 … grad_b2). One launch of the kernels over a single mini-batch: p absent rows
    (zeros, η = 0: they enter no sum and no other row; their outputs are dropped), the head's n
    tokens at positions p … p + n − 1 (their τ), zero padding after them (η = 0, a partial
    mini-batch of p + n rows when p + n < b). The carried sums enter the output rows as the
    layer-1 offset zh1 = −τ ⊙ (Q G_W1 + G_b1) and, inside the kernels, Z̄2's −τ ⊙ (X̄2 G_W2 + G_b2)
    (``gw2``; module docstring, "The head"), and the end state: a completed mini-batch ends at the
    kernels' end weights − τ_{b−1} G; a head that ends the call keeps θ_0 with the sums = the
    kernels' sums + G and pos = p + n."""
    p = st["pos"]
    dt = acc_dtype(XQ.dtype)

    def pad(x):
        z = [x.new_zeros(*x.shape[:2], k, *x.shape[3:]) for k in (p, bsz - p - n)]
        return torch.cat([z[0], x[:, :, :n], z[1]], dim=2)

    xs = [pad(x) for x in (XQ, XK, XV, eta)]
    tau = token_idx.to(dt)
    tau_h = torch.cat([tau.new_zeros(p), tau[p:p + n], tau.new_zeros(bsz - p - n)])   # 0 off the head
    zh1 = -tau_h[:, None] * (xs[0].to(dt) @ st["grad_W1"] + st["grad_b1"])
    gw2 = torch.cat([st["grad_W2"], st["grad_b2"]], dim=2)
    ins = xs + [token_idx, ln_weight, ln_bias, st["W1"], st["b1"], st["W2"], st["b2"]]
    save = torch.is_grad_enabled() and any(x.requires_grad for x in ins + [zh1, gw2])
    o, *ws = _mlp_fwd_op(*ins, bsz, p + n, save, None, zh1, gw2)[:9]
    keys = ("W1", "b1", "W2", "b2")
    if p + n == bsz:
        st_new = {k: w - tau[bsz - 1] * st["grad_" + k] for k, w in zip(keys, ws[:4])}
        st_new.update({"grad_" + k: torch.zeros_like(w) for k, w in zip(keys, ws[:4])})
        st_new["pos"] = 0
    else:   # the kernels' partial mini-batch: its start weights (θ_0) and its sums
        st_new = {k: w for k, w in zip(keys, ws[4:])}
        st_new.update({"grad_" + k: w + st["grad_" + k] for k, w in zip(keys, ws[:4])})
        st_new["pos"] = p + n
    return o[:, :, p:p + n], st_new


def ttt_mlp_triton(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size=16,
                   initial_state: Optional[dict] = None, output_final_state: bool = False
                   ) -> Tuple[torch.Tensor, Optional[dict]]:
    r"""Same contract as ``kernels.ttt.ttt_mlp``. Everything from the first mini-batch boundary on,
    a trailing partial mini-batch included, runs in the Triton kernels (math, tiling and precision
    in the module docstring), and the head (completing a mini-batch begun in ``initial_state``,
    pos > 0; ``_mlp_head``) in a launch of its own before them, chained through autograd."""
    if not 1 <= mini_batch_size <= _MAX_MB:
        raise ValueError(f"ttt_mlp_triton: mini_batch_size must be in [1, {_MAX_MB}], got {mini_batch_size}")
    check_triton_device("ttt_mlp_triton", XQ, XK, XV, eta)
    B, H, T, d = XQ.shape
    bsz = mini_batch_size
    dt = acc_dtype(XQ.dtype)
    st = make_state({"W1": W1, "b1": b1, "W2": W2, "b2": b2}, B, dt, initial_state)
    keys = ("W1", "b1", "W2", "b2")
    outs, t = [], 0
    if st["pos"] > 0 and T > 0:
        t = min(bsz - st["pos"], T)
        o, st = _mlp_head(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, bsz, st, t)
        outs.append(o)
    if t < T:
        # from a boundary (the carried sums are zero there by construction) to the end, a partial
        # last mini-batch of r rows padded with zeros (η = 0: the padding adds nothing to the
        # gradient sums and, the dual form being causal, reaches no real row)
        r = (T - t) % bsz
        pad = (bsz - r) % bsz
        ins = [F.pad(x[:, :, t:], (0, 0, 0, pad)) if pad else x[:, :, t:].contiguous() for x in (XQ, XK, XV)]
        ins.append(F.pad(eta[:, :, t:], (0, pad)) if pad else eta[:, :, t:].contiguous())
        ins += [token_idx, ln_weight, ln_bias, st["W1"], st["b1"], st["W2"], st["b2"]]
        # the start weights of every mini-batch are kept only for the backward
        save = torch.is_grad_enabled() and any(x.requires_grad for x in ins)
        o, *ws = _mlp_fwd_op(*ins, bsz, r or bsz, save)[:9]
        outs.append(o[:, :, :T - t] if pad else o)
        if r == 0:
            st = {k: w for k, w in zip(keys, ws[:4])}
            st.update({"grad_" + k: torch.zeros_like(w) for k, w in zip(keys, ws[:4])})
        else:   # a partial last mini-batch: its start weights and its gradient sums
            st = {k: w for k, w in zip(keys, ws[4:])}
            st.update({"grad_" + k: w for k, w in zip(keys, ws[:4])})
        st["pos"] = r
    out = torch.cat(outs, dim=2) if len(outs) > 1 else (outs[0] if outs else XQ.clone())
    return out, (st if output_final_state else None)


def packed_launch_limit(H: int, T: int, d: int, m: int, mini_batch_size: int, N: int) -> Optional[str]:
    """Why one packed launch cannot take N sequences of T tokens in all (H heads of width d, inner
    width m, mini-batch b), or None when it can: it indexes its slot-major rows and per-sequence
    weights with int32 offsets."""
    rows = (T // mini_batch_size + N) * mini_batch_size          # the slot-major copy's rows per head
    if max(H * rows * max(d, m), N * H * d * m) >= 2 ** 31:
        return (f"a packed launch indexes its slot-major rows and per-sequence weights with int32 offsets: "
                f"H·(⌊T/b⌋ + N)·b·max(d, m) = {H * rows * max(d, m)} and N·H·d·m = {N * H * d * m} "
                f"must be < 2^31; split the batch")
    return None


def ttt_mlp_triton_packed(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size,
                          initial_state: Optional[dict], output_final_state: bool, cu_seqlens: torch.Tensor
                          ) -> Tuple[torch.Tensor, Optional[dict]]:
    """``kernels.ttt.ttt_mlp`` with ``cu_seqlens`` (B = 1, T ≥ 1; the caller checks the weights'
    and ``initial_state``'s shapes and that every "pos" is 0): the N packed sequences in one launch
    of each kernel, each from its own start weights (``initial_state`` row n, or the weights
    arguments [H, …] / [1, H, …] for all), each ending per its own length: after a partial last
    mini-batch of r rows its state is that mini-batch's start weights, the sums Σ η ∇ℓ over its r
    rows and pos = r; otherwise its end weights, zero sums and pos = 0 (an empty sequence: its
    initial weights). The final state holds every tensor stacked [N, H, …] and "pos" as a list of
    N ints (read back after the launches)."""
    if not 1 <= mini_batch_size <= _MAX_MB:
        raise ValueError(f"ttt_mlp_triton: mini_batch_size must be in [1, {_MAX_MB}], got {mini_batch_size}")
    check_triton_device("ttt_mlp_triton", XQ, XK, XV, eta)
    _, H, T, d = XQ.shape
    m = W1.shape[-1]
    cu = check_cu_seqlens("ttt_mlp_triton", cu_seqlens, T, XQ.device)
    N = cu.numel() - 1
    why = packed_launch_limit(H, T, d, m, mini_batch_size, N)
    if why is not None:
        raise ValueError(f"ttt_mlp_triton: {why}")
    keys = ("W1", "b1", "W2", "b2")
    if initial_state is not None:
        w0 = [initial_state[k] for k in keys]
    else:
        w0 = [w.reshape(1, H, *w.shape[-2:]).expand(N, H, *w.shape[-2:]) for w in (W1, b1, W2, b2)]
    outs = _mlp_fwd_op(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, *w0, mini_batch_size, mini_batch_size,
                       True, cu)
    out = outs[0]
    if not output_final_state:
        return out, None
    _nts, part, _empty = _packed_seqs(cu, mini_batch_size)
    part = part.view(N, 1, 1, 1)
    st = {}
    for k, w_end, w_last in zip(keys, outs[1:5], outs[5:9]):
        # a partial last mini-batch: its start weights and its sums (the kernel's end values)
        st[k] = torch.where(part, w_last, w_end)
        st["grad_" + k] = torch.where(part, w_end, torch.zeros_like(w_end))
    st["pos"] = ((cu[1:] - cu[:-1]) % mini_batch_size).tolist()
    return out, st


__all__ = ["packed_launch_limit", "ttt_mlp_triton", "ttt_mlp_triton_packed"]
