r"""Synthetic recall tasks: generators, a small train-and-test loop, and an accuracy table.

Each generator returns ``(inputs, labels)`` LongTensors of shape [B, T] in the model's convention
(labels[t] is the target for inputs[t], −100 where nothing is scored). The answer is fully
determined by the sequence, so a model that implements the right mechanism can reach accuracy 1.

* **Induction heads** (Olsson et al. 2022; the setting of Mamba, Gu & Dao 2023, §4.1.2/E.1):
  random data tokens, a special token S at a random position p followed by a memory token M,
  and S again at the last position. The only scored target is at the last position: M. Mamba
  trains at T = 256 with vocabulary 16 and tests at lengths up to 2^20 — the question is whether
  the mechanism length-generalizes.

* **Multi-query associative recall** (MQAR; Arora et al. 2023, "Zoology"): N key–value pairs
  k_1 v_1 … k_N v_N, then a query region of zeros in which every key appears once more at an
  even offset drawn from a power law (small gaps more likely, exponent ``power_a``); the target at
  a query k_i is v_i. Keys come from [1, V/2), values from [V/2, V); 0 is the filler.

* **Selective copying** (Gu & Dao 2023 §3.1, after Arjovsky et al. 2016's copying task): N data
  tokens scattered at random positions of a region of blanks, then N marker tokens; the target at
  the i-th marker is the i-th data token in order. Blank = 0, marker = 1, data tokens 2 … V−1.

``run_synthetic`` builds a tiny LM of a given layer pattern directly (no trainer), trains it on
fresh batches at one length and measures accuracy at several test lengths, carrying recurrent
state chunk by chunk so memory stays flat in the test length.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ttt_lm.model import LM, ModelConfig

IGNORE = -100


# ---- generators -----------------------------------------------------------------------------

def induction_heads(batch: int, seq_len: int, vocab_size: int = 16,
                    generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Data tokens 0 … V−2, special S = V−1 (``vocab_size`` = V counts S). S occurs exactly twice:
    at p ∈ [0, T−3] followed by M = x[p+1], and at T−1, where the label is M."""
    if seq_len < 3:
        raise ValueError(f"induction heads needs seq_len >= 3, got {seq_len}")
    if vocab_size < 3:
        raise ValueError(f"induction heads needs vocab_size >= 3 (two data tokens and S), got {vocab_size}")
    S = vocab_size - 1
    x = torch.randint(0, S, (batch, seq_len), generator=generator)
    p = torch.randint(0, seq_len - 2, (batch,), generator=generator)
    rows = torch.arange(batch)
    x[rows, p] = S
    x[:, -1] = S
    y = torch.full_like(x, IGNORE)
    y[:, -1] = x[rows, p + 1]
    return x, y


def mqar(batch: int, seq_len: int, vocab_size: int = 256, num_kv_pairs: int = 8, power_a: float = 0.01,
         generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zoology's multi-query associative recall. Layout of one sequence of length T:
    positions 0 … 2N−1 hold k_1 v_1 … k_N v_N; the query region starts at 2N and holds key k_i at
    2N + 2·g_i (distinct gaps g_i drawn with P(g) ∝ a·g^(a−1), g = 1 … (T−2N)/2) and 0 elsewhere."""
    N = num_kv_pairs
    ctx = 2 * N
    space = (seq_len - ctx) // 2
    if space < N:
        raise ValueError(f"mqar: seq_len={seq_len} too short for {N} pairs (needs >= {4 * N})")
    nk = vocab_size // 2 - 1
    if nk < N:
        raise ValueError(f"mqar: vocab_size={vocab_size} gives {nk} keys (1 … V/2−1) < num_kv_pairs={N}")
    keys = torch.rand(batch, nk, generator=generator).argsort(-1)[:, :N] + 1
    values = torch.randint(vocab_size // 2, vocab_size, (batch, N), generator=generator)
    g = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * g ** (power_a - 1)
    gaps = torch.multinomial((p / p.sum()).float().expand(batch, space).contiguous(), N, replacement=False,
                             generator=generator)  # index 0 … space−1
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    x[:, 0:ctx:2] = keys
    x[:, 1:ctx:2] = values
    y = torch.full_like(x, IGNORE)
    qpos = ctx + 2 * gaps
    x.scatter_(1, qpos, keys)
    y.scatter_(1, qpos, values)
    return x, y


def selective_copying(batch: int, seq_len: int, vocab_size: int = 16, num_tokens: int = 8,
                      generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Region of T − N positions with N data tokens (2 … V−1) at sorted random positions and blanks
    (0) elsewhere, followed by N markers (1). Target at marker i: the i-th data token."""
    N = num_tokens
    region = seq_len - N
    if region < N:
        raise ValueError(f"selective copying: seq_len={seq_len} too short for {N} tokens (needs >= {2 * N})")
    if vocab_size < 3:
        raise ValueError("selective copying needs vocab_size >= 3 (blank, marker, data)")
    pos = torch.rand(batch, region, generator=generator).argsort(-1)[:, :N].sort(-1).values
    data = torch.randint(2, vocab_size, (batch, N), generator=generator)
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    x.scatter_(1, pos, data)
    x[:, region:] = 1
    y = torch.full_like(x, IGNORE)
    y[:, region:] = data
    return x, y


@dataclass
class Task:
    name: str
    make: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
    vocab_size: int
    kwargs: Dict = field(default_factory=dict)

    def batch(self, b: int, T: int, g: torch.Generator):
        return self.make(b, T, vocab_size=self.vocab_size, generator=g, **self.kwargs)

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the possible answers: induction V−1 data tokens, MQAR
        the V − V/2 values, selective copying the V − 2 data tokens."""
        V = self.vocab_size
        n = {"induction": V - 1, "mqar": V - V // 2, "selective_copying": V - 2}[self.name]
        return 1.0 / n


def make_task(name: str, vocab_size: Optional[int] = None, **kw) -> Task:
    if name == "induction":
        return Task(name, induction_heads, vocab_size or 16)
    if name == "mqar":
        return Task(name, mqar, vocab_size or 256, {"num_kv_pairs": kw.get("num_kv_pairs") or 8})
    if name in ("selective_copying", "selcopy"):
        return Task("selective_copying", selective_copying, vocab_size or 16,
                    {"num_tokens": kw.get("num_tokens") or 8})
    raise ValueError(f"unknown synthetic task {name!r}; known: induction, mqar, selective_copying")


# ---- models ---------------------------------------------------------------------------------

def parse_mixer_spec(spec: str) -> List[str]:
    """"mamba" → [mamba]; "mamba+attention" → [mamba, attention] (a hybrid's layer pattern)."""
    return [s.strip() for s in spec.split("+") if s.strip()]


def apply_overrides(cfg: ModelConfig, overrides: Optional[Dict[str, str]]) -> ModelConfig:
    """``cfg`` with ``overrides`` ({"ttt.pre_conv": "true", …}, keys as in ``model.*`` without the
    prefix, values parsed as YAML) applied by the config loader's own override path
    (``ttt_lm.config.load_config``); an unknown key or a value of the wrong type is refused with a
    ValueError that names it."""
    if not overrides:
        return cfg
    from omegaconf import OmegaConf

    from ttt_lm.config import ConfigError, ExperimentConfig, load_config
    try:
        return load_config(None, [f"model.{k}={v}" for k, v in overrides.items()],
                           schema=OmegaConf.structured(ExperimentConfig(model=cfg))).model
    except ConfigError as e:
        raise ValueError(f"model option: {e}") from None


def build_tiny_lm(pattern: Sequence[str], vocab_size: int, n_layers: int = 2, d_model: int = 64,
                  n_heads: int = 2, max_seq_len: int = 4096, seed: int = 0,
                  overrides: Optional[Dict[str, str]] = None) -> LM:
    """A small LM for synthetic tasks. Chunk/mini-batch sizes (and LaCT's window) are 16 so that short training
    sequences span several chunks; attention is global (``attention``) unless the pattern says
    ``local_attention``. ``overrides`` (:func:`apply_overrides`) change any other model option,
    e.g. {"ttt.pre_conv": "true"}."""
    torch.manual_seed(seed)
    pat = list(pattern)
    if n_layers % len(pat):
        n_layers = len(pat) * max(1, round(n_layers / len(pat)))
    cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                      layer_pattern=pat, max_seq_len=max_seq_len, tie_embeddings=True)
    for name, section in cfg.sections().items():   # each mixer section says what "short" means (``short``)
        if callable(getattr(section, "short", None)):
            setattr(cfg, name, section.short(16))
    return LM(apply_overrides(cfg, overrides))


def model_label(mixer: str, overrides: Optional[Dict[str, str]] = None) -> str:
    """The name a run's rows carry: the mixer spec, with its model overrides in brackets (so that
    runs with and without them are separate rows of a report), e.g. ``ttt_linear [ttt.pre_conv=true]``."""
    if not overrides:
        return mixer
    return f"{mixer} [{', '.join(f'{k}={v}' for k, v in overrides.items())}]"


# ---- train and test -------------------------------------------------------------------------

def masked_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[int, int]:
    m = labels != IGNORE
    return int((logits.argmax(-1)[m] == labels[m]).sum()), int(m.sum())


@torch.no_grad()
def evaluate_task(model: LM, task: Task, seq_len: int, num_examples: int = 64, batch_size: int = 16,
                  chunk_len: int = 512, seed: int = 10_000) -> float:
    """Accuracy over the scored positions of ``num_examples`` fresh sequences of ``seq_len``,
    processed ``chunk_len`` tokens at a time with the model's states carried across chunks."""
    model.eval()
    g = torch.Generator().manual_seed(seed + seq_len)
    dev = next(model.parameters()).device
    correct = total = 0
    for i in range(0, num_examples, batch_size):
        b = min(batch_size, num_examples - i)
        x, y = task.batch(b, seq_len, g)
        x, y = x.to(dev), y.to(dev)
        states = None
        for s in range(0, seq_len, chunk_len):
            out = model(x[:, s:s + chunk_len], states=states, output_states=s + chunk_len < seq_len)
            states = out.states
            c, n = masked_accuracy(out.logits, y[:, s:s + chunk_len])
            correct += c
            total += n
    return correct / max(total, 1)


@dataclass
class SyntheticResult:
    task: str
    mixer: str
    pattern: List[str]
    train_len: int
    steps: int
    final_train_loss: float
    train_seconds: float
    accuracy: Dict[int, float]
    num_params: int
    steps_to_solve: Optional[int] = None
    lr: Optional[float] = None
    d_model: Optional[int] = None
    state_size: Optional[int] = None       # numbers in one sequence's carried state at train_len
    chance: Optional[float] = None
    budget: Optional[int] = None           # the step budget (steps = steps_to_solve or budget)
    lr_trials: List[Dict] = field(default_factory=list)  # every lr tried: lr, steps_to_solve, train_acc, loss
    seed: int = 0                          # of the model's init, the training batches and the test sequences
    overrides: Dict[str, str] = field(default_factory=dict)  # model options changed (``--set``); in ``mixer`` too
    criterion: bool = True                 # trained to ``stop_at``; False: ran its whole budget, nothing checked


def train_steps(model: LM, next_batch: Callable[[], Tuple[torch.Tensor, torch.Tensor]], steps: int,
                lr: float = 3e-3, weight_decay: float = 0.0, warmup: int = 50, progress: bool = False,
                desc: str = "train", stop: Optional[Callable[[int], bool]] = None) -> Tuple[float, Optional[int]]:
    """AdamW on ``steps`` batches from ``next_batch()`` (inputs, labels with -100 where unscored);
    linear warmup then cosine decay to 10%, gradients clipped to norm 1. ``stop(step)`` is asked after
    every step; once it says True training ends. Returns (last loss, the step it stopped at or None)."""
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))

    def lr_at(i):
        if i < warmup:
            return lr * (i + 1) / warmup
        t = (i - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    it = range(steps)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=desc, leave=False)
    loss_v = float("nan")
    for i in it:
        model.train()
        for pg in opt.param_groups:
            pg["lr"] = lr_at(i)
        x, y = next_batch()
        loss = model(x.to(dev), labels=y.to(dev)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_v = float(loss.detach())
        if stop is not None and stop(i + 1):
            return loss_v, i + 1
    return loss_v, None


def train_task(model: LM, task: Task, train_len: int, steps: int, batch_size: int = 32, lr: float = 3e-3,
               weight_decay: float = 0.0, warmup: int = 50, seed: int = 0, stop_at: Optional[float] = None,
               check_every: int = 50, progress: bool = False,
               check_examples: int = 128) -> Tuple[float, Optional[int]]:
    """:func:`train_steps` on fresh batches of ``task`` at ``train_len``. With ``stop_at``, every
    ``check_every`` steps accuracy is measured on ``check_examples`` held-out sequences at
    ``train_len`` and training stops once it reaches ``stop_at``; returns (last loss, that step)."""
    g = torch.Generator().manual_seed(seed)

    def stop(step):
        return (stop_at is not None and step % check_every == 0
                and evaluate_task(model, task, train_len, num_examples=check_examples, seed=seed + 77) >= stop_at)

    return train_steps(model, lambda: task.batch(batch_size, train_len, g), steps, lr, weight_decay, warmup,
                       progress, f"train {task.name}", stop if stop_at is not None else None)


def state_size(model: LM, task: Task, seq_len: int) -> int:
    """Numbers (tensor elements) one sequence carries from chunk to chunk after ``seq_len`` tokens:
    recurrent states, conv caches, and for attention its KV cache (which grows with the length).
    The quantity Zoology puts on the x-axis of its accuracy-vs-state plot."""
    dev = next(model.parameters()).device
    x, _ = task.batch(1, seq_len, torch.Generator().manual_seed(0))

    def count(o) -> int:
        if torch.is_tensor(o):
            return o.numel()
        if isinstance(o, dict):
            return sum(count(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(count(v) for v in o)
        if hasattr(o, "__dataclass_fields__"):
            return sum(count(getattr(o, f)) for f in o.__dataclass_fields__)
        return 0

    with torch.no_grad():
        out = model(x.to(dev), output_states=True)
    return count(out.states)


def run_synthetic(task: Task, mixer: str, train_len: int, test_lens: Sequence[int], steps: int,
                  batch_size: int = 32, lr: float = 3e-3, d_model: int = 64, n_layers: int = 2,
                  n_heads: int = 2, num_eval: int = 64, seed: int = 0, device: str = "cpu",
                  progress: bool = False, stop_at: Optional[float] = None,
                  impl: str = "chunked", lrs: Optional[Sequence[float]] = None, eval_chunk_len: int = 512,
                  check_every: int = 50, overrides: Optional[Dict[str, str]] = None) -> SyntheticResult:
    """Train a tiny model of ``mixer`` on ``task`` at ``train_len`` and test it at ``test_lens``.

    With ``lrs`` (a small sweep, as Zoology does) one model is trained per learning rate, each
    until accuracy at ``train_len`` reaches ``stop_at`` or ``steps`` run out; the kept one is
    :func:`pick_best` of them, and only it is tested at every length. Every lr tried is recorded
    in ``lr_trials``. ``overrides`` change model options (:func:`build_tiny_lm`); the result's
    ``mixer`` is then :func:`model_label`'s."""
    pattern = parse_mixer_spec(mixer)
    overrides = dict(overrides or {})
    max_len = max([train_len, *test_lens])
    trials = []
    best = None
    t0 = time.time()
    for i, r in enumerate(lrs or [lr]):
        model = build_tiny_lm(pattern, task.vocab_size, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                              max_seq_len=max_len, seed=seed, overrides=overrides).to(device)
        apply_impl(model, impl)
        t1 = time.time()
        loss, solved = train_task(model, task, train_len, steps, batch_size=batch_size, lr=r, seed=seed,
                                  progress=progress, stop_at=stop_at, check_every=check_every)
        acc = evaluate_task(model, task, train_len, num_examples=num_eval, seed=seed + 10_000,
                            chunk_len=eval_chunk_len)
        trial = {"lr": r, "steps_to_solve": solved, "steps": steps if solved is None else solved, "budget": steps,
                 "train_acc": acc, "final_train_loss": loss, "seconds": time.time() - t1}
        trials.append(trial)
        if best is None or pick_best([best[0], trial]) is trial:
            best = (trial, model)
        else:
            del model
    trial, model = best
    dt = time.time() - t0
    acc = {int(T): (trial["train_acc"] if int(T) == train_len else
                    evaluate_task(model, task, int(T), num_examples=num_eval, seed=seed + 10_000,
                                  chunk_len=eval_chunk_len))
           for T in test_lens}
    return SyntheticResult(task.name, model_label(mixer, overrides), model.cfg.layer_kinds(), train_len, trial["steps"],
                           trial["final_train_loss"], dt, acc, model.num_params(), trial["steps_to_solve"],
                           lr=trial["lr"], d_model=d_model, state_size=state_size(model, task, train_len),
                           chance=task.chance, budget=steps, lr_trials=trials, seed=seed, overrides=overrides,
                           criterion=stop_at is not None)


def parse_impl(impl: str) -> Dict[Optional[str], str]:
    """``impl`` is "chunked" or "reference" for every mixer ({None: form}), or per layer kind, e.g.
    "mamba=reference,rglru=reference" ({kind: form}; kinds not named keep the chunked form)."""
    forms = ("chunked", "reference")
    if "=" not in impl:
        if impl not in forms:
            raise ValueError(f"impl must be chunked, reference or <kind>=<form> pairs, got {impl!r}")
        return {None: impl}
    per: Dict[Optional[str], str] = {}
    for part in impl.split(","):
        kind, _, form = part.partition("=")
        if form not in forms or not kind.strip():
            raise ValueError(f"impl pair {part!r}: expected <layer kind>=chunked|reference")
        per[kind.strip()] = form
    return per


def apply_impl(model: LM, impl: str) -> None:
    per = parse_impl(impl)
    for kind, block in zip(model.cfg.layer_kinds(), model.layers):
        block.mixer.impl = per.get(None, per.get(kind, "chunked"))


def pick_best(trials: Sequence[Dict]) -> Dict:
    """The best of several lr trials: among those that reached the criterion, the fewest steps;
    if none did, the highest accuracy at the train length, then the lowest final loss."""
    solved = [t for t in trials if t["steps_to_solve"] is not None]
    if solved:
        return min(solved, key=lambda t: (t["steps_to_solve"], -t["train_acc"]))
    return max(trials, key=lambda t: (t["train_acc"], -t["final_train_loss"]))


def _steps_cell(r: SyntheticResult) -> str:
    if r.steps_to_solve is not None:
        return f"{r.steps_to_solve}"
    if not r.criterion:
        return f"no criterion ({_budget(r)} steps)"
    return f"not solved in {_budget(r)}"


def _seed_steps(r: SyntheticResult) -> str:
    """One seed's entry in the across-seeds table: its steps to solve, ">N" where its budget N ran
    out, "N (no criterion)" where it trained N steps without checking one."""
    if r.steps_to_solve is not None:
        return f"{r.steps_to_solve}"
    return f">{_budget(r)}" if r.criterion else f"{_budget(r)} (no criterion)"


def _solved_count(g: Sequence[SyntheticResult]) -> str:
    """How many of a model's seeds met the criterion, of those trained to one; "no criterion" where
    none was."""
    checked = [r for r in g if r.criterion]
    if not checked:
        return "no criterion"
    return f"{sum(r.steps_to_solve is not None for r in checked)} of {len(checked)}" + (
        f" ({len(g) - len(checked)} without a criterion)" if len(checked) < len(g) else "")


def _budget(r: SyntheticResult) -> int:
    return r.budget if r.budget is not None else r.steps


def _budget_cell(r: SyntheticResult) -> str:
    """The kept model's step budget, and the budgets of the other lrs tried where they differ
    (e.g. ``3000 (lr 0.001: 2000)``), so that a row joined from runs of different budgets says so."""
    own = _budget(r)
    others = [t for t in result_trials(r) if t["lr"] != r.lr and t["budget"] is not None and t["budget"] != own]
    if not others:
        return f"{own}"
    return f"{own} (" + ", ".join(f"lr {t['lr']:g}: {t['budget']}" for t in others) + ")"


def results_table(results: Sequence[SyntheticResult]) -> str:
    """Markdown: one row per mixer (and width): the lr kept, steps to reach the criterion (or "not
    solved in N"; "no criterion (N steps)" for a run trained without one), and accuracy at each test length (train length marked *). Where the rows' step
    budgets differ (or a row's lrs were tried at different budgets), a budget column states each
    row's, so that rows of different budgets are never mixed silently."""
    lens = sorted({T for r in results for T in r.accuracy})
    tl = {r.train_len for r in results}
    widths = len({r.d_model for r in results}) > 1
    seeds = len({r.seed for r in results}) > 1
    cells = [_budget_cell(r) for r in results]
    budgets = len(set(cells)) > 1 or any(" (" in c for c in cells)
    head = ["mixer"] + (["d_model"] if widths else []) + (["seed"] if seeds else [])
    head += ["layers", "params", "state", "lr"]
    head += (["budget"] if budgets else []) + ["steps to solve", "train loss"]
    head += [f"{T}{'*' if T in tl else ''}" for T in lens]
    nfix = len(head) - len(lens)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * nfix + ["---:"] * len(lens)) + "|"]
    for r, cell in zip(results, cells):
        row = [r.mixer] + ([str(r.d_model)] if widths else []) + ([str(r.seed)] if seeds else [])
        row += [",".join(r.pattern), f"{r.num_params / 1e3:.0f}k",
                "" if r.state_size is None else f"{r.state_size / 1e3:.1f}k",
                "" if r.lr is None else f"{r.lr:g}"] + ([cell] if budgets else [])
        row += [_steps_cell(r), f"{r.final_train_loss:.3f}"]
        row += [f"{r.accuracy[T]:.2f}" if T in r.accuracy else "" for T in lens]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def seed_groups(results: Sequence[SyntheticResult]) -> List[List[SyntheticResult]]:
    """The results grouped by model (mixer, d_model, train length), in order of first appearance;
    each group's runs (one per seed) in seed order."""
    groups: Dict[Tuple, List[SyntheticResult]] = {}
    for r in results:
        groups.setdefault(_key(r)[:-1], []).append(r)       # a row's key without its seed
    return [sorted(g, key=lambda r: r.seed) for g in groups.values()]


def _mean_range(xs: Sequence[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{sum(xs) / len(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def seeds_table(results: Sequence[SyntheticResult]) -> str:
    """Markdown: one row per model across its seeds: the seeds, the lr(s) they ran with, how many
    met the criterion, each seed's steps to solve in seed order (">N": not solved in its budget N;
    "N (no criterion)": trained N steps without one), and at each test length the mean accuracy over the seeds with (min–max)."""
    groups = seed_groups(results)
    lens = sorted({T for r in results for T in r.accuracy})
    tl = {r.train_len for r in results}
    widths = len({r.d_model for r in results}) > 1
    head = ["mixer"] + (["d_model"] if widths else []) + ["seeds", "lr", "solved", "steps to solve (per seed)"]
    head += [f"{T}{'*' if T in tl else ''}" for T in lens]
    nfix = len(head) - len(lens)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * nfix + ["---:"] * len(lens)) + "|"]
    for g in groups:
        r0 = g[0]
        lrs = list(dict.fromkeys(r.lr for r in g if r.lr is not None))
        row = [r0.mixer] + ([str(r0.d_model)] if widths else [])
        row += [", ".join(str(r.seed) for r in g), ", ".join(f"{x:g}" for x in lrs),
                _solved_count(g), " · ".join(_seed_steps(r) for r in g)]
        row += [_mean_range([r.accuracy[T] for r in g if T in r.accuracy]) if any(T in r.accuracy for r in g)
                else "" for T in lens]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def several_seeds(results: Sequence[SyntheticResult]) -> bool:
    """Whether some model was run with more than one seed (then tables and plots summarize seeds)."""
    return any(len(g) > 1 for g in seed_groups(results))


MARKERS = "osD^vP*Xh<>"
LINESTYLES = ["-", "--", "-.", ":"]


def _style(k: int, n: int) -> dict:
    """Marker, line style and a small multiplicative x offset for curve k of n, so that curves that
    coincide (e.g. several at chance) stay visible side by side."""
    off = 2 ** (0.06 * (k - (n - 1) / 2)) if n > 1 else 1.0
    from matplotlib import colormaps
    color = colormaps["tab10" if n <= 10 else "tab20"](k % (10 if n <= 10 else 20))   # no colour repeats up to 20
    return {"marker": MARKERS[k % len(MARKERS)], "ls": LINESTYLES[k % len(LINESTYLES)], "off": off, "color": color}


def plot_accuracy(results: Sequence[SyntheticResult], path: Optional[str] = None, title: str = "",
                  chance: Optional[float] = None):
    """Accuracy against test length, one curve per result: distinct markers and line styles with a
    small horizontal offset per curve (stated in the caption) so overlapping curves stay apart,
    a dotted chance line, and the training length marked and labelled. Where some model ran with
    several seeds, one curve per model: the mean over its seeds with min–max bars, labelled with
    how many seeds met the criterion. Returns the Figure when ``path`` is None (else saves and
    closes it)."""
    from ttt_lm.eval.common import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    widths = len({r.d_model for r in results}) > 1
    seeds = several_seeds(results)
    groups = seed_groups(results) if seeds else [[r] for r in results]
    for k, g in enumerate(groups):
        st, r = _style(k, len(groups)), g[0]
        xs = sorted({T for x in g for T in x.accuracy})
        ys = [[x.accuracy[T] for x in g if T in x.accuracy] for T in xs]
        mean = [sum(y) / len(y) for y in ys]
        name = r.mixer + (f" d={r.d_model}" if widths else "")
        if seeds:
            lrs = ", ".join(dict.fromkeys(f"{x.lr:g}" for x in g if x.lr is not None))
            checked = [x for x in g if x.criterion]
            lab = name + (f" (lr {lrs}, no criterion, {len(g)} seeds)" if not checked else
                          f" (lr {lrs}, solved by {sum(x.steps_to_solve is not None for x in checked)} of "
                          f"{len(checked)} seeds" + (f", {len(g) - len(checked)} without a criterion)"
                                                     if len(checked) < len(g) else ")"))
            ax.errorbar([x * st["off"] for x in xs], mean, yerr=[[m - min(y) for m, y in zip(mean, ys)],
                                                                  [max(y) - m for m, y in zip(mean, ys)]],
                        marker=st["marker"], ls=st["ls"], color=st["color"], ms=5, lw=1.3, capsize=2, label=lab,
                        alpha=0.9)
            continue
        solved = (f", solved in {r.steps_to_solve}" if r.steps_to_solve is not None else
                  f", {_budget(r)} steps, no criterion" if not r.criterion else
                  f", not solved in {r.budget}" if r.budget is not None else "")
        lab = name + (f" (lr {r.lr:g}{solved})" if r.lr is not None else "")
        ax.plot([x * st["off"] for x in xs], mean, marker=st["marker"], ls=st["ls"], color=st["color"], ms=5, lw=1.3,
                label=lab, alpha=0.9)
    chance = chance if chance is not None else next((r.chance for r in results if r.chance is not None), None)
    if chance is not None:
        ax.axhline(chance, color="gray", ls=":", lw=1.2, label=f"chance ({chance:.3f})")
    for L in sorted({r.train_len for r in results}):
        ax.axvline(L, color="black", ls="--", lw=1, alpha=0.6, label=f"train length ({L})")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("test sequence length (tokens; curves offset slightly sideways)")
    ax.set_ylabel("accuracy (mean over seeds; bars: min–max)" if seeds else "accuracy")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def plot_accuracy_vs_width(results: Sequence[SyntheticResult], path: Optional[str] = None, title: str = "",
                           chance: Optional[float] = None):
    """Zoology's figure: accuracy at the train length against model width (left) and against the
    state a sequence carries (right), one curve per mixer, with the chance line; a width run with
    several seeds is one point, their mean accuracy."""
    from ttt_lm.eval.common import pyplot
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    mixers = list(dict.fromkeys(r.mixer for r in results))
    chance = chance if chance is not None else next((r.chance for r in results if r.chance is not None), None)
    for k, m in enumerate(mixers):
        gs = sorted((g for g in seed_groups(results) if g[0].mixer == m), key=lambda g: g[0].d_model or 0)
        rs = [g[0] for g in gs]
        st = _style(k, len(mixers))
        acc = [sum(r.accuracy.get(r.train_len, float("nan")) for r in g) / len(g) for g in gs]
        axes[0].plot([(r.d_model or 0) * st["off"] for r in rs], acc, marker=st["marker"], ls=st["ls"], color=st["color"],
                     label=m)
        axes[1].plot([(r.state_size or 0) * st["off"] for r in rs], acc, marker=st["marker"], ls=st["ls"],
                     color=st["color"], label=m)
    for ax, xl in zip(axes, ["model width d_model", "state size (numbers per sequence at the train length)"]):
        if chance is not None:
            ax.axhline(chance, color="gray", ls=":", lw=1.2, label=f"chance ({chance:.3f})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xl)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy at the train length")
    # outside the plots, right of them: inside, it would hide points wherever it went
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def result_from_dict(d: dict) -> SyntheticResult:
    """The inverse of :func:`result_dict` (to redraw a figure from a saved JSON)."""
    d = dict(d)
    d["accuracy"] = {int(k): v for k, v in d["accuracy"].items()}
    return SyntheticResult(**d)


def result_dict(r: SyntheticResult) -> dict:
    d = asdict(r)
    d["accuracy"] = {str(k): v for k, v in r.accuracy.items()}
    return d


# ---- merging saved runs -----------------------------------------------------------------------

#: arguments that must agree between runs whose rows share one table (the budget ``steps``, the
#: lrs, the width, the seed and the test lengths may differ: each row states its own)
PROTOCOL_KEYS = ("task", "train_len", "stop_at", "batch_size", "check_every", "n_layers", "n_heads", "vocab_size",
                 "num_kv_pairs", "num_tokens", "num_eval", "eval_chunk_len")


def _kept_trial(r: SyntheticResult) -> Dict:
    return {"steps_to_solve": r.steps_to_solve, "train_acc": r.accuracy.get(r.train_len, 0.0),
            "final_train_loss": r.final_train_loss}


def result_trials(r: SyntheticResult) -> List[Dict]:
    """Every lr tried for ``r``, each stating its own step budget (trials saved before trials carried
    one get the row's); a result saved without ``lr_trials`` is its one kept trial."""
    trials = r.lr_trials or [dict(lr=r.lr, steps=r.steps, seconds=r.train_seconds, **_kept_trial(r))]
    return [dict(t, budget=t.get("budget", r.budget)) for t in trials]


def _join(rs: Sequence[Tuple[SyntheticResult, str]]) -> SyntheticResult:
    """Results of one model run at different lrs as one row, as if one ``--lrs`` sweep had run them:
    the kept model is :func:`pick_best` of each one's kept model, ``lr_trials`` the union (each trial
    with its own budget) and ``train_seconds`` the sum. No lr may appear twice (which to trust
    would be a guess)."""
    r0 = rs[0][0]
    seen: Dict[float, str] = {}
    for r, src in rs:
        for t in result_trials(r):
            if t["lr"] in seen:
                raise ValueError(f"{r0.task} {r0.mixer} d_model={r0.d_model} seed {r0.seed}: lr {t['lr']:g} was run "
                                 f"in both {seen[t['lr']]} and {src}")
            seen[t["lr"]] = src
    kept = [(_kept_trial(r), r) for r, _ in rs]
    best = pick_best([k for k, _ in kept])
    winner = next(r for k, r in kept if k is best)
    out = SyntheticResult(**{f: getattr(winner, f) for f in winner.__dataclass_fields__})
    out.lr_trials = [t for r, _ in rs for t in _with_accuracy(r)]
    out.train_seconds = sum(r.train_seconds for r, _ in rs)
    return out


def _with_accuracy(r: SyntheticResult) -> List[Dict]:
    """``r``'s trials, its kept one carrying ``r``'s accuracy at every test length (``accuracy``,
    lengths as strings), so that joining it into a row it does not win keeps what was measured."""
    return [dict(t, accuracy={str(k): v for k, v in r.accuracy.items()}) if t["lr"] == r.lr and "accuracy" not in t
            else t for t in result_trials(r)]


def trial_accuracy(r: SyntheticResult, t: Dict) -> Optional[Dict[int, float]]:
    """Accuracy by test length of the model trained in trial ``t`` of row ``r``: the row's own for its
    kept lr, the saved one for a run joined into the row; None for an lr whose model was only
    tested at the train length (not the kept one of its own sweep)."""
    if t["lr"] == r.lr:
        return dict(r.accuracy)
    acc = t.get("accuracy")
    return None if acc is None else {int(k): v for k, v in acc.items()}


def _key(r: SyntheticResult) -> Tuple:
    return (r.task, r.mixer, r.d_model, r.train_len, r.seed)


def merge_results(results: Sequence[SyntheticResult], sources: Optional[Sequence[str]] = None
                  ) -> List[SyntheticResult]:
    """One row per (mixer, d_model, train length, seed) from results saved by separate runs, in order of
    first appearance. Runs of the same model at different learning rates (e.g. one run per lr)
    become one row as if they had been one ``--lrs`` sweep (:func:`_join`); their budgets may
    differ, and every trial states its own."""
    names = list(sources) if sources is not None else [f"result {i}" for i in range(len(results))]
    if len(names) != len(results):
        raise ValueError(f"merge_results: {len(results)} results but {len(names)} source names")
    groups: Dict[Tuple, List[Tuple[SyntheticResult, str]]] = {}
    for r, src in zip(results, names):
        groups.setdefault(_key(r), []).append((r, src))
    return [rs[0][0] if len(rs) == 1 else _join(rs) for rs in groups.values()]


def update_report(old: Sequence[SyntheticResult], new: Sequence[SyntheticResult], old_name: str = "the report",
                  new_name: str = "the new runs") -> Tuple[List[SyntheticResult], List[SyntheticResult]]:
    """The rows of an earlier merged report ``old`` brought up to date with the rows of newer runs
    ``new``. For the same (mixer, d_model, train length, seed): a new row whose lrs include every lr of
    the old row replaces it (a rerun, e.g. with a larger budget); a new row with no lr in common
    joins it as one sweep (:func:`_join`); a partial overlap is refused, since part of the old
    sweep would be silently kept. Returns (rows: the old order, then models only ``new`` has;
    the old rows that were replaced)."""
    fresh = {_key(r): r for r in new}
    rows, replaced, used = [], [], set()
    for r in old:
        n = fresh.get(_key(r))
        if n is None:
            rows.append(r)
            continue
        used.add(_key(r))
        old_lrs = {t["lr"] for t in result_trials(r)}
        new_lrs = {t["lr"] for t in result_trials(n)}
        if old_lrs <= new_lrs:
            rows.append(n)
            replaced.append(r)
        elif old_lrs & new_lrs:
            raise ValueError(f"{r.task} {r.mixer} d_model={r.d_model} seed {r.seed}: {new_name} rerun lr "
                             f"{', '.join(f'{x:g}' for x in sorted(old_lrs & new_lrs))} of {old_name} but not "
                             f"{', '.join(f'{x:g}' for x in sorted(old_lrs - new_lrs))}: rerun every lr of that "
                             f"row, or none")
        else:
            rows.append(_join([(r, old_name), (n, new_name)]))
    rows += [r for r in new if _key(r) not in used]
    return rows, replaced
