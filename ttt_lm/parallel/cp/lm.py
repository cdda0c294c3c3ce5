r"""Each mixer's context-parallel form (``CP_FORMS``, ``cp_mixer``, ``block_scheme``) and a whole
``LM`` over a split sequence (``context_parallel_forward``, ``allreduce_gradients``).

Which scheme a mixer gets is its own declaration (``Mixer.cp_form``, ``op_name``, ``cp_halo``),
and the parallel forms call only its public stages (``context_state``, ``inputs``, ``op``,
``output``; see ``ttt_lm.model.mixers.base``): the package knows ops and forms, not mixers.

``context_parallel_forward(model, input_ids_local, labels_local, group)`` applies this to a
whole ``LM`` and returns a local loss whose mean over the CP group is the full-sequence mean
cross-entropy; after ``loss.backward()`` on every rank, ``allreduce_gradients`` (mean over the
group) leaves every rank with the full-sequence gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ttt_lm.model.layers import acc
from ttt_lm.parallel.cp.comm import _rank_world, gather_lengths, wait_pending
from ttt_lm.parallel.cp.docs import SliceDocs, slice_docs
from ttt_lm.parallel.cp.kv import cp_kv_exchange
from ttt_lm.parallel.cp.pipeline import pass_state_forward
from ttt_lm.parallel.cp.summary import cp_summary, op_combine

#: ``Mixer.cp_form`` → the parallel form (None: the mixer passes its state from rank to rank)
CP_FORMS = {"summary": cp_summary, "kv_exchange": cp_kv_exchange, "state_passing": None}


def _parallel_form(mixer):
    """The summary / gather form the mixer declares, or None (state passing)."""
    if mixer.cp_form not in CP_FORMS:
        raise ValueError(f"context parallel: {type(mixer).__name__}.cp_form={mixer.cp_form!r} is not one of "
                         f"{list(CP_FORMS)}")
    if mixer.cp_form == "summary":
        op_combine(mixer)       # a ValueError naming the op where its folder has no combine
    return CP_FORMS[mixer.cp_form]


def cp_mixer(mixer, x_local, lengths, group=None, tag: int = 0,
             position_ids_local: Optional[torch.Tensor] = None, chunks: int = 1,
             docs: Optional[SliceDocs] = None) -> torch.Tensor:
    """One mixer over a split sequence: its parallel form when it has one, else state passing
    (pipelined over ``chunks`` groups of rows, see ``pass_state_forward``).
    ``position_ids_local`` reach the mixers that read segment positions (``takes_segment_pos``).
    ``docs`` (``SliceDocs``): packed documents, each read from a fresh state
    (``model.reset_at_doc_boundaries``)."""
    form = _parallel_form(mixer)
    if docs is not None and position_ids_local is None and mixer.takes_segment_pos:
        raise ValueError(f"context parallel: {type(mixer).__name__} reads the documents from its segment positions: "
                         "docs need position_ids_local (the slice of the positions they were built from)")
    kw = {"segment_pos": position_ids_local} if position_ids_local is not None and mixer.takes_segment_pos else {}
    if form is not None:
        return form(mixer, x_local, lengths, group, docs=docs, **kw)
    if kw:
        raise ValueError(f"context parallel: {type(mixer).__name__} reads segment positions but has no parallel form")
    return pass_state_forward(mixer, x_local, group, tag, chunks, docs=docs)[0]


def block_scheme(block) -> str:
    """"parallel" (summaries / gathers) or "state" (the whole block passes its state)."""
    return "parallel" if block.pre_conv is None and _parallel_form(block.mixer) is not None else "state"


# ---------------------------------------------------------------------------------------------
# the whole LM
# ---------------------------------------------------------------------------------------------


def context_parallel_forward(model, input_ids_local: torch.Tensor, labels_local: Optional[torch.Tensor],
                             group=None, position_ids_local: Optional[torch.Tensor] = None, chunks: int = 1):
    """``model`` (an ``LM``) over a sequence split across ``group``: input_ids_local,
    labels_local [B, T_r] are this rank's contiguous slice (labels aligned as for ``LM.forward``,
    −100 ignored; every T_r ≥ 1). Returns (loss_local, logits_local): loss_local is this rank's
    summed cross-entropy × world / (valid labels in the whole sequence), so its mean over the
    group is the full-sequence mean cross-entropy (None without labels). Blocks whose mixer
    declares a "summary" or "kv_exchange" ``cp_form`` run in parallel; the others (state
    passing, and blocks with a pre-conv) pass their block state from rank to rank. Activation checkpointing is not applied here.
    ``position_ids_local`` [B, T_r] (this slice of the loader's positions) reach the RG-LRU as its
    segment positions, as in ``LM.forward``. ``chunks``: the state-passing blocks are pipelined
    over that many groups of batch rows (``pass_state_forward``; 1: ranks one after another).
    A model whose layers ``parallelize_tp`` converted (``model.tp_ctx`` set; CP × TP) runs its
    heads' share on each TP rank, the states and summaries passed between CP peers holding those
    heads; its logits are this TP rank's vocabulary shard and the loss is vocab-parallel."""
    rank, world = _rank_world(group)
    lengths = gather_lengths(input_ids_local.shape[1], group)
    if min(lengths) < 1:
        raise ValueError(f"context parallel: every rank needs at least one token, got lengths {lengths}")
    docs = None
    if position_ids_local is not None and model.cfg.reset_at_doc_boundaries:
        # the whole rows' layout, checked once; None when no document starts inside a row
        docs = slice_docs(position_ids_local, lengths, group)
    x = model.embed(input_ids_local)
    for i, block in enumerate(model.layers):
        if block_scheme(block) == "state":
            x, _ = pass_state_forward(block, x, group, tag=i, chunks=chunks, docs=docs)
        else:
            x = x + cp_mixer(block.mixer, block.mixer_norm(x), lengths, group, tag=i,
                             position_ids_local=position_ids_local, docs=docs)
            if block.mlp is not None:
                x = x + block.mlp(block.mlp_norm(x))
    logits = model.lm_head(model.norm(x))
    wait_pending()   # this pass's state sends (the next rank has received them by now)
    loss = None
    if labels_local is not None:
        lg = acc(logits)
        tp = getattr(model, "tp_ctx", None)
        if tp is not None:  # tensor parallel too: this rank's vocabulary shard of the logits
            from ttt_lm.parallel.tensor_parallel import vocab_parallel_cross_entropy
            ce = vocab_parallel_cross_entropy(lg.reshape(-1, lg.shape[-1]), labels_local.reshape(-1), tp.group,
                                              ignore_index=-100, reduction="sum")
        else:
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels_local.reshape(-1), ignore_index=-100,
                                 reduction="sum")
        n = (labels_local != -100).sum().to(torch.int64).reshape(1)
        dist.all_reduce(n, group=group)
        loss = ce * world / n.clamp(min=1).to(ce.dtype)
    return loss, logits


def allreduce_gradients(model, group=None) -> None:
    """Finish pending state sends, then average every parameter gradient over the group: with
    the losses of ``context_parallel_forward`` this is the full-sequence gradient."""
    wait_pending()
    _, world = _rank_world(group)
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # a parameter can be unused on some ranks only (TTT's initial inner weights reach the
        # later ranks through the passed state): zeros there keep the all-reduces matched
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(world)


__all__ = ["CP_FORMS", "cp_mixer", "block_scheme", "context_parallel_forward", "allreduce_gradients"]
