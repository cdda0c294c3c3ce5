"""Pieces every eval shares: input checks, token byte lengths, progress bars, JSON and plots, and
the process group of a multi-process run."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Tuple

import torch

from ttt_lm.env import detect_env, missing_rendezvous
from ttt_lm.model import LM
from ttt_lm.model.registry import kinds_with

class EvalError(ValueError):
    """An eval input that cannot be used (checkpoint, data, tokenizer, context length); the message
    says which and why."""


def check_context(model: LM, length: int, what: str = "context") -> None:
    """Refuse a context longer than ``model.cfg.max_seq_len`` for a model with global attention
    layers: it was built (RoPE range, memory plan) for at most that many positions. Recurrent and
    windowed layers have no such bound."""
    cfg = model.cfg
    if not getattr(type(model), "reads_layer_pattern", True):
        # a model variant with blocks of its own (TTT-E2E) says how many of them attend globally
        n = model.global_attention_layers() if hasattr(model, "global_attention_layers") else 0
        if n and length > cfg.max_seq_len:
            raise EvalError(f"{what} length {length} exceeds model.max_seq_len={cfg.max_seq_len} of a model with "
                            f"global attention layers ({n} of {cfg.n_layers}: {type(model).__name__} without a "
                            f"window); use a length <= {cfg.max_seq_len}")
        return
    # the layers whose mixer declares global_attention (its cost and positional range grow with
    # the context: no window)
    glob = kinds_with(lambda cls: cls.global_attention, cfg.layer_kinds())
    if glob and length > cfg.max_seq_len:
        raise EvalError(f"{what} length {length} exceeds model.max_seq_len={cfg.max_seq_len} of a model with "
                        f"global attention layers ({len(glob)} of {cfg.n_layers}: {sorted(set(cfg.layer_kinds()))}); "
                        f"use a length <= {cfg.max_seq_len}")


def check_vocab(model: LM, vocab_size: int, source: str, allow_padding: bool = False) -> None:
    """The model's embedding must have the tokenizer's vocabulary; with ``allow_padding`` a larger
    table (padded to a multiple of 64/128 for speed) is accepted, never a smaller one.

    The policy for a padded model, the same in every eval, ``generate`` and the trainer: its ids at
    or above the tokenizer's vocab_size are never produced (argmax and sampling mask them) and never
    scored (no data holds them, so none is a target); losses are the model's own softmax over its
    whole table, as in training. Every eval and ``generate`` accept such a model; ``python -m
    ttt_lm.eval`` says so once (:func:`vocab_padding_note`)."""
    from ttt_lm.data.manifest import vocab_fits
    mv = model.cfg.vocab_size
    if vocab_fits(mv, vocab_size, allow_padding):
        return
    raise EvalError(f"vocabulary mismatch: the model has vocab_size={mv} but {source} uses a "
                    f"{vocab_size}-token tokenizer; evaluate with data tokenized by the model's own tokenizer")


def vocab_padding_note(model_vocab: int, tokenizer_vocab: int, source: str) -> Optional[str]:
    """The line an eval prints (on stderr) for a model whose vocabulary is padded beyond its
    tokenizer's; None when the sizes are equal."""
    if model_vocab <= tokenizer_vocab:
        return None
    return (f"note: model.vocab_size={model_vocab} is larger than the vocab_size={tokenizer_vocab} of {source}: "
            f"ids {tokenizer_vocab}..{model_vocab - 1} are padding that no data holds; they are never produced "
            f"or scored")


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


def pick_device(device: Optional[str], local_rank: Optional[int] = None) -> torch.device:
    """``auto`` is CUDA when there is one; with ``local_rank`` (a multi-process run) a bare ``cuda``
    or ``auto`` becomes this process's own GPU, ``cuda:<local_rank>``."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and local_rank is not None:
        return torch.device("cuda", local_rank)
    return torch.device(device)


# ---- several processes ---------------------------------------------------------------------------

@dataclass
class DistContext:
    """This process's place in an eval run. Work item ``i`` of a sequence every rank enumerates in
    the same order belongs to rank ``i mod world_size``; partial sums meet in :meth:`sum`. With
    ``world_size == 1`` every method is the identity, so one process runs the same code."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: where collective tensors live: the rank's GPU for NCCL, the CPU for gloo
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, index: int) -> bool:
        return index % self.world_size == self.rank

    def sum(self, *tensors: torch.Tensor, error: Optional[BaseException] = None) -> Tuple[torch.Tensor, ...]:
        """Element-wise sums over ranks (CPU tensors of the same dtype back; pass float64 and int64 so
        counts stay exact). ``error``, an exception this rank caught while doing its share, is
        re-raised after the collective, and every other rank raises an EvalError too, so a failure
        on one rank ends the run instead of leaving the others waiting."""
        if not self.distributed:
            if error is not None:
                raise error
            return tensors
        import torch.distributed as tdist
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self.comm_device)
        tdist.all_reduce(failed)
        out = []
        for t in tensors:
            t = t.detach().to(self.comm_device, copy=True)
            tdist.all_reduce(t)
            out.append(t.cpu())
        if error is not None:
            raise error
        if int(failed):
            raise EvalError(f"the evaluation failed on {int(failed)} other rank(s) of {self.world_size}; "
                            f"see their error messages")
        return tuple(out)

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order (picklable objects)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as tdist
        out: List[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as tdist
            if tdist.is_initialized():
                tdist.destroy_process_group()


SINGLE = DistContext()


def init_distributed(device: Optional[str]) -> Tuple[DistContext, torch.device]:
    """The process group of a run launched as several processes (torchrun, srun) and this rank's
    device: gloo on the CPU, NCCL on CUDA with rank r on its local GPU ``cuda:<LOCAL_RANK>``. One
    process gets :data:`SINGLE` and no process group. MASTER_ADDR/MASTER_PORT name the rendezvous
    (torchrun sets them; under srun export them before launching)."""
    env = detect_env()
    rank, world, local = env.rank, env.world_size, env.local_rank
    if world <= 1:
        return SINGLE, pick_device(device)
    dev = pick_device(device, local)
    missing = missing_rendezvous()
    if missing:
        raise EvalError(f"{' and '.join(missing)} not set for a {world}-process eval: export MASTER_ADDR (the "
                        f"first node's host name) and MASTER_PORT (a free port) before srun, or launch with torchrun")
    import torch.distributed as tdist
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not tdist.is_initialized():
        tdist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    return DistContext(rank, world, local, dev if backend == "nccl" else torch.device("cpu")), dev


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
