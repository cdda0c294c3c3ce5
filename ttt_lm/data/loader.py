"""Streaming readers: the resumable training loader, the fixed validation loader, whole documents.

Streams. The run reads ``V`` streams in all (``data.streams``; by default ``DEFAULT_STREAMS`` = 8,
or the train split's shard count when it has fewer: never the number of ranks or workers, so a
seed reads the same samples on any layout; fixed when the run starts, and a resumed run takes it
from its checkpoint). For epoch ``e`` the train shards are permuted with a generator seeded by
``(seed, e)`` and stream ``v`` takes every ``V``-th shard of that order starting at ``v``, so
within an epoch the streams read disjoint shards whose union is the whole train split.

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

Order. The run reads one global sequence of samples (windows): sample ``i`` is the next window
of stream ``i mod V``. It depends on the data, the seed and ``V`` only, never on the number of
ranks, workers or the batch size. An optimizer step of global batch ``G`` reads the next ``G``
samples; data-parallel rank ``r`` of ``dp_world`` takes those with ``i ≡ r (mod dp_world)``, in
order, and cuts them into its micro-batches (any contiguous range of ``G`` samples, ``G`` a
multiple of ``dp_world``, gives every rank ``G / dp_world``). DataLoader worker ``j`` of ``W``
serves the rank's ``j``-th, ``(j+W)``-th, ... samples and DataLoader returns them strictly
round-robin, so they arrive in order. When ``dp_world × W`` divides ``V`` every stream has one
reader; otherwise a stream is shared, and each reader reads all its windows and keeps its own
(exact, but more reading). Tensor/sequence-parallel peers pass the same ``dp_rank`` and read the
same samples.

State. A stream's position is three counters ``(epoch, shard index in its epoch list, window
index in that shard)`` plus the global index of the sample at that position; everything it
yields from there is a deterministic function of the seed, the epoch and the shard list, so the
position alone restores it. ``state_dict`` holds the global samples read (exact at an optimizer
step) and every stream's position as this rank last saw it; a stream another rank reads is
behind there, so ``merge_states`` joins all ranks' states taking each stream at its furthest
position, and the result resumes on any number of ranks and with any global batch: the next
step starts at the next sample, none read twice or skipped. Restoring reads only the shard a
stream was in.

Ahead of the reader. ``shards_ahead(n)`` names, from the manifest's token counts alone, the
shards the rank's next ``n`` samples read; ``check_ahead`` verifies them (sha256 against the
manifest) and ``start_verifier`` keeps doing so in a background thread, so that the trainer can
stop before a step that would read a bad shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ttt_lm.data.config import DataConfig
from ttt_lm.data.manifest import DataError, load_manifest, verify_checksums, verify_shard
from ttt_lm.data.remote import is_remote
from ttt_lm.data.shards import iter_shard, read_shard

STATE_VERSION = 2
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
        return [int(i) for i in order[stream::self.n_streams]]

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
            raise DataError(f"stream {stream}: shards {names} in epoch {epoch} hold "
                            f"no sequence of seq_len+1={T + 1} tokens; prepare with larger --shard-tokens "
                            f"or use a shorter seq_len")
        epoch, shard_pos, window = epoch + 1, 0, 0


def first_sample(start: int, dp_rank: int, dp_world: int) -> int:
    """The first global sample index ``>= start`` that data-parallel rank ``dp_rank`` reads."""
    return start + (dp_rank - start) % dp_world


def _to_batch(packed: np.ndarray) -> Dict[str, torch.Tensor]:
    """``packed[0/1/2, b]``: tokens, document ids, positions of window ``b`` (T + 1 each)."""
    t = torch.from_numpy(packed)
    return {"input_ids": t[0, :, :-1].contiguous(), "labels": t[0, :, 1:].contiguous(),
            "doc_ids": t[1, :, :-1].contiguous(), "position_ids": t[2, :, :-1].contiguous()}


class _RankSamples(IterableDataset):
    """Yields this rank's samples ``first, first + dp_world, ...`` (global indices) one at a time,
    each as ``(packed window, global index, stream, stream position after it)``; DataLoader worker
    ``j`` of ``W`` serves the ``j``-th, ``(j+W)``-th, ... of them (the main process all), so that
    DataLoader's strict round-robin over its workers returns them in order."""

    def __init__(self, plan: StreamPlan, table: Sequence[Tuple[Position, int]], first: int):
        self.plan, self.table, self.first = plan, list(table), first

    def __iter__(self):
        info = get_worker_info()
        worker, n = (info.id, info.num_workers) if info is not None else (0, 1)
        p = self.plan
        V, step = p.n_streams, p.dp_world * n
        opened: Dict[int, list] = {}  # stream -> [window iterator, global index of its next window]
        i = self.first + p.dp_world * worker
        while True:
            v = i % V
            if v not in opened:
                pos, nxt = self.table[v]
                opened[v] = [iter_stream(p, v, tuple(pos)), int(nxt)]
            it = opened[v]
            if it[1] > i:
                raise DataError(f"stream {v} is past sample {i} (at {it[1]}): the loader state is inconsistent")
            while it[1] < i:  # windows of this stream that other ranks or workers read
                next(it[0])
                it[1] += V
            tokens, doc_ids, positions, after = next(it[0])
            it[1] += V
            yield np.stack([tokens, doc_ids, positions]), i, v, after
            i += step


def _identity(x):
    return x


class TrainLoader:
    """Infinite, exactly resumable batches for one data-parallel rank (see the module docstring)."""

    def __init__(self, plan: StreamPlan, cfg: DataConfig, micro_batch_size: int, checksum: str):
        self.plan, self.cfg, self.micro_batch_size, self.checksum = plan, cfg, micro_batch_size, checksum
        # per stream: its position and the global index of the window at that position
        self.table: List[Tuple[Position, int]] = [((0, 0, 0), v) for v in range(plan.n_streams)]
        self.start = 0      # global samples read before this loader's (re)start
        self.taken = 0      # samples this rank has read since then
        self.last_indices: List[int] = []  # global sample index of each row of the last batch

    @property
    def samples(self) -> int:
        """Global samples read, counted at this rank's position (exact at every optimizer step:
        then every rank has read the same number since the start)."""
        return self.start + self.taken * self.plan.dp_world

    @property
    def total_streams(self) -> int:
        """``V``: the streams the global order interleaves (``data.streams``, fixed when a run starts)."""
        return self.plan.n_streams

    @property
    def shared_streams(self) -> bool:
        """Whether a stream is read by more than one rank or worker (each then reads all its windows
        and keeps its own): exact, but more reading than ``V`` a multiple of ranks × workers."""
        return self.plan.n_streams % (self.plan.dp_world * max(1, self.cfg.num_workers)) != 0

    @property
    def epoch(self) -> int:
        """The lowest epoch any stream is in."""
        return min(pos[0] for pos, _ in self.table)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        p = self.plan
        ds = _RankSamples(p, self.table, first_sample(self.samples, p.dp_rank, p.dp_world) + 0)
        nw = self.cfg.num_workers
        dl = DataLoader(ds, batch_size=None, num_workers=nw, collate_fn=_identity,
                        prefetch_factor=self.cfg.prefetch_factor * self.micro_batch_size if nw > 0 else None)
        got, idx = [], []
        for packed, i, v, after in dl:
            self.table[v] = (tuple(int(x) for x in after), int(i) + p.n_streams)
            got.append(packed)
            idx.append(int(i))
            if len(got) == self.micro_batch_size:
                self.taken += len(got)
                self.last_indices = idx
                batch = _to_batch(np.stack(got, axis=1))
                got, idx = [], []
                if self.cfg.pin_memory and torch.cuda.is_available():
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                yield batch

    # ---- verification ahead of the reader -----------------------------------------------------

    def shards_ahead(self, n: int) -> List[int]:
        """The train shards (indices into the manifest's list) that this rank's next ``n`` samples
        read, in the order of first use; from the manifest's token counts, without reading them."""
        p, T = self.plan, self.plan.seq_len
        V, table = p.n_streams, list(self.table)
        first = first_sample(self.samples, p.dp_rank, p.dp_world)
        need: Dict[int, int] = {}  # stream -> windows to pass from its position, the last one included
        for m in range(n):
            i = first + m * p.dp_world
            v = i % V
            need[v] = max(need.get(v, 0), (i - table[v][1]) // V + 1)
        out: List[int] = []
        for v in sorted(need):
            (e, s, w), left = table[v][0], need[v]
            empty_epochs = 0
            while left > 0 and empty_epochs < 2:
                shard_list = p.stream_shards(e, v)
                if s >= len(shard_list):
                    e, s, w = e + 1, 0, 0
                    empty_epochs += 1
                    continue
                sh = shard_list[s]
                avail = max(0, (int(p.shards[sh]["tokens"]) - 1) // T) - w
                if avail > 0:
                    empty_epochs = 0
                    if sh not in out:
                        out.append(sh)
                    left -= avail
                s, w = s + 1, 0
        return out

    def check_ahead(self, n: int) -> Optional[str]:
        """Verify every shard that the next ``n`` samples of this rank read and that was not verified
        yet (sha256 against the manifest; a remote shard read through, with retries). Returns what
        is wrong with the first bad one (naming it), or None. Results are kept: a shard is hashed
        once per run, here or by the background pass (``start_verifier``)."""
        for sh in self.shards_ahead(n):
            bad = self._verify(sh)
            if bad:
                return bad
        return None

    def _verify(self, sh: int) -> Optional[str]:
        import threading
        if not hasattr(self, "_verified"):
            self._verified, self._verify_lock = {}, threading.Lock()
        with self._verify_lock:
            if sh in self._verified:
                return self._verified[sh]
        try:
            verify_shard(self.plan.root, self.plan.shards[sh])
            bad = None
        except DataError as e:
            bad = str(e)
        with self._verify_lock:
            self._verified[sh] = bad
        return bad

    def start_verifier(self, n: int, say=None) -> None:
        """A background pass that keeps verifying the shards of this rank's next ``n`` samples as
        the run moves on, so a corrupt or unreachable shard is named long before its turn
        (``say``: where to tell; the trainer stops before the step that would read it)."""
        import threading
        self._stop_verifier = threading.Event()
        told = set()

        def loop():
            while not self._stop_verifier.is_set():
                for sh in self.shards_ahead(n):
                    if self._stop_verifier.is_set():
                        return
                    bad = self._verify(sh)
                    if bad and sh not in told and say is not None:
                        told.add(sh)
                        say(f"{bad}: found ahead of the reader; the run will stop with a checkpoint before the "
                            "step that reads it unless the shard is restored first")
                self._stop_verifier.wait(0.5)

        threading.Thread(target=loop, name="shard-verifier", daemon=True).start()

    def stop_verifier(self) -> None:
        if getattr(self, "_stop_verifier", None) is not None:
            self._stop_verifier.set()

    def _fingerprint(self) -> dict:
        p = self.plan
        return dict(data_checksum=self.checksum, seed=p.seed, seq_len=p.seq_len, shuffle=p.shuffle,
                    total_streams=p.n_streams)

    def state_dict(self) -> dict:
        """JSON-able: the global samples read and each stream's ``(epoch, shard, window)`` with
        the global index of its next window (this rank's view: ``merge_states`` joins the ranks')."""
        return dict(version=STATE_VERSION, samples=self.samples, dp_rank=self.plan.dp_rank,
                    dp_world=self.plan.dp_world, streams=[[*pos, nxt] for pos, nxt in self.table],
                    **self._fingerprint())

    def load_state_dict(self, sd: dict) -> None:
        """Continue from a state saved on any number of data-parallel ranks: this rank's own
        (same layout) or ``merge_states``'s join of all ranks' states."""
        _check_version(sd)
        diffs = [f"{k}: saved {sd.get(k)!r}, now {v!r}" for k, v in self._fingerprint().items() if sd.get(k) != v]
        if diffs:
            raise DataError("the loader state was saved for different data or settings and cannot resume "
                            "exactly: " + "; ".join(diffs))
        if sd.get("dp_rank") is not None and (sd["dp_rank"], sd["dp_world"]) != (self.plan.dp_rank, self.plan.dp_world):
            raise DataError(f"the loader state of data-parallel rank {sd['dp_rank']} of {sd['dp_world']} cannot be "
                            f"loaded by rank {self.plan.dp_rank} of {self.plan.dp_world}: join all ranks' states "
                            "with merge_states")
        self.table = [((int(e), int(s), int(w)), int(n)) for e, s, w, n in sd["streams"]]
        self.start, self.taken = int(sd["samples"]), 0

    load_merged_state = load_state_dict


def _check_version(sd: dict) -> None:
    if sd.get("version") != STATE_VERSION:
        raise DataError(f"loader state version {sd.get('version')!r}, expected {STATE_VERSION} (written by an older "
                        "version of this code, whose data order differs: start a new run, or resume it with that "
                        "version)")


def merge_states(states: Sequence[dict]) -> dict:
    """One state of the whole run from the loader states of all its ranks (tensor/context-parallel
    peers repeat a data-parallel rank's state): each stream at the furthest position any rank
    saw. JSON-able, loadable on any number of ranks (``TrainLoader.load_state_dict``)."""
    if not states:
        raise DataError("no loader state to merge")
    for sd in states:
        _check_version(sd)
    first = states[0]
    keys = ("data_checksum", "seed", "seq_len", "shuffle", "total_streams", "dp_world")
    for sd in states:
        bad = [k for k in keys if sd.get(k) != first.get(k)]
        if bad:
            raise DataError(f"the loader states of the ranks disagree on {bad}")
    ranks = sorted({int(sd["dp_rank"]) for sd in states})
    if ranks != list(range(int(first["dp_world"]))):
        raise DataError(f"loader states of data-parallel ranks {ranks} given, the run had {first['dp_world']}")
    counts = {int(sd["samples"]) for sd in states}
    if len(counts) != 1:
        raise DataError(f"the data-parallel ranks read different numbers of samples ({sorted(counts)}): the "
                        "state was not saved at an optimizer step")
    streams = [max((sd["streams"][v] for sd in states), key=lambda e: e[3]) for v in range(int(first["total_streams"]))]
    return dict(first, dp_rank=None, dp_world=None, streams=[list(e) for e in streams])


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


#: ``data.streams`` when unset: this many streams, or the train split's shard count when it has
#: fewer. A fact of the data, never of the layout, so the same seed reads the same samples on any
#: number of ranks (and workers); each rank reads only its own streams on 1, 2, 4 or 8 ranks × workers
DEFAULT_STREAMS = 8


def default_total_streams(cfg: DataConfig, n_train_shards: int) -> int:
    """``V`` for a run that starts now: ``data.streams``, or ``min(DEFAULT_STREAMS, train shards)``
    (never the number of ranks or workers: the data order is the same on any layout)."""
    return cfg.streams if cfg.streams is not None else max(1, min(DEFAULT_STREAMS, n_train_shards))


def build_train_loader(cfg: DataConfig, micro_batch_size: int, dp_rank: int = 0, dp_world: int = 1,
                       total_streams: Optional[int] = None) -> TrainLoader:
    """The loader of data-parallel rank ``dp_rank``. ``total_streams`` (``V``): a resumed run's
    (from its checkpoint); by default ``data.streams`` or ``default_total_streams``."""
    _check_args(cfg, micro_batch_size, dp_rank, dp_world)
    if total_streams is not None and total_streams < 1 or cfg.streams is not None and cfg.streams < 1:
        raise DataError(f"data.streams must be >= 1, got {total_streams if total_streams is not None else cfg.streams}")
    man = load_manifest(cfg.path)
    if cfg.verify_checksums:
        verify_checksums(man)
    shards = man["splits"]["train"]["shards"]
    V = total_streams if total_streams is not None else default_total_streams(cfg, len(shards))
    if len(shards) < V:
        raise DataError(f"{cfg.path} has {len(shards)} train shard(s), fewer than the {V} data streams "
                        "(data.streams): every stream needs a shard in every epoch; prepare with a smaller "
                        "--shard-tokens or use fewer streams")
    longest = max(s["tokens"] for s in shards)
    if longest < cfg.seq_len + 1:
        raise DataError(f"{cfg.path}: the largest train shard holds {longest} tokens, fewer than "
                        f"seq_len+1 = {cfg.seq_len + 1}")
    return TrainLoader(_plan(cfg, man, "train", dp_rank, dp_world, V), cfg, micro_batch_size,
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
