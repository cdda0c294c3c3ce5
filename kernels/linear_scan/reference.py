r"""Gated linear recurrence, element-wise over channels (the specification):

    h_t = a_t ⊙ h_{t−1} + b_t,      a_t = exp(log_a_t),      h_{−1} = initial_state (or 0)

log_a, b: [B, T, D]; initial_state: [B, D]. The gate is taken in log space so that callers
(RG-LRU: log a_t = −c·r_t·softplus(−Λ)) never form a_t^{c·r_t} by a power of a number near 1.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for half types, else unchanged (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_linear_scan_inputs(name: str, log_a: torch.Tensor, b: torch.Tensor,
                             initial_state: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                             cu_seqlens: Optional[torch.Tensor] = None) -> None:
    """Raises ValueError naming the first problem: log_a and b floating-point [B, T, D] of one
    shape on one device; initial_state [B, D] ([N, D] with ``cu_seqlens``, an integer [N+1]
    tensor over a B = 1 packed batch); chunk_size ≥ 1."""
    for n, t in (("log_a", log_a), ("b", b)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name}: {n} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if log_a.shape != b.shape or b.dim() != 3:
        raise ValueError(f"{name}: log_a and b must both be [B, T, D], got {tuple(log_a.shape)} and {tuple(b.shape)}")
    B, T, D = b.shape
    rows = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{name}: cu_seqlens needs packed input with B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        rows = cu_seqlens.numel() - 1
    devices = {log_a.device, b.device}
    if initial_state is not None:
        if not initial_state.is_floating_point() or initial_state.shape != (rows, D):
            raise ValueError(f"{name}: initial_state must be a floating-point "
                             f"{'[B, D]' if cu_seqlens is None else '[N, D]'} = {(rows, D)}, got "
                             f"{initial_state.dtype} {tuple(initial_state.shape)}")
        devices.add(initial_state.device)
    if len(devices) > 1:
        raise ValueError(f"{name}: inputs on different devices {sorted(map(str, devices))}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")


def linear_scan_ref(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                    output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One step per token. Returns h [B, T, D] in b's dtype and, if asked, h_{T−1} [B, D] in the
    accumulation dtype. With ``cu_seqlens`` (int [N+1], B = 1): N packed sequences, each started
    from ``initial_state[n]`` ([N, D]) or 0; the final state is then [N, D]."""
    check_linear_scan_inputs("linear_scan_ref", log_a, b, initial_state, None, cu_seqlens)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for n in range(len(bounds) - 1):
            s0, s1 = bounds[n], bounds[n + 1]
            o, f = linear_scan_ref(log_a[:, s0:s1], b[:, s0:s1],
                                   None if initial_state is None else initial_state[n:n + 1], True)
            outs.append(o)
            finals.append(f)
        out = torch.cat(outs, 1) if outs else b
        return out, (torch.cat(finals, 0) if output_final_state else None)
    dt = acc_dtype(b.dtype)
    B, T, D = b.shape
    h = (torch.zeros(B, D, dtype=dt, device=b.device) if initial_state is None
         else initial_state.to(dt))
    a = log_a.to(dt).exp()
    bb = b.to(dt)
    hs = []
    for t in range(T):
        h = a[:, t] * h + bb[:, t]
        hs.append(h)
    out = torch.stack(hs, 1) if T > 0 else bb
    return out.to(b.dtype), (h if output_final_state else None)
