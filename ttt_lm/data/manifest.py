"""The manifest: the JSON file that makes a prepared directory self-describing.

Layout of a prepared directory::

    manifest.json
    tokenizer.model               SentencePiece model the shards were encoded with, or
    tokenizer.json                a Hugging Face tokenizer (given to prepare), with
    tokenizer_config.json           its end-of-document token ("eos_token")
    train-000000.tar ...          webdataset shards; one sample per document:
    val-000000.tar ...              <10-digit document index>.tokens.npy (uint16 or uint32, ends in eos)

``manifest.json``::

    {"format": "ttt_lm.tokens.v1", "vocab_size": V, "eos_id": 2, "dtype": "uint16",
     "tokenizer": "tokenizer.model", "tokenizer_sha256": ..., "tokenizer_type": "bpe",
     "splits": {"train": {"shards": [{"name", "tokens", "documents", "bytes", "sha256"}, ...],
                          "tokens": N, "documents": D},
                "val": {...}},
     "tokens": N_total, "documents": D_total, "source": {...}, "checksum": sha256}

``checksum`` is the sha256 of the tokenizer digest and every shard's name and digest in order: two
directories with the same checksum hold the same data.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List

from ttt_lm.data import remote
from ttt_lm.data.errors import DataError  # noqa: F401 - re-exported: ttt_lm.data.manifest.DataError
from ttt_lm.data.hashing import HF_TOKENIZER_CONFIG, sha256_file

FORMAT = "ttt_lm.tokens.v1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")




def manifest_checksum(tokenizer_sha256: str, splits: Dict[str, dict]) -> str:
    h = hashlib.sha256(tokenizer_sha256.encode())
    for split in SPLITS:
        for s in splits.get(split, {}).get("shards", []):
            h.update(f"{split}/{s['name']}:{s['sha256']}".encode())
    return h.hexdigest()


def _manifest_file(path: str) -> str:
    path = os.fspath(path)
    # a directory, existing or not (then the hint below names it, not its parent), or the file
    if os.path.isdir(path) or not path.endswith(".json"):
        return os.path.join(path, MANIFEST)
    return path


def load_manifest(path: str, check_files: bool = True) -> dict:
    """Read and check ``manifest.json`` (``path`` is the directory or the file, or a URL or
    ``pipe:`` command as :mod:`ttt_lm.data.remote` describes).

    Adds ``root`` (the directory, absolute; for remote data the URL base or command template) and
    ``tokenizer_path`` (absolute; for remote data a verified local copy). With ``check_files``
    every listed shard of a local directory must exist with its recorded size, which catches
    truncated copies and missing files at startup rather than mid-run; remote shards are checked
    when read.
    """
    if remote.is_remote(path):
        root, name = remote.split_manifest(os.fspath(path), MANIFEST)
        mfile = remote.shown(remote.locate(root, name))
        raw = remote.read_bytes(root, name)
    else:
        mfile = _manifest_file(path)
        root = os.path.dirname(os.path.abspath(mfile))
        if not os.path.exists(mfile):
            hint = ""
            if os.path.isdir(root) and any(f.endswith(".tar") for f in os.listdir(root)):
                hint = " (it holds .tar files but no manifest: preparation did not finish)"
            raise DataError(f"no prepared data at {path}: {mfile} does not exist{hint}; prepare it with "
                            f"`python -m ttt_lm.data.prepare --input <raw text> --output {root}`")
        with open(mfile, "rb") as f:
            raw = f.read()
    if not raw:
        raise DataError(f"manifest {mfile} is empty")
    try:
        man = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"manifest {mfile} is not valid JSON: {e}") from e
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise DataError(f"manifest {mfile}: format is {man.get('format') if isinstance(man, dict) else None!r}, "
                        f"expected {FORMAT!r}")
    for key in ("vocab_size", "eos_id", "dtype", "tokenizer", "splits", "checksum"):
        if key not in man:
            raise DataError(f"manifest {mfile}: missing key {key!r}")
    if man["dtype"] not in ("uint16", "uint32"):
        raise DataError(f"manifest {mfile}: dtype {man['dtype']!r} is not uint16 or uint32")
    train = man["splits"].get("train", {}).get("shards", [])
    if not train:
        raise DataError(f"manifest {mfile} lists no train shards")
    man["root"] = root
    if remote.is_remote(root):
        # fetched (and its sha256 checked) into a local cache: SentencePiece loads from a file.
        # The shards are checked when read (size and sha256, see ttt_lm.data.remote)
        beside = (HF_TOKENIZER_CONFIG,) if man["tokenizer"].endswith(".json") else ()
        man["tokenizer_path"] = remote.fetch_cached(root, man["tokenizer"], man.get("tokenizer_sha256"), beside)
        return man
    man["tokenizer_path"] = os.path.join(root, man["tokenizer"])
    if check_files:
        problems: List[str] = []
        if not os.path.isfile(man["tokenizer_path"]):
            problems.append(f"tokenizer {man['tokenizer']} is missing")
        for split in SPLITS:
            for s in man["splits"].get(split, {}).get("shards", []):
                p = os.path.join(root, s["name"])
                if not os.path.isfile(p):
                    problems.append(f"shard {s['name']} is missing")
                elif os.path.getsize(p) != s["bytes"]:
                    problems.append(f"shard {s['name']} is {os.path.getsize(p)} bytes, the manifest says "
                                    f"{s['bytes']} (truncated or replaced)")
        if problems:
            raise DataError(f"prepared data at {root} does not match its manifest: " + "; ".join(problems))
    return man


def verify_checksums(man: dict) -> None:
    """Hash the tokenizer and every shard; raise DataError naming the first file that differs."""
    if sha256_file(man["tokenizer_path"]) != man["tokenizer_sha256"]:
        raise DataError(f"tokenizer {man['tokenizer_path']}: sha256 differs from the manifest")
    for split in SPLITS:
        for s in man["splits"].get(split, {}).get("shards", []):
            verify_shard(man["root"], s)
    if manifest_checksum(man["tokenizer_sha256"], man["splits"]) != man["checksum"]:
        raise DataError(f"manifest in {remote.shown(man['root'])}: checksum does not match its shard list")


def verify_shard(root: str, shard: dict) -> None:
    """Hash one shard (a remote one is read through, with the retries of ``ttt_lm.data.remote``);
    raise DataError naming it when it cannot be read or its sha256 differs from the manifest."""
    where = remote.locate(root, shard["name"])
    if remote.is_remote(root):
        digest = remote.sha256_of(root, shard["name"])
    else:
        try:
            digest = sha256_file(where)
        except OSError as e:
            raise DataError(f"shard {where}: cannot be read ({e.strerror or e})") from None
    if digest != shard["sha256"]:
        raise DataError(f"shard {remote.shown(where)}: sha256 differs from the manifest")


def vocab_fits(model_vocab_size: int, tokenizer_vocab_size: int, allow_padding: bool = False) -> bool:
    """The one vocabulary check: whether a model whose embedding has ``model_vocab_size`` rows
    reads the ids of a ``tokenizer_vocab_size``-token tokenizer. Equal sizes fit; with
    ``allow_padding`` a larger table (padded to a multiple of 64/128 for speed) fits too; a smaller
    one never does (ids would index past the embedding). ``check_vocab`` here, the evals'
    ``ttt_lm.eval.common.check_vocab``, the trainer's start and the exporter's tokenizer check
    call it, each raising its own error."""
    for name, n in (("model vocab_size", model_vocab_size), ("tokenizer vocab_size", tokenizer_vocab_size)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"vocabulary check: the {name} must be a positive integer, got {n!r}")
    return model_vocab_size == tokenizer_vocab_size or (allow_padding and model_vocab_size > tokenizer_vocab_size)


def check_vocab(manifest: dict, model_vocab_size: int, allow_padding: bool = False) -> None:
    """Refuse a model whose embedding does not fit the tokenizer the data was encoded with.

    ``allow_padding`` accepts a model vocabulary larger than the tokenizer's (embedding tables
    padded to a multiple of 64/128 for speed); a smaller one is always an error, since token ids
    would index past the embedding.
    """
    v = int(manifest["vocab_size"])
    where = manifest.get("root", "the manifest")
    if vocab_fits(model_vocab_size, v, allow_padding):
        return
    raise DataError(f"vocabulary mismatch: the model has vocab_size={model_vocab_size} but the data in {where} "
                    f"was tokenized with a {v}-token tokenizer ({manifest.get('tokenizer')}); set "
                    f"model.vocab_size={v} or prepare the data with --vocab-size {model_vocab_size}")
