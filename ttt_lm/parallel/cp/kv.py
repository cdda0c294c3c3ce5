r"""The key-value exchange of attention (``cp_kv_exchange``).

* **Key-value exchange** (attention) all-gathers the keys and values (after RoPE at their global
  positions); rank r attends from its queries (RoPE at start_r + t) to the keys of ranks < r and
  its own, causally. With packed documents see below.
* Key-value exchange with documents: q and k are rotated at the global piece offsets, and query
  t of slice r sees gathered key s only if s ≤ start_r + t (and s > start_r + t − w for a window)
  and both lie in the same piece: seg_t = seg_upto_s, a boolean mask [B, 1, T_r, K] over the
  gathered keys (SDPA or the explicit softmax: flash-attn and flex fall back to SDPA with this
  mask: the attention op's ``doc_mask``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ttt_lm.parallel.cp.comm import _context_state, _rank_world, all_gather_varlen
from ttt_lm.parallel.cp.docs import SliceDocs, _check_docs

def cp_kv_exchange(mixer, x, lengths, group=None, docs: Optional[SliceDocs] = None, **kw) -> torch.Tensor:
    """A mixer with ``cp_form="kv_exchange"`` (attention): queries at their global positions
    attend to the gathered keys and values of earlier ranks (a window keeps the last w − 1) and
    to their own.

    ``docs`` (``SliceDocs``, packed documents): q and k are rotated at the global piece offsets
    (``docs.offset``, as the one-process run rotates at ``DocLayout.offset``), and the op gets
    ``doc_mask`` [B, 1, T_r, K]: query t (piece ``docs.seg``) sees gathered key s only in the
    same piece (``docs.seg_upto``, trimmed as the keys are for a window), and'ed with the causal
    (windowed) mask inside the op."""
    rank, _ = _rank_world(group)
    if docs is not None:
        _check_docs(docs, x)
        kw = {**kw, "docs": docs}
    inp, _ = mixer.inputs(x, _context_state(mixer, x, lengths, group), False, **kw)
    k, v = inp["k"], inp["v"]
    parts = all_gather_varlen(torch.cat([k, v], 1), 2, lengths, group)
    kv = torch.cat([parts[0][:, :, :0]] + [parts[s] for s in range(rank)] + [torch.cat([k, v], 1)], 2)
    first = 0                                                         # global index of the first key kept
    if mixer.window is not None:
        first = max(0, kv.shape[2] - (mixer.window - 1) - x.shape[1])
        kv = kv[:, :, first:]
    k_all, v_all = kv.split([k.shape[1], v.shape[1]], 1)
    op_inp = {**inp, "k": k_all, "v": v_all}
    if docs is not None:
        op_inp["doc_mask"] = (docs.seg[:, :, None] == docs.seg_upto[:, None, first:])[:, None]
    y, _ = mixer.op(op_inp, backend=mixer.op_backend(x))
    return mixer.output(y, x)


__all__ = ["cp_kv_exchange"]
