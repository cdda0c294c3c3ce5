r"""Context (sequence) parallelism: the sequence is split into contiguous slices, rank r of the
context-parallel (CP) group holding tokens [start_r, start_r + T_r).

Three schemes, each exact (outputs and gradients equal one pass over the whole sequence):

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
  P_r = Π_t α_t (I − β_t k_t k_tᵀ).

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

* **Key-value exchange** (attention) all-gathers the keys and values (after RoPE at their global
  positions); rank r attends from its queries (RoPE at start_r + t) to the keys of ranks < r and
  its own, causally. With packed documents see below.

Short causal convolutions before an op need the last w − 1 inputs of the tokens
before the slice: an all-gather of each rank's last w − 1 mixer inputs (the "halo").

**Packed documents** (``model.reset_at_doc_boundaries`` with the loader's positions): every
document piece of a row is read from a fresh state, as in the one-process
``LM.forward(ids, position_ids=pos)``. The whole rows' ``DocLayout`` is built once (positions
gathered) and each rank gets its slice of it, ``SliceDocs``: ``starts`` (a start on rank r > 0's
first token only where the position is 0), the global piece ``offset``, ``seg`` / ``seg_upto``.

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
* Key-value exchange with documents: q and k are rotated at the global piece offsets, and query
  t of slice r sees gathered key s only if s ≤ start_r + t (and s > start_r + t − w for a window)
  and both lie in the same piece: seg_t = seg_upto_s, a boolean mask [B, 1, T_r, K] over the
  gathered keys (SDPA or the explicit softmax: flash-attn and flex fall back to SDPA with this
  mask: the attention op's ``doc_mask``).

Gradients flow through collectives wrapped in autograd Functions: all-gather's backward sums
every rank's gradient for the gathered tensor (all-reduce) and keeps the slice of this rank;
send's backward receives, receive's backward sends. Each rank's backward reaches every
collective in the same order, which is why gathered tensors are always used (an empty slice on
rank 0 where nothing earlier exists) so that the backward all-reduce runs on every rank.

Which scheme a mixer gets is its own declaration (``Mixer.cp_form``, ``op_name``, ``cp_halo``),
and the parallel forms call only its public stages (``context_state``, ``inputs``, ``op``,
``output``; see ``ttt_lm.model.mixers.base``): this module knows ops and forms, not mixers.

``context_parallel_forward(model, input_ids_local, labels_local, group)`` applies this to a
whole ``LM`` and returns a local loss whose mean over the CP group is the full-sequence mean
cross-entropy; after ``loss.backward()`` on every rank, ``allreduce_gradients`` (mean over the
group) leaves every rank with the full-sequence gradient.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels import delta_rule as _dr
from kernels import gated_delta_rule as _gdr
from kernels.delta_rule.torch_chunk import delta_rule_chunk_torch
from kernels.gated_delta_rule.torch_chunk import gated_delta_rule_chunk_torch
from kernels.linear_scan import linear_scan, linear_scan_reset
from kernels.selective_scan import selective_scan
from kernels.selective_scan.torch_chunk import selective_scan_chunk
from ttt_lm.model.docs import DocLayout, unflatten_heads, varlen_heads
from ttt_lm.model.layers import acc

# ---------------------------------------------------------------------------------------------
# group helpers and differentiable collectives
# ---------------------------------------------------------------------------------------------


def _rank_world(group) -> Tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def split_lengths(T: int, world: int) -> List[int]:
    """Contiguous split of T tokens over ``world`` ranks, the first T mod world ranks one longer."""
    return [T // world + (1 if r < T % world else 0) for r in range(world)]


def gather_lengths(n: int, group=None) -> List[int]:
    """Every rank's local sequence length."""
    _, world = _rank_world(group)
    t = torch.tensor([n], dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return [int(o) for o in out]


class _AllGather(torch.autograd.Function):
    """x (same shape on every rank) → [world, *x.shape]. Backward: every rank's gradient for
    the gathered tensor summed (all-reduce), this rank's slice kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, world = _rank_world(group)
        ctx.rank = rank
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x, group=group)
        return torch.stack(out, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank], None


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-gather: [world, *x.shape]."""
    return _AllGather.apply(x, group)


def all_gather_varlen(x: torch.Tensor, dim: int, lengths: Sequence[int], group=None) -> List[torch.Tensor]:
    """Differentiable all-gather of tensors whose size along ``dim`` is ``lengths[rank]``
    (other dims equal): the list of every rank's tensor."""
    n_max = max(lengths)
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, n_max - x.shape[dim]]
    g = all_gather(F.pad(x, pad), group)
    return [g[s].narrow(dim, 0, lengths[s]) for s in range(len(lengths))]


def halo(x: torch.Tensor, n: int, lengths: Sequence[int], group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The n tokens of x [B, T_r, C] just before this rank's slice, from earlier ranks (several
    when their slices are shorter than n): (x_halo [B, n, C], valid [n] bool, False before the
    sequence start, where the halo is zero)."""
    rank, _ = _rank_world(group)
    B, T, C = x.shape
    tails = [min(n, L) for L in lengths]
    tail = x[:, T - tails[rank]:]
    parts = all_gather_varlen(tail, 1, tails, group)
    # rank 0 has no earlier token; its empty slice keeps the gather in its graph (see module doc)
    pieces = [x.new_zeros(B, n, C), parts[0][:, :0]] + [parts[s] for s in range(rank)]
    valid = torch.cat([torch.zeros(n, dtype=torch.bool)] + [torch.ones(tails[s], dtype=torch.bool) for s in range(rank)])
    return torch.cat(pieces, 1)[:, -n:], valid[-n:].to(x.device)


# ---- point to point -------------------------------------------------------------------------

#: isend works whose tensors must live until completion; ``wait_pending`` finishes them
_PENDING: List[Tuple[Any, torch.Tensor]] = []


def wait_pending() -> None:
    """Complete the sends issued by state passing (forward and backward)."""
    while _PENDING:
        work, _ = _PENDING.pop(0)
        work.wait()


def _isend(t: torch.Tensor, dst: int, group, tag: int) -> None:
    t = t.contiguous()
    _PENDING.append((dist.isend(t, dst=_global(group, dst), group=group, tag=tag), t))


def _recv(t: torch.Tensor, src: int, group, tag: int) -> torch.Tensor:
    dist.recv(t, src=_global(group, src), group=group, tag=tag)
    return t


def _state_fields(o) -> dict:
    """A typed state's (a dataclass: ``MixerState``) fields, those derived from others left out."""
    return {f.name: getattr(o, f.name) for f in dataclasses.fields(o) if f.init and not f.metadata.get("derived")}


def _is_state(o) -> bool:
    return dataclasses.is_dataclass(o) and not isinstance(o, type)


def _flatten(obj) -> Tuple[Any, List[torch.Tensor]]:
    """A nested typed state/dict/list/tuple → (its structure with tensors replaced by indices, the
    tensors)."""
    tensors: List[torch.Tensor] = []

    def rec(o):
        if torch.is_tensor(o):
            tensors.append(o)
            return ("__tensor__", len(tensors) - 1, tuple(o.shape), o.dtype)
        if _is_state(o):
            return type(o)(**{k: rec(v) for k, v in _state_fields(o).items()})
        if isinstance(o, dict):
            return {k: rec(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(rec(v) for v in o)
        return o
    return rec(obj), tensors


def _unflatten(spec, tensors: Sequence[torch.Tensor]):
    if isinstance(spec, tuple) and len(spec) == 4 and spec[0] == "__tensor__":
        return tensors[spec[1]]
    if _is_state(spec):
        return type(spec)(**{k: _unflatten(v, tensors) for k, v in _state_fields(spec).items()})
    if isinstance(spec, dict):
        return {k: _unflatten(v, tensors) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_unflatten(v, tensors) for v in spec)
    return spec


def _tensor_specs(spec) -> List[Tuple[tuple, torch.dtype]]:
    out = []

    def rec(o):
        if isinstance(o, tuple) and len(o) == 4 and o[0] == "__tensor__":
            out.append((o[1], o[2], o[3]))
        elif _is_state(o):
            for v in _state_fields(o).values():
                rec(v)
        elif isinstance(o, dict):
            for v in o.values():
                rec(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                rec(v)
    rec(spec)
    return [(s, d) for _, s, d in sorted(out, key=lambda e: e[0])]


class _SendState(torch.autograd.Function):
    """Forward: y unchanged, the state's tensors sent to ``dst``. Backward: their gradients
    received from ``dst`` (it sends one for every floating tensor)."""

    @staticmethod
    def forward(ctx, y, dst, group, tag, *tensors):
        ctx.dst, ctx.group, ctx.tag = dst, group, tag
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        for t in tensors:
            _isend(t.detach(), dst, group, tag)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        grads = []
        for shape, dtype, device in ctx.meta:
            if dtype.is_floating_point or dtype.is_complex:
                grads.append(_recv(torch.empty(shape, dtype=dtype, device=device), ctx.dst, ctx.group, ctx.tag))
            else:
                grads.append(None)
        return (gy, None, None, None, *grads)


class _RecvState(torch.autograd.Function):
    """Forward: the state's tensors received from ``src`` (``anchor`` only puts this node in the
    graph). Backward: their gradients sent back to ``src`` (zeros where none arrived)."""

    @staticmethod
    def forward(ctx, anchor, src, group, tag, specs, device):
        ctx.src, ctx.group, ctx.tag = src, group, tag
        out = [_recv(torch.empty(s, dtype=d, device=device), src, group, tag) for s, d in specs]
        ctx.mark_non_differentiable(*[t for t in out if not t.dtype.is_floating_point])
        ctx.set_materialize_grads(True)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        for g in grads:
            if g is not None and (g.dtype.is_floating_point or g.dtype.is_complex):
                _isend(g, ctx.src, ctx.group, ctx.tag)
        return (None,) * 6


def _send_spec(spec, dst: int, group, tag: int) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(spec)), dtype=torch.uint8)
    _isend(torch.tensor([data.numel()], dtype=torch.int64), dst, group, tag)
    _isend(data, dst, group, tag)


def _recv_spec(src: int, group, tag: int):
    n = _recv(torch.zeros(1, dtype=torch.int64), src, group, tag)
    data = _recv(torch.empty(int(n), dtype=torch.uint8), src, group, tag)
    return pickle.loads(data.numpy().tobytes())


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

    def rows(self, index: torch.Tensor) -> "SliceDocs":
        """These rows only (a pipeline group of the state-passing forms; ``seg_upto`` and the
        local layout taken for them)."""
        sel = lambda t: t.index_select(0, index.to(t.device))
        off = sel(self.offset)
        return SliceDocs(sel(self.starts), off, sel(self.seg), sel(self.seg_upto), sel(self.head),
                         sel(self.continues), DocLayout.build(off))


def gather_rows(t_local: torch.Tensor, lengths: Sequence[int], group=None) -> torch.Tensor:
    """The whole rows [B, ΣT_r] of an integer tensor whose slices [B, T_r] the ranks hold
    (not differentiable: positions)."""
    _, world = _rank_world(group)
    n_max = max(lengths)
    x = F.pad(t_local, (0, n_max - t_local.shape[1])).contiguous()
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=group)
    return torch.cat([o[:, :L] for o, L in zip(out, lengths)], 1)


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
    S_in = g[:0, ..., :dv].sum(0)   # zeros, connected to the gather (see module doc)
    for s in range(rank):
        S_in = g[s, ..., dv:] @ S_in + g[s, ..., :dv]
    return S_in


def _summary_runs(q, k, v, beta, g, group, backend, chunk_size, docs):
    """``cp_delta_rule`` / ``cp_gated_delta_rule`` (g None or the log decays)."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    sd = acc(v[:0]).dtype
    if docs is not None:
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


#: ``Mixer.op_name`` → how the ranks combine that op's chunk summaries
SUMMARY_COMBINES = {"linear_scan": _summary_linear_scan, "delta_rule": _summary_delta_rule,
                    "gated_delta_rule": _summary_gated_delta_rule, "selective_scan": _summary_selective_scan}


def _context_state(mixer, x, lengths, group):
    """The mixer's state at the start of this rank's slice, without its recurrent part: from the
    halo of earlier ranks' mixer inputs (zero before the sequence start) and the global start."""
    rank, _ = _rank_world(group)
    n = mixer.cp_halo
    xh, valid = halo(x, n, lengths, group) if n > 0 else (x[:, :0], torch.zeros(0, dtype=torch.bool, device=x.device))
    return mixer.context_state(xh, valid, sum(lengths[:rank]))


def _check_docs(docs, x) -> None:
    if not isinstance(docs, SliceDocs):
        raise TypeError(f"context parallel: docs must be this rank's SliceDocs (slice_docs), got {type(docs).__name__}")
    if tuple(docs.offset.shape) != tuple(x.shape[:2]):
        raise ValueError(f"context parallel: docs cover [B, T_r] = {tuple(docs.offset.shape)} but the slice x is "
                         f"{tuple(x.shape[:2])}")


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


#: ``Mixer.cp_form`` → the parallel form (None: the mixer passes its state from rank to rank)
CP_FORMS = {"summary": cp_summary, "kv_exchange": cp_kv_exchange, "state_passing": None}


def _parallel_form(mixer):
    """The summary / gather form the mixer declares, or None (state passing)."""
    if mixer.cp_form not in CP_FORMS:
        raise ValueError(f"context parallel: {type(mixer).__name__}.cp_form={mixer.cp_form!r} is not one of "
                         f"{list(CP_FORMS)}")
    if mixer.cp_form == "summary" and mixer.op_name not in SUMMARY_COMBINES:
        raise ValueError(f"context parallel: {type(mixer).__name__}.op_name={mixer.op_name!r} has no summary "
                         f"combine; known ops: {list(SUMMARY_COMBINES)}")
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


__all__ = ["SliceDocs", "slice_docs", "gather_rows", "split_lengths", "gather_lengths", "all_gather", "all_gather_varlen", "halo",
           "pass_state_forward", "wait_pending", "cp_linear_scan", "cp_delta_rule", "cp_gated_delta_rule", "cp_summary",
           "delta_rule_docs", "selective_scan_docs",
           "cp_kv_exchange", "SUMMARY_COMBINES", "CP_FORMS", "cp_mixer", "block_scheme",
           "context_parallel_forward", "allreduce_gradients"]
