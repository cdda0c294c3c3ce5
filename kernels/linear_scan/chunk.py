r"""Triton kernels for the gated linear scan, forward and backward:

    h_t = a_t ⊙ h_{t−1} + b_t,        a_t = exp(log_a_t),        h_{−1} = initial_state (or 0)

Backward, with g_t = ∂ℓ/∂h_t (from the output) and g_T = ∂ℓ/∂h_{T−1} (from the final state):

    dh_t = g_t + a_{t+1} ⊙ dh_{t+1}           (reverse scan; dh_{T−1} = g_{T−1} + g_T)
    ∂ℓ/∂b_t = dh_t,    ∂ℓ/∂log_a_t = dh_t ⊙ a_t ⊙ h_{t−1},    ∂ℓ/∂initial_state = a_0 ⊙ dh_0

Layout. A program owns BLOCK_D channels of one sequence (a batch row, or one sequence of a packed
``cu_seqlens`` batch) and walks over time in tiles of BT steps. Each tile of log_a and b is loaded
at once ([BT, BLOCK_D], coalesced along channels) and scanned in registers with the associative
operator on pairs (a, b):

    (a₁, b₁) ∘ (a₂, b₂) = (a₁ a₂,  a₂ b₁ + b₂)

so h_t = A_t ⊙ H + B_t inside the tile, where H is the state carried in from the previous tile.
Every product of gates stays a product (never a ratio of cumulative sums), so nothing overflows
however strong the decay. Accumulation is float32 for half inputs (float64 for float64).

Few long sequences (B × D/BLOCK_D programs would leave most SMs idle) are also split along time
into ``num_segments`` segments run in parallel, in three passes: (1) each segment's aggregate from
a zero state — its end state E_k and total log-gate Σ log_a; (2) the short scan
S_k = exp(Σ_k log_a) ⊙ S_{k−1} + E_k over segments (the same kernel on [B, num_segments, D]);
(3) each segment again from its true start state S_{k−1}, writing h. The backward splits its
reverse scan the same way. Splitting reads log_a and b twice, so it is used only when it buys
parallelism.

The forward stores the float32 state at every tile start (1/BT of the traffic of h); the backward
recomputes h_{t−1} inside each tile from it instead of reading h back in the input precision.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kernels._triton_utils import (autotune_configs, check_triton_device, device_arch, is_interpreting,
                                   next_power_of_2, num_sms, prune_by_elements_per_thread)
from kernels.linear_scan.reference import acc_dtype, check_linear_scan_inputs

_CONFIGS = autotune_configs({"BLOCK_D": [16, 32, 64, 128]}, num_warps=(1, 2, 4, 8, 16), num_stages=(1, 2),
                            interpret={"BLOCK_D": 16})
# Compiled for sm_90 (bf16, BT = 64): 8 elements of the [BT, BLOCK_D] tile per thread needs about 64
# registers in the forward and 110 in the backward; 16 per thread needs ~190 in the backward and
# spills at 32. Among the configs at 8 per thread the autotuner picks by time.
_BY_ELEMENTS = prune_by_elements_per_thread(lambda m: m["BT"] * m["BLOCK_D"], 8)
#: (BT, BLOCK_D, num_warps) of the forward that ptxas spills (4 B, bf16) on one GPU family although
#: they hold 8 elements per thread like their neighbours: never offered to the autotuner on that
#: family (their float32 twins, which do not spill, are dropped with them)
_FWD_SPILLS = {90: {(64, 32, 8)}, 80: {(16, 128, 8)}}


def prune_for_arch(configs, arch: int, meta, forward: bool):
    """The autotune configs a GPU of launch family ``arch`` (see ``device_arch``) may pick for a
    call with constexprs ``meta``: those at 8 elements per thread, less the ones that spill there.
    The compile gate (``compile_cases.py``) lists exactly these per arch."""
    kept = _BY_ELEMENTS(configs, None, **meta)
    if forward and len(kept) > 1:
        kept = [c for c in kept if (meta["BT"], c.kwargs["BLOCK_D"], c.num_warps) not in _FWD_SPILLS[arch]]
    if not kept:
        raise RuntimeError(f"linear_scan: no autotune config left for sm_{arch} at {dict(meta)}")
    return kept


def _prune_fwd(configs, named_args, **kwargs):
    return prune_for_arch(configs, device_arch(named_args["BX"].device), kwargs, True)


def _prune_bwd(configs, named_args, **kwargs):
    return prune_for_arch(configs, device_arch(named_args["BX"].device), kwargs, False)


@triton.jit
def _combine(a1, b1, a2, b2):
    # (a₁, b₁) then (a₂, b₂): h ↦ a₂(a₁ h + b₁) + b₂
    return a1 * a2, a2 * b1 + b2


@triton.autotune(configs=_CONFIGS, key=["D", "BT"], prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit
def _fwd_kernel(LA, BX, H0, H, HT, ST, LSUM, CU, T, D, TILES_PER_SEG, NT,
                HAS_H0: tl.constexpr, STORE_H: tl.constexpr, STORE_ST: tl.constexpr,
                STORE_LSUM: tl.constexpr, IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
                BT: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_d = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.program_id(2)
    prog = i * tl.num_programs(2) + s
    if IS_VARLEN:
        bos = tl.load(CU + i).to(tl.int64)
        eos = tl.load(CU + i + 1).to(tl.int64)
        st_base = bos // BT + i           # distinct tile slots for every sequence (see _state_rows)
    else:
        bos = i.to(tl.int64) * T
        eos = bos + T
        st_base = i.to(tl.int64) * NT
    n_tiles = tl.cdiv(eos - bos, BT)
    k0 = s * TILES_PER_SEG
    k1 = tl.minimum(k0 + TILES_PER_SEG, n_tiles)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    rows = tl.arange(0, BT)
    if HAS_H0:
        h = tl.load(H0 + prog.to(tl.int64) * D + offs_d, mask=mask_d, other=0).to(ACC)
    else:
        h = tl.zeros([BLOCK_D], dtype=ACC)
    lsum = tl.zeros([BLOCK_D], dtype=ACC)
    for k in range(k0, k1):
        t = bos + k * BT + rows
        m = (t < eos)[:, None] & mask_d[None, :]
        off = t[:, None] * D + offs_d[None, :]
        # padding rows get log_a = 0, b = 0: the state passes through them unchanged
        la = tl.load(LA + off, mask=m, other=0).to(ACC)
        bb = tl.load(BX + off, mask=m, other=0).to(ACC)
        if STORE_ST:
            tl.store(ST + (st_base + k) * D + offs_d, h, mask=mask_d)
        A, Bc = tl.associative_scan((tl.exp(la), bb), 0, _combine)
        ht = A * h[None, :] + Bc
        if STORE_H:
            tl.store(H + off, ht.to(H.dtype.element_ty), mask=m)
        h = tl.sum(tl.where(rows[:, None] == BT - 1, ht, 0.0), axis=0)
        if STORE_LSUM:
            lsum += tl.sum(la, axis=0)
    tl.store(HT + prog.to(tl.int64) * D + offs_d, h, mask=mask_d)
    if STORE_LSUM:
        tl.store(LSUM + prog.to(tl.int64) * D + offs_d, lsum, mask=mask_d)


@triton.autotune(configs=_CONFIGS, key=["D", "BT"], prune_configs_by={"early_config_prune": _prune_bwd})
@triton.jit
def _bwd_kernel(LA, BX, G, ST, X0, DLA, DB, DH0, DS, PSUM, CU, T, D, TILES_PER_SEG, NT,
                HAS_X0: tl.constexpr, HAS_H0: tl.constexpr, FULL: tl.constexpr,
                IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
                BT: tl.constexpr, BLOCK_D: tl.constexpr):
    # FULL: gradients of one segment given X0 = dh at the first row after it (or g_T at the end).
    # not FULL: the segment's aggregate with a zero carry — dh at its first row (DS) and
    # Σ log a_{t+1} over its rows (PSUM).
    pid_d = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.program_id(2)
    prog = i * tl.num_programs(2) + s
    if IS_VARLEN:
        bos = tl.load(CU + i).to(tl.int64)
        eos = tl.load(CU + i + 1).to(tl.int64)
        st_base = bos // BT + i
    else:
        bos = i.to(tl.int64) * T
        eos = bos + T
        st_base = i.to(tl.int64) * NT
    n_tiles = tl.cdiv(eos - bos, BT)
    k0 = s * TILES_PER_SEG
    k1 = tl.minimum(k0 + TILES_PER_SEG, n_tiles)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    rows = tl.arange(0, BT)
    if HAS_X0:
        x = tl.load(X0 + prog.to(tl.int64) * D + offs_d, mask=mask_d, other=0).to(ACC)
    else:
        x = tl.zeros([BLOCK_D], dtype=ACC)
    psum = tl.zeros([BLOCK_D], dtype=ACC)
    for j in range(0, k1 - k0):
        k = k1 - 1 - j
        t = bos + k * BT + rows
        m = (t < eos)[:, None] & mask_d[None, :]
        off = t[:, None] * D + offs_d[None, :]
        # α_t = a_{t+1}; past the sequence end α = 1, so the carry x reaches row eos−1 intact
        m_next = ((t + 1) < eos)[:, None] & mask_d[None, :]
        la_next = tl.load(LA + off + D, mask=m_next, other=0).to(ACC)
        g = tl.load(G + off, mask=m, other=0).to(ACC)
        # dh_t = α_t dh_{t+1} + g_t, scanned from the tile's last row back to its first
        P, Q = tl.associative_scan((tl.exp(la_next), g), 0, _combine, reverse=True)
        dh = P * x[None, :] + Q
        x = tl.sum(tl.where(rows[:, None] == 0, dh, 0.0), axis=0)
        if FULL:
            la = tl.load(LA + off, mask=m, other=0).to(ACC)
            # h_{t−1} for every row: the forward scan of the tile shifted down one row, with the
            # identity (1, 0) in row 0, applied to the stored tile-start state h_{t0−1}
            m_prev = (rows >= 1)[:, None] & m
            la_prev = tl.load(LA + off - D, mask=m_prev, other=0).to(ACC)
            b_prev = tl.load(BX + off - D, mask=m_prev, other=0).to(ACC)
            A, Bc = tl.associative_scan((tl.exp(la_prev), b_prev), 0, _combine)
            h_start = tl.load(ST + (st_base + k) * D + offs_d, mask=mask_d, other=0).to(ACC)
            h_prev = A * h_start[None, :] + Bc
            tl.store(DB + off, dh.to(DB.dtype.element_ty), mask=m)
            tl.store(DLA + off, (dh * tl.exp(la) * h_prev).to(DLA.dtype.element_ty), mask=m)
        else:
            psum += tl.sum(la_next, axis=0)
    if FULL:
        if HAS_H0:
            # ∂ℓ/∂h_{−1} = a_0 dh_0; an empty sequence passes its state through (a := 1)
            if s == 0:
                nonempty = (tl.zeros([BLOCK_D], dtype=tl.int64) + n_tiles) > 0
                la0 = tl.load(LA + bos * D + offs_d, mask=mask_d & nonempty, other=0).to(ACC)
                tl.store(DH0 + i.to(tl.int64) * D + offs_d, (tl.exp(la0) * x).to(DH0.dtype.element_ty),
                         mask=mask_d)
    else:
        tl.store(DS + prog.to(tl.int64) * D + offs_d, x, mask=mask_d)
        tl.store(PSUM + prog.to(tl.int64) * D + offs_d, psum, mask=mask_d)


#: tile of the short scan over segments
_SEG_BT = 16


def _acc_tl(dt: torch.dtype):
    return tl.float64 if dt == torch.float64 else tl.float32


def _tile(chunk_size: int) -> int:
    return min(max(next_power_of_2(int(chunk_size)), 2), 256)


def _state_rows(NB: int, T: int, BT: int, varlen: bool) -> int:
    """Rows of the tile-start state buffer. Varlen: sequence n's k-th tile uses slot
    bos_n // BT + n + k; these never collide across sequences and stay below T // BT + N + 1,
    so the buffer is sized without reading cu_seqlens on the host."""
    return (T // BT + NB + 1) if varlen else NB * triton.cdiv(T, BT)


def _pick_segments(NB: int, D: int, T: int, BT: int, device: torch.device, varlen: bool) -> int:
    if varlen or is_interpreting() or device.type != "cuda":
        return 1
    programs = NB * triton.cdiv(D, 64)
    target = 4 * num_sms(device)
    if programs >= target:
        return 1
    # at least 4 tiles per segment, so the second pass over a segment stays a small fraction
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(T, BT) // 4))


def _grid(D, NB, nseg):
    return lambda meta: (triton.cdiv(D, meta["BLOCK_D"]), NB, nseg)


def _forward(la, bx, h0, cu, BT, nseg, store_states):
    """h [as bx], final state [NB, D] (acc dtype), tile-start states (or None)."""
    _, T, D = bx.shape
    varlen = cu is not None
    NB = cu.numel() - 1 if varlen else bx.shape[0]
    acc = acc_dtype(bx.dtype)
    kw = dict(IS_VARLEN=varlen, ACC=_acc_tl(acc), BT=BT)
    h = torch.empty_like(bx)
    nt = triton.cdiv(T, BT)
    states = (torch.empty(_state_rows(NB, T, BT, varlen), D, dtype=acc, device=bx.device)
              if store_states else None)
    cu_arg = cu if varlen else bx
    if nseg == 1:
        ht = torch.empty(NB, D, dtype=acc, device=bx.device)
        _fwd_kernel[_grid(D, NB, 1)](la, bx, h0 if h0 is not None else bx, h, ht,
                                     states if store_states else ht, ht, cu_arg, T, D, nt, nt,
                                     HAS_H0=h0 is not None, STORE_H=True, STORE_ST=store_states,
                                     STORE_LSUM=False, **kw)
        return h, ht, states
    per = triton.cdiv(nt, nseg)
    nseg = triton.cdiv(nt, per)
    seg_end = torch.empty(NB * nseg, D, dtype=acc, device=bx.device)
    lsum = torch.empty_like(seg_end)
    _fwd_kernel[_grid(D, NB, nseg)](la, bx, bx, h, seg_end, seg_end, lsum, cu_arg, T, D, per, nt,
                                    HAS_H0=False, STORE_H=False, STORE_ST=False, STORE_LSUM=True, **kw)
    # S_k = exp(Σ_k log_a) S_{k−1} + E_k: the state at the end of every segment
    ends, ht, _ = _forward(lsum.view(NB, nseg, D), seg_end.view(NB, nseg, D), h0, None, _SEG_BT, 1, False)
    first = (h0.to(acc) if h0 is not None else torch.zeros(NB, D, dtype=acc, device=bx.device))
    starts = torch.cat([first[:, None], ends[:, :-1]], 1).contiguous()
    _fwd_kernel[_grid(D, NB, nseg)](la, bx, starts, h, seg_end, states if store_states else seg_end,
                                    seg_end, cu_arg, T, D, per, nt, HAS_H0=True, STORE_H=True,
                                    STORE_ST=store_states, STORE_LSUM=False, **kw)
    return h, ht, states


def _backward(la, bx, states, g, g_final, h0_dtype, cu, BT, nseg):
    _, T, D = bx.shape
    varlen = cu is not None
    NB = cu.numel() - 1 if varlen else bx.shape[0]
    acc = acc_dtype(bx.dtype)
    kw = dict(IS_VARLEN=varlen, ACC=_acc_tl(acc), BT=BT)
    dla = torch.empty_like(la)
    db = torch.empty_like(bx)
    dh0 = torch.empty(NB, D, dtype=h0_dtype, device=bx.device) if h0_dtype is not None else None
    nt = triton.cdiv(T, BT)
    cu_arg = cu if varlen else bx
    per = triton.cdiv(nt, nseg)
    if nseg == 1:
        x0 = g_final
    else:
        nseg = triton.cdiv(nt, per)
        ds = torch.empty(NB * nseg, D, dtype=acc, device=bx.device)
        psum = torch.empty_like(ds)
        _bwd_kernel[_grid(D, NB, nseg)](la, bx, g, states, ds, dla, db, ds, ds, psum, cu_arg, T, D,
                                        per, nt, HAS_X0=False, HAS_H0=False, FULL=False, **kw)
        # dh at segment k's first row = P_k ⊙ dh(first row of k+1) + L_k: a forward scan over the
        # segments in reverse order, started from g_T
        y, _, _ = _forward(psum.view(NB, nseg, D).flip(1).contiguous(),
                           ds.view(NB, nseg, D).flip(1).contiguous(), g_final, None, _SEG_BT, 1, False)
        last = g_final.to(acc) if g_final is not None else torch.zeros(NB, D, dtype=acc, device=bx.device)
        x0 = torch.cat([y.flip(1)[:, 1:], last[:, None]], 1).contiguous()
    _bwd_kernel[_grid(D, NB, nseg)](la, bx, g, states, x0 if x0 is not None else g, dla, db,
                                    dh0 if dh0 is not None else db, db, db, cu_arg, T, D, per, nt,
                                    HAS_X0=x0 is not None, HAS_H0=dh0 is not None, FULL=True, **kw)
    return dla, db, dh0


# The op is a PyTorch custom op (torch.library): torch.compile (model.compile) captures it as one
# opaque node of the block's graph, with shapes from the fake implementations and the backward
# registered below, instead of tracing the Triton launches or breaking the graph.
@torch.library.custom_op("kernels::linear_scan_fwd", mutates_args=())
def _fwd_op(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor],
            cu_seqlens: Optional[torch.Tensor], BT: int, nseg: int, store_states: bool
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, final state, tile-start states ([0, D] when not stored)."""
    h, ht, states = _forward(log_a, b, initial_state, cu_seqlens, BT, nseg, store_states)
    if states is None:
        states = torch.empty(0, b.shape[2], dtype=ht.dtype, device=b.device)
    return h, ht, states


@_fwd_op.register_fake
def _(log_a, b, initial_state, cu_seqlens, BT, nseg, store_states):
    _, T, D = b.shape
    varlen = cu_seqlens is not None
    NB = cu_seqlens.shape[0] - 1 if varlen else b.shape[0]
    acc = acc_dtype(b.dtype)
    rows = _state_rows(NB, T, BT, varlen) if store_states else 0
    return (torch.empty_like(b), b.new_empty(NB, D, dtype=acc), b.new_empty(rows, D, dtype=acc))


@torch.library.custom_op("kernels::linear_scan_bwd", mutates_args=())
def _bwd_op(log_a: torch.Tensor, b: torch.Tensor, states: torch.Tensor, g: torch.Tensor,
            g_final: Optional[torch.Tensor], h0_dtype: Optional[torch.dtype], cu_seqlens: Optional[torch.Tensor],
            BT: int, nseg: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d log_a, d b, d initial_state ([0, D] when there is none)."""
    dla, db, dh0 = _backward(log_a, b, states, g, g_final, h0_dtype, cu_seqlens, BT, nseg)
    if dh0 is None:
        dh0 = torch.empty(0, b.shape[2], dtype=b.dtype, device=b.device)
    return dla, db, dh0


@_bwd_op.register_fake
def _(log_a, b, states, g, g_final, h0_dtype, cu_seqlens, BT, nseg):
    NB = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else b.shape[0]
    dh0 = (b.new_empty(NB, b.shape[2], dtype=h0_dtype) if h0_dtype is not None
           else b.new_empty(0, b.shape[2]))
    return torch.empty_like(log_a), torch.empty_like(b), dh0


def _setup_context(ctx, inputs, output):
    log_a, b, h0, cu_seqlens, BT, nseg, _ = inputs
    ctx.save_for_backward(log_a, b, output[2], cu_seqlens)
    ctx.h0_dtype = h0.dtype if h0 is not None else None
    ctx.BT, ctx.nseg = BT, nseg
    ctx.mark_non_differentiable(output[2])


def _backward_rule(ctx, g, g_final, _g_states):
    log_a, b, states, cu_seqlens = ctx.saved_tensors
    g = g.contiguous() if g is not None else torch.zeros_like(b)
    g_final = g_final.contiguous() if g_final is not None else None
    dla, db, dh0 = _bwd_op(log_a, b, states, g, g_final, ctx.h0_dtype, cu_seqlens, ctx.BT, ctx.nseg)
    return dla, db, (dh0 if ctx.h0_dtype is not None else None), None, None, None, None


_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


def linear_scan_triton(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                       output_final_state: bool = False, chunk_size: int = 64,
                       cu_seqlens: Optional[torch.Tensor] = None, num_segments: Optional[int] = None
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h [B, T, D] in b's dtype and, if ``output_final_state``, the final state in the accumulation
    dtype: [B, D], or [N, D] with ``cu_seqlens``.

    ``chunk_size``: time steps per tile (rounded up to a power of two, at most 256).
    ``cu_seqlens``: int32 [N+1] offsets of N sequences packed in a B = 1 batch; the state restarts
    at every sequence start (from ``initial_state[n]`` [N, D] if given, else 0).
    ``num_segments``: parallel pieces along time per row (default: enough to fill the GPU; always 1
    with ``cu_seqlens``).
    """
    check_linear_scan_inputs("linear_scan_triton", log_a, b, initial_state, chunk_size, cu_seqlens)
    B, T, D = b.shape
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=b.device, dtype=torch.int32).contiguous()
        NB = cu_seqlens.numel() - 1
    else:
        NB = B
    check_triton_device("linear_scan_triton", log_a, b, initial_state)
    acc = acc_dtype(b.dtype)
    if T == 0:
        ht = initial_state.to(acc) if initial_state is not None else torch.zeros(NB, D, dtype=acc, device=b.device)
        return b, (ht if output_final_state else None)
    BT = _tile(chunk_size)
    if cu_seqlens is not None:
        nseg = 1
    elif num_segments is not None:
        nseg = max(1, min(int(num_segments), triton.cdiv(T, BT)))
    else:
        nseg = _pick_segments(B, D, T, BT, b.device, False)
    h0 = initial_state.contiguous() if initial_state is not None else None
    store = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (log_a, b, h0))
    h, ht, _ = _fwd_op(log_a.contiguous(), b.contiguous(), h0, cu_seqlens, BT, nseg, store)
    return h, (ht if output_final_state else None)


__all__ = ["linear_scan_triton"]
