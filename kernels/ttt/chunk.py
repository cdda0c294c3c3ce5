r"""TTT-Linear dual form in Triton, forward and backward (Sun et al. 2024), with the inner
LayerNorm and its L2-loss gradient fused into the kernel.

One program per (batch, head) walks the full mini-batches of b tokens in order with W1 [d, d]
and b1 [1, d] in registers. For a mini-batch with rows K, Q, V ∈ R^{b×d}, per-token η ∈ R^b,
τ = token_idx ∈ R^b and W_0 = (W1, b1) at its start (notation of ``torch_chunk.py``):

    Z = K W1 + b1,   Γ = ∂/∂Z ½‖LN_γβ(Z) − (V − K)‖²                    (row by row)
    M = tril(E ⊙ (Q Kᵀ + 1)),   E_ij = τ_i η_j
    Z̄ = Q W1 + b1 − M Γ,        out = Q + LN_γβ(Z̄)
    W1 ← W1 − τ_{b−1} Kᵀ (η ⊙ Γ),   b1 ← b1 − τ_{b−1} Σ_j η_j Γ_j

(M Γ = (E ⊙ tril(Q Kᵀ)) Γ + tril(E) Γ, the two dual-form terms in one b×b product.)

The forward stores W1, b1 at the start of every mini-batch (d² + d numbers per mini-batch and
head). The backward walks the mini-batches in reverse, recomputes Z, Γ, M, Z̄ from the stored
start weights, and carries (dW1, db1), the gradient with respect to the weights at the end of
the current mini-batch; through the update, dW1_start = dW1_end + Qᵀ dZ̄ + Kᵀ dZ (dZ from
differentiating Γ, i.e. the second derivative of the LayerNorm-fused loss).

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

Registers (``python -m kernels.compile_report --op ttt``): the backward re-reads Wᵀ from the
stored weights as a transposed tile where it needs it instead of keeping W live through the
mini-batch, and runs on 8 warps.

TTT-MLP (``ttt_mlp_triton``) is in ``mlp_chunk.py``; it shares ``_dot``, ``_ln_stats``, ``_ln_bwd`` and
``_precision`` with this file.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import check_triton_device, is_interpreting
from kernels.ttt.torch_chunk import LN_EPS, acc_dtype, make_state, ttt_linear_chunk

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
def _mini_batch_fwd(q, k, v, e, tau, W, bb, gamma, beta, cmask, tril, D: tl.constexpr, eps,
                    PREC: tl.constexpr):
    """Everything of one mini-batch that the forward and the backward both need."""
    Z = _dot(k, W, PREC) + bb[None, :]
    xh, rstd = _ln_stats(Z, cmask, D, eps)
    tgt = v - k
    gh = (gamma[None, :] * xh + beta[None, :] - tgt) * gamma[None, :]
    G = _ln_bwd(gh, xh, rstd, cmask, D)                                   # Γ
    A = _dot(q, tl.trans(k), PREC)
    Ev = tau[:, None] * e[None, :]
    M = tl.where(tril, Ev * (A + 1.0), 0.0)
    Zb = _dot(q, W, PREC) + bb[None, :] - _dot(M, G, PREC)
    xhb, rstdb = _ln_stats(Zb, cmask, D, eps)
    return xh, rstd, tgt, gh, G, A, Ev, M, xhb, rstdb


@triton.jit
def _ttt_linear_fwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, W0, B0, OUT, WS, BS, WF, BF,
                           T, NMB, H, eps,
                           D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                           SAVE: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)                      # = b_idx * H + h_idx
    h = pid % H
    cdt = W0.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    cmask = cols < D
    wmask = cmask[:, None] & cmask[None, :]
    xmask = (rows < MB)[:, None] & cmask[None, :]
    rmask = rows < MB
    tril = rows[None, :] <= rows[:, None]

    W = tl.load(W0 + pid * D * D + cols[:, None] * D + cols[None, :], mask=wmask, other=0.0).to(cdt)
    bb = tl.load(B0 + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    # padded rows (MB < BT) get τ = η = 0, so they enter no product that reaches a real row
    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)

    for n in range(NMB):
        if SAVE:
            tl.store(WS + (pid * NMB + n) * D * D + cols[:, None] * D + cols[None, :], W, mask=wmask)
            tl.store(BS + (pid * NMB + n) * D + cols, bb, mask=cmask)
        t_off = n * MB + rows
        xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
        q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
        xh, rstd, tgt, gh, G, A, Ev, M, xhb, rstdb = _mini_batch_fwd(
            q, k, v, e, tau, W, bb, gamma, beta, cmask, tril, D, eps, PREC)
        out = q + gamma[None, :] * xhb + beta[None, :]
        tl.store(OUT + xoff, out.to(OUT.dtype.element_ty), mask=xmask)
        eG = e[:, None] * G
        W = W - tau_last * _dot(tl.trans(k), eG, PREC)
        bb = bb - tau_last * tl.sum(eG, axis=0)

    tl.store(WF + pid * D * D + cols[:, None] * D + cols[None, :], W, mask=wmask)
    tl.store(BF + pid * D + cols, bb, mask=cmask)


@triton.jit
def _ttt_linear_bwd_kernel(XQ, XK, XV, ETA, TAU, LNW, LNB, WS, BS, DOUT, DWF, DBF,
                           DXQ, DXK, DXV, DETA, DTAU, DLNW, DLNB, DW0, DB0,
                           T, NMB, H, eps,
                           D: tl.constexpr, BD: tl.constexpr, MB: tl.constexpr, BT: tl.constexpr,
                           PREC: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % H
    cdt = DW0.dtype.element_ty
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BD)
    cmask = cols < D
    wmask = cmask[:, None] & cmask[None, :]
    xmask = (rows < MB)[:, None] & cmask[None, :]
    rmask = rows < MB
    tril = rows[None, :] <= rows[:, None]
    woff = cols[:, None] * D + cols[None, :]

    gamma = tl.load(LNW + h * D + cols, mask=cmask, other=0.0).to(cdt)
    beta = tl.load(LNB + h * D + cols, mask=cmask, other=0.0).to(cdt)
    # padded rows (MB < BT) get τ = η = 0, so they enter no product that reaches a real row
    tau = tl.load(TAU + rows, mask=rmask, other=0.0).to(cdt)
    tau_last = tl.load(TAU + MB - 1).to(cdt)
    is_last = rows == MB - 1

    # gradients with respect to the weights at the END of the current mini-batch
    dW = tl.load(DWF + pid * D * D + woff, mask=wmask, other=0.0).to(cdt)
    dbb = tl.load(DBF + pid * D + cols, mask=cmask, other=0.0).to(cdt)
    dgamma = tl.zeros([BD], dtype=cdt)
    dbeta = tl.zeros([BD], dtype=cdt)
    dtau = tl.zeros([BT], dtype=cdt)

    for i in range(NMB):
        n = NMB - 1 - i
        W = tl.load(WS + (pid * NMB + n) * D * D + woff, mask=wmask, other=0.0)
        bb = tl.load(BS + (pid * NMB + n) * D + cols, mask=cmask, other=0.0)
        t_off = n * MB + rows
        xoff = pid * T * D + t_off[:, None] * D + cols[None, :]
        q = tl.load(XQ + xoff, mask=xmask, other=0.0).to(cdt)
        k = tl.load(XK + xoff, mask=xmask, other=0.0).to(cdt)
        v = tl.load(XV + xoff, mask=xmask, other=0.0).to(cdt)
        e = tl.load(ETA + pid * T + t_off, mask=rmask, other=0.0).to(cdt)
        do = tl.load(DOUT + xoff, mask=xmask, other=0.0).to(cdt)
        xh, rstd, tgt, gh, G, A, Ev, M, xhb, rstdb = _mini_batch_fwd(
            q, k, v, e, tau, W, bb, gamma, beta, cmask, tril, D, eps, PREC)

        # out = Q + γ x̂(Z̄) + β
        dgamma += tl.sum(do * xhb, axis=0)
        dbeta += tl.sum(do, axis=0)
        dZb = _ln_bwd(do * gamma[None, :], xhb, rstdb, cmask, D)
        # Z̄ = Q W1 + b1 − M Γ
        dq = do
        dM = tl.where(tril, -_dot(dZb, tl.trans(G), PREC), 0.0)
        dG = -_dot(tl.trans(M), dZb, PREC)
        # M = tril(E ⊙ (A + 1)), E_ij = τ_i η_j, A = Q Kᵀ
        dE = dM * (A + 1.0)
        dA = dM * Ev
        dq += _dot(dA, k, PREC)
        dk = _dot(tl.trans(dA), q, PREC)
        de = tl.sum(dE * tau[:, None], axis=0)
        dtau += tl.sum(dE * e[None, :], axis=1)
        # end-of-mini-batch update W1' = W1 − τ_{b−1} Kᵀ(η⊙Γ), b1' = b1 − τ_{b−1} Σ η Γ
        P = _dot(k, dW, PREC) + dbb[None, :]
        GP = tl.sum(G * P, axis=1)
        dG += -tau_last * e[:, None] * P
        de += -tau_last * GP
        dtau += tl.where(is_last, -tl.sum(e * GP, axis=0), 0.0)
        dk += -tau_last * _dot(e[:, None] * G, tl.trans(dW), PREC)
        # Γ = (ĝ − mean ĝ − x̂ mean(ĝ x̂)) / σ with ĝ = γ(γ x̂ + β − (V − K)), x̂, σ of Z
        dgh = _ln_bwd(dG, xh, rstd, cmask, D)
        c2 = tl.sum(gh * xh, axis=1) / D
        mux = tl.sum(dG * xh, axis=1) / D
        dxh = -(dG * c2[:, None] + gh * mux[:, None]) * rstd[:, None] + gamma[None, :] * gamma[None, :] * dgh
        dsig = -tl.sum(dG * G, axis=1) * rstd
        dgamma += tl.sum(dgh * (2.0 * gamma[None, :] * xh + beta[None, :] - tgt), axis=0)
        dbeta += tl.sum(dgh * gamma[None, :], axis=0)
        dtgt = -gamma[None, :] * dgh
        dZ = _ln_bwd(dxh, xh, rstd, cmask, D) + tl.where(cmask[None, :], dsig[:, None] * xh / D, 0.0)
        # Z = K W1 + b1, target = V − K
        # Wᵀ read again (as a transposed tile) rather than kept live through the lines above
        Wt = tl.load(WS + (pid * NMB + n) * D * D + cols[:, None] + cols[None, :] * D, mask=wmask, other=0.0)
        dq += _dot(dZb, Wt, PREC)
        dk += _dot(dZ, Wt, PREC) - dtgt
        dv = dtgt
        dW += _dot(tl.trans(q), dZb, PREC) + _dot(tl.trans(k), dZ, PREC)
        dbb += tl.sum(dZb, axis=0) + tl.sum(dZ, axis=0)

        tl.store(DXQ + xoff, dq.to(DXQ.dtype.element_ty), mask=xmask)
        tl.store(DXK + xoff, dk.to(DXK.dtype.element_ty), mask=xmask)
        tl.store(DXV + xoff, dv.to(DXV.dtype.element_ty), mask=xmask)
        tl.store(DETA + pid * T + t_off, de.to(DETA.dtype.element_ty), mask=rmask)

    tl.store(DW0 + pid * D * D + woff, dW, mask=wmask)
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


def _launch_cfg(d: int, b: int, backward: bool = False, half: bool = True):
    """Padded tile sizes (tl.dot needs every block dim ≥ 16) and launch options. Compiled for
    sm_90 and sm_80 (``python -m kernels.compile_report --op ttt``): the forward at d = 64, b = 16
    with bf16 operands fits 4 warps without spilling; the backward (W and dW [d, d] and ~20
    [b, d] tiles live), 3×TF32 operands (``half`` False: float32 inputs), b > 16 and d = 128 need
    8 warps (the tiles spread over twice the register files). 16 warps cap a thread at 128
    registers and spill more."""
    BD = max(16, triton.next_power_of_2(d))
    BT = max(16, triton.next_power_of_2(b))
    if is_interpreting():
        return BD, BT, {}
    small = BD <= 64 and BT <= 16 and half and not backward
    return BD, BT, {"num_warps": 4 if small else 8, "num_stages": 1}


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
    BD, BT, kw = _launch_cfg(d, bsz, half=XQ.dtype in (torch.bfloat16, torch.float16))
    _ttt_linear_fwd_kernel[(B * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, W0c, b0c, out, WS, BS, WF, BF,
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
    BD, BT, kw = _launch_cfg(d, bsz, backward=True, half=XQ.dtype in (torch.bfloat16, torch.float16))
    _ttt_linear_bwd_kernel[(B * H,)](
        XQ, XK, XV, eta, tau_c, lw, lb, WS, BS, dout, dWF, dBF,
        dXQ, dXK, dXV, dETA, dTAU, dLNW, dLNB, dW0, dB0,
        T, NMB, H, LN_EPS, D=d, BD=BD, MB=bsz, BT=BT, PREC=_precision(XQ.dtype), **kw)
    return [dXQ, dXK, dXV, dETA, dTAU.sum((0, 1)).to(tau_dt), dLNW.sum(0).to(lw_dt),
            dLNB.sum(0).to(lb_dt), dW0.to(W_dt), dB0.to(b_dt)]


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


__all__ = ["ttt_linear_triton"]
