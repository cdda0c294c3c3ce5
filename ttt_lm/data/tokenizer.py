"""Tokenizers: SentencePiece (trained here, or given) and Hugging Face ``tokenizer.json`` files.

Training settings follow the lossless recipe: identity normalization, no dummy prefix, no
whitespace collapsing, and byte fallback, so ``decode(encode(s)) == s`` for every string and no
input is ever mapped to ``<unk>`` (characters outside the learned vocabulary become UTF-8 byte
pieces ``<0x..>``). Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (end of document), then 256 byte
pieces, then learned pieces.

A Hugging Face tokenizer (:class:`HFTokenizer`, the ``tokenizers`` library's ``tokenizer.json``,
e.g. GPT-NeoX's) is used as it is: its end-of-document id is the token that
``tokenizer_config.json`` beside the file names as ``eos_token``, else the one given, else the
first of :data:`EOS_TOKENS` among its special tokens; a tokenizer with none is refused.
:func:`open_tokenizer` picks the kind from the file name (``.json``: Hugging Face).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable, List, Optional, Sequence

import sentencepiece as spm

from ttt_lm.data.hashing import HF_TOKENIZER_CONFIG, sha256_file  # noqa: F401 - re-exported
from ttt_lm.data.manifest import load_manifest

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
MODEL_TYPES = ("bpe", "unigram")


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """A SentencePiece model with the few operations the data path and evals need."""

    kind = "sentencepiece"

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


#: end-of-document tokens recognised in a Hugging Face tokenizer without a tokenizer_config.json
#: naming one, in order: GPT-2/GPT-NeoX/Pythia, Llama 2/Mistral/T5, Gemma, Llama 3
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
#: where an HF tokenizer's eos and bos tokens are recorded (transformers' name and format)


def _token_name(v) -> Optional[str]:
    if isinstance(v, dict):  # {"content": "<|endoftext|>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``) with :class:`Tokenizer`'s
    operations. ``eos_token`` names the end-of-document token when neither the
    ``tokenizer_config.json`` beside the file nor :data:`EOS_TOKENS` settle it."""

    kind = "hf"

    def __init__(self, path: str, eos_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:
            raise TokenizerError(f"reading the Hugging Face tokenizer {path} needs the tokenizers package: "
                                 "pip install 'ttt-lm[hf]'") from e
        if not os.path.isfile(path):
            raise TokenizerError(f"tokenizer {path} does not exist")
        self.path = os.path.abspath(path)
        try:
            self.tk = _HF.from_file(self.path)
        except Exception as e:  # noqa: BLE001 - the Rust side raises its own Exception type
            raise TokenizerError(f"tokenizer {path} cannot be loaded as a Hugging Face tokenizer.json: {e}") from e
        side = {}
        cfg = os.path.join(os.path.dirname(self.path), HF_TOKENIZER_CONFIG)
        if os.path.isfile(cfg):
            try:
                with open(cfg) as f:
                    side = json.load(f)
            except ValueError as e:
                raise TokenizerError(f"{cfg} is not valid JSON: {e}") from e
        special = [t.content for t in self.tk.get_added_tokens_decoder().values() if t.special]
        candidates = [eos_token, _token_name(side.get("eos_token"))] + [t for t in EOS_TOKENS if t in special]
        self.eos_token = next((t for t in candidates if t is not None), None)
        if self.eos_token is None:
            raise TokenizerError(f"tokenizer {path} has no end-of-document token: no {HF_TOKENIZER_CONFIG} beside it "
                                 f"names an eos_token and none of {list(EOS_TOKENS)} is among its special tokens "
                                 f"({special[:8]}); name one with --eos-token")
        self._eos = self.tk.token_to_id(self.eos_token)
        if self._eos is None:
            raise TokenizerError(f"tokenizer {path}: the end-of-document token {self.eos_token!r} is not in its "
                                 "vocabulary")
        self.bos_token = _token_name(side.get("bos_token"))
        self._bos = self.tk.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int:
        return -1 if self._bos is None else self._bos

    @property
    def unk_id(self) -> int:
        return -1

    def encode(self, text: str, add_eos: bool = False) -> List[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_eos:
            ids.append(self._eos)
        return ids

    def encode_batch(self, texts: Sequence[str], add_eos: bool = False) -> List[List[int]]:
        out = [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=False)]
        if add_eos:
            for ids in out:
                ids.append(self._eos)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self.tk.id_to_token(int(i))

    def sidecar(self) -> dict:
        """What ``tokenizer_config.json`` beside a copy of this file records, so the copy reads
        the same end-of-document token (transformers' AutoTokenizer reads it too)."""
        out = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token}
        if self.bos_token is not None:
            out["bos_token"] = self.bos_token
        return out

    def save_copy(self, dst: str) -> None:
        """Copy the file to ``dst`` (a ``….json`` path) with :meth:`sidecar` beside it."""
        _atomic_copy(self.path, dst)
        side = os.path.join(os.path.dirname(os.path.abspath(dst)), HF_TOKENIZER_CONFIG)
        with open(side + ".tmp", "w") as f:
            json.dump(self.sidecar(), f, indent=1)
        os.replace(side + ".tmp", side)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def _atomic_copy(src: str, dst: str) -> None:
    shutil.copyfile(src, dst + ".tmp")
    os.replace(dst + ".tmp", dst)


def open_tokenizer(path: str, eos_token: Optional[str] = None):
    """The tokenizer in a file: a Hugging Face ``tokenizer.json`` (any ``.json`` name) or a
    SentencePiece ``.model``."""
    if path.endswith(".json"):
        return HFTokenizer(path, eos_token)
    if eos_token is not None:
        raise TokenizerError(f"--eos-token applies to Hugging Face tokenizers only; {path} is a SentencePiece "
                             "model, whose end-of-document id is its </s>")
    return Tokenizer(path)


def load_tokenizer(path: str):
    """A tokenizer from a ``.model`` or ``tokenizer.json`` file, or from a prepared data
    directory / its ``manifest.json``."""
    if os.path.isdir(path) or os.path.basename(path) == "manifest.json":

        return open_tokenizer(load_manifest(path)["tokenizer_path"])
    return open_tokenizer(path)


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
