r"""``selective_scan`` over a sequence split across ranks, by chunk summaries (``kernels/cp.py``):
h_t = exp(Δ_t A) ⊙ h_{t−1} + (Δ_t x_t) B_t is diagonal in h, so a slice's summary is its
transition A_r = exp(Σ_t Δ_t A) and its final state from zero, combined as the diagonal scans
are (``diag_initial_state``); a second run of the op from the combined state gives the outputs."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kernels.cp import Gather, acc, diag_initial_state, docs_backend, route_rows, rows_final
from kernels.selective_scan import selective_scan
from kernels.selective_scan.torch_chunk import selective_scan_chunk


def selective_scan_docs(inp: dict, h0: Optional[torch.Tensor], docs, backend: str = "torch"
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The selective scan (``inp``: ``kernels.selective_scan``'s arguments, [B, T_r, ·]) over a
    slice of packed rows from the per-row states h0 [B, d_inner, N] (None: zero), Ā_t = 0 at each
    ``docs.starts``. Returns (y, each row's state after the slice). "torch": the PyTorch chunked
    form with ``resets``; "triton": the kernel's ``cu_seqlens`` path over the batch flattened to
    one row, h0 routed to each row's first piece (``route_rows``, ``rows_final``)."""
    backend = docs_backend("selective scan", backend)
    args = {n: t for n, t in inp.items() if n not in ("resets", "cu_seqlens")}
    if backend == "torch":
        return selective_scan_chunk(**args, initial_state=h0, output_final_state=True, resets=docs.starts)
    B, T = docs.starts.shape
    for n in ("x", "delta", "B", "C", "z"):
        if args.get(n) is not None:
            args[n] = args[n].reshape(1, B * T, args[n].shape[-1])
    y, fin = selective_scan(**args, initial_state=route_rows(docs, h0), output_final_state=True,
                            backend="triton", cu_seqlens=docs.cu_seqlens)
    return y.view(B, T, y.shape[-1]), rows_final(docs, fin)


def summary_combine(run, inp, gather: Gather, rank: int, backend, docs=None) -> torch.Tensor:
    """The op's outputs over this rank's slice (``run(inp, h0, output_final_state, backend)``: the
    caller's op call; ``inp``: ``selective_scan``'s arguments). With packed documents (``docs``:
    Ā_t = 0 at each start, ``selective_scan_docs``) a row with a start in the slice has A_r = 0
    (log A_r = −∞), so the state of earlier ranks stops there, and the second run lets h_in reach
    only the tokens before the row's first start."""
    if docs is not None:
        _, h_loc = selective_scan_docs(inp, None, docs, backend)
    else:
        _, h_loc = run(inp, None, True, backend)
    Delta = acc(inp["delta"])
    if inp.get("delta_bias") is not None:
        Delta = Delta + acc(inp["delta_bias"])
    if inp.get("delta_softplus"):
        Delta = F.softplus(Delta)
    log_A = Delta.sum(1)[..., None] * inp["A"]                        # [B, d_inner, N]
    if docs is not None:
        log_A = log_A.masked_fill(docs.starts.any(1)[:, None, None], float("-inf"))
        y, _ = selective_scan_docs(inp, diag_initial_state(log_A, h_loc, gather, rank), docs, backend)
        return y
    h_in = diag_initial_state(log_A, h_loc, gather, rank)
    y, _ = run(inp, h_in, False, backend)
    return y


__all__ = ["selective_scan_docs", "summary_combine"]
