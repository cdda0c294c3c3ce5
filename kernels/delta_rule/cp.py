r"""``delta_rule`` over a sequence split across ranks, by chunk summaries (``kernels/cp.py``); the
gated delta rule's and KDA's combines (their ``cp.py``) are this one with their decay.

The delta rule S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ is affine in S: S_out = P_r S_in +
S^loc(r) with P_r = Π_t (I − β_t k_t k_tᵀ) ∈ R^{d_k×d_k} per head. One run of the op on the
values [v, 0] from the initial state [0, I] yields [S^loc(r), P_r]; the exclusive scan
S_in(r) = P_{r−1} S_in(r−1) + S^loc(r−1) runs over the gathered summaries
(``affine_summary_scan``); a second run from S_in(r) gives the outputs.

Documents: the op runs with resets at ``docs.starts`` (the state set to zero before a start's
update), which keeps the combination affine: the run of [v, 0] from [0, I] with the same resets
zeroes the I block too, so a row with a start in the slice ends in [S^loc, 0]: P_r = 0, the state
from earlier ranks does not reach the slice's end, and the exclusive scan is unchanged; the second
run from S_in(r) lets S_in reach only the tokens before the row's first start.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from kernels import delta_rule as _dr
from kernels import gated_delta_rule as _gdr
from kernels.cp import Gather, acc, affine_summary_scan, docs_backend, flat_heads, route_rows, rows_final, unflat_heads
from kernels.delta_rule.torch_chunk import delta_rule_chunk_torch
from kernels.gated_delta_rule.torch_chunk import gated_delta_rule_chunk_torch


def delta_rule_docs(q, k, v, beta, S0, docs, backend: str = "torch", chunk_size: int = 64,
                    g: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The delta rule (the gated one when ``g`` is given) over a slice of packed rows (q, k
    [B, H, T_r, d_k], v [B, H, T_r, d_v], β (g) [B, H, T_r]) from the per-row states S0
    [B, H, d_k, d_v], S = 0 before the update at each ``docs.starts``. Returns (o, each row's
    state after the slice). "torch" (``docs_backend``): the PyTorch chunked form with
    ``resets``; "triton": the kernel's ``cu_seqlens`` path over the batch flattened to one row,
    S0 routed to each row's first piece, each row's final state its last piece's
    (``route_rows``, ``rows_final``)."""
    backend = docs_backend("gated delta rule" if g is not None else "delta rule", backend)
    if backend == "torch":
        if g is None:
            return delta_rule_chunk_torch(q, k, v, beta, S0, True, chunk_size, docs.starts)
        return gated_delta_rule_chunk_torch(q, k, v, g, beta, S0, True, chunk_size, docs.starts)
    flat = flat_heads(q, k, v, beta) if g is None else flat_heads(q, k, v, g, beta)
    op = _dr.delta_rule_triton if g is None else _gdr.gated_delta_rule_triton
    if op is None:
        raise ValueError("context parallel: backend triton for the delta rules needs triton installed")
    o, fin = op(*flat, route_rows(docs, S0), True, chunk_size, docs.cu_seqlens)
    return unflat_heads(o, q.shape[0]), rows_final(docs, fin)


def summary_runs(run: Callable, k: torch.Tensor, v: torch.Tensor, gather: Gather, rank: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The family's combine: ``run(values, S0)`` → (o, final state) is the op on this rank's slice
    (its q, k, β and decay fixed); [v, 0] from [0, I] gives [S^loc, P] with P = Π (α) (I − β k kᵀ),
    the exclusive scan over ranks S_in, and the run of v from S_in the outputs."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    sd = acc(v[:0]).dtype
    v_ext = torch.cat([v, v.new_zeros(B, H, T, dk)], -1)
    eye = torch.eye(dk, dtype=sd, device=v.device).expand(B, H, dk, dk)
    init = torch.cat([torch.zeros(B, H, dk, dv, dtype=sd, device=v.device), eye], -1)
    _, fin = run(v_ext, init)
    return run(v, affine_summary_scan(fin, dv, gather, rank))


def cp_delta_rule(q, k, v, beta, gather: Gather, rank: int, backend: str = "torch", chunk_size: int = 64,
                  docs=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule`` over a sequence split along T across the ranks (q, k [B, H, T_r, d_k], v
    [B, H, T_r, d_v], β [B, H, T_r]; the sequence starts from S = 0). Returns (o [B, H, T_r, d_v],
    the state after this rank's slice [B, H, d_k, d_v]). ``docs``: S = 0 before the update at
    each ``docs.starts`` (``delta_rule_docs``)."""
    if docs is not None:
        run = lambda vv, S0: delta_rule_docs(q, k, vv, beta, S0, docs, backend, chunk_size)
    else:
        run = lambda vv, S0: _dr.delta_rule(q, k, vv, beta, S0, True, backend=backend, chunk_size=chunk_size)
    return summary_runs(run, k, v, gather, rank)


def summary_combine(run, inp, gather: Gather, rank: int, backend, docs=None) -> torch.Tensor:
    """The op's outputs over this rank's slice (``inp``: the caller's op inputs q, k, v, β and
    ``chunk_size``)."""
    y, _ = cp_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], gather, rank, backend, inp["chunk_size"], docs)
    return y


__all__ = ["delta_rule_docs", "summary_runs", "cp_delta_rule", "summary_combine"]
