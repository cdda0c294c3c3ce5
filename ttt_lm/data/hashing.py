"""The one file-hashing helper of the data package (shards, tokenizers, cached copies): a leaf
module."""
from __future__ import annotations

import hashlib

#: the Hugging Face tokenizer's companion file, kept beside a ``tokenizer.json`` (it names the
#: end-of-document token); a constant of the file layout, shared by the manifest and the tokenizer
HF_TOKENIZER_CONFIG = "tokenizer_config.json"


def sha256_file(path: str, block: int = 1 << 20) -> str:
    """The sha256 of a local file, read in blocks of ``block`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()
