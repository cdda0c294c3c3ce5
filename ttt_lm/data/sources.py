"""Raw text inputs: which files count, how each becomes documents.

A ``.txt`` file (optionally ``.gz``/``.zst`` compressed) is one document. A ``.jsonl`` file
(optionally compressed) holds one document per line, its text under a configurable field.
Directories are searched recursively; files are taken in sorted path order, so the document
order, and with it every shard and checksum, is reproducible.

Bytes that are not UTF-8 are decoded with ``errors="replace"``; the affected documents and the
number of replacement characters are counted in :class:`SourceStats` and end up in the manifest.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import IO, Iterator, List, Sequence, Tuple

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
RAW_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES
_UTF8_REPLACEMENT = "\ufffd".encode("utf-8")


class InputError(ValueError):
    """Raw input that cannot be turned into documents (names the file, and the line if any)."""


@dataclass
class SourceStats:
    files: int = 0
    documents: int = 0
    empty_files: List[str] = field(default_factory=list)
    empty_documents: int = 0
    non_utf8_documents: int = 0
    replacement_chars: int = 0      # U+FFFD inserted for undecodable bytes

    def as_dict(self) -> dict:
        return asdict(self)


def list_input_files(paths: Sequence[str]) -> List[str]:
    """Expand files and directories into the sorted list of raw text files they hold."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: List[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = []
            for root, dirs, files in os.walk(p):
                dirs.sort()
                found += [os.path.join(root, f) for f in files if f.endswith(RAW_SUFFIXES)]
            if not found:
                raise InputError(f"input directory {p} holds no files ending in {', '.join(RAW_SUFFIXES)}")
            out += sorted(found)
        elif os.path.isfile(p):
            if not p.endswith(RAW_SUFFIXES):
                raise InputError(f"input file {p}: unsupported type; expected one of {', '.join(RAW_SUFFIXES)}")
            out.append(p)
        else:
            raise InputError(f"input path {p} does not exist")
    if not out:
        raise InputError("no input files given")
    seen = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def _open_binary(path: str) -> IO[bytes]:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        # A bare stream reader has no readline(); BufferedReader supplies it.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def decode_utf8(raw: bytes, stats: SourceStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        stats.non_utf8_documents += 1
        # U+FFFD that were already present as valid UTF-8 are not replacements.
        stats.replacement_chars += text.count("\ufffd") - raw.count(_UTF8_REPLACEMENT)
        return text


def read_documents(paths: Sequence[str], text_field: str = "text",
                   stats: SourceStats | None = None) -> Iterator[Tuple[str, str]]:
    """Yield ``(source, text)`` for every non-empty document; ``source`` is ``file`` or ``file:line``."""
    stats = SourceStats() if stats is None else stats
    for path in list_input_files(paths):
        stats.files += 1
        before = stats.documents
        try:
            with _open_binary(path) as f:
                if path.endswith(TEXT_SUFFIXES):
                    text = decode_utf8(f.read(), stats)
                    if text.strip():
                        stats.documents += 1
                        yield path, text
                else:
                    yield from _jsonl_documents(f, path, text_field, stats)
        except InputError:
            raise
        except (OSError, EOFError, UnicodeError) as e:
            # gzip/zstd raise these for truncated or corrupt archives
            raise InputError(f"input file {path}: cannot be read ({type(e).__name__}: {e})") from e
        if stats.documents == before:
            stats.empty_files.append(path)
            log.warning("input file %s holds no text; skipped", path)
    if stats.empty_files:
        log.warning("%d input file(s) were empty and skipped", len(stats.empty_files))
    if stats.non_utf8_documents:
        log.warning("%d document(s) had bytes that are not UTF-8; %d replacement character(s) inserted",
                    stats.non_utf8_documents, stats.replacement_chars)


def _jsonl_documents(f: IO[bytes], path: str, text_field: str, stats: SourceStats):
    for lineno, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        line = decode_utf8(raw, stats)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or text_field not in obj:
            raise InputError(f"{path}:{lineno}: no field {text_field!r} "
                             f"(choose the field with --text-field)")
        text = obj[text_field]
        if not isinstance(text, str):
            raise InputError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, not a string")
        if not text.strip():
            stats.empty_documents += 1
            continue
        stats.documents += 1
        yield f"{path}:{lineno}", text
