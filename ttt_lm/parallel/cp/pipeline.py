r"""State passing for the nonlinear recurrences, pipelined over groups of batch rows
(``pass_state_forward``).

* **Nonlinear recurrences by state passing** (TTT with its inner LayerNorm, TTT-MLP, the
  Titans MLP memory, and any module with the ``(x, state, output_state)`` interface): rank r receives
  the final state of rank r − 1, runs its slice from it and sends its own final state to
  r + 1; in the backward pass the state's gradient travels from r + 1 back to r. Pipelined over
  M groups of batch rows (``chunks``): rank r runs group i as soon as rank r − 1's state for
  group i has arrived, its sends being asynchronous, so rank r works on group i while rank r + 1
  works on group i − 1. With c ranks and a time t per rank for the whole local batch, a layer's
  forward takes (M + c − 1)·t/M instead of c·t: the idle share (bubble) of each rank is
  (c − 1)/(M + c − 1) (M = 1: the ranks run one after another). The backward pass runs the
  groups in reverse (autograd takes the group made last first), gradients of the states going
  from r + 1 to r, with the same bubble. Consecutive state-passing layers pipeline across layers
  as well (rank 0 goes on to its next layer without waiting): a run of k of them between two
  layers with collectives idles (c − 1)/(k·M + c − 1).

  *With packed documents* (``model.reset_at_doc_boundaries``; ``SliceDocs``) each document
  piece is read from a fresh state, so only the tokens of a row before its first local document
  start (``head``), in a row whose first token continues an earlier rank's document
  (``continues``), depend on the state handed on. Per group of rows, rank r

    1. runs the slice once with the slice's own layout, ``module(x, docs=docs.local)`` (every
       local document start restarts the state; the row's first token too), which gives every
       token from ``head`` on;
    2. for each row with a local start, runs its last piece alone from a fresh state,
       ``module(x[b, last_b:], None, output_state=True)``: the state that row hands on;
    3. receives one state per row from r − 1 and, for each continuing row, runs its head
       ``module(x[b, :head_b], state_b, output_state=True)``: the outputs before ``head_b`` and,
       for a row without a local start, the state it hands on;
    4. sends the B one-row states to r + 1 (a list: the rows' states differ in their positions).

  The outputs are the head calls' before ``head_b`` and the docs call's after (index ops), so
  the gradients are exact: a state that a row does not read gets a zero gradient. Steps 1 and 2
  need nothing from earlier ranks and run before the receive. Cost per rank and row group: one
  docs call over all rows, one call per continuing row (its head) and one per row with a local
  start (its last piece; not on the last rank, which hands nothing on): up to 2·B extra
  calls, each on a part of one row; a row's head [0, head_b) and last piece [last_b, T_r) do not
  overlap, so they read each token at most once more. A first exact form: one call per row
  group would need the mixers to take a carried state per row beside ``docs``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ttt_lm.parallel.cp.comm import (_flatten, _is_state, _rank_world, _recv_spec, _RecvState, _send_spec,
                                     _SendState, _state_fields, _tensor_specs, _unflatten)
from ttt_lm.parallel.cp.docs import SliceDocs

def _pass_state_one(module, x_local: torch.Tensor, group, tag: int):
    """One group of rows: receive from r − 1, run, send to r + 1 (see ``pass_state_forward``)."""
    rank, world = _rank_world(group)
    state = None
    if rank > 0:
        spec = _recv_spec(rank - 1, group, tag)
        anchor = torch.zeros((), dtype=x_local.dtype, device=x_local.device, requires_grad=True)
        tensors = _RecvState.apply(anchor, rank - 1, group, tag, _tensor_specs(spec), x_local.device)
        state = _unflatten(spec, tensors)
    y, final = module(x_local, state, True)
    if rank < world - 1:
        spec, tensors = _flatten(final)
        _send_spec(spec, rank + 1, group, tag)
        y = _SendState.apply(y, rank + 1, group, tag, *tensors)
    return y, final


def _cat_states(states: Sequence[Any]):
    """The states of consecutive row groups as one state: tensors (batch-first, as every mixer's
    state is) concatenated along the rows; anything else (positions) must agree."""
    first = states[0]
    if torch.is_tensor(first):
        return torch.cat(list(states), 0)
    if _is_state(first):
        return type(first)(**{k: _cat_states([getattr(s, k) for s in states]) for k in _state_fields(first)})
    if isinstance(first, dict):
        return {k: _cat_states([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_cat_states([s[i] for s in states]) for i in range(len(first)))
    if any(s != first for s in states):
        raise ValueError(f"context parallel: the row groups' states disagree on a non-tensor entry: {list(states)}")
    return first


def pass_state_forward(module, x_local: torch.Tensor, group=None, tag: int = 0, chunks: int = 1,
                       docs: Optional[SliceDocs] = None):
    """Run ``module(x, state, output_state=True)`` (a Mixer or a Block) over a sequence split
    across the CP group: rank r starts from the final state of rank r − 1 (rank 0 from
    ``state=None``) and hands its final state to rank r + 1; gradients of the state go back
    from r + 1 to r. Returns (y_local, the final state after this rank's slice). ``tag``
    tells apart the messages of different layers (group i of layer ``tag`` uses the message
    tag ``tag · chunks + i``). ``chunks`` = M splits the batch rows into M groups that are
    pipelined across the ranks (module docstring: bubble (c − 1)/(M + c − 1)); every rank of the
    group must pass the same M, and M ≤ the number of rows. Sends are asynchronous: call
    ``wait_pending()`` (or ``allreduce_gradients``) after the backward pass.

    ``docs`` (``SliceDocs`` of this rank's slice, rows as x_local's): packed documents, each
    read from a fresh state, as ``module(x, docs=DocLayout.build(position_ids))`` reads the whole
    rows in one process (module docstring, "with packed documents": one call with the slice's
    own layout, a call per continuing row for its tokens before its first local start from the
    state handed on, a call per row with a local start for the state it hands on). Each row
    group gets ``docs.rows`` of its rows. The final state is then the list of B one-row states
    (the rows' states differ in their positions), None on the last rank (it computes none)."""
    B = x_local.shape[0]
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"context parallel: pipeline chunks must be an integer >= 1, got {chunks!r}")
    if chunks > B:
        raise ValueError(f"context parallel: {chunks} pipeline chunks need at least {chunks} batch rows per "
                         f"micro-batch, got {B}")
    if docs is not None and tuple(docs.starts.shape) != tuple(x_local.shape[:2]):
        raise ValueError(f"context parallel: docs (SliceDocs) cover [B, T_r] = {list(docs.starts.shape)} but "
                         f"x_local is {list(x_local.shape[:2])}")
    if chunks == 1:
        if docs is not None:
            return _pass_state_docs(module, x_local, group, tag, docs)
        return _pass_state_one(module, x_local, group, tag)
    ys, finals = [], []
    rows = torch.arange(B, device=x_local.device)
    for i, (xs, idx) in enumerate(zip(torch.tensor_split(x_local, chunks, 0), torch.tensor_split(rows, chunks))):
        if docs is not None:
            y, final = _pass_state_docs(module, xs, group, tag * chunks + i, docs.rows(idx))
        else:
            y, final = _pass_state_one(module, xs, group, tag * chunks + i)
        ys.append(y)
        finals.append(final)
    if docs is not None:
        return torch.cat(ys, 0), (None if finals[0] is None else [s for f in finals for s in f])
    return torch.cat(ys, 0), _cat_states(finals)


class _KeepInGraph(torch.autograd.Function):
    """y unchanged; zero gradients for ``tensors`` (the received state): its receive node stays
    in the graph, so its backward sends the earlier rank the gradient it waits for even when no
    row of this rank reads the state (documents that all start inside the slice)."""

    @staticmethod
    def forward(ctx, y, *tensors):
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        return (gy, *[torch.zeros(s, dtype=d, device=dev) if need else None
                      for (s, d, dev), need in zip(ctx.meta, ctx.needs_input_grad[1:])])


def _pass_state_docs(module, x: torch.Tensor, group, tag: int, docs: "SliceDocs"):
    """One group of rows with packed documents (``pass_state_forward``; the steps of the module
    docstring, "with packed documents"). Row b's output is

        y[b, t] = head call of row b from the received state    t < head_b (continuing rows)
                  docs call, module(x, docs=docs.local)          t ≥ head_b

    and the state it hands on is that of its last piece from a fresh state (last_b: its last
    local start), or, for a row without a local start, the head call's (head_b = T_r)."""
    rank, world = _rank_world(group)
    B, T = x.shape[:2]
    idx = torch.arange(T, device=docs.starts.device).expand_as(docs.starts)
    last = torch.where(docs.starts, idx, torch.full_like(idx, -1)).max(1).values
    head, cont, last = torch.stack([docs.head, docs.continues.long(), last]).tolist()   # one host read
    if rank == 0 and any(cont):
        raise ValueError("context parallel: rank 0's rows cannot continue a document of an earlier rank "
                         "(SliceDocs.continues is set on rank 0)")
    if any(c and h == 0 for c, h in zip(cont, head)) or any(not c and h > 0 for c, h in zip(cont, head)):
        raise ValueError(f"context parallel: SliceDocs disagree: head {head} (first local start), continues {cont}")
    # 1. every token from its row's first local start on: one call with the slice's own layout
    y_docs = module(x, None, False, docs=docs.local)[0] if any(h < T for h in head) else None
    # 2. the state a row with a local start hands on: its last piece from a fresh state
    finals: List[Any] = [None] * B
    if rank < world - 1:
        for b in range(B):
            if last[b] >= 0:
                finals[b] = module(x[b:b + 1, last[b]:], None, True)[1]
    # 3. the received states: the tokens before the first local start of the continuing rows
    recv: Tuple[torch.Tensor, ...] = ()
    rows: List[torch.Tensor] = []
    if rank > 0:
        spec = _recv_spec(rank - 1, group, tag)
        anchor = torch.zeros((), dtype=x.dtype, device=x.device, requires_grad=True)
        recv = _RecvState.apply(anchor, rank - 1, group, tag, _tensor_specs(spec), x.device)
        states = _unflatten(spec, recv)
        if not isinstance(states, list) or len(states) != B:
            got = f"a list of {len(states)} states" if isinstance(states, list) else f"one {type(states).__name__}"
            raise ValueError(f"context parallel: rank {rank - 1} handed on {got}, not one state per row of these "
                             f"{B} rows (with packed documents every rank passes its SliceDocs)")
    for b in range(B):
        if not cont[b]:
            rows.append(y_docs[b:b + 1])
            continue
        y_head, st = module(x[b:b + 1, :head[b]], states[b], True)
        if last[b] < 0:
            finals[b] = st
        rows.append(y_head if head[b] == T else torch.cat([y_head, y_docs[b:b + 1, head[b]:]], 1))
    y = torch.cat(rows, 0)
    if recv:
        y = _KeepInGraph.apply(y, *recv)
    if rank < world - 1:
        # 4. one state per row to r + 1
        spec, tensors = _flatten(finals)
        _send_spec(spec, rank + 1, group, tag)
        y = _SendState.apply(y, rank + 1, group, tag, *tensors)
        return y, finals
    return y, None


__all__ = ["pass_state_forward"]
