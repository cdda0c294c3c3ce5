r"""Triton kernels for Mamba's selective scan (Gu & Dao 2023), forward and backward.

The kernels compute the scan core; the elementwise parts around it stay in PyTorch (autograd):
Δ_t = softplus(δ_t + δ_bias) before, and y_t + D ⊙ x_t and the SiLU(z_t) gate after (as
``reference.py``'s ``discretize`` and ``finish``). Per channel d and state index n:

    h_t[d, n] = Ā_t[d, n] h_{t−1}[d, n] + Δ_t[d] x_t[d] B_t[n],     Ā_t = exp(Δ_t[d] A[d, n])
    y_t[d]    = Σ_n C_t[n] h_t[d, n]

Backward, with g_t = ∂ℓ/∂y_t and the reverse scan (dh_{T−1} also receives ∂ℓ/∂h_{T−1} from the
final state)

    dh_t = C_t g_tᵀ + Ā_{t+1} ⊙ dh_{t+1}
    ∂ℓ/∂x_t[d] = Δ_t[d] Σ_n dh_t[d, n] B_t[n]
    ∂ℓ/∂Δ_t[d] = x_t[d] Σ_n dh_t[d, n] B_t[n] + Σ_n dh_t[d, n] A[d, n] Ā_t[d, n] h_{t−1}[d, n]
    ∂ℓ/∂A[d, n] = Σ_t dh_t[d, n] Δ_t[d] Ā_t[d, n] h_{t−1}[d, n]
    ∂ℓ/∂B_t[n] = Σ_d dh_t[d, n] Δ_t[d] x_t[d],     ∂ℓ/∂C_t[n] = Σ_d g_t[d] h_t[d, n]
    ∂ℓ/∂h_{−1} = Ā_0 ⊙ dh_0

where Ā_t h_{t−1} is taken as h_t − Δ_t x_t B_t (the recomputed h_t minus the input term), which
needs no shifted tile.

Layout. A program owns BLOCK_D channels × all N states of one sequence (a batch row, or one
sequence of a packed ``cu_seqlens`` batch) and walks over time in tiles of BT steps. A tile of
Ā and Δ x B is a [BT, BLOCK_D, N] register block, scanned along time with the associative
operator of the linear recurrence,

    (a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂,  a₂ b₁ + b₂)

so h_t = P_t ⊙ H + Q_t inside the tile, H the state carried in from the previous tile (as the
linear scan, ``kernels/linear_scan/chunk.py``). Products of decays stay products, never ratios of
cumulative sums, so nothing overflows at any decay strength. This is the elementwise scan form,
not Mamba-2's chunked matrix form: the decay Ā depends on (d, n), so there is no matrix product
to give to tensor cores; the reductions over n (y) and over d (∂B, ∂C) are register reductions.
Accumulation is float32 for half inputs (float64 for float64).

The forward stores the float32 state at every tile start; the backward recomputes h inside each
tile from it. ∂B and ∂C are sums over channels, which several programs own: each program writes
its partial sum for its channel block ([channel blocks, tokens, N], deterministic) and PyTorch
adds them; ∂A is summed over sequences the same way.

Tile sizes: BT = the chunk size rounded to a power of two in [4, 16]; BLOCK_D such that a
[BT, BLOCK_D, N] block holds 4096 elements (16 per thread at 8 warps), fixed rather than
autotuned because the partial-sum buffers are sized by it. Compiled with Triton's compiler and
ptxas for sm_90 and sm_80 (bf16 and fp32, N = 16, BT = 4, 8, 16) neither kernel spills (forward
≤ 75 registers, backward ≤ 249) and both use ≤ 2 KB of shared memory; BT = 32 spills in the
fp32 backward on sm_90, hence the cap (figures in ``benchmarks/RESULTS.md``).

The ∂B, ∂C partial sums are [Di / BLOCK_D, tokens, N] float32 (at Di = 1536, BLOCK_D = 16:
96 × 64 bytes per token), several times the traffic of x itself; a reduction across programs
(atomics, or a second pass over channel blocks) would cut that (not done).

The forward writes one [Di, N] float32 state per tile per sequence: 64/BT bytes per token and
channel at N = 16, next to ~10 bytes of x, Δ and y; storing them more sparsely and recomputing
the tile states of a span in the backward would save that traffic (not done).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import check_triton_device, is_interpreting, next_power_of_2
from kernels.selective_scan.reference import acc_dtype, check_inputs, discretize, finish

#: elements of one [BT, BLOCK_D, N] register block
_BLOCK_ELEMS = 4096
NUM_WARPS = 8


@triton.jit
def _combine(a1, b1, a2, b2):
    # (a₁, b₁) then (a₂, b₂): h ↦ a₂(a₁ h + b₁) + b₂
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _bounds(CU, i, T, NT, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First and one-past-last token of sequence i and its first tile-state slot."""
    if IS_VARLEN:
        bos = tl.load(CU + i).to(tl.int64)
        eos = tl.load(CU + i + 1).to(tl.int64)
        st_base = bos // BT + i       # distinct slots for every sequence (see _state_rows)
    else:
        bos = i.to(tl.int64) * T
        eos = bos + T
        st_base = i.to(tl.int64) * NT
    return bos, eos, st_base


@triton.jit
def _selective_scan_fwd(X, DT, A, BM, CM, H0, Y, HT, ST, CU, T, DI, N, NT,
                HAS_H0: tl.constexpr, STORE_ST: tl.constexpr, IS_VARLEN: tl.constexpr,
                ACC: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_d = tl.program_id(0)
    i = tl.program_id(1)
    bos, eos, st_base = _bounds(CU, i, T, NT, BT, IS_VARLEN)
    n_tiles = tl.cdiv(eos - bos, BT)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DI
    mask_dn = mask_d[:, None] & (offs_n < N)[None, :]
    off_dn = offs_d[:, None] * N + offs_n[None, :]
    a = tl.load(A + off_dn, mask=mask_dn, other=0).to(ACC)                     # [BD, BN]
    if HAS_H0:
        h = tl.load(H0 + i.to(tl.int64) * DI * N + off_dn, mask=mask_dn, other=0).to(ACC)
    else:
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    rows = tl.arange(0, BT)
    for k in range(0, n_tiles):
        t = bos + k * BT + rows
        mt = t < eos
        m_td = mt[:, None] & mask_d[None, :]
        m_tn = mt[:, None] & (offs_n < N)[None, :]
        off_td = t[:, None] * DI + offs_d[None, :]
        off_tn = t[:, None] * N + offs_n[None, :]
        # padding rows: Δ = 0, so Ā = 1 and Δ x B = 0 — the state passes through unchanged
        dt = tl.load(DT + off_td, mask=m_td, other=0).to(ACC)                 # [BT, BD]
        xx = tl.load(X + off_td, mask=m_td, other=0).to(ACC)
        bb = tl.load(BM + off_tn, mask=m_tn, other=0).to(ACC)                 # [BT, BN]
        cc = tl.load(CM + off_tn, mask=m_tn, other=0).to(ACC)
        if STORE_ST:
            tl.store(ST + (st_base + k) * DI * N + off_dn, h, mask=mask_dn)
        abar = tl.exp(dt[:, :, None] * a[None, :, :])                          # [BT, BD, BN]
        bx = (dt * xx)[:, :, None] * bb[:, None, :]
        P, Q = tl.associative_scan((abar, bx), 0, _combine)
        hs = P * h[None, :, :] + Q
        y = tl.sum(hs * cc[:, None, :], axis=2)                                # [BT, BD]
        tl.store(Y + off_td, y.to(Y.dtype.element_ty), mask=m_td)
        h = tl.sum(tl.where(rows[:, None, None] == BT - 1, hs, 0.0), axis=0)
    tl.store(HT + i.to(tl.int64) * DI * N + off_dn, h, mask=mask_dn)


@triton.jit
def _selective_scan_bwd(X, DT, A, BM, CM, ST, GY, GHT, DX, DDT, DA, DBP, DCP, DH0, CU, T, TOTAL, DI, N, NT,
                HAS_GHT: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
                ACC: tl.constexpr, BT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_d = tl.program_id(0)
    i = tl.program_id(1)
    bos, eos, st_base = _bounds(CU, i, T, NT, BT, IS_VARLEN)
    n_tiles = tl.cdiv(eos - bos, BT)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < DI
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    off_dn = offs_d[:, None] * N + offs_n[None, :]
    a = tl.load(A + off_dn, mask=mask_dn, other=0).to(ACC)
    if HAS_GHT:
        carry = tl.load(GHT + i.to(tl.int64) * DI * N + off_dn, mask=mask_dn, other=0).to(ACC)
    else:
        carry = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    da = tl.zeros([BLOCK_D, BLOCK_N], dtype=ACC)
    rows = tl.arange(0, BT)
    part = pid_d.to(tl.int64) * TOTAL * N          # this channel block's slice of the ∂B, ∂C partials
    for j in range(0, n_tiles):
        k = n_tiles - 1 - j
        t = bos + k * BT + rows
        mt = t < eos
        m_td = mt[:, None] & mask_d[None, :]
        m_tn = mt[:, None] & mask_n[None, :]
        off_td = t[:, None] * DI + offs_d[None, :]
        off_tn = t[:, None] * N + offs_n[None, :]
        dt = tl.load(DT + off_td, mask=m_td, other=0).to(ACC)
        xx = tl.load(X + off_td, mask=m_td, other=0).to(ACC)
        bb = tl.load(BM + off_tn, mask=m_tn, other=0).to(ACC)
        cc = tl.load(CM + off_tn, mask=m_tn, other=0).to(ACC)
        gy = tl.load(GY + off_td, mask=m_td, other=0).to(ACC)
        # h_t inside the tile, from the stored tile-start state
        h0 = tl.load(ST + (st_base + k) * DI * N + off_dn, mask=mask_dn, other=0).to(ACC)
        dtx = dt * xx
        bx = dtx[:, :, None] * bb[:, None, :]
        P, Q = tl.associative_scan((tl.exp(dt[:, :, None] * a[None, :, :]), bx), 0, _combine)
        hs = P * h0[None, :, :] + Q
        # dh_t = C_t g_t + Ā_{t+1} dh_{t+1}, from the tile's last row back to its first; past the
        # sequence end Δ = 0 (Ā = 1), so the carry reaches row eos−1 intact
        m_next = ((t + 1) < eos)[:, None] & mask_d[None, :]
        dt_next = tl.load(DT + off_td + DI, mask=m_next, other=0).to(ACC)
        R, S = tl.associative_scan((tl.exp(dt_next[:, :, None] * a[None, :, :]),
                                    gy[:, :, None] * cc[:, None, :]), 0, _combine, reverse=True)
        dh = R * carry[None, :, :] + S
        carry = tl.sum(tl.where(rows[:, None, None] == 0, dh, 0.0), axis=0)
        decayed = hs - bx                                                       # Ā_t h_{t−1}
        dhb = tl.sum(dh * bb[:, None, :], axis=2)                              # Σ_n dh B
        tl.store(DX + off_td, (dt * dhb).to(DX.dtype.element_ty), mask=m_td)
        ddt = xx * dhb + tl.sum(dh * a[None, :, :] * decayed, axis=2)
        tl.store(DDT + off_td, ddt.to(DDT.dtype.element_ty), mask=m_td)
        da += tl.sum(dh * dt[:, :, None] * decayed, axis=0)
        tl.store(DBP + part + off_tn, tl.sum(dh * dtx[:, :, None], axis=1), mask=m_tn)
        tl.store(DCP + part + off_tn, tl.sum(gy[:, :, None] * hs, axis=1), mask=m_tn)
    tl.store(DA + i.to(tl.int64) * DI * N + off_dn, da, mask=mask_dn)
    if HAS_H0:
        # ∂ℓ/∂h_{−1} = Ā_0 dh_0; an empty sequence passes its state through (Ā := 1)
        nonempty = (tl.zeros([BLOCK_D], dtype=tl.int64) + n_tiles) > 0
        dt0 = tl.load(DT + bos * DI + offs_d, mask=mask_d & nonempty, other=0).to(ACC)
        tl.store(DH0 + i.to(tl.int64) * DI * N + off_dn,
                 (tl.exp(dt0[:, None] * a) * carry).to(DH0.dtype.element_ty), mask=mask_dn)


def _acc_tl(dt: torch.dtype):
    return tl.float64 if dt == torch.float64 else tl.float32


def tile_sizes(chunk_size: int, N: int, interpreting: Optional[bool] = None) -> Tuple[int, int, int]:
    """(BT, BLOCK_D, BLOCK_N): time steps per tile, channels per program, padded state size.
    ``interpreting`` (default: whether TRITON_INTERPRET is on) picks the interpreter's small
    channel block; the compile gate asks for the GPU's."""
    BT = min(max(next_power_of_2(int(chunk_size)), 4), 16)
    BN = next_power_of_2(N)
    if is_interpreting() if interpreting is None else interpreting:
        return BT, 8, BN          # several channel blocks at the tests' small widths
    return BT, max(1, _BLOCK_ELEMS // (BT * BN)), BN


def _state_rows(NB: int, T: int, BT: int, varlen: bool) -> int:
    """Rows of the tile-start state buffer. Varlen: sequence n's k-th tile uses slot
    bos_n // BT + n + k; these never collide across sequences and stay below T // BT + N + 1,
    so the buffer is sized without reading cu_seqlens on the host."""
    return (T // BT + NB + 1) if varlen else NB * triton.cdiv(T, BT)


# The op is a PyTorch custom op (torch.library): torch.compile (model.compile) captures it as one
# opaque node of the block's graph, with shapes from the fake implementations and the backward
# registered below, instead of tracing the Triton launches or breaking the graph.
@torch.library.custom_op("kernels::selective_scan_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, Delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            h0: Optional[torch.Tensor], cu: Optional[torch.Tensor], BT: int, store: bool
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, Δ, A, B, C, h0) → (y = Σ_n C h, h_{T−1}, the tile-start states the backward reads,
    stored when ``store``); Δ and A in the accumulation dtype."""
    x, Delta, A, B, C = (t.contiguous() for t in (x, Delta, A, B, C))
    Bt, T, Di = x.shape
    N = A.shape[1]
    varlen = cu is not None
    NB = cu.numel() - 1 if varlen else Bt
    acc = Delta.dtype
    _, BD, BN = tile_sizes(BT, N)
    states = torch.empty(_state_rows(NB, T, BT, varlen) if store else 1, Di, N, dtype=acc, device=x.device)
    y = torch.empty(Bt, T, Di, dtype=acc, device=x.device)
    hT = torch.empty(NB, Di, N, dtype=acc, device=x.device)
    h0c = h0.to(acc).contiguous() if h0 is not None else None
    _selective_scan_fwd[(triton.cdiv(Di, BD), NB)](
        x, Delta, A, B, C, h0c if h0c is not None else hT, y, hT, states, cu if varlen else x,
        T, Di, N, triton.cdiv(T, BT),
        HAS_H0=h0 is not None, STORE_ST=store, IS_VARLEN=varlen, ACC=_acc_tl(acc),
        BT=BT, BLOCK_D=BD, BLOCK_N=BN, num_warps=NUM_WARPS)
    return y, hT, states


@_fwd_op.register_fake
def _(x, Delta, A, B, C, h0, cu, BT, store):
    Bt, T, Di = x.shape
    N = A.shape[1]
    varlen = cu is not None
    NB = cu.shape[0] - 1 if varlen else Bt
    acc = Delta.dtype
    states = x.new_empty(_state_rows(NB, T, BT, varlen) if store else 1, Di, N, dtype=acc)
    return x.new_empty(Bt, T, Di, dtype=acc), x.new_empty(NB, Di, N, dtype=acc), states


@torch.library.custom_op("kernels::selective_scan_bwd", mutates_args=())
def _bwd_op(x: torch.Tensor, Delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            states: torch.Tensor, gy: Optional[torch.Tensor], ghT: Optional[torch.Tensor], cu: Optional[torch.Tensor],
            BT: int, h0_dtype: Optional[torch.dtype]
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dΔ, dA, dB, dC, d h0 ([0] when there is none)."""
    has_h0 = h0_dtype is not None
    Bt, T, Di = x.shape
    N = A.shape[1]
    varlen = cu is not None
    NB = cu.numel() - 1 if varlen else Bt
    acc = Delta.dtype
    _, BD, BN = tile_sizes(BT, N)
    nblk = triton.cdiv(Di, BD)
    gy = (gy if gy is not None else torch.zeros_like(Delta)).contiguous()
    dx = torch.empty_like(x)
    dDelta = torch.empty_like(Delta)
    dA = torch.empty(NB, Di, N, dtype=acc, device=x.device)
    # every token's row is written unless packed sequences leave tokens out (varlen)
    part = torch.zeros if varlen else torch.empty
    dBp = part(nblk, Bt * T, N, dtype=acc, device=x.device)
    dCp = part(nblk, Bt * T, N, dtype=acc, device=x.device)
    dh0 = torch.empty(NB, Di, N, dtype=h0_dtype, device=x.device) if has_h0 else None
    _selective_scan_bwd[(nblk, NB)](
        x, Delta, A, B, C, states, gy, ghT.contiguous() if ghT is not None else dA,
        dx, dDelta, dA, dBp, dCp, dh0 if dh0 is not None else dA, cu if varlen else x,
        T, Bt * T, Di, N, triton.cdiv(T, BT),
        HAS_GHT=ghT is not None, HAS_H0=has_h0, IS_VARLEN=varlen, ACC=_acc_tl(acc),
        BT=BT, BLOCK_D=BD, BLOCK_N=BN, num_warps=NUM_WARPS)
    dB = dBp.sum(0).view(Bt, T, N).to(B.dtype)
    dC = dCp.sum(0).view(Bt, T, N).to(C.dtype)
    return dx, dDelta, dA.sum(0).to(A.dtype), dB, dC, (dh0 if dh0 is not None else x.new_empty(0))


@_bwd_op.register_fake
def _(x, Delta, A, B, C, states, gy, ghT, cu, BT, h0_dtype):
    NB = cu.shape[0] - 1 if cu is not None else x.shape[0]
    dh0 = x.new_empty(NB, *A.shape, dtype=h0_dtype) if h0_dtype is not None else x.new_empty(0)
    return (torch.empty_like(x), torch.empty_like(Delta), torch.empty_like(A), torch.empty_like(B),
            torch.empty_like(C), dh0)


def _setup_context(ctx, inputs, output):
    x, Delta, A, B, C, h0, cu, BT, _ = inputs
    ctx.save_for_backward(x, Delta, A, B, C, output[2], cu)
    ctx.mark_non_differentiable(output[2])
    ctx.BT, ctx.h0_dtype = BT, (h0.dtype if h0 is not None else None)


def _backward_rule(ctx, gy, ghT, _g_states):
    x, Delta, A, B, C, states, cu = ctx.saved_tensors
    dx, dDelta, dA, dB, dC, dh0 = _bwd_op(x, Delta, A, B, C, states, gy, ghT, cu, ctx.BT, ctx.h0_dtype)
    return dx, dDelta, dA, dB, dC, (dh0 if ctx.h0_dtype is not None else None), None, None, None


_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


def selective_scan_triton(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          initial_state=None, output_final_state=False, chunk_size: int = 16,
                          cu_seqlens: Optional[torch.Tensor] = None
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Same contract as ``selective_scan_ref``, plus ``cu_seqlens`` (int32 [S+1], x of batch 1):
    S packed sequences in one launch, the state restarting at each (from ``initial_state[s]``
    [S, Di, N] or 0); the final state is then [S, Di, N]. ``chunk_size``: time steps per tile
    (rounded to a power of two in [4, 16])."""
    NB = check_inputs("selective_scan_triton", x, delta, A, B, C, initial_state, cu_seqlens)
    Bt, T, Di = x.shape
    N = A.shape[-1]
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.int32).contiguous()
    check_triton_device("selective_scan_triton", x, delta, A, B, C, D, z, delta_bias, initial_state)
    dt = acc_dtype(x.dtype)
    Delta = discretize(delta, delta_bias, delta_softplus, dt)
    if T == 0:
        hT = (initial_state.to(dt) if initial_state is not None
              else torch.zeros(NB, Di, N, dtype=dt, device=x.device))
        return x.new_zeros(Bt, 0, Di), (hT if output_final_state else None)
    BT = tile_sizes(chunk_size, N)[0]
    ins = [x.contiguous(), Delta.contiguous(), A.to(dt).contiguous(), B.contiguous(), C.contiguous()]
    store = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ins + [initial_state])
    y, hT, _ = _fwd_op(*ins, initial_state, cu_seqlens, BT, store)
    return finish(y, x, D, z), (hT if output_final_state else None)


__all__ = ["selective_scan_triton", "tile_sizes"]
