"""Print a model's size and training cost from a config:

    python -m ttt_lm.info configs/ttt_linear_125m.yaml [model.n_layers=6 ...]

Counts parameters on the meta device (no memory is allocated, so 1.3B presets are instant) and
reports the training FLOPs per token from ttt_lm.model.flops, the function MFU logging and the
scaling-law scripts also use.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch

from ttt_lm.config import ConfigError, load_config
from ttt_lm.model.config import ModelConfig


def param_counts(cfg: ModelConfig) -> dict:
    from ttt_lm.model.lm import LM

    with torch.device("meta"):
        model = LM(cfg)
    total = model.num_params()
    return {"total": total, "non_embedding": model.num_params(exclude_embeddings=True)}


def describe(cfg: ModelConfig, seq_len: int) -> dict:
    from ttt_lm.model.flops import flops_per_token

    out = {"layers": dict(Counter(cfg.layer_kinds())), "d_model": cfg.d_model, "n_layers": cfg.n_layers,
           "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size, "seq_len": seq_len}
    out["params"] = param_counts(cfg)
    out["flops_per_token"] = flops_per_token(cfg, seq_len)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.info", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    ap.add_argument("--seq-len", type=int, default=None, help="context for FLOPs (default: data.seq_len)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    d = describe(cfg.model, a.seq_len or cfg.data.seq_len)
    if a.json:
        print(json.dumps(d, indent=2))
        return 0
    p, f = d["params"], d["flops_per_token"]
    print(f"layers        {d['n_layers']} × d_model {d['d_model']}, heads {d['n_heads']}: "
          + ", ".join(f"{k}×{v}" for k, v in d["layers"].items()))
    print(f"parameters    {p['total'] / 1e6:,.1f} M total, {p['non_embedding'] / 1e6:,.1f} M without embeddings")
    print(f"FLOPs/token   {f['train'] / 1e9:,.3f} GFLOP training ({f['forward'] / 1e9:,.3f} forward) at seq_len {d['seq_len']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
