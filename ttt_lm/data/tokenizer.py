"""SentencePiece tokenizer: training and a small wrapper.

Training settings follow the lossless recipe: identity normalization, no dummy prefix, no
whitespace collapsing, and byte fallback, so ``decode(encode(s)) == s`` for every string and no
input is ever mapped to ``<unk>`` (characters outside the learned vocabulary become UTF-8 byte
pieces ``<0x..>``). Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (end of document), then 256 byte
pieces, then learned pieces.
"""
from __future__ import annotations

import hashlib
import os
from typing import Iterable, List, Sequence

import sentencepiece as spm

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
MODEL_TYPES = ("bpe", "unigram")


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """A SentencePiece model with the few operations the data path and evals need."""

    def __init__(self, model_file: str):
        if not os.path.isfile(model_file):
            raise TokenizerError(f"tokenizer model {model_file} does not exist")
        self.path = os.path.abspath(model_file)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"tokenizer model {model_file} cannot be loaded: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def unk_id(self) -> int:
        return self.sp.unk_id()

    def encode(self, text: str, add_eos: bool = False) -> List[int]:
        ids = self.sp.EncodeAsIds(text)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False) -> List[List[int]]:
        return [self.encode(t, add_eos) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self.sp.IdToPiece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer from a ``.model`` file, or from a prepared data directory / its manifest."""
    if os.path.isdir(path) or path.endswith(".json"):
        from ttt_lm.data.manifest import load_manifest

        return Tokenizer(load_manifest(path)["tokenizer_path"])
    return Tokenizer(path)


def sha256_file(path: str, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def _lines(texts: Iterable[str], max_bytes: int) -> Iterable[str]:
    # SentencePiece trains on sentences; lines of the documents are the natural unit. Lines
    # longer than its max_sentence_length are dropped by the trainer, which is harmless.
    used = 0
    for text in texts:
        for line in text.split("\n"):
            if not line:
                continue
            yield line
            used += len(line.encode("utf-8"))
            if used >= max_bytes:
                return


def train_tokenizer(texts: Iterable[str], model_prefix: str, vocab_size: int, model_type: str = "bpe",
                    max_bytes: int = 200 << 20, num_threads: int = 1,
                    character_coverage: float = 0.9999) -> Tokenizer:
    """Train on (the first ``max_bytes`` of) ``texts`` and write ``model_prefix + '.model'``."""
    if model_type not in MODEL_TYPES:
        raise TokenizerError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size < 300:
        # 3 special ids + 256 byte pieces + the corpus's characters
        raise TokenizerError(f"vocab_size {vocab_size} is too small: byte fallback alone takes 259 ids (3 special "
                             "ids and 256 byte pieces), and the corpus's characters need more; use at least 300")
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(_lines(texts, max_bytes)),
            model_prefix=model_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=character_coverage,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            num_threads=max(1, num_threads),
            minloglevel=2,
        )
    except RuntimeError as e:
        raise TokenizerError(f"sentencepiece training ({model_type}, vocab {vocab_size}) failed: {e}") from e
    return Tokenizer(model_prefix + ".model")
