r"""Context parallelism by chunk summaries, the part every op's combine shares; each op's own
combine is ``kernels/<op>/cp.py`` (``summary_combine``), beside its kernels.

A linear recurrence is affine in its initial state, so a sequence split across ranks runs as: each
rank summarizes its slice (its transition and its final state from zero), the summaries are
gathered, an exclusive scan over ranks gives each rank's initial state, and a second run of the
op from it gives the outputs (the math of each op in its ``cp.py``). The ops know no process
group: a combine takes

* ``gather``: a differentiable all-gather over the ranks, t → [world, *t.shape] (the caller's:
  ``ttt_lm.parallel.cp.comm.all_gather`` over the context-parallel group), and ``rank``;
* ``docs``: packed documents of the slice, or None: an object with ``starts`` [B, T_r] bool (a
  document starts there: the state is zero before its update), ``cu_seqlens`` (the slice's own
  pieces, the batch flattened to one row), ``continues`` [B] bool (the row's first token
  continues a document of an earlier rank) and ``local.doc_index`` [B, ...] / ``local.n_docs``
  (each row's pieces in ``cu_seqlens``' order) — ``ttt_lm.parallel.cp.docs.SliceDocs``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

#: a differentiable all-gather over the ranks: t → [world, *t.shape]
Gather = Callable[[torch.Tensor], torch.Tensor]


def acc(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype: float32 for half types, else unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def diag_initial_state(log_A: torch.Tensor, h_loc: torch.Tensor, gather: Gather, rank: int) -> torch.Tensor:
    """h_in(r) = Σ_{s<r} exp(Σ_{s<q<r} log A_q) ⊙ h^loc(s) from this rank's log A_r and h^loc(r)
    (any equal shapes): the exclusive scan of a diagonal recurrence."""
    g = gather(torch.stack([log_A, h_loc], 0))                       # [world, 2, …]
    L, H = g[:rank, 0], g[:rank, 1]
    # Σ_{s<q<r} log A_q = C_{s+1} with C_s = Σ_{s≤q<r} log A_q (C_r = 0), a sum without a
    # difference, so a slice with a reset (log A = −∞) cuts off everything before it; on rank 0
    # an empty sum that keeps the gather in the graph
    C = L.flip(0).cumsum(0).flip(0)
    between = torch.cat([C[1:], torch.zeros_like(L[:1])], 0) if rank > 0 else L
    return (between.exp() * H).sum(0)


def affine_summary_scan(fin: torch.Tensor, dv: int, gather: Gather, rank: int) -> torch.Tensor:
    """S_in(r) from every rank's [S^loc, P] (``fin`` [B, H, d_k, d_v + d_k]; the exclusive scan
    S_in(r) = P_{r−1} S_in(r−1) + S^loc(r−1), S_in(0) = 0): the delta rules' combine."""
    g = gather(fin)                                                   # [world, B, H, dk, dv + dk]
    S_in = g[:0, ..., :dv].sum(0)   # zeros, connected to the gather (an empty sum on rank 0)
    for s in range(rank):
        S_in = g[s, ..., dv:] @ S_in + g[s, ..., :dv]
    return S_in


def docs_backend(name: str, backend) -> str:
    """The backend that runs an op over a slice with document starts from per-row carried states:
    "torch", the PyTorch chunked form with ``resets`` (which takes an initial and gives a final
    state; the sequential reference ops have no resets, so ``impl="reference"`` runs it too), or
    "triton", the kernel's ``cu_seqlens`` path over the slice's own pieces (``route_rows``)."""
    if backend in ("torch", "reference"):
        return "torch"
    if backend == "triton":
        return "triton"
    raise ValueError(f"context parallel: packed documents with the {name} op run on backend torch or triton, "
                     f"not {str(backend)!r}")


def route_rows(docs, S0: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Per-row initial states S0 [B, ...] → the initial states [N, ...] of the slice's own pieces
    (``docs.local``, N pieces over the slice flattened to one row, the order of ``docs.cu_seqlens``):
    a row's first piece starts from its row's state where the row continues a document of an
    earlier rank (``docs.continues``; a start on the row's first token drops it, as a reset does),
    every other piece from zero. Differentiable in S0."""
    if S0 is None:
        return None
    keep = docs.continues.to(S0.dtype).view(-1, *[1] * (S0.dim() - 1))
    first = docs.local.doc_index[:, 0]
    return S0.new_zeros(docs.local.n_docs, *S0.shape[1:]).index_copy(0, first, S0 * keep)


def rows_final(docs, fin: torch.Tensor) -> torch.Tensor:
    """The final states [N, ...] of the slice's pieces → each row's [B, ...]: its last piece's."""
    return fin.index_select(0, docs.local.doc_index[:, -1])


def flat_heads(*ts: torch.Tensor):
    """[B, H, T, ...] tensors → [1, H, B·T, ...]: the rows back to back in one row (row-major, the
    order of ``docs.cu_seqlens``), the layout of the ops' ``cu_seqlens`` path."""
    return tuple(t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:]) for t in ts)


def unflat_heads(t: torch.Tensor, B: int) -> torch.Tensor:
    """[1, H, B·T, ...] → [B, H, T, ...], the inverse of ``flat_heads``."""
    H, BT = t.shape[1], t.shape[2]
    return t[0].reshape(H, B, BT // B, *t.shape[3:]).transpose(0, 1)


def summary_combine(op: str):
    """The summary combine of ``kernels.<op>`` (its ``cp.py``'s ``summary_combine``), or None where
    the op has none."""
    import importlib
    import importlib.util
    if not op.isidentifier() or importlib.util.find_spec(f"kernels.{op}") is None \
            or importlib.util.find_spec(f"kernels.{op}.cp") is None:
        return None
    return getattr(importlib.import_module(f"kernels.{op}.cp"), "summary_combine", None)


def summary_ops():
    """The ops under kernels/ with a summary combine (a ``cp.py`` in their folder), sorted."""
    import pkgutil
    from pathlib import Path
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.ispkg and (here / m.name / "cp.py").exists())


__all__ = ["Gather", "diag_initial_state", "affine_summary_scan", "docs_backend", "route_rows", "rows_final",
           "flat_heads", "unflat_heads", "summary_combine", "summary_ops"]
