r"""Packed documents under context parallelism: this rank's slice of the whole rows' document
layout (``SliceDocs``, ``slice_docs``), which every form reads.

**Packed documents** (``model.reset_at_doc_boundaries`` with the loader's positions): every
document piece of a row is read from a fresh state, as in the one-process
``LM.forward(ids, position_ids=pos)``. The whole rows' ``DocLayout`` is built once (positions
gathered) and each rank gets its slice of it, ``SliceDocs``: ``starts`` (a start on rank r > 0's
first token only where the position is 0), the global piece ``offset``, ``seg`` / ``seg_upto``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ttt_lm.model.docs import DocLayout
from ttt_lm.parallel.cp.comm import _rank_world, gather_rows

# ---------------------------------------------------------------------------------------------
# packed documents: this rank's slice of the whole rows' document layout
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SliceDocs:
    """The documents of packed rows as this rank's slice [start, start + T_r) sees them, taken from
    the ``DocLayout`` of the whole rows (``model.reset_at_doc_boundaries``): every quantity is the
    one-process value, so a document crossing a slice boundary continues on the next rank.

    * ``starts`` [B, T_r] bool: a document (piece) starts here: position 0, or the row's first
      token (on rank 0 only);
    * ``offset`` [B, T_r] long: the token's index in its piece, counted from the piece's first
      token wherever that lies (RoPE, conv masks, TTT's mini-batch phase);
    * ``seg`` [B, T_r] long: the token's piece index in its row; ``seg_upto`` [B, start + T_r]:
      the same for every token of the row up to this slice's end (attention's keys);
    * ``head`` [B] long: the first local start (T_r if none); ``continues`` [B] bool: the row's
      first local token continues a document of an earlier rank (False on rank 0): the tokens
      before ``head`` of such a row read the state the earlier ranks hand on;
    * ``local``: the ``DocLayout`` of the slice alone (its first token a piece start, else the
      same pieces), for the forms that run the slice from a fresh state.
    """
    starts: torch.Tensor
    offset: torch.Tensor
    seg: torch.Tensor
    seg_upto: torch.Tensor
    head: torch.Tensor
    continues: torch.Tensor
    local: DocLayout

    @classmethod
    def of(cls, layout, start: int, end: int) -> "SliceDocs":
        """The slice [start, end) of ``layout`` (the whole rows' ``DocLayout``)."""
        starts = layout.starts[:, start:end]
        offset = layout.offset[:, start:end]
        seg_all = layout.seg
        T = end - start
        idx = torch.arange(T, device=starts.device).expand_as(starts)
        head = torch.where(starts, idx, torch.full_like(idx, T)).min(1).values
        continues = ~starts[:, 0]
        return cls(starts, offset, seg_all[:, start:end], seg_all[:, :end], head, continues,
                   DocLayout.build(offset))

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The slice's own pieces (``local.cu_seqlens``: every row's first local token starts one),
        over the slice flattened to one row [1, B·T_r]."""
        return self.local.cu_seqlens

    @property
    def host_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens`` as a CPU tensor (``DocLayout.host_cu_seqlens`` of the slice's pieces)."""
        return self.local.host_cu_seqlens

    def rows(self, index: torch.Tensor) -> "SliceDocs":
        """These rows only (a pipeline group of the state-passing forms; ``seg_upto`` and the
        local layout taken for them)."""
        sel = lambda t: t.index_select(0, index.to(t.device))
        off = sel(self.offset)
        return SliceDocs(sel(self.starts), off, sel(self.seg), sel(self.seg_upto), sel(self.head),
                         sel(self.continues), DocLayout.build(off))


def slice_docs(position_ids_local: torch.Tensor, lengths: Sequence[int], group=None) -> Optional[SliceDocs]:
    """This rank's ``SliceDocs`` from its slice of the loader's positions (the whole rows gathered
    and checked once: a ValueError names the first bad row and position, as ``LM.forward``'s);
    None when no document starts inside a row (one plain pass, as in ``LM.forward``)."""
    rank, _ = _rank_world(group)
    layout = DocLayout.build(gather_rows(position_ids_local.long(), lengths, group))
    if not layout.inner_starts:
        return None
    start = sum(lengths[:rank])
    return SliceDocs.of(layout, start, start + lengths[rank])


def _check_docs(docs, x) -> None:
    if not isinstance(docs, SliceDocs):
        raise TypeError(f"context parallel: docs must be this rank's SliceDocs (slice_docs), got {type(docs).__name__}")
    if tuple(docs.offset.shape) != tuple(x.shape[:2]):
        raise ValueError(f"context parallel: docs cover [B, T_r] = {tuple(docs.offset.shape)} but the slice x is "
                         f"{tuple(x.shape[:2])}")


__all__ = ["SliceDocs", "slice_docs"]
