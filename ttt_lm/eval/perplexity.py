r"""Validation loss, perplexity and bits per byte.

Over every scored token t (labels ≠ −100) of the batches:

    loss = (1/N) Σ_t −log p(y_t | x_≤t)        (nats per token, N = the exact token count)
    perplexity = exp(loss)
    bits per byte = Σ_t −log₂ p(y_t | x_≤t) / Σ_t bytes(y_t)

where bytes(y) is the number of UTF-8 bytes token y adds to the decoded text
(:func:`ttt_lm.eval.common.token_byte_lengths`), so models with different tokenizers compare on
bits per byte. Sums are accumulated in float64 over a fixed batch order, so the result does not
depend on the batch size beyond float32 rounding inside the model.

With several processes every rank enumerates the same batches and scores those whose index i has
i mod world = rank; the float64 sums and integer counts are then summed over ranks, so the counts
equal one process's exactly and the sums up to the order of float64 additions (~1e-15 relative).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional

import torch
import torch.nn.functional as F

from ttt_lm.eval.common import SINGLE, DistContext, EvalError, check_context, progress
from ttt_lm.model import LM


@torch.no_grad()
def evaluate_perplexity(model: LM, batches: Iterable[Dict[str, torch.Tensor]], token_bytes: Optional[torch.Tensor] = None,
                        max_batches: Optional[int] = None, show_progress: bool = True,
                        total: Optional[int] = None, dist: DistContext = SINGLE) -> dict:
    """Loss, perplexity, token count and (with ``token_bytes``) bytes and bits per byte.

    ``batches`` is the whole evaluation on every rank; ``dist`` picks this rank's share and sums
    the shares (``max_batches`` counts batches of the whole evaluation)."""
    model.eval()
    dev = next(model.parameters()).device
    V = model.cfg.vocab_size
    nll = 0.0
    ntok = 0
    nbytes = 0
    nb = 0
    tb = token_bytes.to(dev) if token_bytes is not None else None
    if total is not None and max_batches is not None:
        total = min(total, max_batches)
    err = None
    try:
        for i, batch in enumerate(progress(batches, total=total, desc="perplexity", enable=show_progress)):
            if max_batches is not None and i >= max_batches:
                break
            if not dist.mine(i):
                continue
            x = batch["input_ids"].to(dev)
            y = batch["labels"].to(dev)
            check_context(model, x.shape[1], "sequence")
            m = y != -100
            if m.any():
                hi = int(max(x.max(), y[m].max()))
                if hi >= V:
                    raise EvalError(f"vocabulary mismatch: the data holds token id {hi} but the model's vocab_size is {V}")
            logits = model(x).logits
            nll += float(F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1), ignore_index=-100,
                                         reduction="sum").double())
            ntok += int(m.sum())
            if tb is not None:
                nbytes += int(tb[y[m]].sum())
            nb += 1
    except Exception as e:  # noqa: BLE001 - re-raised by dist.sum once the other ranks know
        if not dist.distributed:
            raise
        err = e
    sums, counts = dist.sum(torch.tensor([nll], dtype=torch.float64),
                            torch.tensor([ntok, nbytes, nb], dtype=torch.int64), error=err)
    nll = float(sums[0])
    ntok, nbytes, nb = (int(c) for c in counts)
    if ntok == 0:
        raise EvalError("no scored tokens: the data is empty or every label is -100")
    loss = nll / ntok
    out = {"loss": loss, "perplexity": math.exp(loss), "tokens": ntok, "batches": nb, "nll_sum": nll}
    if tb is not None:
        out["bytes"] = nbytes
        out["bits_per_byte"] = nll / (math.log(2) * nbytes) if nbytes else float("nan")
        out["bytes_per_token"] = nbytes / ntok
    return out


def text_batches(ids: torch.Tensor, seq_len: int, batch_size: int):
    """Non-overlapping windows of a token stream, packed like the validation loader: window j is
    ids[j·T : j·T + T + 1] (inputs its first T tokens, labels its last T), so every token after the
    first is scored exactly once except the < T left over at the end."""
    n = (len(ids) - 1) // seq_len
    if n == 0:
        raise EvalError(f"the text has {len(ids)} tokens, fewer than one window of seq_len+1={seq_len + 1}")
    for i in range(0, n, batch_size):
        w = torch.stack([ids[j * seq_len: j * seq_len + seq_len + 1] for j in range(i, min(n, i + batch_size))])
        yield {"input_ids": w[:, :-1], "labels": w[:, 1:]}
