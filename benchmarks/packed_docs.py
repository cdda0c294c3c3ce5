"""Packed documents with ``model.reset_at_doc_boundaries``: forward + backward of a [B, T] batch
whose rows each pack ``--docs`` documents, against the same batch as one document per row, per
tiny preset (4 layers), in one run. The ratio is what matters on a shared CPU.

Document lengths: each row is cut at ``--docs − 1`` distinct points drawn uniformly (seeded), so
lengths vary as in a packed corpus (``--equal`` cuts the rows into equal documents instead).

    OMP_NUM_THREADS=1 python benchmarks/packed_docs.py            # every tiny preset
    OMP_NUM_THREADS=1 python benchmarks/packed_docs.py --presets tiny_hawk tiny_ttt_linear
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ttt_lm.config import load_config  # noqa: E402
from ttt_lm.model import LM  # noqa: E402


def positions(B: int, T: int, n_docs: int, equal: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        if equal:
            cuts = torch.arange(1, n_docs) * (T // n_docs)
        else:
            cuts = torch.randperm(T - 1, generator=g)[:n_docs - 1].sort().values + 1
        bounds = [0] + cuts.tolist() + [T]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return torch.stack(rows)


def time_step(m: LM, ids, labels, pos, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        m(ids, labels=labels, position_ids=pos).loss.backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="*", default=None, help="names under configs/ (default: every tiny_*)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4,
                    help="layers (rounded up to a multiple of the preset's layer pattern)")
    ap.add_argument("--reps", type=int, default=3,
                    help="timed repetitions of each case, alternating (the fastest counts)")
    ap.add_argument("--equal", action="store_true", help="equal document lengths")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    names = a.presets or sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "tiny_*.yaml")))
    B, T = a.batch, a.seq_len
    packed = positions(B, T, a.docs, a.equal, a.seed)
    one = torch.arange(T).expand(B, T).contiguous()
    lens = [int(x) for x in (packed == 0).sum(1)]
    print(f"# [{B}, {T}], {a.docs} documents per row ({'equal' if a.equal else 'random'} lengths; longest "
          f"{int(max((torch.diff(torch.cat([(r == 0).nonzero()[:, 0], torch.tensor([T])])).max()) for r in packed))}"
          f"), fp32, {torch.get_num_threads()} thread(s), best of {a.reps}; docs per row {lens}")
    print("| preset | kinds | layers | one doc / row (s) | packed (s) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml")).model
        n_pat = len(cfg.layer_pattern)
        cfg.n_layers = a.layers if a.layers % n_pat == 0 else n_pat * -(-a.layers // n_pat)
        cfg.reset_at_doc_boundaries = True
        torch.manual_seed(a.seed)
        m = LM(cfg).train()
        g = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        time_step(m, ids, labels, one, 1)   # warm-up
        time_step(m, ids, labels, packed, 1)
        # the two cases alternate, so a change of the machine's load meets both
        t_one = t_packed = float("inf")
        for _ in range(a.reps):
            t_one = min(t_one, time_step(m, ids, labels, one, 1))
            t_packed = min(t_packed, time_step(m, ids, labels, packed, 1))
        print(f"| {name} | {'/'.join(dict.fromkeys(cfg.layer_kinds()))} | {cfg.n_layers} | {t_one:.3f} | {t_packed:.3f} | "
              f"{t_packed / t_one:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
