r"""Gated linear recurrence with log-space gates, element-wise over channels:

    h_t = exp(log_a_t) ⊙ h_{t−1} + b_t,     log_a, b ∈ R^{B×T×D},  h_{−1} = initial_state ∈ R^{B×D}

Used by Griffin's RG-LRU (De et al. 2024) and any diagonal linear RNN. ``reference.py`` is the
specification (one step per token); ``torch_chunk.py`` the chunked PyTorch form; a Triton kernel
in ``chunk.py`` serves ``backend="triton"`` when present. ``linear_scan_reset`` is the same scan with
resets, h_t = b_t where ``reset`` is set (a_t replaced by 0): the rule of Griffin's document
boundaries (a new document drops the carried state).
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract
from kernels.linear_scan.reference import acc_dtype, check_linear_scan_inputs, linear_scan_ref
from kernels.linear_scan.torch_chunk import linear_scan_chunk


def has_triton_backend() -> bool:
    return importlib.util.find_spec("kernels.linear_scan.chunk") is not None


#: what the Triton backend covers (``kernels.contract``): every width, packed sequences, states
CONTRACT = OpContract("kernels.linear_scan", lambda: None if has_triton_backend() else "kernels/linear_scan has no Triton kernel")


def linear_scan(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                output_final_state: bool = False, backend: str = "torch", chunk_size: int = 64,
                cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """h [B, T, D] (b's dtype) and, if ``output_final_state``, h_{T−1} [B, D] in the accumulation
    dtype (float32 for half inputs). ``backend``: "torch" (chunked PyTorch), "reference"
    (sequential), "triton". ``cu_seqlens`` (int32 [N+1], B = 1): N packed sequences, the state
    restarting at each (from ``initial_state`` [N, D] or 0); the final state is then [N, D]."""
    check_linear_scan_inputs("linear_scan", log_a, b, initial_state, chunk_size, cu_seqlens)
    if backend == "torch":
        if cu_seqlens is not None:
            # one chunked scan per sequence (reads the offsets on the host)
            bounds = cu_seqlens.tolist()
            parts = [linear_scan_chunk(log_a[:, s0:s1], b[:, s0:s1],
                                       None if initial_state is None else initial_state[n:n + 1], True, chunk_size)
                     for n, (s0, s1) in enumerate(zip(bounds[:-1], bounds[1:]))]
            h = torch.cat([p[0] for p in parts], 1) if parts else b
            return h, (torch.cat([p[1] for p in parts], 0) if output_final_state else None)
        return linear_scan_chunk(log_a, b, initial_state, output_final_state, chunk_size)
    if backend == "reference":
        return linear_scan_ref(log_a, b, initial_state, output_final_state, cu_seqlens)
    if backend == "triton":
        if not has_triton_backend():
            raise RuntimeError("linear_scan: backend='triton' needs kernels/linear_scan/chunk.py, which is absent")
        from kernels.linear_scan.chunk import linear_scan_triton
        return linear_scan_triton(log_a, b, initial_state, output_final_state, chunk_size, cu_seqlens=cu_seqlens)
    raise ValueError(f"linear_scan: backend must be torch, reference or triton, got {backend!r}")


def linear_scan_reset(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor],
                      reset: torch.Tensor, output_final_state: bool, backend: str, chunk_size: int,
                      inner_resets: bool = True):
    """``linear_scan`` with h_t = b_t where ``reset`` [B, T] (bool) is set: a reset at a row's
    first token drops ``initial_state``. backend "torch": a_t = 0 at each reset inside the one
    scan; the others split the rows at resets inside them into packed sequences (``cu_seqlens``,
    one sequence per document piece; their offsets are read on the host). ``inner_resets=False``:
    the caller knows that ``reset`` is set at most at a row's first token (no documents), so the
    host read is skipped (on a GPU it would wait for every kernel before it). Returns (h, the
    final state or None)."""
    B, T, D = b.shape
    if backend == "torch":
        # the PyTorch form resets inside its one scan (a_t = 0 at a reset): no host read, one call
        return linear_scan_chunk(log_a, b, initial_state, output_final_state, chunk_size, resets=reset)
    h0 = initial_state
    if h0 is not None and T > 0:
        h0 = torch.where(reset[:, 0, None], torch.zeros_like(h0), h0)   # a reset drops the carried state
    if not inner_resets:
        return linear_scan(log_a, b, h0, output_final_state, backend=backend, chunk_size=chunk_size)
    inner = reset[:, 1:].nonzero()
    if inner.numel() == 0:
        return linear_scan(log_a, b, h0, output_final_state, backend=backend, chunk_size=chunk_size)
    starts = sorted(set(range(0, B * T, T)) | set((inner[:, 0] * T + inner[:, 1] + 1).tolist()))
    cu = torch.tensor(starts + [B * T], dtype=torch.int32, device=b.device)
    row_first = torch.tensor([s % T == 0 for s in starts], device=b.device)
    init = torch.zeros(len(starts), D, dtype=acc_dtype(b.dtype), device=b.device)
    if h0 is not None:
        init = init.index_put((row_first.nonzero()[:, 0],), h0.to(init.dtype))
    h, fin = linear_scan(log_a.reshape(1, B * T, D), b.reshape(1, B * T, D), init, output_final_state,
                         backend=backend, chunk_size=chunk_size, cu_seqlens=cu)
    if output_final_state:
        last = torch.tensor([i for i, s in enumerate(starts) if i + 1 == len(starts) or starts[i + 1] % T == 0],
                            device=b.device)
        fin = fin[last]
    return h.reshape(B, T, D), fin


__all__ = ["CONTRACT", "linear_scan", "linear_scan_reset", "linear_scan_ref", "linear_scan_chunk", "has_triton_backend"]
