"""Passkey retrieval (Mohtashami & Jaggi 2023): a random number hidden at a chosen depth of
repetitive filler text must be repeated at the end.

Prompt, in tokens (``context_len`` = its length, at most; the filler is FILLER's five sentences
in order, repeated, as many whole ones as fit):

    INTRO  n₁ filler sentences  NEEDLE("The pass key is 68130. Remember it. 68130 is the pass key.")
    n₂ filler sentences  QUESTION("What is the pass key? The pass key is")

with n₁ = round(depth · (n₁ + n₂)) (halves up), so depth 0 puts the needle right after the
introduction and depth 1 right before the question. The model decodes greedily as many tokens as the answer
" 68130" has; a trial is correct when the decoded text, stripped, starts with the passkey. The
prompt is read ``chunk_len`` tokens at a time with states carried, then decoded with ``step``.

With several processes trial k of the grid (cells in row-major order, trials within a cell) runs
on rank k mod world; the correct counts per cell are summed over ranks and the samples gathered,
so the result is exactly one process's.

:func:`practice_finetune` trains a model on freshly generated prompts of this format with the loss on
the answer's tokens alone (``python -m ttt_lm.eval passkey_train``): trained by the plain LM loss
on documents that contain such prompts, a small model's loss is dominated by the text it cannot
predict (the key's first occurrence) and it does not learn to copy the key.
"""
from __future__ import annotations

import math
import random
import re
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ttt_lm.eval.common import SINGLE, DistContext, EvalError, check_context, check_vocab, progress
from ttt_lm.model import LM

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
FILLER_SENTENCES = tuple(re.findall(r" [^.]*\.", FILLER))  # the unit of filler and of needle placement


def build_prompt(tok, context_len: int, depth: float, key: str) -> Tuple[List[int], List[int], int]:
    """(prompt ids, answer ids, index of the needle's first token). The filler is the sentences of
    :data:`FILLER` in order, repeated, as many whole ones as fit in ``context_len``; the needle goes
    after round(depth · m) of its m sentences (halves round up), so even the shortest prompt has
    several distinct depths (whole five-sentence groups gave a 128-token prompt a single one:
    depths 0, 0.25 and 0.5 were the same prompt, 0.75 and 1 another). Raises if ``context_len`` is
    too short for the introduction, the needle, the question and one filler sentence group."""
    if not 0.0 <= depth <= 1.0:
        raise EvalError(f"depth must be in [0, 1], got {depth}")
    intro, sentences = tok.encode(INTRO), [tok.encode(s) for s in FILLER_SENTENCES]
    needle, question = tok.encode(NEEDLE.format(key=key)), tok.encode(QUESTION)
    fixed = len(intro) + len(needle) + len(question)
    budget = context_len - fixed
    if budget < sum(map(len, sentences)):
        raise EvalError(f"context length {context_len} is too short for a passkey prompt "
                        f"(needs at least {fixed + sum(map(len, sentences))} tokens with this tokenizer)")
    filler: List[List[int]] = []
    while len(sentences[len(filler) % len(sentences)]) <= budget:
        filler.append(sentences[len(filler) % len(sentences)])
        budget -= len(filler[-1])
    n1 = int(math.floor(depth * len(filler) + 0.5))
    ids = intro + [t for s in filler[:n1] for t in s]
    pos = len(ids)
    ids += needle + [t for s in filler[n1:] for t in s] + question
    return ids, tok.encode(" " + key), pos


def grid_keys(trials: int, seed: int = 0, digits: int = 5) -> List[str]:
    """The passkeys :func:`passkey_grid` tests with ``seed``: ``trials`` random ``digits``-digit numbers."""
    rng = random.Random(seed)
    return [str(rng.randrange(10 ** (digits - 1), 10 ** digits)) for _ in range(trials)]


def practice_documents(n: int, max_fillers: int, seed: int = 0, digits: int = 5,
                       exclude: Sequence[str] = ()) -> List[str]:
    """``n`` passkey prompts as plain text with their answer appended, for mixing into a training
    corpus: 0 … ``max_fillers`` filler groups, the needle at a uniform random depth, a random key.
    A model trained on these has seen the format (not the test keys' lengths beyond its training
    length), so the heatmap measures where retrieval holds as context and depth grow. The keys
    come from a random stream other than :func:`grid_keys`' for the same ``seed`` (both once drew
    from ``random.Random(seed)``, so practice and test shared their first key), and none is in
    ``exclude`` (pass ``grid_keys(trials)`` to keep every test key out of training)."""
    if n < 1 or max_fillers < 0:
        raise EvalError(f"practice_documents needs n >= 1 and max_fillers >= 0, got n={n}, max_fillers={max_fillers}")
    banned = {str(k) for k in exclude}
    if sum(len(k) == digits and k.isdigit() and k[0] != "0" for k in banned) >= 9 * 10 ** (digits - 1):
        raise EvalError(f"practice_documents: exclude holds every {digits}-digit key")
    rng = random.Random(f"passkey practice {seed}")  # a stream apart from grid_keys'
    out = []
    for _ in range(n):
        key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        while key in banned:
            key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        k = rng.randint(0, max_fillers)
        k1 = rng.randint(0, k)
        out.append(INTRO + FILLER * k1 + NEEDLE.format(key=key) + FILLER * (k - k1) + QUESTION + " " + key + ".")
    return out


def practice_batch(tok, batch: int, context_len: int, rng: random.Random, digits: int = 5,
                   exclude: Sequence[str] = (), pad_id: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch`` passkey prompts of at most ``context_len`` tokens (as :func:`build_prompt` builds them
    for the eval), each with a random key not in ``exclude`` at a uniform random depth, followed by
    their answer. Returns (inputs, labels), both (batch, T): labels are the next tokens at the positions
    whose next token is one of the answer's tokens (exactly the tokens the eval decodes), -100
    everywhere else, and at the right padding (``pad_id``) of shorter prompts."""
    banned = {str(k) for k in exclude}
    if sum(len(k) == digits and k.isdigit() and k[0] != "0" for k in banned) >= 9 * 10 ** (digits - 1):
        raise EvalError(f"practice_batch: exclude holds every {digits}-digit key")
    seqs = []
    for _ in range(batch):
        key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        while key in banned:
            key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        ids, ans, _ = build_prompt(tok, context_len, rng.random(), key)
        seqs.append((ids, ans))
    T = max(len(ids) + len(ans) for ids, ans in seqs) - 1
    x = torch.full((batch, T), pad_id, dtype=torch.long)
    y = torch.full((batch, T), -100, dtype=torch.long)
    for b, (ids, ans) in enumerate(seqs):
        full = ids + ans
        x[b, :len(full) - 1] = torch.tensor(full[:-1])
        y[b, len(ids) - 1:len(full) - 1] = torch.tensor(ans)
    return x, y


@torch.no_grad()
def answer_metrics(model: LM, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                   vocab_size: Optional[int] = None) -> dict:
    """Mean loss over the answer tokens of ``batches`` (from :func:`practice_batch`), the fraction of
    those tokens predicted right (argmax, teacher-forced, among the ids below ``vocab_size``, the
    tokenizer's) and of prompts with every answer token right."""
    from ttt_lm.eval.synthetic import masked_accuracy
    from ttt_lm.model.lm import mask_vocab
    model.eval()
    dev = next(model.parameters()).device
    loss_sum, right, total, whole, n = 0.0, 0, 0, 0, 0
    for x, y in batches:
        x, y = x.to(dev), y.to(dev)
        logits = model(x).logits.float()
        m = y != -100
        loss_sum += float(torch.nn.functional.cross_entropy(logits[m], y[m], reduction="sum"))
        logits = mask_vocab(logits, vocab_size)
        c, t = masked_accuracy(logits, y)
        right, total = right + c, total + t
        ok = (logits.argmax(-1) == y) | ~m
        whole, n = whole + int(ok.all(-1).sum()), n + x.shape[0]
    return {"answer_loss": loss_sum / max(total, 1), "token_accuracy": right / max(total, 1),
            "prompt_accuracy": whole / max(n, 1)}


def practice_finetune(model: LM, tok, lengths: Sequence[int], steps: int, batch_size: int = 16,
                      lr: float = 1e-3, warmup: int = 20, seed: int = 0, digits: int = 5,
                      exclude: Sequence[str] = (), held_out: int = 64, show_progress: bool = False) -> dict:
    """Train ``model`` in place for ``steps`` AdamW steps (:func:`ttt_lm.eval.synthetic.train_steps`) on
    fresh :func:`practice_batch` prompts, each batch at a context length drawn from ``lengths``; the
    loss covers the answer's tokens only. Keys in ``exclude`` (pass :func:`grid_keys` of the eval) are
    never drawn. Returns :func:`answer_metrics` on ``held_out`` prompts (keys also apart from
    ``exclude``, drawn from their own stream) before and after training, and the last training loss."""
    from ttt_lm.eval.synthetic import train_steps
    if steps < 1 or batch_size < 1 or not lengths:
        raise EvalError(f"practice needs steps >= 1, batch_size >= 1 and at least one length, "
                        f"got steps={steps}, batch_size={batch_size}, lengths={list(lengths)}")
    for L in lengths:
        check_context(model, L)
        build_prompt(tok, L, 0.5, "1" * digits)  # a clear error for a length too short for the format
    check_vocab(model, tok.vocab_size, "the tokenizer", allow_padding=True)
    rng = random.Random(f"passkey finetune {seed}")
    held_rng = random.Random(f"passkey finetune held out {seed}")
    hb = min(batch_size, held_out)
    held = [practice_batch(tok, min(hb, held_out - i), lengths[(i // hb) % len(lengths)], held_rng, digits, exclude)
            for i in range(0, held_out, hb)]
    before = answer_metrics(model, held, tok.vocab_size)

    def next_batch():
        return practice_batch(tok, batch_size, rng.choice(list(lengths)), rng, digits, exclude)

    last, _ = train_steps(model, next_batch, steps, lr=lr, warmup=min(warmup, max(steps - 1, 0)),
                          progress=show_progress, desc="passkey practice")
    model.eval()
    after = answer_metrics(model, held, tok.vocab_size)
    if not math.isfinite(last):
        raise EvalError(f"passkey practice diverged: the last training loss is {last} (try a lower --lr)")
    return {"steps": steps, "lengths": list(lengths), "batch_size": batch_size, "lr": lr, "seed": seed,
            "excluded_keys": len(set(exclude)), "last_loss": last, "before": before, "after": after}


@torch.no_grad()
def greedy_continue(model: LM, ids: Sequence[int], n: int, chunk_len: int = 2048,
                    vocab_size: Optional[int] = None) -> List[int]:
    """Greedy decoding of ``n`` tokens after ``ids``, reading the prompt chunk by chunk; with
    ``vocab_size`` (the tokenizer's) only ids below it (``ttt_lm.model.lm.mask_vocab``)."""
    from ttt_lm.model.lm import mask_vocab
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    states = None
    for s in range(0, x.shape[1], chunk_len):
        out = model(x[:, s:s + chunk_len], states=states, output_states=True)
        states = out.states
    logits = out.logits[:, -1]
    res = []
    for i in range(n):
        nxt = mask_vocab(logits, vocab_size).argmax(-1)
        res.append(int(nxt))
        if i + 1 < n:
            logits, states = model.step(nxt, states)
    return res


@torch.no_grad()
def answer_nll(model: LM, ids: Sequence[int], ans: Sequence[int], chunk_len: int = 2048) -> float:
    """Mean negative log-likelihood (nats per token) of ``ans`` right after ``ids``, teacher-forced,
    the sequence read ``chunk_len`` tokens at a time with states carried."""
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids) + list(ans[:-1])], dtype=torch.long, device=dev)
    states, tail = None, []
    for s in range(0, x.shape[1], chunk_len):
        out = model(x[:, s:s + chunk_len], states=states, output_states=True)
        states = out.states
        lo = max(len(ids) - 1 - s, 0)  # keep only the logits that predict answer tokens
        if lo < out.logits.shape[1]:
            tail.append(out.logits[0, lo:].float())
    target = torch.tensor(list(ans), dtype=torch.long, device=dev)
    return float(torch.nn.functional.cross_entropy(torch.cat(tail), target))


def passkey_grid(model: LM, tok, lengths: Sequence[int], depths: Sequence[float], trials: int = 5,
                 seed: int = 0, chunk_len: int = 2048, digits: int = 5, show_progress: bool = True,
                 generate: Optional[Callable] = None, dist: DistContext = SINGLE, max_samples: int = 20) -> dict:
    """Accuracy for each (context length, depth) over ``trials`` random passkeys (the same keys in
    every cell, so cells differ only in length and depth), the answer's teacher-forced loss per cell
    (:func:`answer_nll`, mean over the trials: it moves where accuracy sits at 0 or 1), and the first
    ``max_samples`` trials' outputs."""
    for L in lengths:
        check_context(model, L)
    check_vocab(model, tok.vocab_size, "the tokenizer", allow_padding=True)
    model.eval()
    gen = generate or (lambda ids, n: greedy_continue(model, ids, n, chunk_len, tok.vocab_size))
    keys = grid_keys(trials, seed, digits)
    cells = [(i, j) for i in range(len(lengths)) for j in range(len(depths))]
    correct = torch.zeros(len(cells), dtype=torch.int64)
    nll = torch.zeros(len(cells), dtype=torch.float64)
    samples = []
    err = None
    try:
        for c, (i, j) in enumerate(progress(cells, total=len(cells), desc="passkey", enable=show_progress)):
            for t, key in enumerate(keys):
                k = c * len(keys) + t
                if not dist.mine(k):
                    continue
                ids, ans, _ = build_prompt(tok, lengths[i], depths[j], key)
                out = tok.decode(gen(ids, len(ans))).strip()
                hit = out.startswith(key)
                correct[c] += int(hit)
                nll[c] += answer_nll(model, ids, ans, chunk_len)
                if k < max_samples:
                    samples.append((k, {"length": lengths[i], "depth": depths[j], "key": key, "output": out,
                                        "correct": hit}))
    except Exception as e:  # noqa: BLE001 - re-raised by dist.sum once the other ranks know
        if not dist.distributed:
            raise
        err = e
    correct, nll = dist.sum(correct, nll, error=err)
    samples = [s for _, s in sorted((x for part in dist.gather(samples) for x in part), key=lambda x: x[0])]
    acc = [[int(correct[i * len(depths) + j]) / len(keys) for j in range(len(depths))] for i in range(len(lengths))]
    loss = [[float(nll[i * len(depths) + j]) / len(keys) for j in range(len(depths))] for i in range(len(lengths))]
    return {"lengths": list(lengths), "depths": list(depths), "trials": trials, "accuracy": acc,
            "mean_accuracy": sum(map(sum, acc)) / (len(lengths) * len(depths)), "answer_loss": loss,
            "samples": samples}


def _grid_panel(fig, ax, values, lens, depths, train_len, cmap, vmin: float, vmax: float, fmt, label: str):
    """One (length × depth) heatmap on ``ax``: ``values[i][j]`` for length i and depth j, written in
    each cell with ``fmt`` in a colour that contrasts with its background, a colorbar labelled ``label``."""
    data = [[values[i][j] for i in range(len(lens))] for j in range(len(depths))]
    im = ax.imshow(data, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto", origin="upper")
    labels = [str(x) for x in lens]
    if train_len:
        labels = [f"{x}\n(train)" if x == train_len else (f"{x}\n(> train)" if x > train_len else str(x))
                  for x in lens]
    ax.set_xticks(range(len(lens)), labels)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" + {0.0: " (start)", 1.0: " (end)"}.get(float(d), "")
                                       for d in depths])
    for i in range(len(lens)):
        for j in range(len(depths)):
            r, g, b, _ = cmap(im.norm(values[i][j]))
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            ax.text(i, j, fmt(values[i][j]), ha="center", va="center", fontsize=9,
                    color="white" if dark else "black")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    cb = fig.colorbar(im, ax=ax, fraction=0.046)
    cb.set_label(label, fontsize=9)
    return cb


def plot_heatmap(result: dict, path: Optional[str] = None, title: str = "", train_len: Optional[int] = None):
    """Accuracy per (context length, depth) cell, written in each cell as a percentage in a colour
    that contrasts with its background; the colorbar is labelled with the trials per cell, and
    ``train_len`` (the training context) is marked on the length axis. When ``result`` holds
    ``answer_loss`` (:func:`passkey_grid`), a second panel beside it shows that per cell (0 to
    0 up to the largest cell, at least ln 10 ≈ 2.3 nats, a uniform guess among the digits, which the
    colorbar marks), so the colour carries every cell's value. Titles and colorbar labels are
    wrapped to their panel and the layout is matplotlib's constrained one: no text is cut off.
    Returns the Figure when ``path`` is None (else saves and closes it)."""
    import textwrap

    from ttt_lm.eval.common import pyplot
    plt = pyplot()
    lens, depths = result["lengths"], result["depths"]
    loss = result.get("answer_loss")
    w, h = max(5.0, 2.4 + 0.9 * len(lens)), max(3.6, 1.6 + 0.5 * len(depths))
    fig, axes = plt.subplots(1, 2 if loss else 1, figsize=(2 * w if loss else w, h), squeeze=False,
                             layout="constrained")
    wrap = lambda text, inches: "\n".join(textwrap.wrap(text, max(12, int(inches * 11))))  # noqa: E731
    _grid_panel(fig, axes[0][0], result["accuracy"], lens, depths, train_len, plt.get_cmap("viridis"), 0, 1,
                lambda v: f"{v:.0%}", wrap(f"retrieval accuracy ({result['trials']} random passkeys per cell)",
                                           h - 1.0))
    axes[0][0].set_title(wrap(title or "passkey retrieval accuracy", w - 1.8), fontsize=10)
    if loss:
        uniform = math.log(10)
        finite = [v for row in loss for v in row if math.isfinite(v)]
        top = max([uniform, *finite])
        cb = _grid_panel(fig, axes[0][1], loss, lens, depths, train_len, plt.get_cmap("viridis_r"), 0, top,
                         lambda v: f"{v:.2f}", wrap("answer loss (nats per answer token)", h - 1.0))
        cb.ax.axhline(uniform, color="red", lw=1.5)
        axes[0][1].set_title(wrap("teacher-forced loss on the answer's tokens (mean over the passkeys; "
                                  "red line: ln 10, a uniform guess among the digits)", w - 1.8), fontsize=10)
    if path is None:
        return fig
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
