"""``linear_scan`` with resets: h_t = b_t where ``reset`` is set (a_t replaced by 0), the rule of
Griffin's document boundaries (a new document drops the carried state)."""
from __future__ import annotations

from typing import Optional

import torch

from kernels.linear_scan.reference import acc_dtype


def linear_scan_reset(log_a: torch.Tensor, b: torch.Tensor, initial_state: Optional[torch.Tensor],
                      reset: torch.Tensor, output_final_state: bool, backend: str, chunk_size: int):
    """``kernels.linear_scan.linear_scan`` with h_t = b_t where ``reset`` [B, T] (bool) is set: a
    reset at a row's first token drops ``initial_state``. backend "torch": a_t = 0 at each reset
    inside the one scan; the others split the rows at resets inside them into packed sequences
    (``cu_seqlens``, one sequence per document piece; their offsets are read on the host).
    Returns (h, the final state or None)."""
    from kernels.linear_scan import linear_scan
    B, T, D = b.shape
    if backend == "torch":
        # the PyTorch form resets inside its one scan (a_t = 0 at a reset): no host read, one call
        from kernels.linear_scan.torch_chunk import linear_scan_chunk
        return linear_scan_chunk(log_a, b, initial_state, output_final_state, chunk_size, resets=reset)
    h0 = initial_state
    if h0 is not None and T > 0:
        h0 = torch.where(reset[:, 0, None], torch.zeros_like(h0), h0)   # a reset drops the carried state
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


__all__ = ["linear_scan_reset"]
