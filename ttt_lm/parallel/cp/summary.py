r"""The linear recurrences by chunk summaries: each rank summarizes its slice, the summaries are
all-gathered and combined by an exclusive scan over ranks, and a second run of the op from the
combined initial state gives the outputs (``cp_summary``). Each op's combine lives beside its
kernels, ``kernels/<op>/cp.py`` (``summary_combine``, found through the mixer's ``op_name``:
``kernels.cp.summary_combine``), and knows no process group: this module hands it the group's
differentiable all-gather and the rank. The functions below are the ops' combines over a group.

* **Linear recurrences by chunk summaries.** A diagonal recurrence h_t = a_t ⊙ h_{t−1} + b_t
  (``kernels.linear_scan``, ``kernels.selective_scan``) is affine in its initial state. Rank r scans its slice from
  h = 0, giving h^loc_t, and summarizes the slice by its total transition A_r = Π_t a_t
  (exp of Σ log a_t) and its local final state h^loc(r). After an all-gather of the summaries,

      h_in(r) = Σ_{s<r} (Π_{s<q<r} A_q) h^loc(s)          (exclusive scan over ranks)
      h_t     = h^loc_t + (Π_{τ≤t} a_τ) ⊙ h_in(r)

  The delta rule S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ is affine in S too:
  S_out = P_r S_in + S^loc(r) with P_r = Π_t (I − β_t k_t k_tᵀ) ∈ R^{d_k×d_k} per head. One run
  of the op on the values [v, 0] from the initial state [0, I] yields [S^loc(r), P_r]; the
  exclusive scan S_in(r) = P_{r−1} S_in(r−1) + S^loc(r−1) runs over the gathered summaries; a
  second run from S_in(r) gives the outputs. The gated delta rule
  S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ combines the same way, with
  P_r = Π_t α_t (I − β_t k_t k_tᵀ), and KDA S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ
  (a decay per key channel) with P_r = Π_t (I − β_t k_t k_tᵀ) Diag(α_t), still a [d_k, d_k] matrix:
  the same runs of [v, 0] from [0, I] and the same exclusive scan (``cp_kda``).

  Mamba-2's SSD S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ has a scalar transition per head,
  A_r = exp(A Σ_t Δ_t), and combines as the diagonal scans do (``kernels/ssd/cp.py``).

* Summaries with documents. The convolutions mask their taps by the global offset, the halo
  included: y_t = b + Σ_{j<w, j ≤ offset_t} W_j ⊙ x_{t−j}, x_{t−j} from the halo for t < j
  (``doc_conv`` with the cache), so an earlier document's inputs in the halo are dropped. The ops
  run with resets at ``starts`` (the state set to zero before a start's update), which keeps the
  combination affine: on a row with a start in slice r the state entering the slice does not reach
  its end, so its transition is zero — P_r = 0 for the delta rules (the run of [v, 0] from
  [0, I] with the same resets ends in [S^loc(r), 0]), A_r = 0 (log A_r = −∞) for the diagonal
  scans — while S^loc(r) / h^loc(r) is the state of the row's last piece from its start. The
  exclusive scan over ranks is unchanged, and the second run from S_in(r) (or h_t = h^loc_t +
  (Π_{τ≤t} a_τ) h_in(r), Π = 0 from the first start on) lets the carried state reach exactly the
  tokens before the row's first local start. The RG-LRU reads the documents from its segment
  positions (resets where the position is 0, its conv masked by them) as the one-process run does.
  The ops with documents run in their PyTorch chunked forms with ``resets`` (``impl="reference"``
  too: the sequential reference ops take no resets) or on the Triton kernels' ``cu_seqlens`` path
  over the slice's own pieces, each row's carried state routed to its first piece and its final
  state taken from its last piece (``delta_rule_docs``, ``selective_scan_docs``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from kernels.cp import docs_backend as _docs_backend
from kernels.cp import summary_combine
from kernels.delta_rule import cp as _dr_cp
from kernels.delta_rule.cp import delta_rule_docs
from kernels.gated_delta_rule import cp as _gdr_cp
from kernels.kda import cp as _kda_cp
from kernels.kda.cp import kda_docs
from kernels.linear_scan import cp as _ls_cp
from kernels.selective_scan.cp import selective_scan_docs
from ttt_lm.parallel.cp.comm import _context_state, _rank_world, all_gather
from ttt_lm.parallel.cp.docs import SliceDocs, _check_docs


def _ranks(group):
    """(the group's differentiable all-gather, this rank) as the ops' combines take them."""
    return (lambda t: all_gather(t, group)), _rank_world(group)[0]


def cp_linear_scan(log_a: torch.Tensor, b: torch.Tensor, group=None, backend: str = "torch",
                   chunk_size: int = 64, reset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.linear_scan.linear_scan`` over a sequence split across the group (each rank
    passes its slice [B, T_r, D], T_r ≥ 1, the whole sequence starting from h = 0). ``reset``
    [B, T_r] (bool): h_t = b_t there (a_t replaced by 0), which cuts the reach of every earlier
    state. Returns (h [B, T_r, D] in b's dtype, the state after this rank's slice [B, D])."""
    return _ls_cp.cp_linear_scan(log_a, b, *_ranks(group), backend, chunk_size, reset)


def cp_delta_rule(q, k, v, beta, group=None, backend: str = "torch", chunk_size: int = 64,
                  docs: Optional[SliceDocs] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.delta_rule`` over a sequence split along T across the group (q, k
    [B, H, T_r, d_k], v [B, H, T_r, d_v], β [B, H, T_r]; the sequence starts from S = 0).
    Returns (o [B, H, T_r, d_v], the state after this rank's slice [B, H, d_k, d_v]).

    ``docs`` (``SliceDocs``, packed documents): S = 0 before the update at each ``docs.starts``
    (``delta_rule_docs``); the combine with documents is ``kernels/delta_rule/cp.py``'s."""
    return _dr_cp.cp_delta_rule(q, k, v, beta, *_ranks(group), backend, chunk_size, docs)


def cp_gated_delta_rule(q, k, v, g, beta, group=None, backend: str = "torch", chunk_size: int = 64,
                        docs: Optional[SliceDocs] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.gated_delta_rule.gated_delta_rule`` over a sequence split along T across the
    group (q, k [B, H, T_r, d_k], v [B, H, T_r, d_v], g, β [B, H, T_r]; the sequence starts from
    S = 0), by ``cp_delta_rule``'s summaries with P_r = Π α_t (I − β_t k_t k_tᵀ).
    Returns (o [B, H, T_r, d_v], the state after this rank's slice [B, H, d_k, d_v]).
    ``docs``: as ``cp_delta_rule``'s (P_r = 0 on a row with a start in the slice)."""
    return _gdr_cp.cp_gated_delta_rule(q, k, v, g, beta, *_ranks(group), backend, chunk_size, docs)


def cp_kda(q, k, v, g, beta, group=None, backend: str = "torch", chunk_size: int = 64,
           docs: Optional[SliceDocs] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.kda.kda`` over a sequence split along T across the group (q, k, g [B, H, T_r, d_k],
    v [B, H, T_r, d_v], β [B, H, T_r]; the sequence starts from S = 0), by ``cp_delta_rule``'s
    summaries with P_r = Π_t (I − β_t k_t k_tᵀ) Diag(α_t). Returns (o [B, H, T_r, d_v], the state
    after this rank's slice [B, H, d_k, d_v]). ``docs``: as ``cp_delta_rule``'s (``kda_docs``)."""
    return _kda_cp.cp_kda(q, k, v, g, beta, *_ranks(group), backend, chunk_size, docs)


def op_combine(mixer):
    """The summary combine of the mixer's op (``kernels/<op_name>/cp.py``); a ValueError naming
    the op where its folder has none."""
    combine = summary_combine(mixer.op_name) if isinstance(mixer.op_name, str) else None
    if combine is None:
        raise ValueError(f"context parallel: {type(mixer).__name__}.op_name={mixer.op_name!r} has no summary "
                         f"combine (kernels/<op>/cp.py with summary_combine)")
    return combine


def cp_summary(mixer, x, lengths, group=None, docs: Optional[SliceDocs] = None, **kw) -> torch.Tensor:
    """A mixer with ``cp_form="summary"``: its inputs stage (conv halo from earlier ranks), its
    op by chunk summaries combined across ranks (``kernels/<op_name>/cp.py``'s
    ``summary_combine``), its output stage. ``kw``: ``segment_pos`` for mixers that read it.

    ``docs`` (``SliceDocs``, packed documents): ``inputs(x, state, docs=docs)`` with the halo
    state, so the convolutions mask their taps by the global ``offset`` (the halo's inputs of an
    earlier document dropped, ``doc_conv``'s cache), and the op gets ``resets`` = ``docs.starts``
    (a start on rank r > 0's first token only where its position is 0); the summary combines
    handle the resets (``cp_delta_rule``, the selective scan's combine; the RG-LRU's resets come
    from its segment positions, ``cp_linear_scan``). Backends with documents: the PyTorch chunked
    forms (also for ``impl="reference"``: the sequential reference ops take no resets) and the
    Triton kernels' ``cu_seqlens`` paths, each row's carried state routed to its first piece
    (``delta_rule_docs``, ``selective_scan_docs``)."""
    combine = op_combine(mixer)
    if docs is not None:
        _check_docs(docs, x)
        kw = {**kw, "docs": docs}
    inp, _ = mixer.inputs(x, _context_state(mixer, x, lengths, group), False, **kw)
    y = combine(mixer.op, inp, *_ranks(group), mixer.op_backend(x), docs)
    return mixer.output(y, x)


__all__ = ["cp_linear_scan", "cp_delta_rule", "cp_gated_delta_rule", "cp_kda", "delta_rule_docs", "kda_docs",
           "selective_scan_docs", "op_combine", "cp_summary"]
