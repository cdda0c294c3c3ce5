"""lm-evaluation-harness adapter: our checkpoints as an ``lm_eval`` model named ``ttt_lm``.

lm_eval 0.4.13 has no plugin mechanism for models (its registry is filled by imports: the models
it ships are listed in ``lm_eval.models.MODEL_MAPPING``, and its CLI reads no entry points), so
the model is registered by importing this module. From the shell, ``python -m
ttt_lm.eval.lm_eval_cli`` imports it and then runs lm_eval's own command line, with every option
of ``lm_eval`` (``--model ttt_lm --model_args checkpoint=out/tiny``, ``--batch_size``,
``--bootstrap_iters``, ``--log_samples``, ``--output_path``, ``--include_path``)::

    python -m ttt_lm.eval.lm_eval_cli --model ttt_lm --model_args checkpoint=out/tiny \
        --include_path ttt_lm/eval/tasks --tasks ttt_tiny --batch_size 8 --log_samples --output_path results

From Python::

    import ttt_lm.eval.lm_eval_adapter  # noqa: F401  (registers "ttt_lm")
    from lm_eval import simple_evaluate
    simple_evaluate(model="ttt_lm", model_args="checkpoint=out/tiny,device=cpu", tasks=["lambada_openai"])

or ``python -m ttt_lm.eval lm_eval --checkpoint out/tiny --tasks lambada_openai``.

Scoring follows lm_eval's causal-LM conventions: trailing spaces of a context move to the
continuation; the pair is encoded as a whole and split at the context's length; an empty context is
replaced by the end-of-document id (what the model saw before every document). Sequences are read
``chunk_len`` tokens at a time with each layer's state carried, so recurrent models score contexts
of any length with flat memory. A model with global attention layers sees at most
``model.max_seq_len`` tokens: longer contexts are cut on the left, and rolling log-likelihoods use
lm_eval's disjoint rolling windows of that length.

Batching (``batch_size``, lm_eval's ``--batch_size``; default 1): requests are ordered longest first
with lm_eval's ``Collator`` and scored ``batch_size`` at a time. Log-likelihood rows are padded on
the right (every layer is causal, so padding after a row's last token changes none of its scores);
per chunk only each position's target log-probability and greedy match are kept, so memory is
``batch_size × chunk_len × vocab`` whatever the length. Generation reads the common prompt prefix
(the shortest prompt's length) in one forward pass, then advances all rows together one decode
step at a time: a row still inside its prompt is fed its next prompt token, the others their
sampled token, so every row's states see exactly its own text. Rows of one batch share their
generation settings (lm_eval groups requests by ``gen_kwargs``). ``batch_size=auto`` is refused:
give a number.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM as HarnessLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ttt_lm.eval.checkpoint import load_checkpoint, missing_tokenizer
from ttt_lm.eval.common import EvalError, check_vocab, dtype_of, pick_device, progress
from ttt_lm.model.registry import mixer_class
from ttt_lm.model.lm import mask_vocab, sample_next

#: a scoring item: the whole token sequence and how many of its last tokens are scored
Item = Tuple[List[int], int]


def _batch_size(value) -> int:
    if value is None:
        return 1
    if isinstance(value, str) and value.startswith("auto"):
        raise EvalError(f"batch_size={value} is not supported by ttt_lm: give a number (e.g. --batch_size 8)")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise EvalError(f"batch_size must be a positive integer, got {value!r}") from None
    if n < 1:
        raise EvalError(f"batch_size must be a positive integer, got {value!r}")
    return n


@register_model("ttt_lm")
class TTTLMHarness(HarnessLM):
    """``model_args``: checkpoint (export or run dir; ``pretrained`` is an alias, the key lm_eval
    names its output directory after), tokenizer (a ``.model`` file or a prepared
    data dir; default: the export's tokenizer.model, else its config's data.path), dtype,
    chunk_len, max_gen_toks. ``device`` and ``batch_size`` come from lm_eval's ``--device`` and
    ``--batch_size`` (in Python: model_args or simple_evaluate's arguments). A CUDA device on a
    machine without CUDA (lm_eval's CLI default is cuda:0) falls back to the CPU with a message."""

    def __init__(self, checkpoint: Optional[str] = None, tokenizer: Optional[str] = None, device: str = "auto",
                 dtype: str = "float32", chunk_len: int = 2048, max_gen_toks: int = 256, model=None,
                 tokenizer_obj=None, batch_size=1, max_batch_size=None, pretrained: Optional[str] = None,
                 **_unused):
        super().__init__()
        if pretrained is not None:
            if checkpoint is not None and checkpoint != pretrained:
                raise EvalError(f"model_args name two checkpoints: checkpoint={checkpoint} and pretrained={pretrained}")
            checkpoint = pretrained
        from ttt_lm.data import load_tokenizer
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval's CLI passes --device, default cuda:0, to every model: on a machine without
            # CUDA that default (or a request for CUDA) runs on the CPU, and says so
            print(f"ttt_lm: device {device} requested but CUDA is not available; running on the CPU",
                  file=sys.stderr)
            device = "cpu"
        dev = pick_device(device)
        ck = None
        if model is None:
            if checkpoint is None:
                raise EvalError("ttt_lm needs model_args checkpoint=<export or run dir>")
            ck = load_checkpoint(checkpoint, device=dev, dtype=dtype_of(dtype))
            model = ck.model
            tokenizer = tokenizer or ck.tokenizer_path
        if tokenizer_obj is None:
            if tokenizer is None:
                raise EvalError("no tokenizer: " + (missing_tokenizer(ck, "model_args tokenizer=<path>") if ck
                                                    else "pass tokenizer=<.model file or prepared data dir>"))
            tokenizer_obj = load_tokenizer(tokenizer)
        self.model = model.eval()
        self.tok = tokenizer_obj
        check_vocab(self.model, self.tok.vocab_size, f"the tokenizer {getattr(self.tok, 'path', '')}",
                    allow_padding=True)
        self._device = next(self.model.parameters()).device
        self.chunk_len = int(chunk_len)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = _batch_size(batch_size)
        kinds = self.model.cfg.layer_kinds()
        #: tokens a model with global attention can see; None = unbounded (state carried)
        self.max_length = self.model.cfg.max_seq_len if any(mixer_class(k).global_attention for k in kinds) else None

    # ---- tokens --------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, s: str) -> List[int]:
        return self.tok.encode(s)

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        if context == "":
            cont = self.tok_encode(continuation)
            return [self.eot_token_id], cont
        n = len(context) - len(context.rstrip())
        if n:
            continuation, context = context[-n:] + continuation, context[:-n]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):]

    # ---- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def _score_batch(self, items: Sequence[Item]) -> List[Tuple[float, bool]]:
        """(log-likelihood, greedy) of the last n tokens of each sequence, rows padded on the right
        and read chunk by chunk with the states carried."""
        rows = []
        for seq, n in items:
            inp, tgt = seq[:-1], seq[1:]
            if self.max_length is not None and len(inp) > self.max_length:
                inp, tgt = inp[-self.max_length:], tgt[-self.max_length:]
            rows.append((inp, tgt, min(n, len(tgt))))
        B, L = len(rows), max(len(r[0]) for r in rows)
        x = torch.full((B, L), self.eot_token_id, dtype=torch.long)
        y = torch.full((B, L), -1, dtype=torch.long)
        for i, (inp, tgt, _) in enumerate(rows):
            x[i, :len(inp)] = torch.tensor(inp)
            y[i, :len(tgt)] = torch.tensor(tgt)
        x, y = x.to(self._device), y.to(self._device)
        lp = torch.zeros(B, L, dtype=torch.float64, device=self._device)
        hit = torch.zeros(B, L, dtype=torch.bool, device=self._device)
        states = None
        for s in range(0, L, self.chunk_len):
            e = min(L, s + self.chunk_len)
            o = self.model(x[:, s:e], states=states, output_states=e < L)
            states = o.states
            logp = F.log_softmax(o.logits.float(), -1)
            yy = y[:, s:e]
            lp[:, s:e] = logp.gather(-1, yy.clamp(min=0)[..., None])[..., 0].double()
            hit[:, s:e] = mask_vocab(logp, self.tok.vocab_size).argmax(-1) == yy  # greedy: a real token
        out = []
        for i, (inp, _, n) in enumerate(rows):
            a, b = len(inp) - n, len(inp)
            out.append((float(lp[i, a:b].sum()), bool(hit[i, a:b].all())))
        return out

    def _score_items(self, items: Sequence[Item], desc: str, disable_tqdm: bool) -> List[Tuple[float, bool]]:
        """Scores of ``items`` in their order, computed ``batch_size`` at a time, longest first."""
        todo = [(i, it) for i, it in enumerate(items) if it[1] > 0]
        coll = Collator(todo, sort_fn=lambda t: (-len(t[1][0]), t[0]))
        res: List[Tuple[float, bool]] = []
        batches = coll.get_batched(n=self.batch_size)
        n_batches = -(-len(todo) // self.batch_size)
        for batch in progress(batches, total=n_batches, desc=desc, enable=not disable_tqdm and n_batches > 0):
            res.extend(self._score_batch([it for _, it in batch]))
        out: List[Tuple[float, bool]] = [(0.0, True)] * len(items)  # an empty continuation scores 0
        for (i, _), r in zip(todo, coll.get_original(res)):
            out[i] = r
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        items = []
        for req in requests:
            ctx, cont = self._encode_pair(*req.args)
            items.append((ctx + cont, len(cont)))
        res = self._score_items(items, "loglikelihood", disable_tqdm)
        for req, r in zip(requests, res):
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        items, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            toks = self.tok_encode(text)
            if self.max_length is None:
                windows = [([self.eot_token_id], toks)]
            else:
                windows = map(make_disjoint_window, get_rolling_token_windows(
                    toks, prefix_token=self.eot_token_id, max_seq_len=self.max_length, context_len=1))
            for ctx, pred in windows:
                items.append((list(ctx) + list(pred), len(pred)))
                owner.append(k)
        scores = self._score_items(items, "loglikelihood_rolling", disable_tqdm)
        res = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, scores):
            res[k] += ll
        for req, total in zip(requests, res):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return res

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def _generate_batch(self, prompts: List[List[int]], max_new: int, temperature: float,
                        until: List[str]) -> List[str]:
        """Continuations of ``prompts`` (one batch, rows advancing together; see the module
        docstring), each ending at the end-of-document id, at the first ``until`` string (cut there)
        or after ``max_new`` tokens."""
        B, n0 = len(prompts), min(len(p) for p in prompts)
        x = torch.tensor([p[:n0] for p in prompts], dtype=torch.long, device=self._device)
        states, logits = None, None
        for s in range(0, n0, self.chunk_len):
            o = self.model(x[:, s:s + self.chunk_len], states=states, output_states=True)
            states, logits = o.states, o.logits[:, -1].float()
        out: List[List[int]] = [[] for _ in range(B)]
        texts, done, pos = [""] * B, [False] * B, n0
        while True:
            drawn = sample_next(logits, temperature, vocab_size=self.tok.vocab_size).tolist()
            feed = []
            for i in range(B):
                if pos < len(prompts[i]):  # still inside this row's prompt
                    feed.append(prompts[i][pos])
                    continue
                t = self.eot_token_id if done[i] else int(drawn[i])
                if not done[i]:
                    if t == self.eot_token_id:
                        done[i] = True
                    else:
                        out[i].append(t)
                        texts[i] = self.tok.decode(out[i])
                        done[i] = len(out[i]) >= max_new or any(u in texts[i] for u in until)
                feed.append(t)
            if all(done):
                break
            pos += 1
            logits, states = self.model.step(torch.tensor(feed, dtype=torch.long, device=self._device), states)
            logits = logits.float()
        for i, t in enumerate(texts):
            for u in until:
                if u and u in t:
                    t = t.split(u)[0]
            texts[i] = t
        return texts

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        todo = []
        for k, req in enumerate(requests):
            context, kw = req.args
            kw = dict(kw or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            if kw.pop("do_sample", False) and temperature == 0.0:
                temperature = 1.0
            ids = self.tok_encode(context) or [self.eot_token_id]
            if self.max_length is not None and len(ids) + max_new > self.max_length:
                ids = ids[-max(1, self.max_length - max_new):]
            todo.append((k, ids, (max_new, temperature, tuple(until))))
        coll = Collator(todo, sort_fn=lambda t: (-len(t[1]), t[0]), group_fn=lambda t: t[2], group_by="gen_kwargs")
        res: List[str] = []
        n_batches = sum(-(-len(v) // self.batch_size) for v in coll._arr_with_indices.values())
        for batch in progress(coll.get_batched(n=self.batch_size), total=n_batches, desc="generate_until",
                              enable=not disable_tqdm and n_batches > 0):
            max_new, temperature, until = batch[0][2]
            res.extend(self._generate_batch([t[1] for t in batch], max_new, temperature, list(until)))
        res = coll.get_original(res)
        for req, text in zip(requests, res):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return res


def run_tasks(checkpoint: str, tasks: Sequence[str], include_path: Optional[str] = None, limit=None,
              num_fewshot: Optional[int] = None, tokenizer: Optional[str] = None, device: str = "auto",
              dtype: str = "float32", chunk_len: int = 2048, seed: int = 1234, batch_size: int = 1,
              bootstrap_iters: int = 100000, log_samples: bool = False) -> dict:
    """lm_eval's ``simple_evaluate`` on a checkpoint; returns its results dict (with ``samples``
    when ``log_samples``). ``bootstrap_iters`` is lm_eval's: 0 computes no standard errors; a
    metric with a closed form (a mean such as ``acc``) gets it, the others (``perplexity``) that
    many bootstrap resamples. A dataset that cannot be loaded is an EvalError saying so."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    args = {"checkpoint": checkpoint, "device": device, "dtype": dtype, "chunk_len": chunk_len,
            "batch_size": batch_size}
    if tokenizer:
        args["tokenizer"] = tokenizer
    try:
        tm = TaskManager(include_path=include_path) if include_path else TaskManager()
        return simple_evaluate(model="ttt_lm", model_args=args, tasks=list(tasks), task_manager=tm, limit=limit,
                               num_fewshot=num_fewshot, random_seed=seed, numpy_random_seed=seed,
                               torch_random_seed=seed, fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters,
                               log_samples=log_samples)
    except EvalError:
        raise
    except Exception as e:  # noqa: BLE001 - only a dataset failure is rephrased, anything else re-raised
        msg = dataset_error(e)
        if msg is None:
            raise
        raise EvalError(msg) from e


def dataset_error(exc: BaseException) -> Optional[str]:
    """A one-line explanation when ``exc`` is a task's dataset failing to load (no network or
    offline mode for a Hub dataset, a missing local data file), else None. The task is read from
    the frame of lm_eval's ``ConfigurableTask.download`` in the traceback."""
    import traceback
    task, path, in_datasets = None, None, False
    tb = exc.__traceback__
    while tb is not None:
        f = tb.tb_frame
        if f.f_code.co_name == "download" and hasattr(f.f_locals.get("self"), "config"):
            cfg = f.f_locals["self"].config
            task, path = getattr(cfg, "task", None), getattr(cfg, "dataset_path", None)
        in_datasets = in_datasets or "/datasets/" in f.f_code.co_filename.replace("\\", "/")
        tb = tb.tb_next
    if task is None or not (in_datasets or isinstance(exc, (ConnectionError, FileNotFoundError))):
        return None
    reason = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines()[0]
    return (f"task {task}: its dataset {path!r} could not be loaded ({reason}). A Hub dataset must be "
            f"downloaded once with network access (it is cached for offline runs with HF_DATASETS_OFFLINE=1); "
            f"a local one (dataset_path: json, data_files) names its files relative to the working directory. "
            f"A task that runs offline: --include_path ttt_lm/eval/tasks --tasks ttt_tiny, from the repository root")


def cache_default_task_index() -> None:
    """Keep lm_eval's index of its own tasks in a file. Every ``TaskManager`` (every start of
    lm_eval's CLI, every ``run_tasks``) parses all of lm_eval's ~14,000 task YAML files again (16 s
    of CPU here, most of a failed start's time); the folder is fixed for an installed lm_eval, so its
    index is read from ``$XDG_CACHE_HOME/ttt_lm`` (``~/.cache/ttt_lm``), keyed by lm_eval's version,
    the folder, its YAML files' count and their newest modification time, and written there when
    missing. Other task folders (``--include_path``) are indexed as lm_eval does, merged after it."""
    import hashlib
    import logging
    import os
    import pickle
    from pathlib import Path

    try:
        import lm_eval
        import lm_eval.tasks as tasks
        from lm_eval.tasks._index import TaskIndex
    except ImportError:  # pragma: no cover - another lm_eval layout: its own indexing stays
        return
    build = TaskIndex.__dict__.get("build")
    if not isinstance(build, staticmethod) or getattr(build.__func__, "_ttt_lm_cached", False):
        return
    build = build.__func__
    defaults = Path(tasks.__file__).resolve().parent
    log = logging.getLogger("lm_eval.tasks._index")

    def defaults_index(resolve_includes: bool) -> dict:
        files = list(TaskIndex._iter_yaml_files(defaults))
        newest = max((f.stat().st_mtime_ns for f in files), default=0)
        key = f"{getattr(lm_eval, '__version__', '?')} {defaults} {len(files)} {newest} {resolve_includes}"
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ttt_lm"
        path = cache / f"lm_eval_task_index_{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except Exception:  # noqa: BLE001 - no cache file yet, or an unreadable one: index again
            pass
        index = build([defaults], resolve_includes=resolve_includes)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(index, f)
            os.replace(tmp, path)
        except Exception:  # noqa: BLE001 - a read-only home: the next start indexes again
            pass
        return index

    def cached_build(paths, *, resolve_includes=True):
        index: dict = {}
        for root in paths:
            part = (defaults_index(resolve_includes) if Path(root).resolve() == defaults
                    else build([root], resolve_includes=resolve_includes))
            for name, entry in part.items():   # later paths override earlier, as lm_eval merges them
                if name in index:
                    log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                index[name].yaml_path)
                index[name] = entry
        return index

    cached_build._ttt_lm_cached = True
    TaskIndex.build = staticmethod(cached_build)


cache_default_task_index()
