r"""Titans linear neural memory (Behrouz et al. 2025, "Titans: Learning to Memorize at Test Time"),
token by token: the specification of ``kernels.titans``.

Per batch element and head the memory is a matrix M ∈ R^{d_k×d_v} read as M(k) = Mᵀk (a row
vector k maps to k M). With surprise S (momentum), data-dependent θ_t (step), η_t (momentum) and
α_t (forgetting), the associative loss ℓ(M; k, v) = ‖M(k) − v‖² and its gradient
∇ℓ(M; k, v) = 2 k (Mᵀk − v)ᵀ:

    S_t = η_t S_{t−1} − θ_t ∇ℓ(M̂_t; k_t, v_t)
    M_t = (1 − α_t) M_{t−1} + S_t
    o_t = M_t(q_t)

Chunked gradients (the paper's parallel training, §3.2): the positions are cut into chunks of C
tokens and every gradient in a chunk is taken at the memory at the start of that chunk,
M̂_t = M_{τ(t)−1} with τ(t) the first position of t's chunk. C = 1 is the fully sequential
rule M̂_t = M_{t−1}. The recurrences for S and M are still per token, so o_t reads the memory after
the updates of every token up to and including t.

Chunk boundaries are where (offset + t) % C == 0: ``offset`` tokens of the first chunk were
consumed before this call, whose gradients are then taken at the given anchor M̂ (the third
element of ``initial_state``). The returned state is (M_T, S_T, M̂) with M̂ the anchor for the
next token, so segments can be chained at any position. The op takes log η_t and
log(1 − α_t) ("log_keep"), so callers can form them stably (log-sigmoid).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _initial(initial_state, B, H, dk, dv, like):
    if initial_state is None:
        z = torch.zeros(B, H, dk, dv, dtype=like.dtype, device=like.device)
        return z, z, z
    M, S = (_acc(t).to(like.dtype) for t in initial_state[:2])
    Mh = _acc(initial_state[2]).to(like.dtype) if len(initial_state) > 2 and initial_state[2] is not None else M
    return M, S, Mh


def check_titans_inputs(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                        log_eta: torch.Tensor, log_keep: torch.Tensor, initial_state=None,
                        chunk_size: int = 16, offset: int = 0, n_states: Optional[int] = None) -> None:
    """Raises ValueError naming the first problem with the op's inputs: q, k [B, H, T, d_k];
    v [B, H, T, d_v]; θ, log η, log(1 − α) [B, H, T] (one gate per token and head);
    initial_state None or (M, S[, M̂]) each [n_states (default B), H, d_k, d_v];
    chunk_size ≥ 1; offset ≥ 0."""
    named = (("q", q), ("k", k), ("v", v), ("theta", theta), ("log_eta", log_eta), ("log_keep", log_keep))
    for n, t in named:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name}: {n} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    for n, t in named[:3]:
        if t.dim() != 4:
            raise ValueError(f"{name}: {n} must be [B, H, T, d], got shape {tuple(t.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"{name}: q and k must have the same shape [B, H, T, d_k], got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{name}: v must be [B, H, T, d_v] = [{B}, {H}, {T}, d_v] like k, got {tuple(v.shape)}")
    for n, t in named[3:]:
        if t.shape != (B, H, T):
            raise ValueError(f"{name}: {n} must be [B, H, T] = {(B, H, T)} (one gate per token and head), "
                             f"got {tuple(t.shape)}")
    devices = {t.device for _, t in named}
    if initial_state is not None:
        if isinstance(initial_state, torch.Tensor) or len(initial_state) not in (2, 3):
            raise ValueError(f"{name}: initial_state must be a tuple (M, S) or (M, S, M̂)")
        want = (B if n_states is None else n_states, H, dk, dv)
        for n, t in zip(("M", "S", "M̂"), initial_state):
            if t is None and n == "M̂":
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != want:
                raise ValueError(f"{name}: initial {n} must be a floating-point tensor of shape "
                                 f"[{'B' if n_states is None else 'N'}, H, d_k, d_v] = {want}, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"{name}: inputs on different devices {sorted(map(str, devices))}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{name}: offset must be a non-negative int, got {offset!r}")


def titans_linear_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                            log_eta: torch.Tensor, log_keep: torch.Tensor,
                            initial_state: Optional[Sequence[torch.Tensor]] = None,
                            output_final_state: bool = False, chunk_size: int = 16, offset: int = 0
                            ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; theta, log_eta, log_keep [B, H, T];
    initial_state (M, S[, M̂]) each [B, H, d_k, d_v]. Returns o [B, H, T, d_v] and (M, S, M̂)."""
    check_titans_inputs("titans_linear_reference", q, k, v, theta, log_eta, log_keep, initial_state,
                        chunk_size, offset)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, theta, log_eta, log_keep = (_acc(t) for t in (q, k, v, theta, log_eta, log_keep))
    M, S, Mh = _initial(initial_state, B, H, dk, dv, k)
    eta, keep = log_eta.exp(), log_keep.exp()
    outs = []
    for t in range(T):
        if (offset + t) % chunk_size == 0:
            Mh = M
        k_t, v_t = k[:, :, t], v[:, :, t]
        err = torch.einsum("bhk,bhkv->bhv", k_t, Mh) - v_t
        grad = 2.0 * torch.einsum("bhk,bhv->bhkv", k_t, err)
        S = eta[:, :, t, None, None] * S - theta[:, :, t, None, None] * grad
        M = keep[:, :, t, None, None] * M + S
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], M))
    if (offset + T) % chunk_size == 0:
        Mh = M
    o = torch.stack(outs, 2) if T > 0 else v.new_zeros(B, H, 0, dv)
    return o.to(out_dtype), ((M, S, Mh) if output_final_state else None)
