"""The document layout of a packed batch, computed once per forward and handed to every mixer.

A training row packs documents end to end; the data's ``position_ids`` [B, T] give each token's
offset in its document (0 at a document's first token, +1 at every later one). A row's first
token starts a document piece whatever its position (the loader cuts rows out of the packed
stream, so a row usually starts inside a document: that piece is read from a fresh state).

``DocLayout.build(position_ids)`` checks the positions and derives, on their own device:

* ``starts`` [B, T] bool: a document (piece) starts here (position 0, or the row's first token);
* ``seg`` [B, T] long: which document of its row a token belongs to (0, 1, ...);
* ``offset`` [B, T] long: the token's index inside its piece (``position_ids`` where the piece
  starts at 0; a row's first piece counts from 0 as well);
* on the host: ``n_docs`` (N) and ``max_len`` (the longest piece), read with the validity check
  in one transfer, and ``host_lengths`` [N] (each piece's length, row-major), from which every
  view takes its sizes.

Where the host read happens: the loader's ``position_ids`` are CPU tensors, so ``LM.forward``
builds the layout on the host (every read above is of a CPU tensor) and then moves its [B, T]
tensors to the model's device (``DocLayout.to``, non-blocking copies). The views below compute
their index tensors on the device and their sizes from the host copies, so no view reads a
device tensor back: with host positions the layout costs no device→host synchronization. (Under
``torch.compile`` the views whose sizes depend on the documents, ``aligned``, ``balanced`` and
``prefixed``, still break a block's graph where it first builds them: dynamo does not trace their
host computation.) A layout built from positions on a device
(``DocLayout.build`` of a CUDA tensor, as context parallelism's gathered rows) reads its three
numbers at ``build`` and its ``host_lengths`` once, at the first view that needs a size (or at
``to``).

Two views of the same documents:

* ``cu_seqlens`` [N + 1] int32: the batch flattened to [1, B·T], cumulative document lengths as
  flash-attn's varlen API and the ``kernels/`` ops' ``cu_seqlens`` take them;
* the padded view, ``pad(x)`` [B, T, ...] → [N, L, ...] (document n in row n, zero after its
  end, L = the longest document) and ``unpad(y)`` back; both are one gather, differentiable.

A mixer whose forms reset inside the scan (masks on the packed rows: attention's document mask,
the RG-LRU's segment positions) reads ``starts``/``seg``/``position_ids``; the chunked ones (TTT,
Titans, LaCT) use the chunk-aligned view ``aligned(C)`` (each document from a chunk boundary of
its row, restarts at its first chunk inside the scan; ``longer_than`` leaves the short documents
out) or ``balanced(C)`` (the same in rows about as long as the longest document, for a scan that
loops over steps in Python: TTT's mini-batches, the Titans memory, Titans MAC); the others run their form once on the
padded view, where each document is a row of its own from the initial state. Titans MAL's form
uses ``prefixed(n)`` (n slots before every document, for the learned tokens it prepends to each
document).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ttt_lm.model.backend import Backend


def check_positions(position_ids: torch.Tensor) -> Optional[str]:
    """None when ``position_ids`` [B, T] is a valid layout, else the message naming the first bad
    row and position. One host synchronization (a 3-element read)."""
    info = _bad_and_sizes(position_ids)
    return _message(position_ids, info)


def _bad_and_sizes(pos: torch.Tensor):
    """(first bad flat index or -1, number of document pieces, longest piece), read to the host in
    one transfer."""
    B, T = pos.shape
    step_ok = (pos[:, 1:] == pos[:, :-1] + 1) | (pos[:, 1:] == 0)
    ok = torch.cat([pos[:, :1] >= 0, step_ok], dim=1).flatten()
    idx = torch.arange(B * T, device=pos.device)
    first_bad = torch.where(ok, torch.full_like(idx, B * T), idx).min()
    starts = _starts(pos).flatten()
    begin = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    offset = idx - begin
    vals = torch.stack([first_bad, starts.sum(), offset.max() + 1]).tolist()
    return vals, starts.view(B, T), offset.view(B, T)


def host_to_device(t: torch.Tensor, device, non_blocking: bool = True) -> torch.Tensor:
    """``t`` on ``device``; from the host to a CUDA device through pinned memory, so that the
    non-blocking copy never waits for the stream (a pageable source may make the driver do so)."""
    device = torch.device(device)
    if non_blocking and device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


def _starts(pos: torch.Tensor) -> torch.Tensor:
    s = pos == 0
    s[:, 0] = True
    return s


def _message(pos: torch.Tensor, info) -> Optional[str]:
    (first_bad, _, _), _, _ = info
    B, T = pos.shape
    if first_bad >= B * T:
        return None
    b, t = divmod(first_bad, T)
    if t == 0:
        return (f"position_ids row {b}, position 0: a row's first position must be >= 0 (its offset in "
                f"its document), got {int(pos[b, 0])}")
    return (f"position_ids row {b}, position {t}: positions must go up by 1 inside a document or restart "
            f"at 0 where a document starts, got {int(pos[b, t - 1])} then {int(pos[b, t])}")


@dataclass
class DocLayout:
    position_ids: torch.Tensor   # [B, T] long, on the model's device
    starts: torch.Tensor         # [B, T] bool
    offset: torch.Tensor         # [B, T] long: index inside the document piece
    n_docs: int                  # document pieces in the batch (>= B)
    max_len: int                 # the longest piece
    #: [N] long on the host: each piece's length, row-major (None until first needed on a layout
    #: built on a device: ``_host`` reads it then)
    host_lengths: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    #: per-batch objects the layers share (attention's flex block mask), keyed by their maker
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, position_ids: torch.Tensor) -> "DocLayout":
        """Check ``position_ids`` (a ValueError names the first bad row and position) and build the
        layout on their device. Positions on the host: no device is touched (``to`` moves the
        layout to the model's device). Positions on a device: one device→host read here (3
        numbers), and one more, of the N lengths, at the first view that needs a size."""
        pos = position_ids.long()
        info = _bad_and_sizes(pos)
        msg = _message(pos, info)
        if msg is not None:
            raise ValueError(msg)
        (_, n_docs, max_len), starts, offset = info
        out = cls(pos, starts, offset, int(n_docs), int(max_len))
        if pos.device.type == "cpu":
            out._host()
        return out

    def to(self, device, non_blocking: bool = True,
           position_ids: Optional[torch.Tensor] = None) -> "DocLayout":
        """The layout with its [B, T] tensors on ``device`` (non-blocking copies from the host:
        no synchronization) and its host sizes kept, so its views read nothing back.
        ``position_ids``: the same positions already on ``device`` (reused instead of a second
        copy). A layout built on a device reads its ``host_lengths`` first (once)."""
        lengths = self._host()[0]
        if position_ids is None or position_ids.device != torch.device(device) \
                or tuple(position_ids.shape) != self.shape:
            position_ids = host_to_device(self.position_ids, device, non_blocking)
        return DocLayout(position_ids.long(), host_to_device(self.starts, device, non_blocking),
                         host_to_device(self.offset, device, non_blocking), self.n_docs, self.max_len, lengths)

    def _host(self):
        """(lengths [N], row of each piece [N], pieces per row [B]) as CPU long tensors: the
        sizes of the views, computed once per batch from ``host_lengths`` (read from the device
        here, once, when the layout was built on one)."""
        if "host" not in self.cache:
            if self.host_lengths is None:
                self.host_lengths = self._doc_lengths()[2].cpu()
            B, T = self.shape
            lens = self.host_lengths
            row = (lens.cumsum(0) - 1) // T              # rows are T tokens, pieces laid end to end
            self.cache["host"] = (lens, row, torch.bincount(row, minlength=B))
        return self.cache["host"]

    @property
    def shape(self):
        return tuple(self.position_ids.shape)

    @property
    def inner_starts(self) -> bool:
        """Whether a document starts inside some row (else every row is one piece)."""
        return self.n_docs > self.shape[0]

    @property
    def seg(self) -> torch.Tensor:
        """[B, T]: the index of each token's document within its row."""
        return self.starts.long().cumsum(1) - 1

    @property
    def doc_index(self) -> torch.Tensor:
        """[B, T]: the index of each token's document in the batch (0 … N − 1, row-major)."""
        return self.starts.flatten().long().cumsum(0).view(self.shape) - 1

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[N + 1] int32 cumulative lengths of the documents of the batch flattened to [1, B·T]."""
        B, T = self.shape
        begins = torch.nonzero_static(self.starts.flatten(), size=self.n_docs)[:, 0]  # size known: no sync
        end = torch.full((1,), B * T, dtype=begins.dtype, device=begins.device)
        return torch.cat([begins, end]).to(torch.int32)

    @property
    def host_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens`` as a CPU int32 tensor, from the host copy of the lengths (no device read
        once the layout has them): for an op's PyTorch form that plans its pieces on the host."""
        lens = self._host()[0]
        return torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)

    def _doc_lengths(self):
        """(each token's document [B·T], its offset in it [B·T], each document's length [N]),
        computed once per batch for every view built from them."""
        if "lengths" not in self.cache:
            d = self.doc_index.flatten()
            off = self.offset.flatten()
            lens = torch.zeros(self.n_docs, dtype=torch.long, device=d.device).scatter_reduce(0, d, off + 1, "amax")
            self.cache["lengths"] = (d, off, lens)
        return self.cache["lengths"]

    def aligned(self, C: int, longer_than: int = 0) -> AlignedDocs:
        """The chunk-aligned view for chunk size C (``AlignedDocs``), built once per batch and C
        (its length T′ ≤ T + (documents in a row) · (C − 1) from the host lengths: T′ = max over
        rows of Σ_{its documents kept} ⌈len/C⌉·C). ``longer_than`` = n
        > 0 keeps only the documents of more than n tokens (the others have no place in the view:
        ``AlignedDocs.kept`` is False on their tokens, T′ may be 0)."""
        key = ("aligned", C, longer_than)
        if key in self.cache:
            return self.cache[key]
        B, T = self.shape
        dev = self.starts.device
        d, off, lens = self._doc_lengths()
        keep_doc = lens > longer_than
        plen = torch.where(keep_doc, (lens + C - 1) // C * C, 0)
        begin = plen.cumsum(0) - plen                      # each document's start, rows laid end to end
        row_base = begin[self.doc_index[:, 0]]             # [B]
        hl, hrow, _ = self._host()
        hplen = torch.where(hl > longer_than, (hl + C - 1) // C * C, 0)
        Tp = int(torch.zeros(B, dtype=torch.long).index_add_(0, hrow, hplen).max())   # host tensors
        row = torch.arange(B, device=dev).repeat_interleave(T)
        doc_begin = begin[d] - row_base[row]               # in its row of the aligned view
        n_mb = Tp // C
        kept = keep_doc[d]
        # a left-out document's tokens go to one scratch place after the view, dropped
        dest = torch.where(kept, row * Tp + doc_begin + off, B * Tp)
        big = torch.iinfo(torch.long).max // 2
        offset = torch.full((B * Tp + 1,), big, dtype=torch.long, device=dev).index_copy(0, dest, off)[:-1]
        first = torch.where(kept, row * n_mb + doc_begin // C, B * n_mb)
        resets = torch.zeros(B * n_mb + 1, dtype=torch.bool, device=dev).index_fill(0, first, True)[:-1]
        out = AlignedDocs(dest, offset.view(B, Tp), resets.view(B, n_mb), Tp,
                          None if longer_than <= 0 else kept.view(B, T))
        self.cache[key] = out
        return out

    def balanced(self, C: int) -> AlignedDocs:
        """The documents laid out at multiples of C as in ``aligned(C)``, but in rows of their own
        choosing (``AlignedDocs.rows``): as many rows as the longest padded document fits into the
        total, filled longest document first, each into the row with the least so far (LPT
        scheduling), so that a scan over the rows runs about as many steps as the longest document
        needs. For a mixer whose scan takes one step per block of tokens over all rows at once
        (TTT's mini-batch loop, the Titans memory's chunk loop, Titans MAC's block scan). The
        schedule is made on the host from ``host_lengths``; its [N] document places reach the
        device in one non-blocking copy."""
        key = ("balanced", C)
        if key in self.cache:
            return self.cache[key]
        B, T = self.shape
        dev = self.starts.device
        d, off, lens = self._doc_lengths()
        plen = [-(-n // C) * C for n in self._host()[0].tolist()]
        rows = max(1, min(self.n_docs, -(-sum(plen) // max(plen))))
        heap = [(0, r) for r in range(rows)]
        begin = [0] * self.n_docs
        for n in sorted(range(self.n_docs), key=lambda n: -plen[n]):
            load, r = heapq.heappop(heap)
            begin[n] = (r, load)
            heapq.heappush(heap, (load + plen[n], r))
        Tp = max(load for load, _ in heap)
        flat = host_to_device(torch.tensor([r * Tp + b for r, b in begin], dtype=torch.long), dev)
        dest = flat[d] + off
        big = torch.iinfo(torch.long).max // 2
        offset = torch.full((rows * Tp,), big, dtype=torch.long, device=dev).index_copy(0, dest, off)
        resets = torch.zeros(rows * Tp // C, dtype=torch.bool, device=dev).index_fill(0, flat // C, True)
        out = AlignedDocs(dest, offset.view(rows, Tp), resets.view(rows, Tp // C), Tp, rows=rows,
                          packed_shape=(B, T))
        self.cache[key] = out
        return out

    def prefixed(self, n: int) -> "PrefixedDocs":
        """The rows with n slots inserted before every document (piece), for a mixer that runs
        each document alone as [n prefix tokens ‖ the document] (Titans MAL's persistent tokens):
        ``PrefixedDocs``, built once per batch and n. Its layout counts positions from each
        document's first prefix slot; a row with fewer documents than the longest row ends in
        padding that continues its last document (after it, so causal forms never read it). Its
        sizes come from the host lengths (T′ = T + n · the most pieces in a row; piece lengths
        len + n, a row's last piece also its padding), so it reads nothing back."""
        key = ("prefixed", n)
        if key in self.cache:
            return self.cache[key]
        B, T = self.shape
        dev = self.starts.device
        seg = self.seg
        hl, hrow, count = self._host()
        Tp = T + n * int(count.max())
        dest = (torch.arange(T, device=dev) + n * (seg + 1)) + torch.arange(B, device=dev)[:, None] * Tp
        dest = dest.flatten()
        begins = torch.nonzero_static(self.starts.flatten(), size=self.n_docs)[:, 0]   # size known: no sync
        first = dest[begins] - n                                   # each document's first prefix slot
        slot = (first[:, None] + torch.arange(n, device=dev)).flatten()
        # source of every slot of the [B·T′] view: a token (0 … B·T − 1), a prefix token
        # (B·T + j), or zero (B·T + n: the padding at a row's end)
        src = torch.full((B * Tp,), B * T + n, dtype=torch.long, device=dev)
        src = src.index_copy(0, dest, torch.arange(B * T, device=dev))
        src = src.index_copy(0, slot, (B * T + torch.arange(n, device=dev)).repeat(self.n_docs))
        starts = torch.zeros(B * Tp, dtype=torch.bool, device=dev).index_fill(0, first, True).view(B, Tp)
        idx = torch.arange(Tp, device=dev).expand(B, Tp)
        offset = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 1).values
        # the layout of the [B, T′] rows, as DocLayout.build(offset) gives it (offset is a valid
        # layout by construction, its starts those above), its sizes from the host
        plens = hl + n
        plens.index_add_(0, count.cumsum(0) - 1, Tp - T - n * count)   # each row's padding: its last piece
        layout = DocLayout(offset, starts, offset, self.n_docs, int(plens.max()), plens)
        out = PrefixedDocs(layout, dest, src, n)
        self.cache[key] = out
        return out

    def _dest(self) -> torch.Tensor:
        """[B·T]: each token's flat index in the padded [N · L] view."""
        return (self.doc_index * self.max_len + self.offset).flatten()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] → [N, L, ...]: document n in row n, zeros after its end."""
        B, T = self.shape
        flat = x.reshape(B * T, *x.shape[2:])
        out = flat.new_zeros(self.n_docs * self.max_len, *x.shape[2:])
        out = out.index_copy(0, self._dest(), flat)
        return out.view(self.n_docs, self.max_len, *x.shape[2:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y [N, L, ...] → [B, T, ...], the inverse of ``pad`` on the tokens that exist."""
        B, T = self.shape
        flat = y.reshape(self.n_docs * self.max_len, *y.shape[2:])
        return flat.index_select(0, self._dest()).view(B, T, *y.shape[2:])


def masked_conv(conv: torch.nn.Conv1d, x: torch.Tensor, offset: torch.Tensor,
                cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A depthwise causal ``nn.Conv1d`` (weight [C, 1, w], y_t = b + Σ_j weight[:, j] x_{t−w+1+j})
    over x [B, T, C] restarted at each document start, from zero history: y_t = b + Σ_{j<w,
    j ≤ offset_t} W_j ⊙ x_{t−j}, ``offset`` [B, T] the token's index in its document (the taps
    that would read the previous document are masked, not sliced): the convolution of each
    document alone.

    ``cache`` [B, C, w − 1] (None: zeros): the w − 1 inputs just before x (x_{−w+1} … x_{−1}), for
    a slice of longer rows (context parallelism's halo); ``offset`` then counts from each piece's
    first token wherever it lies, so a tap reaches into the cache only for a document that began
    before the slice, and the same mask drops the cached inputs of an earlier document."""
    w = conv.kernel_size[0]
    weight = conv.weight[:, 0, :]                       # [C, w]; tap j (x_{t−j}) is weight[:, w−1−j]
    y = conv.bias.to(x.dtype).expand_as(x) if conv.bias is not None else torch.zeros_like(x)
    T = x.shape[1]
    if cache is not None:
        if cache.shape != (x.shape[0], x.shape[2], w - 1):
            raise ValueError(f"masked_conv: cache must be [B, C, w − 1] = {(x.shape[0], x.shape[2], w - 1)}, "
                             f"got {tuple(cache.shape)}")
        xp = torch.cat([cache.to(x.dtype).transpose(1, 2), x], 1)   # [B, w − 1 + T, C]
        for j in range(w):
            keep = (offset >= j).unsqueeze(-1).to(x.dtype)
            y = y + weight[:, w - 1 - j].to(x.dtype) * xp[:, w - 1 - j:w - 1 - j + T] * keep
        return y
    for j in range(min(w, T)):
        xs = x if j == 0 else torch.nn.functional.pad(x[:, :T - j], (0, 0, j, 0))
        keep = (offset >= j).unsqueeze(-1).to(x.dtype)
        y = y + weight[:, w - 1 - j].to(x.dtype) * xs * keep
    return y


def doc_conv(conv, x: torch.Tensor, docs, cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A ``CausalConv1d`` over the packed rows x [B, T, C], restarted at each document start
    (``masked_conv`` at ``docs.offset``). ``cache`` [B, C, w − 1]: the inputs before x (a slice
    of longer rows: ``docs`` then a ``SliceDocs``, its offsets counted over the whole rows)."""
    return masked_conv(conv.conv, x, docs.offset, cache)


@dataclass
class AlignedDocs:
    """The documents of a batch laid out so that each starts at a multiple of C, each in its own
    row and order, followed by zeros up to the next multiple (``DocLayout.aligned``): [B, T′]
    with T′ the longest such row. ``offset`` [B, T′]: a token's index in its document (a large
    value on padding, whose outputs are dropped); ``resets`` [B, T′/C] bool: chunk m starts a
    document. ``kept`` [B, T] bool (None: every token): the tokens the view holds, when it
    leaves out the short documents (``DocLayout.aligned(C, longer_than)``); ``unpad`` gives zeros
    on the others. ``DocLayout.balanced`` gives the same view in ``rows`` rows of its own choosing
    (B above stands for them; ``unpad`` returns the packed [B, T] rows)."""
    dest: torch.Tensor     # [B·T]: each token's flat index in [B · T′] (B · T′ for a token left out)
    offset: torch.Tensor   # [B, T′]
    resets: torch.Tensor   # [B, T′ / C]
    length: int            # T′
    kept: Optional[torch.Tensor] = None   # [B, T] bool
    #: ``DocLayout.balanced``: the rows of this view (else B, the packed rows') and the packed shape
    rows: Optional[int] = None
    packed_shape: Optional[Tuple[int, int]] = None

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        rows = B if self.rows is None else self.rows
        flat = x.reshape(B * T, *x.shape[2:])
        n = rows * self.length + (self.kept is not None)       # the scratch place of left-out tokens
        out = flat.new_zeros(n, *x.shape[2:]).index_copy(0, self.dest, flat)
        return out[:rows * self.length].view(rows, self.length, *x.shape[2:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        rows = y.shape[0]
        flat = y.reshape(rows * self.length, *y.shape[2:])
        if self.kept is not None:
            flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        flat = flat.index_select(0, self.dest)
        return flat.view(rows if self.packed_shape is None else self.packed_shape[0], -1, *y.shape[2:])


@dataclass
class PrefixedDocs:
    """Packed rows [B, T] laid out as [B, T′] with ``n`` prefix slots before every document
    (``DocLayout.prefixed``): ``layout`` is the ``DocLayout`` of the [B, T′] rows (each document
    with its prefix one document); ``dest`` [B·T] each token's flat index there; ``src`` [B·T′]
    the source of each slot (a token, a prefix token, or zero)."""
    layout: DocLayout
    dest: torch.Tensor
    src: torch.Tensor
    n: int

    def pad(self, x: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] and the prefix tokens [n, D] → [B, T′, D] (one gather, differentiable)."""
        B, T, D = x.shape
        table = torch.cat([x.reshape(B * T, D), prefix.to(x.dtype), x.new_zeros(1, D)])
        return table.index_select(0, self.src).view(B, -1, D)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, T′, ...] → [B, T, ...]: the tokens' slots (the prefix slots and padding dropped)."""
        B = y.shape[0]
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.dest).view(B, -1, *y.shape[2:])


def check_packed_triton(name: str, backend, cu_seqlens, initial_state, output_final_state: bool) -> None:
    """The refusals shared by the ops' packed-document branches: the PyTorch chunked form and the
    Triton kernel run packed documents (``backend`` is the other one), and the Triton kernel's
    ``cu_seqlens`` path starts every document from the zero state (no initial, no final state)."""
    if backend == Backend.TORCH:
        return
    if backend != Backend.TRITON:
        raise ValueError(f"{name}: packed documents run in the PyTorch chunked form or the Triton kernel, "
                         f"not {backend!r}")
    if initial_state is not None or output_final_state:
        raise ValueError(f"{name}: packed documents (cu_seqlens) start from the zero state; they take no "
                         "initial state and return no final state")
    if cu_seqlens is None:
        raise ValueError(f"{name}: the Triton form of packed documents needs inp['cu_seqlens'] (from "
                         "inputs(x, docs=...)) beside inp['resets']")


def varlen_heads(*ts: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """[B, H, T, ...] tensors → [1, H, B·T, ...]: the rows of the batch back to back in one row
    (row-major, the order of ``DocLayout.cu_seqlens``), the layout of the ops' ``cu_seqlens`` path."""
    return tuple(t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:]) for t in ts)


def unflatten_heads(t: torch.Tensor, B: int) -> torch.Tensor:
    """[1, H, B·T, ...] → [B, H, T, ...], the inverse of ``varlen_heads``."""
    H, BT = t.shape[1], t.shape[2]
    return t[0].reshape(H, B, BT // B, *t.shape[3:]).transpose(0, 1)


__all__ = ["AlignedDocs", "DocLayout", "PrefixedDocs", "check_packed_triton", "check_positions", "doc_conv",
           "host_to_device", "masked_conv",
           "unflatten_heads", "varlen_heads"]
