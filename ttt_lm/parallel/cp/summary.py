r"""The linear recurrences by chunk summaries: each rank summarizes its slice, the summaries are
all-gathered and combined by an exclusive scan over ranks, and a second run of the op from the
combined initial state gives the outputs (``cp_summary``, ``SUMMARY_COMBINES``).

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
  A_r = exp(A Σ_t Δ_t), and combines as the diagonal scans do (``_summary_ssd``).

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
import torch.nn.functional as F

from kernels import delta_rule as _dr
from kernels import gated_delta_rule as _gdr
from kernels import kda as _kda
from kernels.delta_rule.torch_chunk import delta_rule_chunk_torch
from kernels.gated_delta_rule.torch_chunk import gated_delta_rule_chunk_torch
from kernels.kda.reference import kda_reference
from kernels.kda.torch_chunk import kda_chunk_torch
from kernels.linear_scan import linear_scan, linear_scan_reset
from kernels.selective_scan import selective_scan
from kernels.selective_scan.torch_chunk import selective_scan_chunk
from ttt_lm.model.docs import unflatten_heads, varlen_heads
from ttt_lm.model.layers import acc
from ttt_lm.parallel.cp.comm import _context_state, _rank_world, all_gather
from ttt_lm.parallel.cp.docs import SliceDocs, _check_docs

# ---------------------------------------------------------------------------------------------
# linear recurrences: summaries and their exclusive scan over ranks
# ---------------------------------------------------------------------------------------------


def _diag_initial_state(log_A: torch.Tensor, h_loc: torch.Tensor, group) -> torch.Tensor:
    """h_in(r) = Σ_{s<r} exp(Σ_{s<q<r} log A_q) ⊙ h^loc(s) from this rank's log A_r and h^loc(r)
    (any equal shapes)."""
    rank, _ = _rank_world(group)
    g = all_gather(torch.stack([log_A, h_loc], 0), group)        # [world, 2, …]
    L, H = g[:rank, 0], g[:rank, 1]
    # Σ_{s<q<r} log A_q = C_{s+1} with C_s = Σ_{s≤q<r} log A_q (C_r = 0), a sum without a
    # difference, so a slice with a reset (log A = −∞) cuts off everything before it; on rank 0
    # an empty sum that keeps the gather in the graph
    C = L.flip(0).cumsum(0).flip(0)
    between = torch.cat([C[1:], torch.zeros_like(L[:1])], 0) if rank > 0 else L
    return (between.exp() * H).sum(0)


def cp_linear_scan(log_a: torch.Tensor, b: torch.Tensor, group=None, backend: str = "torch",
                   chunk_size: int = 64, reset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.linear_scan.linear_scan`` over a sequence split across the group (each rank
    passes its slice [B, T_r, D], T_r ≥ 1, the whole sequence starting from h = 0). ``reset``
    [B, T_r] (bool): h_t = b_t there (a_t replaced by 0), which cuts the reach of every earlier
    state. Returns (h [B, T_r, D] in b's dtype, the state after this rank's slice [B, D])."""
    if reset is None:
        h_loc, _ = linear_scan(log_a, b, None, False, backend=backend, chunk_size=chunk_size)
    else:
        h_loc, _ = linear_scan_reset(log_a, b, None, reset, False, backend, chunk_size)
        log_a = acc(log_a).masked_fill(reset[..., None], float("-inf"))
    cum = acc(log_a).cumsum(1)                                        # log Π_{τ≤t} a_τ
    h_in = _diag_initial_state(cum[:, -1], acc(h_loc[:, -1]), group)
    h = acc(h_loc) + cum.exp() * h_in[:, None]
    return h.to(b.dtype), h[:, -1]


def _docs_backend(name: str, backend) -> str:
    """The backend that runs an op over a slice with document starts from per-row carried states:
    "torch", the PyTorch chunked form with ``resets`` (which takes an initial and gives a final
    state; the sequential reference ops have no resets, so ``impl="reference"`` runs it too), or
    "triton", the kernel's ``cu_seqlens`` path over the slice's own pieces (``_route_rows``)."""
    if backend in ("torch", "reference"):
        return "torch"
    if backend == "triton":
        return "triton"
    raise ValueError(f"context parallel: packed documents with the {name} op run on backend torch or triton, "
                     f"not {str(backend)!r}")


def _route_rows(docs: SliceDocs, S0: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
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


def _rows_final(docs: SliceDocs, fin: torch.Tensor) -> torch.Tensor:
    """The final states [N, ...] of the slice's pieces → each row's [B, ...]: its last piece's."""
    return fin.index_select(0, docs.local.doc_index[:, -1])


def delta_rule_docs(q, k, v, beta, S0, docs: SliceDocs, backend: str = "torch", chunk_size: int = 64,
                    g: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The delta rule (the gated one when ``g`` is given) over a slice of packed rows (q, k
    [B, H, T_r, d_k], v [B, H, T_r, d_v], β (g) [B, H, T_r]) from the per-row states S0
    [B, H, d_k, d_v], S = 0 before the update at each ``docs.starts``. Returns (o, each row's
    state after the slice). "torch" (``_docs_backend``): the PyTorch chunked form with
    ``resets``; "triton": the kernel's ``cu_seqlens`` path over the batch flattened to one row,
    S0 routed to each row's first piece, each row's final state its last piece's
    (``_route_rows``, ``_rows_final``)."""
    backend = _docs_backend("gated delta rule" if g is not None else "delta rule", backend)
    if backend == "torch":
        if g is None:
            return delta_rule_chunk_torch(q, k, v, beta, S0, True, chunk_size, docs.starts)
        return gated_delta_rule_chunk_torch(q, k, v, g, beta, S0, True, chunk_size, docs.starts)
    flat = varlen_heads(q, k, v, beta) if g is None else varlen_heads(q, k, v, g, beta)
    op = _dr.delta_rule_triton if g is None else _gdr.gated_delta_rule_triton
    if op is None:
        raise ValueError("context parallel: backend triton for the delta rules needs triton installed")
    o, fin = op(*flat, _route_rows(docs, S0), True, chunk_size, docs.cu_seqlens)
    return unflatten_heads(o, q.shape[0]), _rows_final(docs, fin)


def _affine_summary_scan(fin: torch.Tensor, dv: int, group) -> torch.Tensor:
    """S_in(r) from every rank's [S^loc, P] (the exclusive scan S_in(r) = P_{r−1} S_in(r−1) +
    S^loc(r−1), S_in(0) = 0)."""
    rank, _ = _rank_world(group)
    g = all_gather(fin, group)                                        # [world, B, H, dk, dv + dk]
    S_in = g[:0, ..., :dv].sum(0)   # zeros, connected to the gather (see ``comm``'s module doc)
    for s in range(rank):
        S_in = g[s, ..., dv:] @ S_in + g[s, ..., :dv]
    return S_in


def kda_docs(q, k, v, g, beta, S0, docs: SliceDocs, backend: str = "torch", chunk_size: int = 64
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA (g [B, H, T_r, d_k] the per-channel log decays) over a slice of packed rows from the
    per-row states S0, as ``delta_rule_docs``: "torch", the PyTorch chunked form with ``resets``;
    "triton", the public entry's ``cu_seqlens`` path over the slice's pieces (``_route_rows``,
    ``_rows_final``)."""
    if _docs_backend("KDA", backend) == "torch":
        return kda_chunk_torch(q, k, v, g, beta, S0, True, chunk_size, docs.starts)
    o, fin = _kda.kda(*varlen_heads(q, k, v, g, beta), _route_rows(docs, S0), True, backend="triton",
                      chunk_size=chunk_size, cu_seqlens=docs.cu_seqlens)
    return unflatten_heads(o, q.shape[0]), _rows_final(docs, fin)


def _kda_run(q, k, v, g, beta, S0, backend, chunk_size):
    """KDA from S0 with its final state: the reference and PyTorch forms directly (the mixer's
    gates hold their ranges by construction), another backend through the public entry."""
    if backend == "reference":
        return kda_reference(q, k, v, g, beta, S0, True)
    if backend == "torch":
        return kda_chunk_torch(q, k, v, g, beta, S0, True, chunk_size)
    return _kda.kda(q, k, v, g, beta, S0, True, backend=str(backend), chunk_size=chunk_size)


def _summary_runs(q, k, v, beta, g, group, backend, chunk_size, docs, per_channel: bool = False):
    """``cp_delta_rule`` / ``cp_gated_delta_rule`` / ``cp_kda`` (g None, the log decays [B, H, T]
    or, ``per_channel``, [B, H, T, d_k])."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    sd = acc(v[:0]).dtype
    if per_channel:
        run = ((lambda vv, S0: kda_docs(q, k, vv, g, beta, S0, docs, backend, chunk_size)) if docs is not None
               else (lambda vv, S0: _kda_run(q, k, vv, g, beta, S0, backend, chunk_size)))
    elif docs is not None:
        run = lambda vv, S0: delta_rule_docs(q, k, vv, beta, S0, docs, backend, chunk_size, g)
    elif g is None:
        run = lambda vv, S0: _dr.delta_rule(q, k, vv, beta, S0, True, backend=backend, chunk_size=chunk_size)
    else:
        run = lambda vv, S0: _gdr.gated_delta_rule_trusted(q, k, vv, g, beta, S0, True, backend=backend,
                                                           chunk_size=chunk_size)
    # [v, 0] from [0, I]: the final state is [S^loc, P] with P = Π (α) (I − β k kᵀ)
    v_ext = torch.cat([v, v.new_zeros(B, H, T, dk)], -1)
    eye = torch.eye(dk, dtype=sd, device=v.device).expand(B, H, dk, dk)
    init = torch.cat([torch.zeros(B, H, dk, dv, dtype=sd, device=v.device), eye], -1)
    _, fin = run(v_ext, init)
    return run(v, _affine_summary_scan(fin, dv, group))


def cp_delta_rule(q, k, v, beta, group=None, backend: str = "torch", chunk_size: int = 64,
                  docs: Optional[SliceDocs] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.delta_rule`` over a sequence split along T across the group (q, k
    [B, H, T_r, d_k], v [B, H, T_r, d_v], β [B, H, T_r]; the sequence starts from S = 0).
    Returns (o [B, H, T_r, d_v], the state after this rank's slice [B, H, d_k, d_v]).

    ``docs`` (``SliceDocs``, packed documents): S = 0 before the update at each ``docs.starts``
    (``delta_rule_docs``). The run of [v, 0] from [0, I] with the same starts zeroes the I block
    too, so a row with a start in the slice ends in [S^loc, 0]: P_r = 0, the state from earlier
    ranks does not reach the slice's end, and the exclusive scan is unchanged; the second run from
    S_in(r) lets S_in reach only the tokens before the row's first start."""
    return _summary_runs(q, k, v, beta, None, group, backend, chunk_size, docs)


def cp_gated_delta_rule(q, k, v, g, beta, group=None, backend: str = "torch", chunk_size: int = 64,
                        docs: Optional[SliceDocs] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.gated_delta_rule.gated_delta_rule`` over a sequence split along T across the
    group (q, k [B, H, T_r, d_k], v [B, H, T_r, d_v], g, β [B, H, T_r]; the sequence starts from
    S = 0), by ``cp_delta_rule``'s summaries with P_r = Π α_t (I − β_t k_t k_tᵀ).
    Returns (o [B, H, T_r, d_v], the state after this rank's slice [B, H, d_k, d_v]).
    ``docs``: as ``cp_delta_rule``'s (P_r = 0 on a row with a start in the slice)."""
    return _summary_runs(q, k, v, beta, g, group, backend, chunk_size, docs)


def cp_kda(q, k, v, g, beta, group=None, backend: str = "torch", chunk_size: int = 64,
           docs: Optional[SliceDocs] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.kda.kda`` over a sequence split along T across the group (q, k, g [B, H, T_r, d_k],
    v [B, H, T_r, d_v], β [B, H, T_r]; the sequence starts from S = 0), by ``cp_delta_rule``'s
    summaries with P_r = Π_t (I − β_t k_t k_tᵀ) Diag(α_t). Returns (o [B, H, T_r, d_v], the state
    after this rank's slice [B, H, d_k, d_v]). ``docs``: as ``cp_delta_rule``'s (``kda_docs``)."""
    return _summary_runs(q, k, v, beta, g, group, backend, chunk_size, docs, per_channel=True)


# ---------------------------------------------------------------------------------------------
# the mixer contract's parallel forms (ttt_lm.model.mixers.base: cp_form, the public stages)
# ---------------------------------------------------------------------------------------------


def _summary_linear_scan(mixer, inp, group, backend, docs=None):
    """The RG-LRU's documents are its resets from segment positions (``inp["reset"]``), which
    ``docs`` does not change."""
    reset = inp.get("reset")
    h, _ = cp_linear_scan(inp["log_a"], inp["b"], group, backend, inp["chunk_size"],
                          reset if reset is not None and bool(reset.any()) else None)
    return h


def _summary_delta_rule(mixer, inp, group, backend, docs=None):
    y, _ = cp_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], group, backend, inp["chunk_size"], docs)
    return y


def _summary_gated_delta_rule(mixer, inp, group, backend, docs=None):
    y, _ = cp_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], group, backend,
                               inp["chunk_size"], docs)
    return y


def _summary_kda(mixer, inp, group, backend, docs=None):
    y, _ = cp_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], group, backend, inp["chunk_size"], docs)
    return y


def selective_scan_docs(inp: dict, h0: Optional[torch.Tensor], docs: SliceDocs, backend: str = "torch"
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The selective scan (``inp``: ``kernels.selective_scan``'s arguments, [B, T_r, ·]) over a
    slice of packed rows from the per-row states h0 [B, d_inner, N] (None: zero), Ā_t = 0 at each
    ``docs.starts``. Returns (y, each row's state after the slice). "torch": the PyTorch chunked
    form with ``resets``; "triton": the kernel's ``cu_seqlens`` path over the batch flattened to
    one row, h0 routed to each row's first piece (``_route_rows``, ``_rows_final``)."""
    backend = _docs_backend("selective scan", backend)
    args = {n: t for n, t in inp.items() if n not in ("resets", "cu_seqlens")}
    if backend == "torch":
        return selective_scan_chunk(**args, initial_state=h0, output_final_state=True, resets=docs.starts)
    B, T = docs.starts.shape
    for n in ("x", "delta", "B", "C", "z"):
        if args.get(n) is not None:
            args[n] = args[n].reshape(1, B * T, args[n].shape[-1])
    y, fin = selective_scan(**args, initial_state=_route_rows(docs, h0), output_final_state=True,
                            backend="triton", cu_seqlens=docs.cu_seqlens)
    return y.view(B, T, y.shape[-1]), _rows_final(docs, fin)


def _summary_selective_scan(mixer, inp, group, backend, docs=None):
    """The selective scan's summary is A_r = exp(Σ_t Δ_t A) and the final state from zero; a
    second run of the op from the combined initial state gives the outputs. With packed documents
    (``docs``: Ā_t = 0 at each start, ``selective_scan_docs``) a row with a start in the slice has
    A_r = 0 (log A_r = −∞, as ``cp_linear_scan``'s resets), so the state of earlier ranks stops
    there, and the second run lets h_in reach only the tokens before the row's first start."""
    if docs is not None:
        _, h_loc = selective_scan_docs(inp, None, docs, backend)
    else:
        _, h_loc = mixer.op(inp, None, True, backend)
    Delta = acc(inp["delta"])
    if inp.get("delta_bias") is not None:
        Delta = Delta + acc(inp["delta_bias"])
    if inp.get("delta_softplus"):
        Delta = F.softplus(Delta)
    log_A = Delta.sum(1)[..., None] * inp["A"]                        # [B, d_inner, N]
    if docs is not None:
        log_A = log_A.masked_fill(docs.starts.any(1)[:, None, None], float("-inf"))
        y, _ = selective_scan_docs(inp, _diag_initial_state(log_A, h_loc, group), docs, backend)
        return y
    h_in = _diag_initial_state(log_A, h_loc, group)
    y, _ = mixer.op(inp, h_in, False, backend)
    return y


def _summary_ssd(mixer, inp, group, backend, docs=None):
    """Mamba-2's SSD (``kernels.ssd``: S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ per head): the
    summary of a slice is its scalar transition per head, exp(A Σ_t Δ_t), and its final state from
    zero; the exclusive scan over ranks is the diagonal one (``_diag_initial_state``) with the
    transition broadcast over the state [p, n]; a second run of the op from the combined state gives
    the outputs. With packed documents the op runs on the slice's own pieces (``inp["cu_seqlens"]``,
    states per piece): the carried state is routed to each row's first piece and each row's final
    state taken from its last (``_route_rows``, ``_rows_final``); a row with a start in the slice has
    transition 0 (log −∞), so the state of earlier ranks stops at its first start."""
    from kernels.ssd.reference import discretize
    _, fin = mixer.op(inp, None, True, backend)
    S_loc = fin if docs is None else _rows_final(docs, fin)
    delta = discretize(inp["dt"], inp.get("dt_bias"), inp.get("dt_softplus", False), S_loc.dtype)
    log_A = delta.sum(1) * inp["A"].to(S_loc.dtype)                   # [B, h]
    if docs is not None:
        log_A = log_A.masked_fill(docs.starts.any(1)[:, None], float("-inf"))
    S_in = _diag_initial_state(log_A[..., None, None].expand_as(S_loc), S_loc, group)
    y, _ = mixer.op(inp, S_in if docs is None else _route_rows(docs, S_in), False, backend)
    return y


#: ``Mixer.op_name`` → how the ranks combine that op's chunk summaries
SUMMARY_COMBINES = {"linear_scan": _summary_linear_scan, "delta_rule": _summary_delta_rule,
                    "gated_delta_rule": _summary_gated_delta_rule, "kda": _summary_kda,
                    "selective_scan": _summary_selective_scan, "ssd": _summary_ssd}


def cp_summary(mixer, x, lengths, group=None, docs: Optional[SliceDocs] = None, **kw) -> torch.Tensor:
    """A mixer with ``cp_form="summary"``: its inputs stage (conv halo from earlier ranks), its
    op by chunk summaries combined across ranks (``SUMMARY_COMBINES[mixer.op_name]``), its
    output stage. ``kw``: ``segment_pos`` for mixers that read it.

    ``docs`` (``SliceDocs``, packed documents): ``inputs(x, state, docs=docs)`` with the halo
    state, so the convolutions mask their taps by the global ``offset`` (the halo's inputs of an
    earlier document dropped, ``doc_conv``'s cache), and the op gets ``resets`` = ``docs.starts``
    (a start on rank r > 0's first token only where its position is 0); the summary combines
    handle the resets (``cp_delta_rule``, ``_summary_selective_scan``; the RG-LRU's resets come
    from its segment positions, ``cp_linear_scan``). Backends with documents: the PyTorch chunked
    forms (also for ``impl="reference"``: the sequential reference ops take no resets) and the
    Triton kernels' ``cu_seqlens`` paths, each row's carried state routed to its first piece
    (``delta_rule_docs``, ``selective_scan_docs``)."""
    if docs is not None:
        _check_docs(docs, x)
        kw = {**kw, "docs": docs}
    inp, _ = mixer.inputs(x, _context_state(mixer, x, lengths, group), False, **kw)
    y = SUMMARY_COMBINES[mixer.op_name](mixer, inp, group, mixer.op_backend(x), docs)
    return mixer.output(y, x)


__all__ = ["cp_linear_scan", "cp_delta_rule", "cp_gated_delta_rule", "cp_kda", "delta_rule_docs", "kda_docs",
           "selective_scan_docs", "SUMMARY_COMBINES", "cp_summary"]
