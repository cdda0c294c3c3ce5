"""Prepare a corpus: raw text -> SentencePiece tokenizer -> webdataset token shards + manifest.

    python -m ttt_lm.data.prepare --input corpus/ more.jsonl.zst --output data/mycorpus \
        --vocab-size 32000 --model-type bpe --shard-tokens 16000000 --val-fraction 0.01

Steps: (1) list the inputs (sorted, so the output is reproducible); (2) train a tokenizer on the
training documents (or copy the one given with ``--tokenizer``); (3) encode every document in
worker processes, append the end-of-document id, and write it to a train or val shard; (4) write
``manifest.json`` last, so a directory with a manifest is a finished one.

The validation split is a fixed, evenly spread set of whole documents: document ``i`` (in input
order) is held out when ``ceil((i+1)·f) > ceil(i·f)`` for ``f = --val-fraction``, which holds out
``ceil(n·f)`` documents including the first. Whole documents keep the validation stream usable
for per-position and long-context evaluation.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import re
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
from tqdm import tqdm

from ttt_lm.data.manifest import FORMAT, MANIFEST, DataError, load_manifest, manifest_checksum
from ttt_lm.data.shards import ShardWriter, token_dtype
from ttt_lm.data.sources import SourceStats, list_input_files, read_documents
from ttt_lm.data.tokenizer import (HF_TOKENIZER_CONFIG, TokenizerError, open_tokenizer, sha256_file,
                                   train_tokenizer)

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"


def is_val_document(i: int, val_fraction: float) -> bool:
    return val_fraction > 0 and math.ceil((i + 1) * val_fraction) > math.ceil(i * val_fraction)


# Worker-process state: the tokenizer is loaded once per process, not shipped with every task.
_TOK = None
_DTYPE: Optional[np.dtype] = None


def _init_worker(model_file: str, dtype: str) -> None:
    global _TOK, _DTYPE
    _TOK, _DTYPE = open_tokenizer(model_file), np.dtype(dtype)


def _encode(text: str) -> np.ndarray:
    return np.asarray(_TOK.encode(text, add_eos=True), dtype=_DTYPE)


def _windows(docs: Iterator[Tuple[int, str]], max_docs: int = 2048, max_bytes: int = 32 << 20):
    # Bounded groups of documents: Pool.imap would otherwise read the whole corpus ahead.
    group: List[Tuple[int, str]] = []
    size = 0
    for i, text in docs:
        group.append((i, text))
        size += len(text)
        if len(group) >= max_docs or size >= max_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


#: written into --output when preparation starts, removed once manifest.json is in place: a
#: directory holding it is one that prepare began and did not finish
MARKER = ".prepare-incomplete"
_OWN_FILE = re.compile(r"^(?:(?:train|val)-\d{6}\.tar(?:\.tmp)?|tokenizer\.(?:model|vocab|json)|tokenizer_config\.json"
                       r"|manifest\.json(?:\.tmp)?)$")


def _claim_output(output: str, overwrite: bool) -> None:
    """Make ``output`` ours to write, deleting only what prepare itself writes.

    Accepted: a new or empty directory; one that prepare began and did not finish (MARKER); a
    prepared one (manifest.json) with ``overwrite``. Anything else that is not empty is refused,
    naming a few of its entries: prepare never deletes a file it did not write, and even in a
    directory it may write, only its own names (shards, tokenizer, manifest) are removed.
    """
    os.makedirs(output, exist_ok=True)
    entries = sorted(os.listdir(output))
    if MANIFEST in entries and not overwrite:
        raise DataError(f"{output} already holds prepared data (manifest.json); pass --overwrite to replace it")
    if entries and MANIFEST not in entries and MARKER not in entries:
        few = ", ".join(entries[:5]) + (f", … ({len(entries)} entries)" if len(entries) > 5 else "")
        raise DataError(f"--output {output} is not empty and is not a prepared data directory (no manifest.json); "
                        f"it holds {few}. prepare writes only into a new or empty directory (or replaces prepared "
                        "data with --overwrite): choose another --output")
    with open(os.path.join(output, MARKER), "w"):
        pass
    for f in entries:
        if _OWN_FILE.match(f):
            os.remove(os.path.join(output, f))


def _check_counts(n_docs: int, n_train: int, n_files: int) -> None:
    if n_docs == 0:
        raise DataError(f"no documents found in {n_files} input file(s): all were empty")
    if n_train == 0:
        raise DataError(f"only {n_docs} document(s) in the input: at least 2 are needed to hold out "
                        f"a validation split (or use --val-fraction 0)")


def _given_tokenizer_file(tokenizer: str) -> str:
    """The tokenizer file that ``--tokenizer`` names: the file itself, or a prepared directory's."""
    if not os.path.isdir(tokenizer):
        return tokenizer
    if os.path.isfile(os.path.join(tokenizer, MANIFEST)):
        return load_manifest(tokenizer, check_files=False)["tokenizer_path"]
    for name in (TOKENIZER_FILE, HF_TOKENIZER_FILE):
        if os.path.isfile(os.path.join(tokenizer, name)):
            return os.path.join(tokenizer, name)
    raise DataError(f"--tokenizer {tokenizer} is a directory without a manifest.json, {TOKENIZER_FILE} or "
                    f"{HF_TOKENIZER_FILE}")


def prepare(inputs: Sequence[str], output: str, *, vocab_size: int = 32000, model_type: str = "bpe",
            tokenizer: Optional[str] = None, eos_token: Optional[str] = None, text_field: str = "text",
            shard_tokens: int = 16_000_000,
            val_fraction: float = 0.01, workers: Optional[int] = None,
            tokenizer_train_bytes: int = 200 << 20, character_coverage: float = 0.9999,
            overwrite: bool = False, progress: bool = True) -> dict:
    """Prepare ``inputs`` into ``output``; returns its manifest as :func:`load_manifest` reads it.
    ``tokenizer``: a SentencePiece ``.model``, a Hugging Face ``tokenizer.json`` (its
    end-of-document token: ``eos_token``, else as :class:`ttt_lm.data.tokenizer.HFTokenizer`
    finds it) or a prepared directory, used instead of training one."""
    files = list_input_files(inputs)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    given = given_tok = None
    if tokenizer is not None:
        src = _given_tokenizer_file(tokenizer)
        given_tok = open_tokenizer(src, eos_token)  # fails clearly if it is not a tokenizer
        with open(src, "rb") as f:  # read before cleaning: it may live in the output directory
            given = f.read()
    elif eos_token is not None:
        raise DataError("--eos-token names the end-of-document token of a Hugging Face --tokenizer; without "
                        "--tokenizer a SentencePiece tokenizer is trained, whose end-of-document token is </s>")
    _claim_output(output, overwrite)
    hf = given_tok is not None and given_tok.kind == "hf"
    model_file = os.path.join(output, HF_TOKENIZER_FILE if hf else TOKENIZER_FILE)

    # 1. tokenizer
    if given is not None:
        with open(model_file, "wb") as f:
            f.write(given)
        if hf:  # records the end-of-document token beside the copy, so every reader finds the same
            with open(os.path.join(output, HF_TOKENIZER_CONFIG), "w") as f:
                json.dump(given_tok.sidecar(), f, indent=1)
        tokenizer_type = "hf" if hf else "given"
    else:
        log.info("training a %s tokenizer with %d pieces on %d input file(s)", model_type, vocab_size, len(files))
        seen = SourceStats()
        read_all = []  # set once the inputs were read to the end

        def train_texts():
            for i, (_, text) in enumerate(read_documents(files, text_field, seen)):
                if not is_val_document(i, val_fraction):
                    yield text
            read_all.append(True)

        try:
            train_tokenizer(train_texts(), os.path.join(output, "tokenizer"), vocab_size, model_type,
                            max_bytes=tokenizer_train_bytes, num_threads=workers,
                            character_coverage=character_coverage)
        except TokenizerError as e:
            if not read_all:  # refused before reading the corpus (e.g. --vocab-size too small): say why
                raise DataError(f"cannot train the tokenizer with --vocab-size {vocab_size}: {e}") from e
            n_train = sum(not is_val_document(i, val_fraction) for i in range(seen.documents))
            _check_counts(seen.documents, n_train, len(files))
            raise
        os.remove(os.path.join(output, "tokenizer.vocab"))
        tokenizer_type = model_type
    tok = open_tokenizer(model_file)
    dtype = token_dtype(tok.vocab_size)

    # 2. encode and write shards
    stats = SourceStats()
    writers = {"train": ShardWriter(output, "train", shard_tokens, dtype),
               "val": ShardWriter(output, "val", shard_tokens, dtype)}
    docs = ((i, text) for i, (_, text) in enumerate(read_documents(files, text_field, stats)))
    bar = tqdm(desc=f"tokenize ({workers} proc)", unit="doc", disable=not progress, file=sys.stderr)
    total_tokens = 0
    pool = mp.get_context("fork").Pool(workers, _init_worker, (model_file, dtype.str)) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(model_file, dtype.str)
        for group in _windows(docs):
            texts = [t for _, t in group]
            arrays = pool.map(_encode, texts, chunksize=max(1, len(texts) // (4 * workers))) if pool \
                else [_encode(t) for t in texts]
            for (i, _), arr in zip(group, arrays):
                writers["val" if is_val_document(i, val_fraction) else "train"].add(i, arr)
                total_tokens += len(arr)
            bar.update(len(group))
            bar.set_postfix(tokens=total_tokens, refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    splits = {}
    for name, w in writers.items():
        shards = w.close()
        splits[name] = dict(shards=shards, tokens=sum(s["tokens"] for s in shards),
                            documents=sum(s["documents"] for s in shards))
    _check_counts(stats.documents, splits["train"]["documents"], len(files))

    # 3. manifest, written last and atomically
    tok_sha = sha256_file(model_file)
    man = dict(
        format=FORMAT, vocab_size=tok.vocab_size, eos_id=tok.eos_id, bos_id=tok.bos_id, dtype=dtype.name,
        tokenizer=os.path.basename(model_file), tokenizer_sha256=tok_sha, tokenizer_type=tokenizer_type,
        splits=splits, tokens=total_tokens, documents=stats.documents,
        source=dict(inputs=[os.fspath(p) for p in inputs], files=len(files), text_field=text_field,
                    val_fraction=val_fraction, shard_tokens=shard_tokens, stats=stats.as_dict()),
        checksum=manifest_checksum(tok_sha, splits),
    )
    tmp = os.path.join(output, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(man, f, indent=1)
    os.replace(tmp, os.path.join(output, MANIFEST))
    os.remove(os.path.join(output, MARKER))
    log.info("prepared %s: %d documents, %d tokens (train %d in %d shards, val %d in %d shards), vocab %d",
             output, stats.documents, total_tokens, splits["train"]["tokens"], len(splits["train"]["shards"]),
             splits["val"]["tokens"], len(splits["val"]["shards"]), tok.vocab_size)
    return load_manifest(output)


def build_argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ttt_lm.data.prepare",
                                description="Tokenize raw text into webdataset shards with a manifest.")
    p.add_argument("--input", "-i", nargs="+", required=True,
                   help="files (.txt, .jsonl, optionally .gz/.zst; Hugging Face datasets' .parquet and .arrow), "
                        "directories searched recursively, or folders written by datasets' save_to_disk")
    p.add_argument("--output", "-o", required=True, help="directory to write (training needs only this path)")
    p.add_argument("--text-field", default="text",
                   help="field holding the text in .jsonl inputs and column of Hugging Face datasets")
    p.add_argument("--vocab-size", type=int, default=32000, help="pieces of the tokenizer to train")
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--tokenizer", default=None,
                   help="use this tokenizer instead of training one: a SentencePiece .model, a Hugging Face "
                        "tokenizer.json (e.g. GPT-NeoX's) or a prepared directory's")
    p.add_argument("--eos-token", default=None,
                   help="the end-of-document token of a Hugging Face --tokenizer (default: the eos_token of the "
                        "tokenizer_config.json beside it, else <|endoftext|>, </s>, <eos> or <|end_of_text|>)")
    p.add_argument("--tokenizer-train-bytes", type=int, default=200 << 20,
                   help="train the tokenizer on at most this many bytes of training text")
    p.add_argument("--character-coverage", type=float, default=0.9999,
                   help="share of characters given their own piece; the rest use byte fallback")
    p.add_argument("--shard-tokens", type=int, default=16_000_000, help="target tokens per shard")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for validation")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace prepared data already in --output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_argparser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        prepare(args.input, args.output, vocab_size=args.vocab_size, model_type=args.model_type,
                tokenizer=args.tokenizer, eos_token=args.eos_token, text_field=args.text_field,
                shard_tokens=args.shard_tokens,
                val_fraction=args.val_fraction, workers=args.workers,
                tokenizer_train_bytes=args.tokenizer_train_bytes, character_coverage=args.character_coverage,
                overwrite=args.overwrite, progress=not args.no_progress)
    except (DataError, ValueError) as e:   # refused input: exit status 2 (README, "Exit status")
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
