r"""The collectives of context parallelism, each differentiable: the all-gathers (of fixed and
of per-rank lengths), the halo of earlier tokens that a short convolution reads, and the
point-to-point sends of a state (any typed state / dict / list of tensors) between neighbours,
with ``wait_pending`` for the asynchronous ones.

Short causal convolutions before an op need the last w − 1 inputs of the tokens
before the slice: an all-gather of each rank's last w − 1 mixer inputs (the "halo").

Gradients flow through collectives wrapped in autograd Functions: all-gather's backward sums
every rank's gradient for the gathered tensor (all-reduce) and keeps the slice of this rank;
send's backward receives, receive's backward sends. Each rank's backward reaches every
collective in the same order, which is why gathered tensors are always used (an empty slice on
rank 0 where nothing earlier exists) so that the backward all-reduce runs on every rank.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def gather_rows(t_local: torch.Tensor, lengths: Sequence[int], group=None) -> torch.Tensor:
    """The whole rows [B, ΣT_r] of an integer tensor whose slices [B, T_r] the ranks hold
    (not differentiable: positions)."""
    _, world = _rank_world(group)
    n_max = max(lengths)
    x = F.pad(t_local, (0, n_max - t_local.shape[1])).contiguous()
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x, group=group)
    return torch.cat([o[:, :L] for o, L in zip(out, lengths)], 1)


def _context_state(mixer, x, lengths, group):
    """The mixer's state at the start of this rank's slice, without its recurrent part: from the
    halo of earlier ranks' mixer inputs (zero before the sequence start) and the global start."""
    rank, _ = _rank_world(group)
    n = mixer.cp_halo
    xh, valid = halo(x, n, lengths, group) if n > 0 else (x[:, :0], torch.zeros(0, dtype=torch.bool, device=x.device))
    return mixer.context_state(xh, valid, sum(lengths[:rank]))


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


__all__ = ["split_lengths", "gather_lengths", "all_gather", "all_gather_varlen", "halo", "gather_rows", "wait_pending"]
