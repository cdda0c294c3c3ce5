r"""What every backend of ``kernels.delta_rule`` accepts, checked once at its entry, and the
per-channel β form.

Shapes: q, k [B, H, T, d_k]; v [B, H, T, d_v]; β [B, H, T] (one write strength per token and
head) or [B, H, T, d_v] (one per value channel, as flash-linear-attention allows);
initial_state [N, H, d_k, d_v] with N = B, or N = number of sequences of a packed ``cu_seqlens``
batch.

Per-channel β. With β_t ∈ R^{d_v} the write is

    S_t = S_{t−1} + k_t (β_t ∘ (v_t − S_{t−1}ᵀ k_t))ᵀ,

so column j of S (the value channel j) follows its own scalar-β delta rule
S_t[:, j] = (I − β_{t,j} k_t k_tᵀ) S_{t−1}[:, j] + β_{t,j} k_t v_{t,j}: the d_v columns are
independent, each with its own chunk matrix T = (I + tril(diag(β_{:,j}) K Kᵀ, −1))⁻¹. The chunked
backends therefore run it as d_v scalar-β delta rules of value width 1 (``fold_channel_beta``:
head h, channel j becomes head h·d_v + j with the same q, k), which costs about d_v times the
work of the scalar case on the key side; the sequential reference applies the formula directly.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def check_delta_rule_inputs(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                            chunk_size: Optional[int] = None,
                            cu_seqlens: Optional[torch.Tensor] = None) -> bool:
    """Raises ValueError naming the first problem; returns whether β is per value channel."""
    for n, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {n} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {n} must be a floating-point tensor, got {t.dtype}")
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: {n} must be [B, H, T, d], got shape {_shape(t)}")
    if q.shape != k.shape:
        raise ValueError(f"{name}: q and k must have the same shape [B, H, T, d_k], got "
                         f"q {_shape(q)} and k {_shape(k)}")
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{name}: v must be [B, H, T, d_v] = [{B}, {H}, {T}, d_v] like k, got {_shape(v)}")
    if dk == 0 or dv == 0:
        raise ValueError(f"{name}: d_k and d_v must be positive, got d_k={dk}, d_v={dv}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"{name}: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if _shape(beta) == (B, H, T):
        per_channel = False
    elif _shape(beta) == (B, H, T, dv):
        per_channel = True
    else:
        raise ValueError(f"{name}: beta must be [B, H, T] = {(B, H, T)} (per head) or [B, H, T, d_v] = "
                         f"{(B, H, T, dv)} (per value channel), got {_shape(beta)}")
    devices = {t.device for t in (q, k, v, beta)}
    if initial_state is not None:
        devices.add(initial_state.device)
    if len(devices) > 1:
        raise ValueError(f"{name}: inputs on different devices {sorted(map(str, devices))}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"{name}: cu_seqlens needs a packed batch of 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, got "
                             f"{cu_seqlens.dtype} {_shape(cu_seqlens)}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        if not initial_state.is_floating_point():
            raise ValueError(f"{name}: initial_state must be floating point, got {initial_state.dtype}")
        if _shape(initial_state) != (N, H, dk, dv):
            what = "[B, H, d_k, d_v]" if cu_seqlens is None else "[N sequences, H, d_k, d_v]"
            raise ValueError(f"{name}: initial_state must be {what} = {(N, H, dk, dv)}, got "
                             f"{_shape(initial_state)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")
    return per_channel


def fold_channel_beta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                      initial_state: Optional[torch.Tensor]):
    """Per-channel β [B, H, T, d_v] → d_v·H heads of a scalar-β delta rule with d_v = 1:
    q, k [B, H·d_v, T, d_k] (repeated), v [B, H·d_v, T, 1], β [B, H·d_v, T], state
    [N, H·d_v, d_k, 1]; head h·d_v + j is value channel j of head h."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]

    def rep(x):
        return x[:, :, None].expand(B, H, dv, T, dk).reshape(B, H * dv, T, dk)

    v1 = v.permute(0, 1, 3, 2).reshape(B, H * dv, T, 1)
    b1 = beta.permute(0, 1, 3, 2).reshape(B, H * dv, T)
    s1 = None
    if initial_state is not None:
        N = initial_state.shape[0]
        s1 = initial_state.permute(0, 1, 3, 2).reshape(N, H * dv, dk, 1)
    return rep(q), rep(k), v1, b1, s1


def unfold_channel_beta(o: torch.Tensor, final_state: Optional[torch.Tensor], H: int, dv: int):
    """Inverse of ``fold_channel_beta`` on the results: o [B, H·d_v, T, 1] → [B, H, T, d_v];
    final state [N, H·d_v, d_k, 1] → [N, H, d_k, d_v]."""
    B, _, T, _ = o.shape
    o = o.reshape(B, H, dv, T).permute(0, 1, 3, 2).contiguous()
    if final_state is not None:
        N, _, dk, _ = final_state.shape
        final_state = final_state.reshape(N, H, dv, dk).permute(0, 1, 3, 2).contiguous()
    return o, final_state


def check_gate_values(name: str, g: torch.Tensor, beta: torch.Tensor) -> None:
    """g ≤ 0 and 0 ≤ β ≤ 1 (NaN fails both): one flag read back to the host."""
    if g.numel() == 0:
        return
    bad_g = ~(g <= 0).all()
    bad_b = ~((beta >= 0) & (beta <= 1)).all()
    flags = torch.stack([bad_g, bad_b]).tolist()
    if flags[0]:
        raise ValueError(f"{name}: g is the log decay and must be <= 0 (α = exp(g) in (0, 1]); got max "
                         f"{g.max().item():.4g}" + (" or NaN" if bool(torch.isnan(g).any()) else ""))
    if flags[1]:
        raise ValueError(f"{name}: beta must lie in [0, 1]; got values in [{beta.min().item():.4g}, "
                         f"{beta.max().item():.4g}]" + (" or NaN" if bool(torch.isnan(beta).any()) else ""))


__all__ = ["check_delta_rule_inputs", "fold_channel_beta", "unfold_channel_beta", "check_gate_values"]
