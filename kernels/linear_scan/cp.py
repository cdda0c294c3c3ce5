r"""``linear_scan`` over a sequence split across ranks, by chunk summaries (``kernels/cp.py``).

h_t = a_t ⊙ h_{t−1} + b_t is affine in its initial state. Rank r scans its slice from h = 0,
giving h^loc_t, and summarizes the slice by its total transition A_r = Π_t a_t (exp of Σ log a_t)
and its local final state h^loc(r). After an all-gather of the summaries,

    h_in(r) = Σ_{s<r} (Π_{s<q<r} A_q) h^loc(s)          (exclusive scan over ranks)
    h_t     = h^loc_t + (Π_{τ≤t} a_τ) ⊙ h_in(r)

Resets (h_t = b_t where set, a_t replaced by 0) make A_r = 0 (log −∞) on a row with one in the
slice, so the state of earlier ranks reaches only the tokens before it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.cp import Gather, acc, diag_initial_state
from kernels.linear_scan import linear_scan, linear_scan_reset


def cp_linear_scan(log_a: torch.Tensor, b: torch.Tensor, gather: Gather, rank: int, backend: str = "torch",
                   chunk_size: int = 64, reset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``linear_scan`` over a sequence split across the ranks (each passes its slice [B, T_r, D],
    T_r ≥ 1, the whole sequence starting from h = 0). ``reset`` [B, T_r] (bool): h_t = b_t there.
    Returns (h [B, T_r, D] in b's dtype, the state after this rank's slice [B, D])."""
    if reset is None:
        h_loc, _ = linear_scan(log_a, b, None, False, backend=backend, chunk_size=chunk_size)
    else:
        h_loc, _ = linear_scan_reset(log_a, b, None, reset, False, backend, chunk_size)
        log_a = acc(log_a).masked_fill(reset[..., None], float("-inf"))
    cum = acc(log_a).cumsum(1)                                        # log Π_{τ≤t} a_τ
    h_in = diag_initial_state(cum[:, -1], acc(h_loc[:, -1]), gather, rank)
    h = acc(h_loc) + cum.exp() * h_in[:, None]
    return h.to(b.dtype), h[:, -1]


def summary_combine(run, inp, gather: Gather, rank: int, backend, docs=None) -> torch.Tensor:
    """The op's outputs over this rank's slice (``inp``: the caller's op inputs ``log_a``, ``b``,
    ``chunk_size`` and ``reset``). A caller's documents are its resets (the RG-LRU's from segment
    positions, ``inp["reset"]``), which ``docs`` does not change."""
    reset = inp.get("reset")
    h, _ = cp_linear_scan(inp["log_a"], inp["b"], gather, rank, backend, inp["chunk_size"],
                          reset if reset is not None and bool(reset.any()) else None)
    return h


__all__ = ["cp_linear_scan", "summary_combine"]
