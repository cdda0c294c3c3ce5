r"""What every backend of ``kernels.lact`` accepts, checked once at its entry, and the stream
state that lets a sequence be processed in several calls.

Shapes (B batch, H fast-weight heads, T new tokens):

* q, k [B, H, T, d_k]; v [B, H, T, d_v]; lr0, lr1, lr2 and momentum [B, H, T];
* w0, w2 [H, d_h, d_k] or [B, H, d_h, d_k]; w1 [H, d_v, d_h] or [B, H, d_v, d_h] (a [H, ...]
  weight is shared by every batch row, as the layer's learned initial weights are).

The stream state (``initial_state`` / ``final_state``) is a dict of tensors, batch first:

* "w0", "w1", "w2" [B, H, ...]: the fast weights the last token was read with;
* "w0_norm", "w1_norm", "w2_norm" [B, H, rows, 1]: the row norms of the initial weights (the
  targets of the weight normalisation, fixed at the start of the stream);
* "w0_main", "w1_main", "w2_main": with ``prenorm`` only, the un-normalised accumulators;
* "m0", "m1", "m2": with momentum only, the momentum buffers (the last update before Muon);
* "k" [B, H, n, d_k], "v" [B, H, n, d_v], "lr0", "lr1", "lr2" (and "momentum") [B, H, n]: the
  open chunk, the n ≤ chunk_size tokens since the last chunk boundary, already read but not yet
  written (the last chunk is written only when a later token arrives).

n is the open chunk's length, so the position within the chunk is k.shape[2].
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

#: the fast weights, in the order w0, w1, w2
WEIGHTS = ("w0", "w1", "w2")
#: the per-token inputs of the open chunk a stream state keeps
PENDING = ("k", "v", "lr0", "lr1", "lr2")

NAME = "block_causal_lact_swiglu"


def _shape(t) -> Tuple[int, ...]:
    return tuple(t.shape)


def _err(msg: str) -> ValueError:
    return ValueError(f"{NAME}: {msg}")


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Fast weights are kept in float32 for half-precision inputs, else in the weights' dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def state_keys(momentum: bool, prenorm: bool) -> Tuple[str, ...]:
    keys = WEIGHTS + tuple(f"{w}_norm" for w in WEIGHTS) + PENDING
    if prenorm:
        keys += tuple(f"{w}_main" for w in WEIGHTS)
    if momentum:
        keys += ("m0", "m1", "m2", "momentum")
    return keys


def check_lact_inputs(q, k, v, lr0, lr1, lr2, w0, w1, w2, chunk_size, momentum, muon_dtype,
                      initial_state, backend, backends) -> Tuple[int, int, int, int, int, int]:
    """Raises ValueError naming the first bad argument; returns (B, H, T, d_k, d_v, d_h)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise _err(f"chunk_size must be a positive int, got {chunk_size!r}")
    if backend not in backends:
        raise _err(f"unknown backend {backend!r}; available: {list(backends)}")
    if muon_dtype is not None and not isinstance(muon_dtype, torch.dtype):
        raise _err(f"muon_dtype must be a torch.dtype or None, got {muon_dtype!r}")
    for n, t in (("q", q), ("k", k), ("v", v), ("lr0", lr0), ("lr1", lr1), ("lr2", lr2)):
        if not isinstance(t, torch.Tensor):
            raise _err(f"{n} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise _err(f"{n} must be a floating-point tensor, got {t.dtype}")
    for n, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise _err(f"{n} must be [B, H, T, d], got shape {_shape(t)}")
    if q.shape != k.shape:
        raise _err(f"q and k must have the same shape [B, H, T, d_k], got q {_shape(q)} and k {_shape(k)}")
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    if v.shape[:3] != k.shape[:3]:
        raise _err(f"v must be [B, H, T, d_v] = [{B}, {H}, {T}, d_v] like k, got {_shape(v)}")
    if T == 0:
        raise _err("q, k, v have no tokens (T = 0)")
    if dk == 0 or dv == 0:
        raise _err(f"d_k and d_v must be positive, got d_k={dk}, d_v={dv}")
    for n, t in (("lr0", lr0), ("lr1", lr1), ("lr2", lr2), ("momentum", momentum)):
        if n == "momentum" and t is None:
            continue
        if n == "momentum" and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise _err(f"momentum must be a floating-point tensor or None, got {type(t).__name__}")
        if _shape(t) != (B, H, T):
            raise _err(f"{n} must be [B, H, T] = {(B, H, T)} (one value per token and head), got {_shape(t)}")
    if initial_state is not None:
        _check_state(initial_state, B, H, dk, dv, chunk_size, momentum is not None)
        d_h = initial_state["w0"].shape[2]
        for n, w in (("w0", w0), ("w1", w1), ("w2", w2)):
            if w is not None and not isinstance(w, torch.Tensor):
                raise _err(f"{n} must be a tensor or None, got {type(w).__name__}")
        return B, H, T, dk, dv, d_h
    for n, w in (("w0", w0), ("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor):
            raise _err(f"{n} must be a tensor (it may be None only with initial_state), got {type(w).__name__}")
        if not w.is_floating_point():
            raise _err(f"{n} must be a floating-point tensor, got {w.dtype}")
        if w.dim() not in (3, 4):
            raise _err(f"{n} must be [H, rows, cols] or [B, H, rows, cols], got {_shape(w)}")
        lead = (H,) if w.dim() == 3 else (B, H)
        if _shape(w)[:-2] != lead:
            raise _err(f"{n}'s leading dims must be {lead} (the heads of q, k, v, or batch and heads), "
                       f"got {_shape(w)}")
    if w0.shape != w2.shape:
        raise _err(f"w0 and w2 must have the same shape [.., d_h, d_k], got {_shape(w0)} and {_shape(w2)}")
    if w0.shape[-1] != dk:
        raise _err(f"w0 and w2 must be [.., d_h, d_k] with d_k = {dk} (k's last dim), got {_shape(w0)}")
    d_h = w0.shape[-2]
    if _shape(w1)[-2:] != (dv, d_h):
        raise _err(f"w1 must be [.., d_v, d_h] = [.., {dv}, {d_h}] (v's last dim, w0's rows), got {_shape(w1)}")
    return B, H, T, dk, dv, d_h


def _check_state(st, B, H, dk, dv, chunk_size, use_momentum) -> None:
    if not isinstance(st, dict):
        raise _err(f"initial_state must be a dict (a final_state of this op), got {type(st).__name__}")
    has_m = "m0" in st
    if has_m != use_momentum:
        raise _err("initial_state " + ("holds momentum buffers but momentum is None" if has_m else
                                       "has no momentum buffers (m0, m1, m2) but momentum is given"))
    prenorm = "w0_main" in st
    missing = [key for key in state_keys(use_momentum, prenorm) if key not in st]
    if missing:
        raise _err(f"initial_state is missing {missing}")
    w0 = st["w0"]
    if w0.dim() != 4 or _shape(w0)[:2] != (B, H) or w0.shape[-1] != dk:
        raise _err(f"initial_state['w0'] must be [B, H, d_h, d_k] = [{B}, {H}, d_h, {dk}], got {_shape(w0)}")
    dh = w0.shape[2]
    want = {"w0": (B, H, dh, dk), "w2": (B, H, dh, dk), "w1": (B, H, dv, dh)}
    for w, shp in want.items():
        if _shape(st[w]) != shp:
            raise _err(f"initial_state[{w!r}] must be {shp}, got {_shape(st[w])}")
        if _shape(st[f"{w}_norm"]) != shp[:3] + (1,):
            raise _err(f"initial_state['{w}_norm'] must be {shp[:3] + (1,)}, got {_shape(st[f'{w}_norm'])}")
        for extra in (f"{w}_main",) if prenorm else ():
            if _shape(st[extra]) != shp:
                raise _err(f"initial_state[{extra!r}] must be {shp}, got {_shape(st[extra])}")
    if use_momentum:
        for i, w in enumerate(WEIGHTS):
            if _shape(st[f"m{i}"]) != want[w]:
                raise _err(f"initial_state['m{i}'] must be {want[w]}, got {_shape(st[f'm{i}'])}")
    n = st["k"].shape[2] if st["k"].dim() == 4 else -1
    if _shape(st["k"]) != (B, H, n, dk) or not 0 <= n <= chunk_size:
        raise _err(f"initial_state['k'] (the open chunk) must be [B, H, n, d_k] with n ≤ chunk_size = "
                   f"{chunk_size}, got {_shape(st['k'])}")
    if _shape(st["v"]) != (B, H, n, dv):
        raise _err(f"initial_state['v'] must be {(B, H, n, dv)}, got {_shape(st['v'])}")
    for key in ("lr0", "lr1", "lr2") + (("momentum",) if use_momentum else ()):
        if _shape(st[key]) != (B, H, n):
            raise _err(f"initial_state[{key!r}] must be {(B, H, n)}, got {_shape(st[key])}")


def row_norm(w: torch.Tensor) -> torch.Tensor:
    """‖w_i‖ of every row, keepdim: [.., rows, 1]."""
    return w.norm(dim=-1, keepdim=True)


def start_state(w0, w1, w2, B: int, prenorm: bool, use_momentum: bool, sd: torch.dtype,
                initial_state: Optional[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The weights, norm targets, accumulators and momentum buffers the schedule starts from, as
    [B, H, ...] tensors in the state dtype ``sd`` (the graph to w0, w1, w2 kept)."""
    if initial_state is not None:
        keys = [key for key in initial_state if key not in PENDING and key != "momentum"]
        return {key: initial_state[key].to(sd) for key in keys}
    out: Dict[str, torch.Tensor] = {}
    for name, w in (("w0", w0), ("w1", w1), ("w2", w2)):
        w = w.to(sd)
        # the target is computed from the initial weights once, not detached (as the official code)
        out[f"{name}_norm"] = row_norm(w).expand(B, *w.shape[-3:-1], 1) if w.dim() == 3 else row_norm(w)
        out[name] = w.expand(B, *w.shape[-3:]) if w.dim() == 3 else w
        if prenorm:
            out[f"{name}_main"] = out[name]
        if use_momentum:
            out["m" + name[1]] = torch.zeros(B, *w.shape[-3:], dtype=sd, device=w.device)
    return out


def stream(q, k, v, lr0, lr1, lr2, momentum, sd: torch.dtype,
           initial_state: Optional[Dict[str, torch.Tensor]]):
    """The token stream the schedule runs on: the open chunk of ``initial_state`` followed by the
    new tokens (k, v, lr's, momentum), all in ``sd``; returns (dict of them, n0) where n0 is the
    open chunk's length (the new queries sit at positions n0 … n0 + T − 1 of the stream)."""
    new = {"k": k, "v": v, "lr0": lr0, "lr1": lr1, "lr2": lr2}
    if momentum is not None:
        new["momentum"] = momentum
    if initial_state is None or initial_state["k"].shape[2] == 0:
        return {key: t.to(sd) for key, t in new.items()}, 0
    n0 = initial_state["k"].shape[2]
    return {key: torch.cat([initial_state[key].to(sd), t.to(sd)], dim=2) for key, t in new.items()}, n0


def newton_schulz5(G: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    r"""Muon's orthogonalisation of each matrix of G [N, m, n] (Jordan et al.'s quintic Newton–Schulz,
    with the five coefficient triples of the official LaCT code): X = G (cast to ``dtype``;
    None keeps G's), transposed when m > n, X ← X / (‖X‖_F + 1e-7), then five steps
    A = X Xᵀ, B = b A + (c A) A, X ← a X + B X. Returns X in the dtype it ran in."""
    X = G if dtype is None else G.to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in NS_COEFFS:
        A = X @ X.transpose(-2, -1)
        Bm = b * A + (c * A) @ A      # the official order: (c·A)·A, which rounds differently in bf16
        X = a * X + Bm @ X
    return X.transpose(-2, -1) if tall else X


#: (a, b, c) of the five Newton–Schulz steps, as the official code ships them
NS_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def chunk_bounds(L: int, C: int):
    """[(start, end, written)] of the chunks of a stream of L tokens: a chunk is written when a
    token follows it, so the last one (partial or full) never is."""
    out = []
    for s in range(0, L, C):
        e = min(s + C, L)
        out.append((s, e, e < L))
    return out
