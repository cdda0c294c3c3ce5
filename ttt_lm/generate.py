"""Sample text from a trained model:

    python -m ttt_lm.generate --checkpoint out/tiny --prompt "ROMEO:" --max-new-tokens 100 \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 0 [--num-samples 3] [--device cuda] \\
        [--prefill-chunk 2048]

``--checkpoint`` is an export directory (``python -m ttt_lm.train.export``, which copies the
tokenizer into it), a Hugging Face folder (``export --format hf``) or a run directory;
``--tokenizer`` names another ``.model`` or ``tokenizer.json`` file or prepared data directory. The
prompt is encoded after the end-of-document id (2 for the SentencePiece tokenizers trained here,
the tokenizer's own for a ``tokenizer.json``): every training document
followed one, so the model reads the prompt as the start of a document. Generation uses
:meth:`ttt_lm.model.LM.generate`: the prompt is read ``--prefill-chunk`` tokens per forward pass
(default 2048, ``ttt_lm.model.lm.PREFILL_CHUNK``), each piece from the states the previous one left,
so a recurrent model reads a prompt of any length in the memory of one piece (the result equals one
pass over the prompt); then one decode step per token
with each layer's state (attention's KV cache, the recurrent layers' states; TTT-E2E's window
caches, fast weights and open chunk, its inner step taken as each chunk's next token is read), sampling with
temperature, top-k and top-p (temperature 0 is greedy), and stops a sample at the end-of-document
id or after ``--max-new-tokens``. A model whose vocabulary is padded beyond the tokenizer's never
produces the padding ids (their logits are masked). A model with global attention layers is refused a prompt plus
continuation longer than its ``model.max_seq_len``. ``--seed`` fixes the draw (the same seed, device
and settings give the same text). Prints each sample (prompt and continuation) separated by a
line of dashes, or with ``--json`` one JSON object per sample.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

import torch

from ttt_lm.model.lm import PREFILL_CHUNK


def generate_text(ck, tok, prompt: str, max_new_tokens: int = 100, temperature: float = 1.0,
                  top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
                  num_samples: int = 1, prefill_chunk: Optional[int] = PREFILL_CHUNK) -> List[dict]:
    """``num_samples`` continuations of ``prompt`` from the checkpoint ``ck`` (a
    :class:`ttt_lm.eval.checkpoint.Checkpoint`) with tokenizer ``tok``; each a dict with the
    continuation's ``text`` and ``ids`` and why it ended (``eos`` or ``length``). ``prefill_chunk``:
    prompt tokens per forward pass (``LM.generate``; None: one pass)."""
    from ttt_lm.eval.common import check_context, check_vocab
    model = ck.model
    check_vocab(model, tok.vocab_size, f"the tokenizer {tok.path}", allow_padding=True)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1 (prompt tokens per forward pass), got {prefill_chunk}")
    ids = [tok.eos_id] + tok.encode(prompt)
    check_context(model, len(ids) + max_new_tokens, "prompt + --max-new-tokens")
    dev = model.embed.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.tensor([ids] * num_samples, dtype=torch.long, device=dev)
    out = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen,
                         eos_id=tok.eos_id, vocab_size=tok.vocab_size,
                         prefill_chunk=prefill_chunk)[:, len(ids):].tolist()
    samples = []
    for row in out:
        end = "length"
        if tok.eos_id in row:
            row, end = row[:row.index(tok.eos_id)], "eos"
        samples.append({"prompt": prompt, "text": tok.decode(row), "ids": row, "stop": end})
    return samples


def _tokens_per_pass(v: str) -> int:
    """--prefill-chunk's value: an integer >= 1 (refused by the parser, before any checkpoint is read)."""
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (prompt tokens per forward pass), "
                                         f"got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (prompt tokens per forward pass), got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.generate", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--checkpoint", required=True,
                    help="export dir (model.pt + config.yaml), Hugging Face folder or run dir")
    ap.add_argument("--prompt", default="", help="text to continue (default: empty, a new document)")
    ap.add_argument("--tokenizer", help=".model or tokenizer.json file or prepared data dir (default: the export's)")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 is greedy decoding")
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    ap.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens holding this mass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=1, help="continuations drawn as one batch")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    ap.add_argument("--json", action="store_true", help="one JSON object per sample instead of text")
    ap.add_argument("--prefill-chunk", type=_tokens_per_pass, default=PREFILL_CHUNK, metavar="N",
                    help=f"read the prompt N tokens per forward pass, carrying every layer's state (default "
                         f"{PREFILL_CHUNK}); memory is then that of N tokens for the recurrent layers")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    from ttt_lm.config import ConfigError
    from ttt_lm.data import DataError, load_tokenizer
    from ttt_lm.data.tokenizer import TokenizerError
    from ttt_lm.eval.checkpoint import load_checkpoint, missing_tokenizer
    from ttt_lm.eval.common import EvalError, dtype_of, pick_device
    try:
        ck = load_checkpoint(a.checkpoint, device=pick_device(a.device), dtype=dtype_of(a.dtype))
        path = a.tokenizer or ck.tokenizer_path
        if path is None:
            raise EvalError(f"no tokenizer: {missing_tokenizer(ck)}")
        samples = generate_text(ck, load_tokenizer(path), a.prompt, a.max_new_tokens, a.temperature, a.top_k,
                                a.top_p, a.seed, a.num_samples, a.prefill_chunk)
    except (EvalError, DataError, TokenizerError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, s in enumerate(samples):
        if a.json:
            print(json.dumps(s, ensure_ascii=False))
        else:
            if i:
                print("-" * 40)
            print(s["prompt"] + s["text"])
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
