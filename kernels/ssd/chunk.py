r"""Triton chunked SSD (Mamba-2), forward and backward: the delta-rule family's kernels
(``kernels/delta_rule/core.py``) with the scalar decay on (``USE_G``) and the delta term off
(``USE_DELTA = False``).

Per head i (group γ = i // (h / g) of B and C), SSD's state S ∈ R^{p×n} is, transposed, the
family's state S' = Sᵀ ∈ R^{d_k×d_v} with

    k = B (d_k = n),   v = x (d_v = p),   q = C,   β = Δ,   g = Δ A (the scalar log decay),

    S'_t = e^{g_t} S'_{t−1} + β_t k_t v_tᵀ,     o_t = S'_tᵀ q_t = S_t C_t,

the gated delta rule without its −β k kᵀ term. Per chunk of C tokens the family's WY part drops
out (T = I, W = 0): Ṽ = diag(Δ) X, and

    O = diag(e^{γ}) C S'_n + (M ∘ Γ ∘ C Bᵀ) diag(Δ) X,     S'_{n+1} = e^{γ_C} S'_n + (diag(e^{γ_C − γ}) B)ᵀ diag(Δ) X

— the SSD chunked form (``torch_chunk.py``: Y_off, Y_diag, S_next) with every decay factor the
exponential of a difference of cumulative log decays inside a chunk, ≤ 0, so decays of −70 per
token (a chunk's −4480) stay finite. Kernels run: ``_fwd_state`` and ``_fwd_o`` forward,
``_bwd_dv_local``, ``_bwd_state``, ``_bwd_dqk`` and ``_bwd_beta`` backward (no ``_wy_inv``,
``_wy_fwd`` or ``_bwd_wy``).

Glue in PyTorch around the custom op ``kernels::ssd_fwd`` (its gradients by autograd): the
sequence-first [b, T, h, ·] inputs are laid out head-first [b, h, T, ·] (contiguous copies), B and C
expanded from g groups to h heads (``repeat_interleave``; their gradients summed back over the
heads of a group by autograd), Δ = softplus(dt + dt_bias) and g = Δ A in float32 (so the
gradients of dt, dt_bias and A come through Δ's two uses, β and g), the states transposed
between [N, h, p, n] and the kernels' [N, h, n, p], and y = o + D x, then ∘ SiLU(z)
(``reference.skip_and_gate``) — as the torch form, in the accumulation dtype, cast to x's dtype.
o comes out of the kernels in x's dtype (bf16 for bf16 inputs: one more rounding than the torch
form before D x is added).

The kernel chunk: ``chunk_size`` (mamba_ssm's 256 by default) rounded to a power of two and
capped by ``launch_meta`` (32 for bf16 at n = 128, 16 for float32: the gated delta rule's tiles,
under which ptxas spills nothing); the chunked form is exact for any chunk, so the result does not
depend on it, only the speed. Head dims: n ≤ ``MAX_N`` = 128, p ≤ ``MAX_P`` = 256 (mamba2's
presets: n = 128, p = 64).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels._triton_utils import INTERPRET_ARCH, check_triton_device, device_arch
from kernels.delta_rule import core
from kernels.delta_rule.core import _IN_DTYPES
from kernels.gated_delta_rule import chunk as _gdr_chunk
from kernels.ssd.reference import acc_dtype, discretize, skip_and_gate
from kernels.ssd.shapes import check_ssd_inputs

#: head dims the kernels take: n = d_k, p = d_v of the family's tiles
MAX_N = _gdr_chunk.MAX_DK
MAX_P = _gdr_chunk.MAX_DV


def launch_meta(DK: int, DV: int, dtype: torch.dtype, arch: int = INTERPRET_ARCH):
    """The gated delta rule's launch config for the same head dims (d_k = n, d_v = p), dtype and
    GPU family (the kernels are the same, with fewer of them launched), plus ``warps_beta``, the
    warps of ``_bwd_beta`` (elementwise: 4)."""
    mt = dict(_gdr_chunk.launch_meta(DK, DV, dtype, arch))
    mt.update(warps_beta=4)
    return mt


#: ``kernels::ssd_fwd`` (and ``_bwd``), the family's op with the scalar decay and no delta term
#: (core.make_op, use_delta=False); the launch config is looked up in this module at each launch
_fwd_op = core.make_op("ssd", lambda *a: launch_meta(*a), use_delta=False)


def ssd_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
               dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
               initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
               chunk_size: int = 256, cu_seqlens: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``kernels.ssd.ssd``'s arguments and results (mamba_ssm's layout: x [b, T, h, p], dt [b, T, h],
    A [h], B, C [b, T, g, n], D [h] or [h, p], z [b, T, h, p], dt_bias [h], initial_state
    [N, h, p, n]); y [b, T, h, p] in x's dtype, final state [N, h, p, n] in float32 (float64 for
    float64 inputs) or None. ``cu_seqlens`` [N + 1] (b = 1): N packed sequences in one launch per
    kernel. Values (A ≤ 0, Δ ≥ 0) are not checked here (``ssd`` does)."""
    name = "ssd_triton"
    check_ssd_inputs(name, x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, cu_seqlens)
    check_triton_device(name, x, dt, A, B, C, D, z, dt_bias, initial_state)
    if x.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}: x, B, C must be one of {[str(d) for d in _IN_DTYPES]}, got {x.dtype}")
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if n > MAX_N:
        raise ValueError(f"{name}: B and C must have a state size n ≤ {MAX_N} (the kernels' d_k), got n = {n}; "
                         f"use backend='torch'")
    if p > MAX_P:
        raise ValueError(f"{name}: x must have a head dim p ≤ {MAX_P} (the kernels' d_v), got p = {p}; "
                         f"use backend='torch'")
    acc = acc_dtype(x)
    delta = discretize(dt, dt_bias, dt_softplus, acc)                 # Δ [b, T, h]
    beta = delta.transpose(1, 2).contiguous()                         # [b, h, T]
    lg = (delta * A.to(acc)).transpose(1, 2).contiguous()            # g = Δ A
    heads = lambda t: t.transpose(1, 2).repeat_interleave(h // g, 1).contiguous()   # noqa: E731  [b, h, T, n]
    q, k = heads(C), heads(B)
    v = x.transpose(1, 2).contiguous()                                # [b, h, T, p]
    h0 = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()   # [N, h, n, p]
    o, ht = core.run(name, _fwd_op, launch_meta, device_arch(x.device), q, k, v, lg, beta, h0,
                     output_final_state, chunk_size, cu_seqlens)
    y = skip_and_gate(o.transpose(1, 2).to(acc), x.to(acc), D, z).to(x.dtype)
    return y, (ht.transpose(-1, -2).contiguous() if ht is not None else None)


__all__ = ["ssd_triton", "launch_meta", "MAX_N", "MAX_P"]
