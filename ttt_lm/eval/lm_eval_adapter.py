"""lm-evaluation-harness adapter: our checkpoints as an ``lm_eval`` model named ``ttt_lm``.

Importing this module registers the model, after which lm_eval's own evaluator runs any task::

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
lm_eval's disjoint rolling windows of that length. Requests are processed one at a time.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM as HarnessLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ttt_lm.eval.checkpoint import load_checkpoint
from ttt_lm.eval.common import EvalError, GLOBAL_ATTENTION, check_vocab, dtype_of, pick_device, progress


@register_model("ttt_lm")
class TTTLMHarness(HarnessLM):
    """``model_args``: checkpoint (export or run dir), tokenizer (a ``.model`` file or a prepared
    data dir; default: beside the checkpoint or its config's data.path), device, dtype,
    chunk_len, max_gen_toks."""

    def __init__(self, checkpoint: Optional[str] = None, tokenizer: Optional[str] = None, device: str = "auto",
                 dtype: str = "float32", chunk_len: int = 2048, max_gen_toks: int = 256, model=None,
                 tokenizer_obj=None, batch_size=None, **_unused):
        super().__init__()
        from ttt_lm.data import load_tokenizer
        dev = pick_device(device)
        if model is None:
            if checkpoint is None:
                raise EvalError("ttt_lm needs model_args checkpoint=<export or run dir>")
            ck = load_checkpoint(checkpoint, device=dev, dtype=dtype_of(dtype))
            model = ck.model
            tokenizer = tokenizer or ck.tokenizer_path
        if tokenizer_obj is None:
            if tokenizer is None:
                raise EvalError("no tokenizer: " + (missing_tokenizer(ck, "model_args tokenizer=<path>") if model is None
                                                    else "pass tokenizer=<.model file or prepared data dir>"))
            tokenizer_obj = load_tokenizer(tokenizer)
        self.model = model.eval()
        self.tok = tokenizer_obj
        check_vocab(self.model, self.tok.vocab_size, f"the tokenizer {getattr(self.tok, 'path', '')}",
                    allow_padding=True)
        self._device = next(self.model.parameters()).device
        self.chunk_len = int(chunk_len)
        self.max_gen_toks = int(max_gen_toks)
        kinds = self.model.cfg.layer_kinds()
        #: tokens a model with global attention can see; None = unbounded (state carried)
        self.max_length = self.model.cfg.max_seq_len if any(k in GLOBAL_ATTENTION for k in kinds) else None

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
    def _run(self, ids: Sequence[int]):
        """Logits for every position of ``ids`` (chunked, states carried) and the final states."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self._device)
        outs, states = [], None
        for s in range(0, x.shape[1], self.chunk_len):
            o = self.model(x[:, s:s + self.chunk_len], states=states, output_states=True)
            states = o.states
            outs.append(o.logits[0].float())
        return torch.cat(outs, 0), states

    def _score(self, ctx: List[int], cont: List[int]) -> Tuple[float, bool]:
        if not cont:
            return 0.0, True
        full = ctx + cont
        inp = full[:-1]
        if self.max_length is not None and len(inp) > self.max_length:
            inp = inp[-self.max_length:]
        logits, _ = self._run(inp)
        lp = F.log_softmax(logits[-len(cont):], -1)
        tgt = torch.tensor(cont, device=lp.device)
        ll = float(lp.gather(1, tgt[:, None]).sum())
        greedy = bool((lp.argmax(-1) == tgt).all())
        return ll, greedy

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        res = []
        for req in progress(requests, total=len(requests), desc="loglikelihood", enable=not disable_tqdm):
            ctx, cont = self._encode_pair(*req.args)
            r = self._score(ctx, cont)
            res.append(r)
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        res = []
        for req in progress(requests, total=len(requests), desc="loglikelihood_rolling", enable=not disable_tqdm):
            (text,) = req.args
            toks = self.tok_encode(text)
            if self.max_length is None:
                total = self._score([self.eot_token_id], toks)[0]
            else:
                total = 0.0
                for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                        toks, prefix_token=self.eot_token_id, max_seq_len=self.max_length, context_len=1)):
                    total += self._score(list(ctx), list(pred))[0]
            res.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return res

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        res = []
        for req in progress(requests, total=len(requests), desc="generate_until", enable=not disable_tqdm):
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
            logits, states = self._run(ids)
            last = logits[-1:]
            out: List[int] = []
            text = ""
            for i in range(max_new):
                if temperature > 0:
                    nxt = torch.multinomial((last / temperature).softmax(-1), 1)[:, 0]
                else:
                    nxt = last.argmax(-1)
                t = int(nxt)
                if t == self.eot_token_id:
                    break
                out.append(t)
                text = self.tok.decode(out)
                if any(u in text for u in until):
                    break
                if i + 1 < max_new:
                    last, states = self.model.step(nxt, states)
                    last = last.float()
            for u in until:
                if u and u in text:
                    text = text.split(u)[0]
            res.append(text)
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
        return res


def run_tasks(checkpoint: str, tasks: Sequence[str], include_path: Optional[str] = None, limit=None,
              num_fewshot: Optional[int] = None, tokenizer: Optional[str] = None, device: str = "auto",
              dtype: str = "float32", chunk_len: int = 2048, seed: int = 1234) -> dict:
    """lm_eval's ``simple_evaluate`` on a checkpoint; returns its results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    args = {"checkpoint": checkpoint, "device": device, "dtype": dtype, "chunk_len": chunk_len}
    if tokenizer:
        args["tokenizer"] = tokenizer
    return simple_evaluate(model="ttt_lm", model_args=args, tasks=list(tasks), task_manager=tm, limit=limit,
                           num_fewshot=num_fewshot, random_seed=seed, numpy_random_seed=seed,
                           torch_random_seed=seed, fewshot_random_seed=seed, bootstrap_iters=0,
                           log_samples=False)
