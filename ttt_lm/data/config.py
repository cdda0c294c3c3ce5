"""Data section of the experiment config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    path: str = "data/shakespeare"      # a prepared directory (manifest.json + shards + tokenizer)
    seq_len: int = 256                  # tokens per training sequence
    num_workers: int = 0                # DataLoader worker processes per rank (0: read in the main process)
    # streams the global data order interleaves (sample i from stream i mod streams); None: 8, or the
    # train shards when fewer (ttt_lm.data.loader.DEFAULT_STREAMS; never the rank count, so the order
    # is the same on any layout). Fixed for the run; any rank count resumes it, and each rank reads
    # only its own streams when ranks × workers divides it
    streams: Optional[int] = None
    seed: int = 1234                    # shard and sample order; part of the loader state
    shuffle: bool = True                # False: shards and sequences in manifest order (debugging)
    prefetch_factor: int = 2            # micro-batches each worker prepares ahead (num_workers > 0 only)
    pin_memory: bool = False
    verify_checksums: bool = False      # sha256 every shard against the manifest before first use
    # sha256 the shards each step reads before it runs (a background pass keeps ahead): a bad shard
    # then stops the run with a checkpoint before the step that reads it. Each shard is read once
    # more per run (for remote data: twice the transfer); false: a bad shard ends the run unsaved
    verify_ahead: bool = True
