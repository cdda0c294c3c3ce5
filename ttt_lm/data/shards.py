"""Webdataset shards of token arrays: writing and reading one shard.

A sample is one document: key ``<10-digit corpus document index>``, member ``tokens.npy`` holding
a 1-D uint16/uint32 array that ends in the end-of-document id. Shards are written with a fixed
mtime and owner, so the same input gives byte-identical shards and the same checksums.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
from typing import List, Tuple

import numpy as np
import webdataset as wds

from ttt_lm.data import remote
from ttt_lm.data.manifest import DataError
from ttt_lm.data.tokenizer import sha256_file

log = logging.getLogger(__name__)

MEMBER = "tokens.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class ShardWriter:
    """Writes ``<prefix>-NNNNNN.tar`` shards of about ``target_tokens`` tokens each.

    Documents are never split: a shard closes before the document that would take it past the
    target, so a document longer than the target gets a shard of its own.
    """

    def __init__(self, out_dir: str, prefix: str, target_tokens: int, dtype: np.dtype):
        if target_tokens <= 0:
            raise ValueError(f"target_tokens must be positive, got {target_tokens}")
        self.out_dir, self.prefix, self.target, self.dtype = out_dir, prefix, target_tokens, np.dtype(dtype)
        self.shards: List[dict] = []
        self._tar = None
        self._tokens = self._docs = 0

    def _open(self):
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._name = name
        self._tmp = os.path.join(self.out_dir, name + ".tmp")
        self._tar = wds.TarWriter(self._tmp, encoder=False, mtime=0)
        self._tokens = self._docs = 0

    def _close(self):
        if self._tar is None:
            return
        self._tar.close()
        self._tar = None
        final = os.path.join(self.out_dir, self._name)
        os.replace(self._tmp, final)
        self.shards.append(dict(name=self._name, tokens=self._tokens, documents=self._docs,
                                bytes=os.path.getsize(final), sha256=sha256_file(final)))

    def add(self, doc_index: int, tokens: np.ndarray) -> None:
        if self._tar is not None and self._tokens > 0 and self._tokens + len(tokens) > self.target:
            self._close()
        if self._tar is None:
            self._open()
        buf = io.BytesIO()
        np.save(buf, np.asarray(tokens, dtype=self.dtype), allow_pickle=False)
        self._tar.write({"__key__": f"{doc_index:010d}", MEMBER: buf.getvalue()})
        self._tokens += len(tokens)
        self._docs += 1

    def close(self) -> List[dict]:
        self._close()
        return self.shards


def _raise(exn: Exception) -> bool:
    raise exn


def read_shard(root: str, shard: dict, vocab_size: int, dtype: str,
               verify_sha256: bool = True) -> Tuple[List[Tuple[int, np.ndarray]], int]:
    """All documents of one shard, in file order, as ``(doc_index, tokens)``; plus the skip count.

    The shard is read into memory once; what was read is checked against the manifest before any
    document is used, and a mismatch raises DataError naming the shard and what differs:

    - its size and (unless ``verify_sha256=False``) its sha256: one flipped byte anywhere, in a tar
      header or in token data, is caught here. Hashing costs one pass over bytes already in
      memory: ~0.1 s for a 16M-token (39 MiB) shard on a 2-core CPU, against several seconds to
      parse it;
    - after parsing, the number of samples (documents read + damaged ones skipped) and, when none
      was skipped, the number of tokens. A damaged tar header in the middle of a shard reads as
      the end of the archive in ``tarfile``: without these counts the rest of the shard would be
      dropped silently.

    A broken tar structure raises DataError too. A sample whose payload is damaged although the
    shard matches its digest (it was written that way: not a 1-D array of the manifest's dtype,
    empty, or with ids outside the vocabulary) is skipped and logged; every reader skips the same
    samples, so the data order stays deterministic.
    """
    path = remote.locate(root, shard["name"])
    if remote.is_remote(root):  # a URL or pipe: command (ttt_lm.data.remote): fetched whole
        raw = remote.read_bytes(root, shard["name"])
        size = len(raw)
    else:
        if not os.path.isfile(path):
            raise DataError(f"shard {path} is missing")
        size = os.path.getsize(path)
    if size != shard["bytes"]:
        raise DataError(f"shard {path} is {size} bytes, the manifest says {shard['bytes']}: truncated or "
                        f"replaced; prepare the data again")
    if not remote.is_remote(root):
        with open(path, "rb") as f:
            raw = f.read()
    if verify_sha256:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != shard["sha256"]:
            raise DataError(f"shard {path}: sha256 differs from the manifest ({digest[:12]}… read, "
                            f"{shard['sha256'][:12]}… recorded): the file is corrupt; restore it from the original "
                            "copy or prepare the data again")
    docs: List[Tuple[int, np.ndarray]] = []
    bad: List[str] = []
    want = np.dtype(dtype)
    try:
        files = (dict(f, __url__=path) for f in wds.tariterators.tar_file_iterator(io.BytesIO(raw), handler=_raise))
        for sample in wds.tariterators.group_by_keys(files, handler=_raise):
            key = sample.get("__key__", "?")
            try:
                arr = np.load(io.BytesIO(sample[MEMBER]), allow_pickle=False)
                if arr.dtype != want or arr.ndim != 1 or arr.size == 0:
                    raise ValueError(f"array {arr.dtype}{list(arr.shape)}, expected non-empty 1-D {want}")
                if int(arr.max()) >= vocab_size:
                    raise ValueError(f"token id {int(arr.max())} >= vocab_size {vocab_size}")
                docs.append((int(key), arr))
            except (KeyError, ValueError, OSError, EOFError) as e:
                bad.append(f"{key}: {type(e).__name__}: {e}")
    except Exception as e:  # tarfile.ReadError, truncated headers, gzip/IO errors
        raise DataError(f"shard {path} is corrupt and cannot be read as a tar file: {e}") from e
    n_read = len(docs) + len(bad)
    if n_read != shard["documents"]:
        raise DataError(f"shard {path}: read {n_read} document(s), the manifest says {shard['documents']}: "
                        "the tar file ends early (a damaged member header reads as the end of the archive) or "
                        "does not belong to this manifest; prepare the data again")
    n_tokens = sum(len(a) for _, a in docs)
    if not bad and n_tokens != shard["tokens"]:
        raise DataError(f"shard {path}: read {n_tokens} tokens, the manifest says {shard['tokens']}; "
                        "prepare the data again")
    if bad:
        log.warning("shard %s: skipped %d corrupt sample(s) of %d: %s", path, len(bad), shard["documents"],
                    "; ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
    if not docs:
        raise DataError(f"shard {path} holds no readable documents (manifest says {shard['documents']})")
    return docs, len(bad)
