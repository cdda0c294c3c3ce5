"""Data section of the experiment config."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = "data/shakespeare"      # a prepared directory (manifest.json + shards + tokenizer)
    seq_len: int = 256                  # tokens per training sequence
    num_workers: int = 0                # DataLoader worker processes per rank
    seed: int = 1234
