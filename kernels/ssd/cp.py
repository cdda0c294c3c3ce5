r"""``ssd`` over a sequence split across ranks, by chunk summaries (``kernels/cp.py``): Mamba-2's
S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ has a scalar transition per head, so a slice's summary is
exp(A Σ_t Δ_t) and its final state from zero, combined as the diagonal scans are
(``diag_initial_state``, the transition broadcast over the state [p, n]); a second run of the op
from the combined state gives the outputs."""
from __future__ import annotations

import torch

from kernels.cp import Gather, diag_initial_state, route_rows, rows_final
from kernels.ssd.reference import discretize


def summary_combine(run, inp, gather: Gather, rank: int, backend, docs=None) -> torch.Tensor:
    """The op's outputs over this rank's slice (``run(inp, S0, output_final_state, backend)``: the
    caller's op call; ``inp``: ``ssd``'s arguments). With packed documents the op runs on the
    slice's own pieces (``inp["cu_seqlens"]``, states per piece): the carried state is routed to
    each row's first piece and each row's final state taken from its last (``route_rows``,
    ``rows_final``); a row with a start in the slice has transition 0 (log −∞), so the state of
    earlier ranks stops at its first start."""
    _, fin = run(inp, None, True, backend)
    S_loc = fin if docs is None else rows_final(docs, fin)
    delta = discretize(inp["dt"], inp.get("dt_bias"), inp.get("dt_softplus", False), S_loc.dtype)
    log_A = delta.sum(1) * inp["A"].to(S_loc.dtype)                   # [B, h]
    if docs is not None:
        log_A = log_A.masked_fill(docs.starts.any(1)[:, None], float("-inf"))
    S_in = diag_initial_state(log_A[..., None, None].expand_as(S_loc), S_loc, gather, rank)
    y, _ = run(inp, S_in if docs is None else route_rows(docs, S_in), False, backend)
    return y


__all__ = ["summary_combine"]
