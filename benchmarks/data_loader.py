"""Throughput of the training data reader alone: shards -> packed, shuffled batches (no model).

    python benchmarks/data_loader.py [--data data/shakespeare] [--workers 0 2] [--batches 400]

Prints one line per worker count with tokens/s over the timed batches; the first batches
(worker start-up, first shard reads) are excluded as warm-up. Prepares the default corpus first
when --data is the default path and it is missing.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ttt_lm.data import DataConfig, build_train_loader  # noqa: E402
from ttt_lm.data.default_corpus import DEFAULT_OUTPUT, prepare_corpus, shakespeare_files  # noqa: E402


def measure(path: str, seq_len: int, batch: int, workers: int, batches: int, warmup: int) -> float:
    cfg = DataConfig(path=path, seq_len=seq_len, num_workers=workers)
    it = iter(build_train_loader(cfg, batch, 0, 1))
    for _ in itertools.islice(it, warmup):
        pass
    t0 = time.perf_counter()
    n = 0
    for b in itertools.islice(it, batches):
        n += b["input_ids"].numel()
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_OUTPUT)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args()
    if args.data == DEFAULT_OUTPUT:
        prepare_corpus(shakespeare_files(), args.data, progress=False)
    for w in args.workers:
        tps = measure(args.data, args.seq_len, args.batch, w, args.batches, args.warmup)
        print(f"data_loader: {args.data} seq_len={args.seq_len} batch={args.batch} num_workers={w}: "
              f"{tps:,.0f} tokens/s over {args.batches} batches")


if __name__ == "__main__":
    main()
