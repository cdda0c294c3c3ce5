r"""Mamba's selective scan (Gu & Dao 2023, Algorithm 2), the specification. Per channel d and
state index n, with input-dependent step Δ_t, B_t, C_t:

    Δ_t   = softplus(δ_t + δ_bias)        (or δ_t itself when delta_softplus is False)
    h_t   = exp(Δ_t A) ⊙ h_{t−1} + (Δ_t ⊙ x_t) B_t        Ā = exp(ΔA),  B̄x ≈ ΔBx  (zero-order
                                                            hold for A, Euler for B, as the paper's code)
    y_t   = C_t · h_t + D ⊙ x_t
    out_t = y_t ⊙ SiLU(z_t)                                 (when z is given)

Shapes: x, δ, z [Bt, T, Di]; A [Di, N]; B, C [Bt, T, N]; D, δ_bias [Di]; h [Bt, Di, N].
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half types, else unchanged (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_inputs(name: str, x, delta, A, B, C, initial_state=None, cu_seqlens=None) -> int:
    """Shapes of a selective-scan call; a clear error naming the wrong one. Returns the number of
    sequences (Bt, or S with ``cu_seqlens`` [S+1], which needs Bt = 1)."""
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [Bt, T, Di], got {tuple(x.shape)}")
    Bt, T, Di = x.shape
    N = A.shape[-1]
    if delta.shape != x.shape or A.shape != (Di, N) or B.shape != (Bt, T, N) or C.shape != (Bt, T, N):
        raise ValueError(f"{name}: expected x, delta [Bt, T, Di], A [Di, N], B, C [Bt, T, N]; got "
                         f"x {tuple(x.shape)}, delta {tuple(delta.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if cu_seqlens is not None:
        if Bt != 1:
            raise ValueError(f"{name}: cu_seqlens needs packed input with Bt = 1, got Bt = {Bt}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"{name}: cu_seqlens must be 1-D [S+1], got shape {tuple(cu_seqlens.shape)}")
    rows = Bt if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (rows, Di, N):
        raise ValueError(f"{name}: initial_state must be {'[Bt, Di, N]' if cu_seqlens is None else '[S, Di, N]'}"
                         f" = {(rows, Di, N)}, got {tuple(initial_state.shape)}")
    return rows


def discretize(delta: torch.Tensor, delta_bias: Optional[torch.Tensor], delta_softplus: bool, dt: torch.dtype):
    d = delta.to(dt)
    if delta_bias is not None:
        d = d + delta_bias.to(dt)
    return F.softplus(d) if delta_softplus else d


def finish(y: torch.Tensor, x: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor]) -> torch.Tensor:
    """y + D ⊙ x, then the SiLU(z) gate, cast back to x's dtype."""
    if D is not None:
        y = y + x.to(y.dtype) * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y.to(x.dtype)


def selective_scan_ref(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       initial_state=None, output_final_state=False
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    dt = acc_dtype(x.dtype)
    Bt, T, Di = x.shape
    N = A.shape[1]
    Delta = discretize(delta, delta_bias, delta_softplus, dt)            # [Bt, T, Di]
    A_, B_, C_ = A.to(dt), B.to(dt), C.to(dt)
    u = Delta * x.to(dt)
    h = (torch.zeros(Bt, Di, N, dtype=dt, device=x.device) if initial_state is None
         else initial_state.to(dt))
    ys = []
    for t in range(T):
        A_bar = torch.exp(Delta[:, t, :, None] * A_)                     # [Bt, Di, N]
        h = A_bar * h + u[:, t, :, None] * B_[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", h, C_[:, t]))
    y = torch.stack(ys, 1) if T > 0 else x.new_zeros(Bt, 0, Di, dtype=dt)
    return finish(y, x, D, z), (h if output_final_state else None)
