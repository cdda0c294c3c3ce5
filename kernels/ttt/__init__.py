r"""TTT-Linear and TTT-MLP inner loops (Sun et al. 2024, "Learning to (Learn at Test Time)").

Per head h, inputs are row vectors q_t, k_t, v_t ∈ R^d ([B, H, T, d] tensors XQ, XK, XV after
the outer projections and RoPE), the learnable per-token inner learning rate η_t ([B, H, T], the
official ``ttt_lr_eta`` = η_base·σ(θ_η·x_t + b)/d) and the per-position scale token_idx ∈ R^b
(official: clamp(1/(p+1) + learnable_token_idx[p], 0)). Token t at position p inside its
mini-batch of b tokens produces, with θ_0 the inner weights at the start of that mini-batch,

    θ_t = θ_0 − token_idx[p] · Σ_{s ≤ t, same mini-batch} η_s ∇_θ ℓ(θ_0; k_s, v_s)
    out_t = q_t + LN(f(q_t; θ_t)),     ℓ(θ; k, v) = ½‖LN(f(k; θ)) − (v − k)‖²

(see ``reference.py`` for the spec, ``torch_chunk.py`` for the dual form). Shapes: ln_weight,
ln_bias [H, d]; W1 [H, d, d] and b1 [H, 1, d] for TTT-Linear, or W1 [H, d, m], b1 [H, 1, m],
W2 [H, m, d], b2 [H, 1, d] for TTT-MLP; each may carry a leading batch axis [B, …].

State (``initial_state`` / final state), a dict: "W1", "b1"(, "W2", "b2") = θ_0 of the current
mini-batch [B, H, …]; "grad_W1", … = Σ η_s ∇ℓ_s over the tokens of the current mini-batch seen so
far (zero at a boundary); "pos" = how many of them (int in [0, b)). When ``initial_state`` is
given it replaces the weights arguments. Returns (out [B, H, T, d], final_state or None).

``backend``: "torch" (dual form, training and prefill), "primal" (token by token with the
per-token θ_t materialized: decoding), "reference" (the specification), "triton" (Triton kernel
in ``chunk.py`` for TTT-Linear, ``mlp_chunk.py`` for TTT-MLP, when present).

Variable-length batches: ``cu_seqlens`` (int32 [N+1], cumulative lengths, B = 1) packs N
sequences along T. Each starts at a mini-batch boundary from θ_0 = ``initial_state`` row n (every
tensor [N, H, …], "pos" 0 for all) or from the weights arguments ([H, …] or [1, H, …]); the final
state then holds every tensor stacked [N, H, …] and "pos" as a list of N ints. Sequences may be
empty (their final state is their initial one). With backend="triton", TTT-Linear runs the packed
batch in one launch of each of its kernels (``ttt_linear_triton_packed`` in ``chunk.py``: the
mini-batch tables built on the device, one flag read back to check the offsets), and so does
TTT-MLP (``ttt_mlp_triton_packed`` in ``mlp_chunk.py``); every other backend runs once on each
sequence, so its kernels are launched N times.

In-scan restarts: ``mini_batch_resets`` (bool [B, ⌈T/b⌉], backend="torch", no initial state)
start mini-batch m of row r from the weights arguments where it is True, inside the one dual-form
scan over the batch (``torch_chunk.scan_mini_batches``): documents laid out so that each starts
at a mini-batch boundary (``ttt_lm.model.docs.DocLayout.aligned``) then run as if each were alone.
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Dict, List, Optional, Tuple

import torch

from kernels.contract import OpContract
from kernels.ttt.reference import ttt_linear_ref, ttt_mlp_ref
from kernels.ttt.torch_chunk import (acc_dtype, make_state, ttt_linear_chunk, ttt_linear_primal, ttt_mlp_chunk,
                                     ttt_mlp_primal)


def has_triton_backend(kind: str = "linear") -> bool:
    """Whether the Triton kernels provide ``ttt_<kind>_triton`` (kind: "linear" in ``chunk.py``,
    "mlp" in ``mlp_chunk.py``)."""
    module = "chunk" if kind == "linear" else "mlp_chunk"
    if importlib.util.find_spec(f"kernels.ttt.{module}") is None:
        return False
    try:
        if kind == "linear":
            from kernels.ttt import chunk as mod
        else:
            from kernels.ttt import mlp_chunk as mod
    except ImportError:  # triton itself missing
        return False
    return hasattr(mod, f"ttt_{kind}_triton")


def _built(kind: str):
    def built() -> Optional[str]:
        if has_triton_backend(kind):
            return None
        return f"kernels/ttt/{'chunk' if kind == 'linear' else 'mlp_chunk'}.py has no ttt_{kind}_triton"
    return built


#: what the Triton backends of ``ttt_linear`` and ``ttt_mlp`` cover (``kernels.contract``): every
#: head size, packed sequences in one launch (``triton_packed_limit`` bounds one launch's size),
#: states at any position inside a mini-batch
TTT_LINEAR = OpContract("kernels.ttt.ttt_linear", _built("linear"))
TTT_MLP = OpContract("kernels.ttt.ttt_mlp", _built("mlp"))


def triton_packed_limit(kind: str, H: int, T: int, d: int, N: int, mini_batch_size: int,
                        inner: int) -> Optional[str]:
    """Why the one-launch packed path (``cu_seqlens``, backend="triton") of ``ttt_<kind>`` cannot
    take N sequences of T tokens in all (H heads of width d, inner width ``inner``, mini-batch b):
    its kernels' int32 offsets; None when it can (the packed path raises this reason)."""
    if kind == "linear":
        from kernels.ttt.chunk import packed_launch_limit
        return packed_launch_limit(H, T, d, N)
    from kernels.ttt.mlp_chunk import packed_launch_limit
    return packed_launch_limit(H, T, d, inner, mini_batch_size, N)


# The Triton kernels form element offsets as int32 products of their program index (one program per
# (batch row, head[, mini-batch])) with the row sizes; a launch whose buffers reach 2^31 elements
# would wrap. Larger batches run in groups of batch rows, each its own launch.
_INT32_ELEMS = 2 ** 31


def _triton_rows_per_launch(name: str, XQ: torch.Tensor, mini_batch_size: int, inner: int) -> int:
    """How many batch rows one launch of the TTT kernels may take so that every buffer they index
    (inputs [H, T, d]; per-mini-batch start weights [H, ⌈T/b⌉, d, inner] and row tiles
    [H, ⌈T/b⌉, b padded to a power of two ≥ 16, max(inner, 2d, 128)] per row) stays below 2^31
    elements; a single row that does not is refused."""
    B, H, T, d = XQ.shape
    nmb = -(-T // mini_batch_size) + 1
    rows = max(16, 1 << (mini_batch_size - 1).bit_length())    # a mini-batch's rows padded as the kernels pad them
    per_row = H * max(T * d, nmb * d * inner, nmb * rows * max(inner, 2 * d, 128))
    if per_row >= _INT32_ELEMS:
        raise ValueError(f"{name}: one batch row needs {per_row} elements of kernel buffers (H = {H}, T = {T}, "
                         f"d = {d}, mini-batch {mini_batch_size}), beyond the kernels' int32 offsets "
                         f"(2^31); use a shorter sequence (carry the state across calls) or fewer heads")
    return max(1, (_INT32_ELEMS - 1) // per_row)


def _in_row_groups(fn: Callable, XQ: torch.Tensor, rows: int, n_inputs: int, args: tuple):
    """``fn(*args)`` over groups of ``rows`` batch rows: the first ``n_inputs`` arguments ([B, …]),
    batched weights ([B, H, …], 4 dims) and ``initial_state`` tensors sliced along the batch axis;
    outputs and final states concatenated back. Every (batch row, head) is independent in the
    kernels, so the result is the one-launch result."""
    B = XQ.shape[0]
    *head, initial_state, output_final_state = args
    outs, finals = [], []
    for r0 in range(0, B, rows):
        sl = slice(r0, r0 + rows)
        part = [a[sl] if i < n_inputs or (torch.is_tensor(a) and a.dim() == 4 and a.shape[0] == B) else a
                for i, a in enumerate(head)]
        st = None if initial_state is None else {
            k: (v[sl] if torch.is_tensor(v) and v.dim() == 4 and v.shape[0] == B else v)
            for k, v in initial_state.items()}
        o, f = fn(*part, st, output_final_state)
        outs.append(o)
        finals.append(f)
    out = torch.cat(outs, 0)
    if not output_final_state:
        return out, None
    final = {k: torch.cat([f[k] for f in finals], 0) for k in finals[0] if k != "pos"}
    final["pos"] = finals[0]["pos"]
    return out, final


def _check_packed(name: str, XQ: torch.Tensor, cu_seqlens: torch.Tensor, weights: dict,
                  initial_state: Optional[dict]) -> None:
    """The packed one-launch path's entry checks: B = 1, ``cu_seqlens`` [N+1] with N ≥ 1, and an
    ``initial_state`` (if any) with one row per sequence."""
    if XQ.shape[0] != 1:
        raise ValueError(f"{name}: cu_seqlens needs packed input with B = 1, got B = {XQ.shape[0]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    _check_varlen_state(name, weights, initial_state, cu_seqlens.numel() - 1)


def _run_triton(name: str, fn: Callable, XQ: torch.Tensor, mini_batch_size: int, width: int, args: tuple):
    """``fn(*args)`` in one launch, or in groups of batch rows where one launch's offsets would
    pass the int32 limit (``_triton_rows_per_launch``, ``_in_row_groups``)."""
    rows = _triton_rows_per_launch(name, XQ, mini_batch_size, width)
    if rows < XQ.shape[0]:
        return _in_row_groups(fn, XQ, rows, 4, args)
    return fn(*args)


def _check(XQ, XK, XV, eta, token_idx, mini_batch_size):
    if XQ.dim() != 4 or XK.shape != XQ.shape or XV.shape != XQ.shape:
        raise ValueError(f"ttt: XQ, XK, XV must all be [B, H, T, d], got {tuple(XQ.shape)}, "
                         f"{tuple(XK.shape)}, {tuple(XV.shape)}")
    if eta.shape != XQ.shape[:3]:
        raise ValueError(f"ttt: eta must be [B, H, T] = {tuple(XQ.shape[:3])}, got {tuple(eta.shape)}")
    if token_idx.shape != (mini_batch_size,):
        raise ValueError(f"ttt: token_idx must be [mini_batch_size] = [{mini_batch_size}], got {tuple(token_idx.shape)}")


def _seq_bounds(name: str, cu_seqlens: torch.Tensor, B: int, T: int) -> List[int]:
    """The packed batch's offsets on the host, checked."""
    if B != 1:
        raise ValueError(f"{name}: cu_seqlens needs packed input with B = 1, got B = {B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"{name}: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"{name}: cu_seqlens must rise from 0 to T = {T} without decreasing, got {bounds}")
    return bounds


def _check_varlen_state(name: str, weights: Dict[str, torch.Tensor], initial_state: Optional[dict], N: int):
    """The weights and ``initial_state`` of a packed batch of N sequences: weights [H, …] or
    [1, H, …], ``initial_state`` tensors [N, H, …] with every "pos" 0."""
    for k, w in weights.items():
        if w.dim() == 4 and w.shape[0] != 1:
            raise ValueError(f"{name}: with cu_seqlens the weight {k} must be [H, …] or [1, H, …], got "
                             f"{tuple(w.shape)}; per-sequence weights go in initial_state [N, H, …]")
    if initial_state is not None:
        pos = initial_state["pos"]
        # one int for all sequences, or one per sequence (a stacked final state's list)
        pos = pos.reshape(-1).tolist() if torch.is_tensor(pos) else (
            list(pos) if isinstance(pos, (list, tuple)) else [pos])
        if any(p != 0 for p in pos):
            raise ValueError(f"{name}: with cu_seqlens every sequence must start at a mini-batch boundary "
                             f"(initial_state['pos'] = 0), got pos = {pos}")
        for k in list(weights) + ["grad_" + k for k in weights]:
            if initial_state[k].shape[0] != N:
                raise ValueError(f"{name}: with cu_seqlens initial_state[{k!r}] must be [N = {N}, H, …], "
                                 f"got {tuple(initial_state[k].shape)}")


def _varlen(name: str, run: Callable, weights: Dict[str, torch.Tensor], XQ: torch.Tensor,
            initial_state: Optional[dict], output_final_state: bool, cu_seqlens: torch.Tensor):
    """``run(t0, t1, state_n)`` on every sequence [t0, t1) of the packed batch, each from its own
    initial state; outputs concatenated along T, final states stacked along the batch axis."""
    B, H, T, d = XQ.shape
    bounds = _seq_bounds(name, cu_seqlens, B, T)
    N = len(bounds) - 1
    _check_varlen_state(name, weights, initial_state, N)
    outs, finals = [], []
    for n, (t0, t1) in enumerate(zip(bounds[:-1], bounds[1:])):
        st = None
        if initial_state is not None:
            st = {k: v[n:n + 1] for k, v in initial_state.items() if k != "pos"}
            st["pos"] = 0
        if t1 > t0:
            o, fin = run(t0, t1, st)
            outs.append(o)
        else:
            fin = make_state(weights, 1, acc_dtype(XQ.dtype), st) if output_final_state else None
        finals.append(fin)
    out = torch.cat(outs, dim=2) if outs else XQ.new_zeros(1, H, 0, d)
    if not output_final_state:
        return out, None
    final = {k: torch.cat([f[k] for f in finals], 0) for k in finals[0] if k != "pos"}
    final["pos"] = [int(f["pos"]) for f in finals]
    return out, final


def _check_resets(name: str, backend: str, initial_state, cu_seqlens) -> None:
    if backend != "torch":
        raise ValueError(f"{name}: mini_batch_resets are a backend='torch' feature, got backend={backend!r}")
    if initial_state is not None or cu_seqlens is not None:
        raise ValueError(f"{name}: mini_batch_resets start every row from the weights arguments; "
                         f"they take no initial_state and no cu_seqlens")


def ttt_linear(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor,
               token_idx: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
               W1: torch.Tensor, b1: torch.Tensor, mini_batch_size: int = 16,
               initial_state: Optional[dict] = None, output_final_state: bool = False,
               backend: str = "torch", cu_seqlens: Optional[torch.Tensor] = None,
               mini_batch_resets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[dict]]:
    """TTT-Linear: f(x; W1, b1) = x W1 + b1. With ``cu_seqlens`` (int32 [N+1], B = 1) the N packed
    sequences run in one launch per kernel with backend="triton", one after another through any
    other ``backend`` (see the module docstring). ``mini_batch_resets`` (module docstring): the
    PyTorch dual form's in-scan restarts."""
    _check(XQ, XK, XV, eta, token_idx, mini_batch_size)
    if mini_batch_resets is not None:
        _check_resets("ttt_linear", backend, initial_state, cu_seqlens)
        return ttt_linear_chunk(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size, None,
                                output_final_state, mini_batch_resets)
    if cu_seqlens is not None and backend == "triton" and has_triton_backend("linear") and XQ.shape[2] > 0:
        # one launch of each kernel over the packed batch (a batch of empty sequences only, T = 0,
        # keeps its initial states through the per-sequence path below, which launches nothing)
        _check_packed("ttt_linear", XQ, cu_seqlens, {"W1": W1, "b1": b1}, initial_state)
        from kernels.ttt.chunk import ttt_linear_triton_packed
        return ttt_linear_triton_packed(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size,
                                        initial_state, output_final_state, cu_seqlens)
    if cu_seqlens is not None:
        def run(t0, t1, st):
            return ttt_linear(XQ[:, :, t0:t1], XK[:, :, t0:t1], XV[:, :, t0:t1], eta[:, :, t0:t1], token_idx,
                              ln_weight, ln_bias, W1, b1, mini_batch_size, st, output_final_state, backend)
        return _varlen("ttt_linear", run, {"W1": W1, "b1": b1}, XQ, initial_state, output_final_state, cu_seqlens)
    args = (XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size, initial_state, output_final_state)
    if backend == "torch":
        return ttt_linear_chunk(*args)
    if backend == "primal":
        return ttt_linear_primal(*args)
    if backend == "reference":
        return ttt_linear_ref(*args)
    if backend == "triton":
        if not has_triton_backend("linear"):
            raise RuntimeError("ttt_linear: backend='triton' needs ttt_linear_triton in kernels/ttt/chunk.py, which is absent")
        from kernels.ttt.chunk import ttt_linear_triton
        return _run_triton("ttt_linear", ttt_linear_triton, XQ, mini_batch_size, XQ.shape[-1], args)
    raise ValueError(f"ttt_linear: backend must be torch, primal, reference or triton, got {backend!r}")


def ttt_mlp(XQ: torch.Tensor, XK: torch.Tensor, XV: torch.Tensor, eta: torch.Tensor,
            token_idx: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
            W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor,
            mini_batch_size: int = 16, initial_state: Optional[dict] = None,
            output_final_state: bool = False, backend: str = "torch",
            cu_seqlens: Optional[torch.Tensor] = None,
            mini_batch_resets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[dict]]:
    """TTT-MLP: f(x; W1, b1, W2, b2) = GELU_tanh(x W1 + b1) W2 + b2. With ``cu_seqlens`` (int32
    [N+1], B = 1) the N packed sequences run in one launch per kernel with backend="triton", one
    after another through any other ``backend`` (see the module docstring). ``mini_batch_resets``
    (module docstring): the PyTorch dual form's in-scan restarts."""
    _check(XQ, XK, XV, eta, token_idx, mini_batch_size)
    if mini_batch_resets is not None:
        _check_resets("ttt_mlp", backend, initial_state, cu_seqlens)
        return ttt_mlp_chunk(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size,
                             None, output_final_state, mini_batch_resets)
    if cu_seqlens is not None and backend == "triton" and has_triton_backend("mlp") and XQ.shape[2] > 0:
        # one launch of each kernel over the packed batch (T = 0: the per-sequence path below)
        _check_packed("ttt_mlp", XQ, cu_seqlens, {"W1": W1, "b1": b1, "W2": W2, "b2": b2}, initial_state)
        from kernels.ttt.mlp_chunk import ttt_mlp_triton_packed
        return ttt_mlp_triton_packed(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2,
                                     mini_batch_size, initial_state, output_final_state, cu_seqlens)
    if cu_seqlens is not None:
        def run(t0, t1, st):
            return ttt_mlp(XQ[:, :, t0:t1], XK[:, :, t0:t1], XV[:, :, t0:t1], eta[:, :, t0:t1], token_idx,
                           ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size, st, output_final_state, backend)
        return _varlen("ttt_mlp", run, {"W1": W1, "b1": b1, "W2": W2, "b2": b2}, XQ, initial_state,
                       output_final_state, cu_seqlens)
    args = (XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size,
            initial_state, output_final_state)
    if backend == "torch":
        return ttt_mlp_chunk(*args)
    if backend == "primal":
        return ttt_mlp_primal(*args)
    if backend == "reference":
        return ttt_mlp_ref(*args)
    if backend == "triton":
        if not has_triton_backend("mlp"):
            raise RuntimeError("ttt_mlp: backend='triton' needs ttt_mlp_triton in kernels/ttt/mlp_chunk.py, which is absent")
        from kernels.ttt.mlp_chunk import ttt_mlp_triton
        return _run_triton("ttt_mlp", ttt_mlp_triton, XQ, mini_batch_size, W1.shape[-1], args)
    raise ValueError(f"ttt_mlp: backend must be torch, primal, reference or triton, got {backend!r}")


__all__ = ["TTT_LINEAR", "TTT_MLP", "ttt_linear", "ttt_mlp", "ttt_linear_ref", "ttt_mlp_ref", "ttt_linear_chunk", "ttt_mlp_chunk",
           "ttt_linear_primal", "ttt_mlp_primal", "has_triton_backend", "triton_packed_limit"]
