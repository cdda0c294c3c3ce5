"""Streaming readers: the resumable training loader, the fixed validation loader, whole documents.

Streams. The run reads ``V`` streams in all (``data.streams``; by default ``dp_world ×
max(1, num_workers)`` when the run starts, then fixed: a resumed run takes it from its
checkpoint). For epoch ``e`` the train shards are permuted with a generator seeded by
``(seed, e)`` and stream ``v`` takes every ``V``-th shard of that order starting at ``v``, so
within an epoch the streams read disjoint shards whose union is the whole train split, whatever
the number of ranks. Data-parallel rank ``r`` serves the ``S = V / dp_world`` streams
``v = r + dp_world·s`` (its local streams ``s = 0 .. S-1``); each of its DataLoader workers serves
``S / num_workers`` of them (the main process all of them with ``num_workers = 0``).
Tensor/sequence-parallel peers pass the same ``dp_rank`` and therefore read the same data.

Packing. A stream reads its shards one at a time. A shard's documents (each ending in the
end-of-document id) are permuted with a generator seeded by ``(seed, e, shard)`` and
concatenated; window ``j`` is ``tokens[j·T : j·T + T + 1]`` (consecutive windows share one
token, so every token is a label once) and the ``(len - 1) // T`` windows are visited in an
order permuted by the same key. The tail of a shard shorter than a window is dropped, which
loses less than ``T`` tokens per shard. A shuffled shard is read whole (as its documents) before
its first window; remote data read in order (``shuffle=False``) is cut into windows as the
documents stream in, holding one window and one document (``StreamPlan.iter_windows``), and
resuming inside such a shard reads its start again and drops the windows before the position.
A batch is ``B`` consecutive windows of one stream:

    input_ids[b, t]    = window[b, t]
    labels[b, t]       = window[b, t + 1]
    doc_ids[b, t]      = corpus index of the document input_ids[b, t] belongs to
    position_ids[b, t] = offset of input_ids[b, t] within that document (0 at its first token)

A model resets its state where ``position_ids == 0`` (or where ``doc_ids`` changes).

Order. A rank's batch ``k`` comes from its local stream ``k mod S``: DataLoader returns batches
from its workers strictly round-robin, and worker ``j`` of ``W`` serves local streams
``(k0 + j + W·i) mod S`` for its ``i``-th batch after a (re)start at batch ``k0``. Counting the
batches of all ranks in the order ``g = k·dp_world + r`` (one micro-batch of every rank, then
the next), batch ``g`` comes from stream ``g mod V``: the run reads one global sequence of
batches whose order does not depend on the number of ranks. An optimizer step of
``micro_batch_size × grad_accum × dp_world`` sequences reads the next ``grad_accum × dp_world``
batches of it, so with the same ``V`` and the same global batch every step reads the same
sequences on any number of ranks (only which rank reads which, and so the order in which their
gradients are summed, differs).

State. A stream's position is three counters ``(epoch, shard index in its epoch list, window
index in that shard)``, and everything it yields from there is a deterministic function of the
seed, the epoch and the shard list, so the position alone restores it. Every batch carries its
stream's position after it and the main process keeps the latest per stream. ``state_dict`` is
per data-parallel rank (its local streams and its batch count); restoring reads only the shard a
stream was in. To resume on another number of ranks, ``merge_states`` joins the states of all
old ranks into one table of the ``V`` stream positions and the global batch count ``G``, and
``TrainLoader.load_merged_state`` gives rank ``r`` of ``dp_world'`` its streams and the batch
count ``G / dp_world'`` (``V`` and ``G`` must be multiples of ``dp_world'``): no sequence is read
twice or skipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ttt_lm.data.config import DataConfig
from ttt_lm.data.manifest import DataError, load_manifest, verify_checksums
from ttt_lm.data.remote import is_remote
from ttt_lm.data.shards import iter_shard, read_shard

STATE_VERSION = 1
# Distinct streams of random numbers derived from one seed.
_SHARD_ORDER, _DOC_ORDER, _WINDOW_ORDER = 1, 2, 3

Position = Tuple[int, int, int]  # (epoch, shard index within the stream's epoch list, window index)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))


@dataclass(frozen=True)
class StreamPlan:
    """Everything that decides what a stream reads; small and picklable for worker processes."""
    root: str
    shards: Tuple[dict, ...]
    vocab_size: int
    dtype: str
    seq_len: int
    seed: int
    shuffle: bool
    dp_rank: int
    dp_world: int
    n_streams: int

    def stream_shards(self, epoch: int, stream: int) -> List[int]:
        n = len(self.shards)
        order = _rng(self.seed, _SHARD_ORDER, epoch).permutation(n) if self.shuffle else np.arange(n)
        return [int(i) for i in order[self.dp_rank::self.dp_world][stream::self.n_streams]]

    def shard_windows(self, epoch: int, shard: int):
        """Packed tokens of one shard with their document ids and positions, and the window order."""
        docs, _ = read_shard(self.root, self.shards[shard], self.vocab_size, self.dtype)
        order = _rng(self.seed, _DOC_ORDER, epoch, shard).permutation(len(docs)) if self.shuffle \
            else np.arange(len(docs))
        tokens, doc_ids, positions = _pack([docs[i] for i in order])
        n_windows = max(0, (len(tokens) - 1) // self.seq_len)
        windows = _rng(self.seed, _WINDOW_ORDER, epoch, shard).permutation(n_windows) if self.shuffle \
            else np.arange(n_windows)
        return tokens, doc_ids, positions, windows

    @property
    def streams_shards(self) -> bool:
        """Whether windows are cut from a shard as its documents arrive (:meth:`iter_windows`):
        remote data read in order. A shuffled shard needs all its documents first (they are
        permuted before packing), and a local one is checked whole before use."""
        return not self.shuffle and is_remote(self.root)

    def iter_windows(self, epoch: int, shard: int, start: int = 0):
        """Windows ``start, start + 1, ...`` of one shard in its order, each as
        ``(tokens, doc_ids, positions, is_last)``."""
        if not self.streams_shards:
            tokens, doc_ids, positions, order = self.shard_windows(epoch, shard)
            T = self.seq_len
            for w in range(start, len(order)):
                a = int(order[w]) * T
                yield tokens[a:a + T + 1], doc_ids[a:a + T + 1], positions[a:a + T + 1], w == len(order) - 1
            return
        held = None  # one window of look-ahead: whether a window is the shard's last is known after it
        for w, window in enumerate(self._cut_windows(shard)):
            if held is not None:
                yield (*held, False)
            held = window if w >= start else None
        if held is not None:
            yield (*held, True)

    def _cut_windows(self, shard: int):
        """The windows of a shard in order, cut from its documents as they stream in (the shard's
        checks run at its end, see ``iter_shard``); at most one window plus one document is held."""
        T = self.seq_len
        tokens = doc_ids = positions = np.zeros(0, np.int64)
        for doc, arr in iter_shard(self.root, self.shards[shard], self.vocab_size, self.dtype):
            t, d, p = _pack([(doc, arr)])
            tokens, doc_ids, positions = (np.concatenate(x) for x in ((tokens, t), (doc_ids, d), (positions, p)))
            a = 0
            while len(tokens) - a >= T + 1:
                yield tokens[a:a + T + 1], doc_ids[a:a + T + 1], positions[a:a + T + 1]
                a += T
            tokens, doc_ids, positions = tokens[a:].copy(), doc_ids[a:].copy(), positions[a:].copy()


def _pack(docs: Sequence[Tuple[int, np.ndarray]]):
    lengths = np.array([len(t) for _, t in docs], dtype=np.int64)
    tokens = np.concatenate([t for _, t in docs]).astype(np.int64)
    doc_ids = np.repeat(np.array([d for d, _ in docs], dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(len(tokens), dtype=np.int64) - starts
    return tokens, doc_ids, positions


def iter_stream(plan: StreamPlan, stream: int, pos: Position) -> Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray, Position]]:
    """Windows ``(tokens[T+1], doc_ids[T+1], positions[T+1], position after it)`` forever."""
    epoch, shard_pos, window = pos
    T = plan.seq_len
    while True:
        from_start = shard_pos == 0 and window == 0
        produced = False
        shard_list = plan.stream_shards(epoch, stream)
        while shard_pos < len(shard_list):
            for tokens, doc_ids, positions, last in plan.iter_windows(epoch, shard_list[shard_pos], window):
                window += 1
                nxt = (epoch, shard_pos + 1, 0) if last else (epoch, shard_pos, window)
                produced = True
                yield tokens, doc_ids, positions, nxt
            shard_pos, window = shard_pos + 1, 0
        if from_start and not produced:
            names = [plan.shards[i]["name"] for i in shard_list]
            raise DataError(f"data-parallel rank {plan.dp_rank}, stream {stream}: shards {names} in epoch {epoch} hold "
                            f"no sequence of seq_len+1={T + 1} tokens; prepare with larger --shard-tokens "
                            f"or use a shorter seq_len")
        epoch, shard_pos, window = epoch + 1, 0, 0


def _to_batch(packed: np.ndarray) -> Dict[str, torch.Tensor]:
    """``packed[0/1/2, b]``: tokens, document ids, positions of window ``b`` (T + 1 each)."""
    t = torch.from_numpy(packed)
    return {"input_ids": t[0, :, :-1].contiguous(), "labels": t[0, :, 1:].contiguous(),
            "doc_ids": t[1, :, :-1].contiguous(), "position_ids": t[2, :, :-1].contiguous()}


class _TrainStreams(IterableDataset):
    """Yields the batches of this rank's local streams; a DataLoader worker serves every
    ``num_workers``-th of them (the main process all), round-robin (see the module docstring)."""

    def __init__(self, plan: StreamPlan, batch_size: int, positions: Sequence[Position], rotation: int):
        self.plan, self.batch_size, self.positions, self.rotation = plan, batch_size, list(positions), rotation

    def __iter__(self):
        info = get_worker_info()
        worker, n = (info.id, info.num_workers) if info is not None else (0, 1)
        S = self.plan.n_streams
        if S % n:
            raise DataError(f"{n} DataLoader workers for {S} streams: the workers must divide the streams")
        windows = {}
        i = 0
        while True:
            stream = (self.rotation + worker + n * i) % S
            i += 1
            if stream not in windows:
                windows[stream] = iter_stream(self.plan, stream, tuple(self.positions[stream]))
            got = [next(windows[stream]) for _ in range(self.batch_size)]
            # One numpy array per batch: it crosses the worker pipe as plain bytes, which is much
            # cheaper than four tensors passed as shared-memory handles.
            yield (np.stack([np.stack([g[i] for g in got]) for i in range(3)]), stream, got[-1][3])


def _identity(x):
    return x


class TrainLoader:
    """Infinite, exactly resumable batches for one data-parallel rank (see the module docstring)."""

    def __init__(self, plan: StreamPlan, cfg: DataConfig, micro_batch_size: int, checksum: str):
        self.plan, self.cfg, self.micro_batch_size, self.checksum = plan, cfg, micro_batch_size, checksum
        self.positions: List[Position] = [(0, 0, 0)] * plan.n_streams
        self.batches = 0

    @property
    def epoch(self) -> int:
        """The lowest epoch any of this rank's streams is in."""
        return min(p[0] for p in self.positions)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        ds = _TrainStreams(self.plan, self.micro_batch_size, self.positions, self.batches % self.plan.n_streams)
        nw = self.cfg.num_workers
        dl = DataLoader(ds, batch_size=None, num_workers=nw, collate_fn=_identity,
                        prefetch_factor=self.cfg.prefetch_factor if nw > 0 else None)
        for packed, stream, position in dl:
            self.positions[stream] = tuple(int(x) for x in position)
            self.batches += 1
            batch = _to_batch(packed)
            if self.cfg.pin_memory and torch.cuda.is_available():
                batch = {k: v.pin_memory() for k, v in batch.items()}
            yield batch

    def _fingerprint(self) -> dict:
        p = self.plan
        return dict(data_checksum=self.checksum, seed=p.seed, seq_len=p.seq_len, shuffle=p.shuffle,
                    micro_batch_size=self.micro_batch_size, dp_rank=p.dp_rank, dp_world=p.dp_world,
                    n_streams=p.n_streams)

    def state_dict(self) -> dict:
        """JSON-able: the batches consumed so far and each stream's (epoch, shard, window) after them."""
        return dict(version=STATE_VERSION, batches=self.batches, streams=[list(p) for p in self.positions],
                    **self._fingerprint())

    def load_state_dict(self, sd: dict) -> None:
        """This rank's own state, saved on the same number of data-parallel ranks and streams
        (another layout: ``merge_states`` and ``load_merged_state``)."""
        if sd.get("version") != STATE_VERSION:
            raise DataError(f"loader state version {sd.get('version')!r}, expected {STATE_VERSION}")
        diffs = [f"{k}: saved {sd.get(k)!r}, now {v!r}" for k, v in self._fingerprint().items() if sd.get(k) != v]
        if diffs:
            raise DataError("the loader state was saved for different data or settings and cannot resume "
                            "exactly (n_streams: streams per data-parallel rank): " + "; ".join(diffs))
        self.positions = [tuple(int(x) for x in p) for p in sd["streams"]]
        self.batches = int(sd["batches"])

    @property
    def total_streams(self) -> int:
        """``V``: the streams of all data-parallel ranks together."""
        return self.plan.dp_world * self.plan.n_streams

    def load_merged_state(self, merged: dict) -> None:
        """Take this rank's streams from ``merge_states``'s table (saved on any number of ranks)."""
        p = self.plan
        fp = {k: v for k, v in self._fingerprint().items() if k in _MERGED_KEYS}
        diffs = [f"{k}: saved {merged.get(k)!r}, now {v!r}" for k, v in fp.items() if merged.get(k) != v]
        if diffs:
            raise DataError("the loader state was saved for different data or settings and cannot resume "
                            "exactly: " + "; ".join(diffs))
        V, G = int(merged["total_streams"]), int(merged["global_batches"])
        if V != self.total_streams:
            raise DataError(f"the checkpoint's data order has {V} streams (data.streams) and this loader "
                            f"{p.dp_world} ranks × {p.n_streams} = {self.total_streams}; build it with "
                            f"total_streams={V}")
        if G % p.dp_world:
            raise DataError(f"{G} batches were read on {merged['dp_world']} data-parallel ranks: not a multiple of "
                            f"{p.dp_world} ranks, so they cannot continue the same order (keep the global batch: "
                            "micro_batch_size × grad_accum × data-parallel ranks)")
        self.positions = [tuple(int(x) for x in merged["streams"][p.dp_rank + p.dp_world * s])
                          for s in range(p.n_streams)]
        self.batches = G // p.dp_world


#: what a merged state keeps of each rank's fingerprint (the rest describes the old layout)
_MERGED_KEYS = ("data_checksum", "seed", "seq_len", "shuffle", "micro_batch_size")


def merge_states(states: Sequence[dict]) -> dict:
    """One table of the ``V`` stream positions and the global batch count from the loader states
    of every rank of a run (tensor/context-parallel peers may repeat a data-parallel rank's state;
    they must agree). JSON-able; see ``TrainLoader.load_merged_state``."""
    if not states:
        raise DataError("no loader state to merge")
    for sd in states:
        if sd.get("version") != STATE_VERSION:
            raise DataError(f"loader state version {sd.get('version')!r}, expected {STATE_VERSION}")
    first = states[0]
    dp, S = int(first["dp_world"]), int(first["n_streams"])
    by_rank: Dict[int, dict] = {}
    for sd in states:
        bad = [k for k in (*_MERGED_KEYS, "dp_world", "n_streams") if sd.get(k) != first.get(k)]
        if bad:
            raise DataError(f"the loader states of the ranks disagree on {bad}")
        r = int(sd["dp_rank"])
        if r in by_rank and (by_rank[r]["streams"] != sd["streams"] or by_rank[r]["batches"] != sd["batches"]):
            raise DataError(f"two loader states of data-parallel rank {r} disagree")
        by_rank[r] = sd
    if sorted(by_rank) != list(range(dp)):
        raise DataError(f"loader states of data-parallel ranks {sorted(by_rank)} given, the run had {dp}")
    counts = {int(sd["batches"]) for sd in by_rank.values()}
    if len(counts) != 1:
        raise DataError(f"the data-parallel ranks read different numbers of batches ({sorted(counts)}): the "
                        "state was not saved at an optimizer step")
    streams = [list(by_rank[v % dp]["streams"][v // dp]) for v in range(dp * S)]
    return dict(version=STATE_VERSION, total_streams=dp * S, global_batches=counts.pop() * dp, dp_world=dp,
                streams=streams, **{k: first[k] for k in _MERGED_KEYS})


def _plan(cfg: DataConfig, man: dict, split: str, dp_rank: int, dp_world: int, n_streams: int) -> StreamPlan:
    return StreamPlan(root=man["root"], shards=tuple(man["splits"][split]["shards"]), vocab_size=man["vocab_size"],
                      dtype=man["dtype"], seq_len=cfg.seq_len, seed=cfg.seed, shuffle=cfg.shuffle,
                      dp_rank=dp_rank, dp_world=dp_world, n_streams=n_streams)


def _check_args(cfg: DataConfig, micro_batch_size: int, dp_rank: int, dp_world: int) -> None:
    if cfg.seq_len < 1:
        raise ValueError(f"data.seq_len must be >= 1, got {cfg.seq_len}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if cfg.num_workers < 0:
        raise ValueError(f"data.num_workers must be >= 0, got {cfg.num_workers}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world={dp_world})")


def default_total_streams(cfg: DataConfig, dp_world: int) -> int:
    """``V`` for a run that starts now: ``data.streams``, or ``dp_world × max(1, num_workers)``."""
    return cfg.streams if cfg.streams is not None else dp_world * max(1, cfg.num_workers)


def build_train_loader(cfg: DataConfig, micro_batch_size: int, dp_rank: int = 0, dp_world: int = 1,
                       total_streams: Optional[int] = None) -> TrainLoader:
    """The loader of data-parallel rank ``dp_rank``. ``total_streams`` (``V``): a resumed run's
    (from its checkpoint); by default ``data.streams`` or ``dp_world × max(1, num_workers)``."""
    _check_args(cfg, micro_batch_size, dp_rank, dp_world)
    V = total_streams if total_streams is not None else default_total_streams(cfg, dp_world)
    if V < 1 or V % dp_world:
        raise DataError(f"{V} data streams (data.streams, or the checkpoint's: fixed when a run starts) cannot be "
                        f"shared by {dp_world} data-parallel ranks: the streams must be a multiple of the ranks. Use a "
                        f"rank count that divides {V}, or start runs with data.streams set to a multiple of every "
                        "rank count they may resume on")
    n_streams = V // dp_world
    if cfg.num_workers > 0 and n_streams % cfg.num_workers:
        raise DataError(f"each of the {dp_world} data-parallel rank(s) serves {n_streams} of the {V} data streams; "
                        f"data.num_workers={cfg.num_workers} must divide that (or be 0)")
    man = load_manifest(cfg.path)
    if cfg.verify_checksums:
        verify_checksums(man)
    shards = man["splits"]["train"]["shards"]
    if len(shards) < dp_world * n_streams:
        raise DataError(f"{cfg.path} has {len(shards)} train shard(s), fewer than data-parallel ranks × streams "
                        f"= {dp_world} × {n_streams} = {dp_world * n_streams} (streams = data.streams, by default "
                        f"ranks × max(1, num_workers)); prepare with a smaller --shard-tokens or use fewer streams")
    longest = max(s["tokens"] for s in shards)
    if longest < cfg.seq_len + 1:
        raise DataError(f"{cfg.path}: the largest train shard holds {longest} tokens, fewer than "
                        f"seq_len+1 = {cfg.seq_len + 1}")
    return TrainLoader(_plan(cfg, man, "train", dp_rank, dp_world, n_streams), cfg, micro_batch_size,
                       man["checksum"])


class ValLoader:
    """The validation split, packed like training data but unshuffled: the same batches every time.

    Windows ``j·T : j·T + T + 1`` of the val documents concatenated in manifest order; rank ``r``
    takes windows ``r, r + dp_world, ...``, and every rank gets the same number
    (``n_windows // dp_world``) so collective evals stay in step. The last batch may be smaller.
    """

    def __init__(self, plan: StreamPlan, micro_batch_size: int):
        self.plan, self.micro_batch_size = plan, micro_batch_size
        self._data = None

    def _load(self):
        if self._data is None:
            docs = []
            for s in self.plan.shards:
                docs += read_shard(self.plan.root, s, self.plan.vocab_size, self.plan.dtype)[0]
            tokens, doc_ids, positions = _pack(docs)
            T, p = self.plan.seq_len, self.plan
            per_rank = ((len(tokens) - 1) // T) // p.dp_world
            if per_rank == 0:
                raise DataError(f"{p.root}: the validation split has {len(tokens)} tokens, too few for one "
                                f"sequence of {T + 1} per data-parallel rank ({p.dp_world} ranks)")
            self._data = (tokens, doc_ids, positions, np.arange(per_rank) * p.dp_world + p.dp_rank)
        return self._data

    def __len__(self) -> int:
        return math.ceil(len(self._load()[3]) / self.micro_batch_size)

    @property
    def num_tokens(self) -> int:
        return len(self._load()[3]) * self.plan.seq_len

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        tokens, doc_ids, positions, windows = self._load()
        T = self.plan.seq_len
        for i in range(0, len(windows), self.micro_batch_size):
            starts = windows[i:i + self.micro_batch_size] * T
            yield _to_batch(np.stack([np.stack([x[a:a + T + 1] for a in starts]) for x in (tokens, doc_ids, positions)]))


def build_val_loader(cfg: DataConfig, micro_batch_size: int, dp_rank: int = 0, dp_world: int = 1) -> ValLoader:
    _check_args(cfg, micro_batch_size, dp_rank, dp_world)
    man = load_manifest(cfg.path)
    if not man["splits"].get("val", {}).get("shards"):
        raise DataError(f"{cfg.path} has no validation split (prepared with --val-fraction 0)")
    return ValLoader(_plan(cfg, man, "val", dp_rank, dp_world, 1), micro_batch_size)


def iter_documents(path: str, split: str = "val", dp_rank: int = 0, dp_world: int = 1,
                   with_ids: bool = False) -> Iterator:
    """Whole documents of a split in manifest order, as LongTensors ending in the eos id.

    Rank ``r`` of ``dp_world`` gets documents ``r, r + dp_world, ...``. With ``with_ids`` yields
    ``(corpus document index, tokens)``.
    """
    man = load_manifest(path)
    if split not in man["splits"] or not man["splits"][split]["shards"]:
        raise DataError(f"{path} has no {split!r} split")
    i = 0
    for s in man["splits"][split]["shards"]:
        for doc_id, arr in read_shard(man["root"], s, man["vocab_size"], man["dtype"])[0]:
            if i % dp_world == dp_rank:
                t = torch.from_numpy(arr.astype(np.int64))
                yield (doc_id, t) if with_ids else t
            i += 1
