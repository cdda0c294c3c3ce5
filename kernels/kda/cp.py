r"""``kda`` over a sequence split across ranks: S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} +
β_t k_t v_tᵀ (a decay per key channel) is affine in S with P_r = Π_t (I − β_t k_t k_tᵀ) Diag(α_t),
still a [d_k, d_k] matrix: the delta rule's summaries (``kernels/delta_rule/cp.py``), the same runs
of [v, 0] from [0, I] and the same exclusive scan."""
from __future__ import annotations

from typing import Tuple

import torch

from kernels import kda as _kda
from kernels.cp import Gather, docs_backend, flat_heads, route_rows, rows_final, unflat_heads
from kernels.delta_rule.cp import summary_runs
from kernels.kda.reference import kda_reference
from kernels.kda.torch_chunk import kda_chunk_torch


def kda_docs(q, k, v, g, beta, S0, docs, backend: str = "torch", chunk_size: int = 64
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA (g [B, H, T_r, d_k] the per-channel log decays) over a slice of packed rows from the
    per-row states S0, as ``delta_rule_docs``: "torch", the PyTorch chunked form with ``resets``;
    "triton", the public entry's ``cu_seqlens`` path over the slice's pieces (``route_rows``,
    ``rows_final``)."""
    if docs_backend("KDA", backend) == "torch":
        return kda_chunk_torch(q, k, v, g, beta, S0, True, chunk_size, docs.starts)
    o, fin = _kda.kda(*flat_heads(q, k, v, g, beta), route_rows(docs, S0), True, backend="triton",
                      chunk_size=chunk_size, cu_seqlens=docs.cu_seqlens)
    return unflat_heads(o, q.shape[0]), rows_final(docs, fin)


def _kda_run(q, k, v, g, beta, S0, backend, chunk_size):
    """KDA from S0 with its final state: the reference and PyTorch forms directly (the caller's
    gates hold their ranges by construction), another backend through the public entry."""
    if backend == "reference":
        return kda_reference(q, k, v, g, beta, S0, True)
    if backend == "torch":
        return kda_chunk_torch(q, k, v, g, beta, S0, True, chunk_size)
    return _kda.kda(q, k, v, g, beta, S0, True, backend=str(backend), chunk_size=chunk_size)


def cp_kda(q, k, v, g, beta, gather: Gather, rank: int, backend: str = "torch", chunk_size: int = 64,
           docs=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kda`` over a sequence split along T across the ranks (q, k, g [B, H, T_r, d_k], v
    [B, H, T_r, d_v], β [B, H, T_r]; the sequence starts from S = 0). Returns (o [B, H, T_r, d_v],
    the state after this rank's slice [B, H, d_k, d_v]). ``docs``: as the delta rule's
    (``kda_docs``)."""
    if docs is not None:
        run = lambda vv, S0: kda_docs(q, k, vv, g, beta, S0, docs, backend, chunk_size)
    else:
        run = lambda vv, S0: _kda_run(q, k, vv, g, beta, S0, backend, chunk_size)
    return summary_runs(run, k, v, gather, rank)


def summary_combine(run, inp, gather: Gather, rank: int, backend, docs=None) -> torch.Tensor:
    """The op's outputs over this rank's slice (``inp``: q, k, v, g, β and ``chunk_size``)."""
    y, _ = cp_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], gather, rank, backend, inp["chunk_size"], docs)
    return y


__all__ = ["kda_docs", "cp_kda", "summary_combine"]
