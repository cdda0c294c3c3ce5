"""Pieces every eval shares: input checks, token byte lengths, progress bars, JSON and plots."""
from __future__ import annotations

import json
import os
import sys
from typing import Iterable, Optional

import torch

from ttt_lm.model import LM

#: layer kinds whose cost and positional range grow with the context (no window)
GLOBAL_ATTENTION = ("attention",)


class EvalError(ValueError):
    """An eval input that cannot be used (checkpoint, data, tokenizer, context length); the message
    says which and why."""


def check_context(model: LM, length: int, what: str = "context") -> None:
    """Refuse a context longer than ``model.cfg.max_seq_len`` for a model with global attention
    layers: it was built (RoPE range, memory plan) for at most that many positions. Recurrent and
    windowed layers have no such bound."""
    cfg = model.cfg
    glob = [k for k in cfg.layer_kinds() if k in GLOBAL_ATTENTION]
    if glob and length > cfg.max_seq_len:
        raise EvalError(f"{what} length {length} exceeds model.max_seq_len={cfg.max_seq_len} of a model with "
                        f"global attention layers ({len(glob)} of {cfg.n_layers}: {sorted(set(cfg.layer_kinds()))}); "
                        f"use a length <= {cfg.max_seq_len}")


def check_vocab(model: LM, vocab_size: int, source: str, allow_padding: bool = False) -> None:
    """The model's embedding must have the tokenizer's vocabulary; with ``allow_padding`` a larger
    table (padded to a multiple of 64/128 for speed) is accepted, never a smaller one."""
    mv = model.cfg.vocab_size
    if mv == vocab_size or (allow_padding and mv > vocab_size):
        return
    raise EvalError(f"vocabulary mismatch: the model has vocab_size={mv} but {source} uses a "
                    f"{vocab_size}-token tokenizer; evaluate with data tokenized by the model's own tokenizer")


def token_byte_lengths(tok, vocab_size: Optional[int] = None) -> torch.Tensor:
    """UTF-8 bytes each token id contributes to decoded text (int64 [V]).

    For a SentencePiece model: a byte-fallback piece ``<0xAB>`` is 1 byte, control and unknown
    pieces (``<s>``, ``</s>``, ``<unk>``) 0, any other piece its text with ``▁`` read as a space.
    With the project's lossless tokenizer (no dummy prefix, identity normalization) the sum over
    a token sequence equals ``len(decode(ids).encode())``; bits per byte divide by this sum.
    """
    sp = getattr(tok, "sp", tok)
    n = vocab_size if vocab_size is not None else sp.GetPieceSize()
    out = torch.zeros(n, dtype=torch.int64)
    for i in range(min(n, sp.GetPieceSize())):
        if sp.IsControl(i) or sp.IsUnknown(i):
            continue
        if sp.IsByte(i):
            out[i] = 1
            continue
        out[i] = len(sp.IdToPiece(i).replace("\u2581", " ").encode("utf-8"))
    return out


def progress(it: Iterable, total: Optional[int] = None, desc: str = "", enable: bool = True):
    if not enable:
        return it
    from tqdm import tqdm
    return tqdm(it, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def pick_device(device: Optional[str]) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def dtype_of(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float64": torch.float64, "fp64": torch.float64}
    if name not in table:
        raise EvalError(f"unknown dtype {name!r}; one of {sorted(table)}")
    return table[name]


def write_json(path: str, obj) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (works without a display)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt
