r"""Mamba-2's state-space dual (SSD) layer one token at a time: the specification of ``kernels.ssd``.

Per batch element and head i (group γ = i // (h / g) of B and C), with state S ∈ R^{p×n}, step
Δ_t = dt_t (or softplus(dt_t + dt_bias) when asked) and a scalar decay a_t = exp(Δ_t A_i) ∈ (0, 1]
(Dao & Gu 2024, "Transformers are SSMs", arXiv 2405.21060, §3 and the Mamba-2 block of §7):

    S_t = a_t S_{t−1} + Δ_t x_t B_tᵀ           x_t ∈ R^p, B_t, C_t ∈ R^n (of group γ)
    y_t = S_t C_t + D_i ∘ x_t                  D_i a scalar or a vector in R^p
    y_t ← y_t ∘ SiLU(z_t)                      when z is given (after D, as mamba_ssm does)

in mamba_ssm's layout and semantics (``mamba_chunk_scan_combined``): x [b, T, h, p], dt [b, T, h],
A [h], B, C [b, T, g, n], state [b, h, p, n]. With ``cu_seqlens`` (b = 1) the state restarts at
every sequence start, from that sequence's row of ``initial_state`` (or zero), and the final state
of each sequence is returned.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from kernels.ssd.shapes import check_cu_seqlens, check_ssd_inputs


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: float32 for half inputs, else x's own."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def discretize(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], dt_softplus: bool, dtype: torch.dtype
               ) -> torch.Tensor:
    """The step Δ = dt (+ dt_bias) (softplus when asked), in ``dtype``: mamba_ssm's order."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    return F.softplus(dt) if dt_softplus else dt


def skip_and_gate(y: torch.Tensor, x: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor]
                  ) -> torch.Tensor:
    """y + D ∘ x, then ∘ SiLU(z): y, x, z [b, T, h, p] in the accumulation dtype; D [h] or [h, p]."""
    if D is not None:
        y = y + x * (D.to(y.dtype)[:, None] if D.dim() == 1 else D.to(y.dtype))
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def ssd_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                  dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                  initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                  cu_seqlens: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The per-step recurrence (module docstring). Returns y [b, T, h, p] in x's dtype and, if
    ``output_final_state``, the final state [N, h, p, n] in the accumulation dtype (N = b, or the
    number of sequences of ``cu_seqlens``)."""
    check_ssd_inputs("ssd_reference", x, dt, A, B, C, D, z, dt_bias, initial_state, None, cu_seqlens)
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dtype = acc_dtype(x)
    xs = x.to(dtype)
    delta = discretize(dt, dt_bias, dt_softplus, dtype)               # Δ [b, T, h]
    decay = (delta * A.to(dtype)).exp()                               # a_t [b, T, h]
    Bh = B.to(dtype).repeat_interleave(h // g, dim=2)                 # [b, T, h, n]: head i reads group i // (h/g)
    Ch = C.to(dtype).repeat_interleave(h // g, dim=2)
    cu: List[int] = [0, T] if cu_seqlens is None else check_cu_seqlens("ssd_reference", cu_seqlens, T)
    N = len(cu) - 1
    zero = xs.new_zeros(b, h, p, n)

    def start(k: int) -> torch.Tensor:
        if initial_state is None:
            return zero
        h0 = initial_state.to(dtype)
        return h0 if cu_seqlens is None else h0[k:k + 1]

    ys, finals = [], []
    for k in range(N):
        S = start(k)
        for t in range(cu[k], cu[k + 1]):
            S = decay[:, t, :, None, None] * S + \
                (delta[:, t, :, None] * xs[:, t])[..., None] * Bh[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
        finals.append(S)
    y = torch.stack(ys, 1) if T else xs.new_zeros(b, 0, h, p)
    y = skip_and_gate(y, xs, D, z)
    final = (torch.cat(finals, 0) if cu_seqlens is not None else finals[0]) if output_final_state else None
    return y.to(x.dtype), final


__all__ = ["ssd_reference", "discretize", "skip_and_gate", "acc_dtype"]
