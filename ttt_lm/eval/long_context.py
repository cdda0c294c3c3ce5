r"""Loss by token position over whole documents (the long-context plot of the TTT paper, Sun et
al. 2024, Fig. 2/§3: loss against token index; a model that uses its context keeps improving with
the index, one whose memory saturates flattens out).

Every document is truncated to ``max_len + 1`` tokens and run through the model once, ``chunk_len``
tokens at a time with each layer's state (recurrent state, conv caches, KV cache) carried from
chunk to chunk, so memory is flat in ``max_len`` for recurrent and windowed layers; global
attention keeps its full KV cache (it is bounded by ``model.max_seq_len``). For position t
(0-based token index of the input) we accumulate

    S_t = Σ_docs −log p(x_{t+1} | x_≤t),   C_t = number of documents reaching t,

and report bucket means Σ_{t∈b} S_t / Σ_{t∈b} C_t over log-spaced buckets of token index
(1-based, as plotted), and for each requested context length L the mean over all t < L.

With several processes every rank reads the documents in the same order and forms the same
batches (documents of equal length, ``batch_size`` at a time); batch i runs on rank i mod world,
and S and C are summed over ranks, so C and the document counts equal one process's exactly and S
up to the order of float64 additions.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ttt_lm.eval.common import SINGLE, DistContext, EvalError, check_context, progress
from ttt_lm.model import LM


@torch.no_grad()
def loss_by_position(model: LM, docs: Iterable[torch.Tensor], max_len: int, chunk_len: int = 2048,
                     min_len: Optional[int] = None, max_docs: Optional[int] = None, batch_size: int = 1,
                     show_progress: bool = True, dist: DistContext = SINGLE) -> Dict[str, np.ndarray]:
    """Per-position loss sums S and counts C (float64/int64 arrays of length ``max_len``).

    ``docs`` is the whole corpus on every rank; ``dist`` runs this rank's batches and sums them.

    Documents with fewer than ``min_len`` tokens (default ``max_len + 1``: only documents that
    cover every position, so each position averages over the same documents) are skipped."""
    check_context(model, max_len)
    model.eval()
    dev = next(model.parameters()).device
    V = model.cfg.vocab_size
    min_len = max_len + 1 if min_len is None else max(2, min_len)
    S = torch.zeros(max_len, dtype=torch.float64)
    C = torch.zeros(max_len, dtype=torch.int64)
    used = skipped = 0
    pending: Dict[int, List[torch.Tensor]] = {}

    def run(group: List[torch.Tensor]):
        x = torch.stack(group).to(dev)
        if int(x.max()) >= V:
            raise EvalError(f"vocabulary mismatch: a document holds token id {int(x.max())} but the model's "
                            f"vocab_size is {V}")
        T = x.shape[1] - 1
        states = None
        for s in range(0, T, chunk_len):
            e = min(T, s + chunk_len)
            out = model(x[:, s:e], states=states, output_states=e < T)
            states = out.states
            nll = F.cross_entropy(out.logits.float().transpose(1, 2), x[:, s + 1:e + 1], reduction="none")
            S[s:e] += nll.double().sum(0).cpu()
            C[s:e] += x.shape[0]

    n_groups = 0

    def dispatch(group: List[torch.Tensor]):
        nonlocal n_groups
        if dist.mine(n_groups):
            run(group)
        n_groups += 1

    bar = progress(None, total=max_docs, desc=f"documents @ {max_len}", enable=show_progress)
    err = None
    try:
        for doc in docs:
            if max_docs is not None and used >= max_docs:
                break
            if len(doc) < min_len:
                skipped += 1
                continue
            d = doc[:max_len + 1].long()
            pending.setdefault(len(d), []).append(d)
            used += 1
            if len(pending[len(d)]) >= batch_size:
                dispatch(pending.pop(len(d)))
            if bar is not None and hasattr(bar, "update"):
                bar.update(1)
        for group in pending.values():
            dispatch(group)
    except Exception as e:  # noqa: BLE001 - re-raised by dist.sum once the other ranks know
        if not dist.distributed:
            raise
        err = e
    if bar is not None and hasattr(bar, "close"):
        bar.close()
    S, C = dist.sum(S, C, error=err)
    if used == 0:
        raise EvalError(f"no document has >= {min_len} tokens ({skipped} shorter ones skipped); lower --max-len "
                        f"or pass --min-len to include shorter documents")
    return {"sum": S.numpy(), "count": C.numpy(), "documents": used, "skipped": skipped}


def log_buckets(max_len: int, n: int = 32) -> np.ndarray:
    """Bucket edges over 1-based token index, log-spaced from 1 to max_len + 1 (unique integers)."""
    e = np.unique(np.round(np.logspace(0, math.log10(max_len + 1), n + 1)).astype(np.int64))
    e[0], e[-1] = 1, max_len + 1
    return e


def summarize(stats: Dict[str, np.ndarray], lengths: Sequence[int] = (), n_buckets: int = 32) -> dict:
    S, C = stats["sum"], stats["count"]
    max_len = len(S)
    edges = log_buckets(max_len, n_buckets)
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        s, c = S[a - 1:b - 1].sum(), C[a - 1:b - 1].sum()
        if c > 0:
            buckets.append({"start": int(a), "end": int(b - 1), "center": float(math.sqrt(a * (b - 1))),
                            "loss": float(s / c), "tokens": int(c)})
    at = {}
    for L in sorted(set(int(x) for x in lengths if 0 < int(x) <= max_len)) or [max_len]:
        c = C[:L].sum()
        if c:
            loss = float(S[:L].sum() / c)
            at[str(L)] = {"loss": loss, "perplexity": math.exp(loss), "tokens": int(c)}
    return {"max_len": max_len, "documents": int(stats["documents"]), "skipped": int(stats["skipped"]),
            "buckets": buckets, "mean_loss_at_length": at}


def plot_loss_by_position(curves: Dict[str, dict], path: str, title: str = "") -> None:
    """One line per checkpoint: bucket mean loss against token index (log scale)."""
    from ttt_lm.eval.common import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, summ in curves.items():
        xs = [b["center"] for b in summ["buckets"]]
        ys = [b["loss"] for b in summ["buckets"]]
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token index")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title or "loss by token position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
