r"""PyTorch chunked form of the selective scan (see reference.py for the recurrence), the CPU path
and the GPU fallback, with a hand-written backward (one autograd node for the whole scan).

    h_t = Ā_t ⊙ h_{t−1} + Δ_t x_t B_tᵀ,    Ā_t = exp(Δ_t A),    y_t = h_t C_t     (per channel d, state n)

The decay Ā depends on (d, n) as well as t, so the matrix form of Mamba-2's SSD (one decay per
head) does not apply: a chunk of L tokens in matrix form needs an [L, L, Di, N] tensor, which is
what made the earlier form slow (≈ 43 s for forward+backward of 4k tokens at d_model 256). Here
the work is the scan's own O(T·Di·N), split so Python runs few, large operations:

* per chunk, vectorized over its L tokens: Ā = exp(Δ A) and Δ x B as [Bt, L, Di, N], and after
  the chunk's scan y = Σ_n C h and every gradient below;
* per token, one fused multiply-add on [Bt, Di, N]: h_t = addcmul(Δ_t x_t B_t, Ā_t, h_{t−1})
  written straight into the chunk's buffer (the loop touches no autograd graph).

Only the chunk-start states are kept for the backward; each chunk's states are recomputed there.
Backward, with g_t = ∂ℓ/∂y_t, the reverse scan (dh_{T−1} also receives ∂ℓ/∂h_{T−1})

    dh_t = C_t g_tᵀ + Ā_{t+1} ⊙ dh_{t+1}
    ∂x_t = Δ_t Σ_n dh_t B_t,    ∂Δ_t = x_t Σ_n dh_t B_t + Σ_n dh_t ⊙ A ⊙ Ā_t h_{t−1}
    ∂A = Σ_t Δ_t dh_t ⊙ Ā_t h_{t−1},    ∂B_t = Σ_d dh_t Δ_t x_t,    ∂C_t = Σ_d g_t h_t,    ∂h_{−1} = Ā_0 dh_0

Cost and memory grow linearly with T (no slice of a full-length tensor is differentiated inside
the loop); products of decays stay products, so nothing overflows at any decay strength.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from kernels.selective_scan.reference import acc_dtype, discretize, finish


def _chunk_terms(Delta, x, A, B, keep=None):
    """Ā = exp(Δ A) and Δ x B for one chunk: [Bt, l, Di, N] each. ``keep`` [Bt, l] (0 where a
    sequence starts): Ā_t ← keep_t Ā_t, so h_{t−1} does not reach h_t there (a constant mask:
    every gradient through Ā is masked alike)."""
    abar = torch.exp(Delta[..., None] * A)
    if keep is not None:
        abar = abar * keep[:, :, None, None]
    return abar, (Delta * x)[..., None] * B[:, :, None, :]


def _scan_chunk(abar, bx, h, hs):
    """hs[:, t] = Ā_t ⊙ h_{t−1} + bx_t from h_{−1} = h; returns the last state (a view of hs)."""
    for t in range(abar.shape[1]):
        h = torch.addcmul(bx[:, t], abar[:, t], h, out=hs[:, t])
    return h


class _SelectiveScan(torch.autograd.Function):
    """(x, Δ, A, B, C, h0) → (y = Σ_n C h, h_{T−1}); Δ in the accumulation dtype."""

    @staticmethod
    def forward(ctx, x, Delta, A, B, C, h0, L, keep=None):
        dt = Delta.dtype
        Bt, T, Di = x.shape
        N = A.shape[1]
        xa, Aa, Ba, Ca = x.to(dt), A.to(dt), B.to(dt), C.to(dt)
        h = h0.to(dt) if h0 is not None else x.new_zeros(Bt, Di, N, dtype=dt)
        n = math.ceil(T / L)
        starts = x.new_empty(n, Bt, Di, N, dtype=dt)
        hs_buf = x.new_empty(Bt, min(L, T), Di, N, dtype=dt)
        y = x.new_empty(Bt, T, Di, dtype=dt)
        for c in range(n):
            s0, s1 = c * L, min(T, (c + 1) * L)
            starts[c] = h
            abar, bx = _chunk_terms(Delta[:, s0:s1], xa[:, s0:s1], Aa, Ba[:, s0:s1],
                                    None if keep is None else keep[:, s0:s1])
            hs = hs_buf[:, :s1 - s0]
            h = _scan_chunk(abar, bx, h, hs).clone()
            y[:, s0:s1] = torch.einsum("bldn,bln->bld", hs, Ca[:, s0:s1])
        ctx.save_for_backward(x, Delta, A, B, C, starts)
        ctx.keep = keep
        ctx.L, ctx.h0_dtype = L, (h0.dtype if h0 is not None else None)
        return y, h

    @staticmethod
    def backward(ctx, gy, ghT):
        x, Delta, A, B, C, starts = ctx.saved_tensors
        L = ctx.L
        dt = Delta.dtype
        Bt, T, Di = x.shape
        N = A.shape[1]
        xa, Aa, Ba, Ca = x.to(dt), A.to(dt), B.to(dt), C.to(dt)
        gy = gy.to(dt) if gy is not None else torch.zeros_like(Delta)
        # carry = Ā_{t+1} ⊙ dh_{t+1}, the part of dh_t that comes from later tokens
        carry = ghT.to(dt).clone() if ghT is not None else x.new_zeros(Bt, Di, N, dtype=dt)
        dx, dDelta = torch.empty_like(xa), torch.empty_like(Delta)
        dB, dC = torch.empty_like(Ba), torch.empty_like(Ca)
        dA = torch.zeros_like(Aa)
        l_max = min(L, T)
        hs_buf = x.new_empty(Bt, l_max + 1, Di, N, dtype=dt)    # row 0: h_{s0−1}; rows 1…: h_t
        dh_buf = x.new_empty(Bt, l_max, Di, N, dtype=dt)
        for c in reversed(range(starts.shape[0])):
            s0, s1 = c * L, min(T, (c + 1) * L)
            l = s1 - s0
            Dc, xc, Bc, Cc, gc = Delta[:, s0:s1], xa[:, s0:s1], Ba[:, s0:s1], Ca[:, s0:s1], gy[:, s0:s1]
            abar, bx = _chunk_terms(Dc, xc, Aa, Bc, None if ctx.keep is None else ctx.keep[:, s0:s1])
            hx = hs_buf[:, :l + 1]
            hx[:, 0] = starts[c]
            _scan_chunk(abar, bx, starts[c], hx[:, 1:])
            hs, hprev = hx[:, 1:], hx[:, :-1]
            dh = dh_buf[:, :l]
            for t in reversed(range(l)):
                # dh_t = C_t g_tᵀ + carry; the outer product is broadcast inside the multiply-add
                torch.addcmul(carry, gc[:, t, :, None], Cc[:, t, None, :], out=dh[:, t])
                carry = abar[:, t] * dh[:, t]
            P = dh * abar * hprev                                        # dh ⊙ Ā_t h_{t−1}
            dhb = torch.einsum("bldn,bln->bld", dh, Bc)
            dx[:, s0:s1] = Dc * dhb
            dDelta[:, s0:s1] = xc * dhb + torch.einsum("bldn,dn->bld", P, Aa)
            dA += torch.einsum("bldn,bld->dn", P, Dc)
            dB[:, s0:s1] = torch.einsum("bldn,bld->bln", dh, Dc * xc)
            dC[:, s0:s1] = torch.einsum("bldn,bld->bln", hs, gc)
        dh0 = carry.to(ctx.h0_dtype) if ctx.h0_dtype is not None else None
        return dx.to(x.dtype), dDelta, dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), dh0, None, None


def selective_scan_chunk(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         initial_state=None, output_final_state=False, chunk_size: int = 64,
                         resets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``resets`` [Bt, T] bool: a sequence starts there from a zero state (Ā_t masked to 0 inside
    the scan), so a row of packed sequences gives each one's own outputs."""
    dt = acc_dtype(x.dtype)
    Bt, T, Di = x.shape
    N = A.shape[1]
    Delta = discretize(delta, delta_bias, delta_softplus, dt)
    if T == 0:
        h = (torch.zeros(Bt, Di, N, dtype=dt, device=x.device) if initial_state is None
             else initial_state.to(dt))
        return x.new_zeros(Bt, 0, Di), (h if output_final_state else None)
    keep = None if resets is None else (~resets.to(torch.bool)).to(dt)
    y, h = _SelectiveScan.apply(x, Delta, A, B, C, initial_state, max(1, int(chunk_size)), keep)
    return finish(y, x, D, z), (h if output_final_state else None)
