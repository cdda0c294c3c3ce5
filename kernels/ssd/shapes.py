r"""What every backend of ``kernels.ssd`` accepts, checked once at its entry.

Shapes (mamba_ssm's ``mamba_chunk_scan_combined`` layout, sequence-first): x [b, T, h, p]; dt
[b, T, h]; A [h]; B, C [b, T, g, n] with g dividing h (head i reads group i // (h / g)); D [h] or
[h, p]; z [b, T, h, p]; dt_bias [h]; initial_state [N, h, p, n] with N = b, or N = the number of
sequences of a packed ``cu_seqlens`` batch (b = 1). x, B, C and z share one floating-point
dtype; dt, A, D, dt_bias and the state are floating point of any width (read in the accumulation
dtype). ``chunk_size`` is a power of two (the Triton kernels tile by it).

Values (``check_ssd_values``, run by the public entry ``ssd``): A ≤ 0 (the decay exp(Δ A) is in
(0, 1]) and the step Δ ≥ 0 after ``dt_bias`` and the softplus; one flag read back to the host,
skipped inside ``torch.compile`` graphs.
"""
from __future__ import annotations

from typing import List, Optional

import torch


def _shape(t: torch.Tensor):
    return tuple(t.shape)


def check_ssd_inputs(name: str, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
                     dt_bias: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                     chunk_size: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None) -> None:
    """Raises ValueError naming the first problem (the argument and what it should be)."""
    named = [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias),
             ("initial_state", initial_state)]
    for n, t in named:
        if t is None and n in ("D", "z", "dt_bias", "initial_state"):
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {n} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {n} must be a floating-point tensor, got {t.dtype}")
    if x.dim() != 4:
        raise ValueError(f"{name}: x must be [b, T, h, p], got shape {_shape(x)}")
    b, T, h, p = x.shape
    if h == 0 or p == 0:
        raise ValueError(f"{name}: x must have h ≥ 1 heads of p ≥ 1 channels, got shape {_shape(x)}")
    if _shape(dt) != (b, T, h):
        raise ValueError(f"{name}: dt must be [b, T, h] = {(b, T, h)} (one step per token and head), "
                         f"got {_shape(dt)}")
    if _shape(A) != (h,):
        raise ValueError(f"{name}: A must be [h] = {(h,)} (one decay rate per head), got {_shape(A)}")
    if B.dim() != 4 or _shape(B)[:2] != (b, T):
        raise ValueError(f"{name}: B must be [b, T, g, n] with b, T = {b}, {T} as in x, got {_shape(B)}")
    g, n = B.shape[2], B.shape[3]
    if g == 0 or n == 0:
        raise ValueError(f"{name}: B must have g ≥ 1 groups of n ≥ 1 state channels, got {_shape(B)}")
    if h % g:
        raise ValueError(f"{name}: the number of heads h = {h} must be divisible by the number of groups "
                         f"g = {g} of B and C (head i reads group i // (h / g))")
    if _shape(C) != _shape(B):
        raise ValueError(f"{name}: C must have B's shape [b, T, g, n] = {_shape(B)}, got {_shape(C)}")
    if z is not None and _shape(z) != _shape(x):
        raise ValueError(f"{name}: z must have x's shape [b, T, h, p] = {_shape(x)}, got {_shape(z)}")
    if len({x.dtype, B.dtype, C.dtype} | ({z.dtype} if z is not None else set())) != 1:
        raise ValueError(f"{name}: x, B, C (and z) must share one dtype, got x {x.dtype}, B {B.dtype}, "
                         f"C {C.dtype}" + (f", z {z.dtype}" if z is not None else ""))
    if D is not None and _shape(D) not in ((h,), (h, p)):
        raise ValueError(f"{name}: D must be [h] = {(h,)} or [h, p] = {(h, p)}, got {_shape(D)}")
    if dt_bias is not None and _shape(dt_bias) != (h,):
        raise ValueError(f"{name}: dt_bias must be [h] = {(h,)}, got {_shape(dt_bias)}")
    devices = {t.device for _, t in named if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}: inputs on different devices {sorted(map(str, devices))}")
    N = b
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                             f"{_shape(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else ''}")
        if b != 1:
            raise ValueError(f"{name}: cu_seqlens needs a packed batch of b = 1, got b = {b}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and _shape(initial_state) != (N, h, p, n):
        what = "[b, h, p, n]" if cu_seqlens is None else "[N sequences, h, p, n]"
        raise ValueError(f"{name}: initial_state must be {what} = {(N, h, p, n)}, got {_shape(initial_state)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"{name}: chunk_size must be a power of two (1, 2, 4, …, 256, …), got {chunk_size!r}")


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, T: int) -> List[int]:
    """The offsets on the host, checked: rising (empty sequences allowed) from 0 to T."""
    cu = [int(v) for v in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(e < a for a, e in zip(cu, cu[1:])):
        raise ValueError(f"{name}: cu_seqlens must rise from 0 to T = {T}, got {cu}")
    return cu


def check_ssd_values(name: str, dt: torch.Tensor, A: torch.Tensor, dt_bias: Optional[torch.Tensor] = None,
                     dt_softplus: bool = False) -> None:
    """A ≤ 0 and Δ = dt (+ dt_bias, softplus when asked) ≥ 0 (NaN fails both): one flag read back."""
    bad_a = ~(A <= 0).all()
    if dt_softplus:     # softplus is positive; only a NaN can fail
        bad_dt = torch.isnan(dt).any() | (torch.isnan(dt_bias).any() if dt_bias is not None else False)
    else:
        step = dt if dt_bias is None else dt + dt_bias.to(dt.dtype)
        bad_dt = ~(step >= 0).all() if step.numel() else torch.zeros((), dtype=torch.bool, device=dt.device)
    flags = torch.stack([torch.as_tensor(bad_a), torch.as_tensor(bad_dt, device=A.device)]).tolist()
    if flags[0]:
        raise ValueError(f"{name}: A must be <= 0 (the decay exp(dt * A) in (0, 1]); got max "
                         f"{A.max().item():.4g}" + (" or NaN" if bool(torch.isnan(A).any()) else ""))
    if flags[1] and dt_softplus:
        raise ValueError(f"{name}: dt" + (" and dt_bias" if dt_bias is not None else "") + " must not be NaN")
    if flags[1]:
        what = "dt" + (" + dt_bias" if dt_bias is not None else "")
        raise ValueError(f"{name}: the step {what} must be >= 0 (or pass dt_softplus=True); got min "
                         f"{(dt if dt_bias is None else dt + dt_bias.to(dt.dtype)).min().item():.4g}"
                         + (" or NaN" if bool(torch.isnan(dt).any()) else ""))


__all__ = ["check_ssd_inputs", "check_ssd_values", "check_cu_seqlens"]
