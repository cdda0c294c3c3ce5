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
(1-based, as plotted), and for each requested context length L the mean over all t < L. Each
bucket also carries a 95% confidence interval over documents: with m_d the mean loss of document
d over the bucket's positions it reaches and n documents, ±1.96·sd(m_d)/√n (documents, not
tokens, are the independent units; tokens of one document are correlated).

A corpus with few, long documents (three validation plays) gives wide bands; ``windows`` cuts
every document into consecutive pieces of ``max_len + 1`` tokens, each scored from an empty
state, so the curve averages over many contexts (each piece is then a "document" above).

With several processes every rank reads the documents in the same order and forms the same
batches (documents of equal length, ``batch_size`` at a time); batch i runs on rank i mod world,
and S and C are summed over ranks, so C and the document counts equal one process's exactly and S
up to the order of float64 additions.

Two checkpoints scored on the same documents are compared paired (:func:`paired_difference`):
for each range of positions [L_{j−1}, L_j) between the requested lengths (L_0 = 0) and each
document d reaching it, δ_d = (d's mean loss over the range under the other model) − (under the
reference); the range's difference is the mean of δ_d with ±1.96·sd(δ_d)/√n over those documents,
and the change from the first range to the last is the same statistic of δ_d(last) − δ_d(first),
so that a difference which grows with the position (one model using context the other cannot
reach) is measured against the document-to-document noise of both curves at once.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from ttt_lm.eval.common import SINGLE, DistContext, EvalError, check_context, progress
from ttt_lm.model import LM


def windows(docs: Iterable[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """Consecutive, non-overlapping pieces of ``size`` tokens of every document (a shorter tail
    piece too; the length filter of :func:`loss_by_position` decides whether it counts)."""
    if size < 2:
        raise EvalError(f"window size must be >= 2 tokens, got {size}")
    for doc in docs:
        for s in range(0, len(doc), size):
            yield doc[s:s + size]


@torch.no_grad()
def loss_by_position(model: LM, docs: Iterable[torch.Tensor], max_len: int, chunk_len: int = 2048,
                     min_len: Optional[int] = None, max_docs: Optional[int] = None, batch_size: int = 1,
                     show_progress: bool = True, dist: DistContext = SINGLE) -> Dict[str, np.ndarray]:
    """Per-position loss sums S and counts C (float64/int64 arrays of length ``max_len``), and
    ``per_doc``: each document's loss at each position (float32 [documents, max_len], 0 where a
    document does not reach) with ``doc_len`` (scored positions per document), for the bands;
    it takes 4 · documents · ``max_len`` bytes (e.g. 64 MB for 500 documents of 32k tokens).

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
    pending_idx: Dict[int, List[int]] = {}
    rows: Dict[int, torch.Tensor] = {}  # document index -> its per-position losses (this rank's documents)
    digest = hashlib.sha256()  # of every scored document's tokens, in order (every rank reads them all)

    def run(group: List[torch.Tensor], idx: List[int]):
        x = torch.stack(group).to(dev)
        if int(x.max()) >= V:
            raise EvalError(f"vocabulary mismatch: a document holds token id {int(x.max())} but the model's "
                            f"vocab_size is {V}")
        T = x.shape[1] - 1
        states = None
        per = torch.zeros(x.shape[0], T, dtype=torch.float32)
        for s in range(0, T, chunk_len):
            e = min(T, s + chunk_len)
            out = model(x[:, s:e], states=states, output_states=e < T)
            states = out.states
            nll = F.cross_entropy(out.logits.float().transpose(1, 2), x[:, s + 1:e + 1], reduction="none")
            S[s:e] += nll.double().sum(0).cpu()
            C[s:e] += x.shape[0]
            per[:, s:e] = nll.cpu()
        for r, i in enumerate(idx):
            rows[i] = per[r]

    n_groups = 0

    def dispatch(length: int):
        nonlocal n_groups
        group, idx = pending.pop(length), pending_idx.pop(length)
        if dist.mine(n_groups):
            run(group, idx)
        n_groups += 1

    bar = progress(None, total=max_docs, desc=f"documents @ {max_len}", enable=show_progress)
    err = None
    lengths: List[int] = []
    try:
        for doc in docs:
            if max_docs is not None and used >= max_docs:
                break
            if len(doc) < min_len:
                skipped += 1
                continue
            d = doc[:max_len + 1].long()
            digest.update(len(d).to_bytes(8, "little"))
            digest.update(d.numpy().astype("<i8").tobytes())
            pending.setdefault(len(d), []).append(d)
            pending_idx.setdefault(len(d), []).append(used)
            lengths.append(len(d) - 1)
            used += 1
            if len(pending[len(d)]) >= batch_size:
                dispatch(len(d))
            if bar is not None and hasattr(bar, "update"):
                bar.update(1)
        for length in list(pending):
            dispatch(length)
    except Exception as e:  # noqa: BLE001 - re-raised by dist.sum once the other ranks know
        if not dist.distributed:
            raise
        err = e
    if bar is not None and hasattr(bar, "close"):
        bar.close()
    S, C = dist.sum(S, C, error=err)
    per_doc = np.zeros((used, max_len), dtype=np.float32)
    for part in (dist.gather(rows) if dist.distributed else [rows]):
        for i, r in part.items():
            per_doc[i, :len(r)] = r.numpy()
    if used == 0:
        raise EvalError(f"no document has >= {min_len} tokens ({skipped} shorter ones skipped); lower --max-len "
                        f"or pass --min-len to include shorter documents")
    return {"sum": S.numpy(), "count": C.numpy(), "documents": used, "skipped": skipped,
            "per_doc": per_doc, "doc_len": np.asarray(lengths, dtype=np.int64), "fingerprint": digest.hexdigest()}


def _doc_means(stats: Dict[str, np.ndarray], a: int, b: int) -> tuple:
    """Each document's mean loss over positions [a, b) (0-based) where it reaches a, and which."""
    reach = np.clip(stats["doc_len"] - a, 0, b - a)
    ok = reach > 0
    return stats["per_doc"][:, a:b].astype(np.float64).sum(1) / np.maximum(reach, 1), ok


def _mean_ci(x: np.ndarray) -> dict:
    ci = float(1.96 * x.std(ddof=1) / math.sqrt(len(x))) if len(x) >= 2 else None
    return {"diff": float(x.mean()), "ci95": ci, "documents": int(len(x))}


def paired_difference(ref: Dict[str, np.ndarray], other: Dict[str, np.ndarray], lengths: Sequence[int]) -> dict:
    """``other`` − ``ref`` per range of positions between consecutive ``lengths`` (from 0; the
    last range ends at max_len), paired over documents (the module docstring), and the change of
    that difference from the first range to the last. Both must have scored the same documents
    (their ``fingerprint``): otherwise an :class:`EvalError` names what differs."""
    if ref.get("fingerprint") != other.get("fingerprint") or len(ref["sum"]) != len(other["sum"]):
        raise EvalError(f"the two runs scored different documents ({ref['documents']} and {other['documents']} "
                        f"documents of up to {len(ref['sum'])} and {len(other['sum'])} tokens, "
                        f"fingerprints {str(ref.get('fingerprint'))[:12]} and {str(other.get('fingerprint'))[:12]}); "
                        f"give both the same --data")
    max_len = len(ref["sum"])
    edges = [0] + sorted(set(int(x) for x in lengths if 0 < int(x) < max_len)) + [max_len]
    ranges, deltas = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        m_ref, ok = _doc_means(ref, a, b)
        m_oth, _ = _doc_means(other, a, b)
        d = m_oth - m_ref
        deltas.append((d, ok))
        ranges.append({"start": a + 1, "end": b, **_mean_ci(d[ok])})
    out = {"ranges": ranges}
    if len(ranges) >= 2:
        (d0, ok0), (d1, ok1) = deltas[0], deltas[-1]
        both = ok0 & ok1
        out["change"] = {"from": [ranges[0]["start"], ranges[0]["end"]], "to": [ranges[-1]["start"], ranges[-1]["end"]],
                         **_mean_ci(d1[both] - d0[both])}
    return out


def log_buckets(max_len: int, n: int = 32) -> np.ndarray:
    """Bucket edges over 1-based token index, log-spaced from 1 to max_len + 1 (unique integers)."""
    e = np.unique(np.round(np.logspace(0, math.log10(max_len + 1), n + 1)).astype(np.int64))
    e[0], e[-1] = 1, max_len + 1
    return e


def _ci95(per_doc: np.ndarray, doc_len: np.ndarray, a: int, b: int) -> Optional[float]:
    """Half-width of the 95% interval of the mean loss over positions [a, b) (0-based), with
    documents as the units: 1.96 · sd of the per-document means / √n; None for fewer than 2."""
    reach = np.clip(doc_len - a, 0, b - a)
    ok = reach > 0
    if ok.sum() < 2:
        return None
    m = per_doc[ok, a:b].astype(np.float64).sum(1) / reach[ok]
    return float(1.96 * m.std(ddof=1) / math.sqrt(len(m)))


def summarize(stats: Dict[str, np.ndarray], lengths: Sequence[int] = (), n_buckets: int = 32) -> dict:
    S, C = stats["sum"], stats["count"]
    per_doc, doc_len = stats.get("per_doc"), stats.get("doc_len")
    max_len = len(S)
    edges = log_buckets(max_len, n_buckets)
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        s, c = S[a - 1:b - 1].sum(), C[a - 1:b - 1].sum()
        if c > 0:
            bk = {"start": int(a), "end": int(b - 1), "center": float(math.sqrt(a * (b - 1))),
                  "loss": float(s / c), "tokens": int(c)}
            if per_doc is not None:
                bk["documents"] = int((doc_len >= a).sum())
                bk["ci95"] = _ci95(per_doc, doc_len, a - 1, b - 1)
            buckets.append(bk)
    at = {}
    for L in sorted(set(int(x) for x in lengths if 0 < int(x) <= max_len)) or [max_len]:
        c = C[:L].sum()
        if c:
            loss = float(S[:L].sum() / c)
            at[str(L)] = {"loss": loss, "perplexity": math.exp(loss), "tokens": int(c)}
            if per_doc is not None:
                at[str(L)]["ci95"] = _ci95(per_doc, doc_len, 0, L)
    return {"max_len": max_len, "documents": int(stats["documents"]), "skipped": int(stats["skipped"]),
            "buckets": buckets, "mean_loss_at_length": at}


def plot_loss_by_position(curves: Dict[str, dict], path: Optional[str] = None, title: str = "",
                          train_len: Union[None, int, Dict[str, Optional[int]]] = None):
    """One line per checkpoint: bucket mean loss against token index (log scale), its 95% band over
    documents shaded, the number of documents in the legend, and a dashed vertical line at each
    distinct training context (``train_len``: one length, or one per curve name). Returns the
    Figure when ``path`` is None (else saves and closes it)."""
    from ttt_lm.eval.common import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    markers = "os^Dvx+*"
    for k, (name, summ) in enumerate(curves.items()):
        bs = summ["buckets"]
        xs = np.array([b["center"] for b in bs])
        ys = np.array([b["loss"] for b in bs])
        n = summ["documents"]
        line, = ax.plot(xs, ys, marker=markers[k % len(markers)], ms=4, lw=1.5,
                        label=f"{name} ({n} document{'s' if n != 1 else ''})")
        ci = [b.get("ci95") for b in bs]
        if any(c is not None for c in ci):
            h = np.array([c if c is not None else np.nan for c in ci])
            ax.fill_between(xs, ys - h, ys + h, color=line.get_color(), alpha=0.2, lw=0)
    tl = train_len if isinstance(train_len, dict) else {None: train_len}
    for k, L in enumerate(sorted({v for v in tl.values() if v})):
        ax.axvline(L, color="black", ls="--", lw=1, alpha=0.7, label=f"training context ({L} tokens)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token index (position in the document)")
    ax.set_ylabel("mean loss (nats/token)")
    docs = sorted({s["documents"] for s in curves.values()})
    ds = f"{docs[0]} documents" if len(docs) == 1 else "documents per curve in legend"
    ax.set_title((title or "loss by token position") + f"\n{ds}; shaded: 95% interval over documents",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
