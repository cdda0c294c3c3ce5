"""Where a prepared corpus is read from: a local directory, a URL, or a ``pipe:`` command.

``data.path`` takes three forms; every file of the corpus (``manifest.json``, the tokenizer, the
shards the manifest names) is found from it by name:

    /scratch/corpus                                  local directory: <dir>/<name>
    https://host/corpora/corpus                      URL base: <base>/<name>, opened by webdataset's
                                                     ``gopen`` (``curl -f -s -L`` for http/https;
                                                     gs://, hf://, ais://, sftp:// as gopen supports)
    pipe:aws s3 cp s3://bucket/corpus/{file} -       a shell command that writes the file to stdout;
                                                     ``{file}`` is replaced by the file's name

A URL base may also name the manifest itself (``https://host/corpus/manifest.json``), and may
carry a query string, which every file's URL keeps (``https://host/corpus?sig=…`` →
``https://host/corpus/train-000000.tar?sig=…``: a token valid for the whole folder, such as an
Azure SAS token); messages show such a query as ``?…``. The ``pipe:`` spelling is webdataset's;
webdataset's brace ranges (``train-{000000..000009}.tar``) are not needed because the manifest
lists every shard, so the template names one file through ``{file}`` instead.

Shards are read as streams (:func:`open_stream`, read by ``ttt_lm.data.shards.iter_shard``): the
bytes are hashed and counted as they arrive and the tar members decoded one at a time, so no
shard is held whole as bytes. Integrity is the same as for a local directory, checked on what
was read: each shard's size and sha256 against the manifest, the tokenizer's sha256 when it is
fetched. For a remote shard they are known at the shard's end: where the loader cuts windows as
the documents arrive (remote data read in order, ``data.shuffle=false``) a damaged shard stops
the run at its end, after its windows were used; everywhere else (a shuffled shard, whose
documents are permuted, the validation split, ``iter_documents``) the whole shard's documents
are collected and checked before any is used. What cannot be checked without reading every shard
first is the size check a local directory gets at startup (``load_manifest`` stats each file);
``data.verify_checksums=true`` does read (and hash, streaming) every shard up front.

The manifest is read whole into memory (it is small). The tokenizer is cached on local disk,
content-addressed by its sha256, under ``$TTT_LM_CACHE`` (default ``~/.cache/ttt_lm``), because
SentencePiece and ``tokenizers`` load from a file; a Hugging Face ``tokenizer.json`` gets its
``tokenizer_config.json`` (the end-of-document token) beside it.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Optional, Tuple
from urllib.parse import urlsplit, urlunsplit

from ttt_lm.data.errors import DataError
from ttt_lm.data.hashing import sha256_file

PIPE = "pipe:"
PLACEHOLDER = "{file}"

#: curl exit codes that say what went wrong, for the one-line error
_CURL = {6: "could not resolve the host", 7: "could not connect (connection refused or host down)",
         22: "the server answered with an HTTP error (404 not found, 403 forbidden, 5xx ...)",
         28: "timed out", 35: "TLS handshake failed", 56: "the connection broke while receiving"}


def is_remote(path) -> bool:
    """A ``pipe:`` command or a URL with a scheme that webdataset's gopen opens (not file://)."""
    path = os.fspath(path)
    if path.startswith(PIPE):
        return True
    scheme, sep, _ = path.partition("://")
    if not sep or scheme == "file":
        return False
    from webdataset.gopen import gopen_schemes
    return scheme in gopen_schemes and scheme != "__default__"


def split_manifest(path: str, manifest_name: str) -> Tuple[str, str]:
    """``(base, manifest file name)`` of a remote ``data.path``."""
    if path.startswith(PIPE):
        if PLACEHOLDER not in path:
            raise DataError(f"data.path {path!r}: a pipe: command must contain {PLACEHOLDER}, which is replaced by "
                            f"each file's name, e.g. 'pipe:aws s3 cp s3://bucket/corpus/{PLACEHOLDER} -'")
        return path, manifest_name
    parts = urlsplit(path)
    base = parts.path.rstrip("/")
    if base.endswith(".json"):
        base, name = base.rsplit("/", 1)
        return urlunsplit(parts._replace(path=base)), name
    return urlunsplit(parts._replace(path=base)), manifest_name


def locate(base: str, name: str) -> str:
    """The URL (or command) of file ``name`` of the corpus at ``base``; a local path otherwise.
    A URL base's query string (a container-wide access token) is kept on every file's URL:
    ``https://h/corpus?sig=…`` → ``https://h/corpus/manifest.json?sig=…``."""
    if base.startswith(PIPE):
        return base.replace(PLACEHOLDER, name)
    if is_remote(base):
        parts = urlsplit(base)
        return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + name))
    return os.path.join(base, name)


def shown(url: str) -> str:
    """``url`` as messages show it: a query string (it may hold a signature) becomes ``?…``."""
    return _redact(url) if is_remote(url) and not url.startswith(PIPE) else url


def _redact(msg: str) -> str:
    return re.sub(r"(\w+://[^\s'\"?]+)\?[^\s'\"\]]+", r"\1?…", msg)


def open_stream(base: str, name: str):
    """File ``name`` of the corpus at ``base`` opened for reading as a stream (webdataset's
    ``gopen``: curl's or the command's stdout); a failure to start is one DataError naming it.
    Errors met while reading surface from its ``read`` and ``close`` (see :func:`explain`)."""
    url = locate(base, name)
    from webdataset.gopen import gopen
    try:
        return gopen(url, "rb")
    except Exception as e:  # noqa: BLE001 - gopen raises IOError/ValueError/OSError by scheme
        raise DataError(f"cannot read {shown(url)}: {explain(e)}") from None


def read_bytes(base: str, name: str) -> bytes:
    """The whole file ``name`` of the corpus at ``base``; a failure is one DataError naming it."""
    url = locate(base, name)
    try:
        with open_stream(base, name) as f:
            data = f.read()
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - gopen raises IOError/ValueError/OSError by scheme
        raise DataError(f"cannot read {shown(url)}: {explain(e)}") from None
    return data


def sha256_of(base: str, name: str, chunk: int = 1 << 20) -> str:
    """The sha256 of file ``name``, hashed as it streams in (never held whole)."""
    url = locate(base, name)
    h = hashlib.sha256()
    try:
        with open_stream(base, name) as f:
            for b in iter(lambda: f.read(chunk), b""):
                h.update(b)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - gopen raises IOError/ValueError/OSError by scheme
        raise DataError(f"cannot read {shown(url)}: {explain(e)}") from None
    return h.hexdigest()


def explain(e: Exception) -> str:
    """One line saying why a read failed (curl's exit code in words, a command's status)."""
    msg = _redact(" ".join(str(e).split()))
    if "unsafe_gopen" in msg:
        return "pipe: commands are refused while WDS_SECURE=1 is set in the environment"
    if "exit" in msg and "curl" in msg:
        for code, why in _CURL.items():
            if f"exit {code} " in msg + " ":
                return f"curl exit {code}: {why}"
    if "exit" in msg:
        code = msg.split("exit", 1)[1].split()[0]
        return f"the command exited with status {code}"
    return f"{type(e).__name__}: {msg}"


def cache_dir() -> str:
    return os.environ.get("TTT_LM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ttt_lm")


def fetch_cached(base: str, name: str, sha256: Optional[str], beside: Tuple[str, ...] = ()) -> str:
    """A local copy of file ``name``, checked against ``sha256`` and kept under :func:`cache_dir`
    in a folder named by its digest. ``beside``: files that must lie next to the copy (a Hugging
    Face tokenizer's ``tokenizer_config.json``), fetched with it; the manifest holds no digest of
    theirs."""
    fname = os.path.basename(name)
    if sha256:
        d = os.path.join(cache_dir(), "files", sha256)
        path = os.path.join(d, fname)
        if (os.path.isfile(path) and all(os.path.isfile(os.path.join(d, b)) for b in beside)
                and sha256_file(path) == sha256):
            return path
    raw = read_bytes(base, name)
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 and digest != sha256:
        raise DataError(f"{shown(locate(base, name))}: sha256 {digest[:12]}… differs from the manifest's "
                        f"{sha256[:12]}…: the file is corrupt or belongs to another corpus")
    d = os.path.join(cache_dir(), "files", digest)
    os.makedirs(d, exist_ok=True)
    for b in beside:
        _write(os.path.join(d, b), read_bytes(base, b))
    path = os.path.join(d, fname)
    _write(path, raw)  # last: a complete folder is one whose file is present
    return path


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # atomic: concurrent ranks write the same bytes
