"""Raw text inputs: which files count, how each becomes documents.

A ``.txt`` file (optionally ``.gz``/``.zst`` compressed) is one document. A ``.jsonl`` file
(optionally compressed) holds one document per line, its text under a configurable field.
Directories are searched recursively; files are taken in sorted path order, so the document
order, and with it every shard and checksum, is reproducible.

Hugging Face datasets (read with the optional ``datasets`` package, streaming: rows are read one
at a time, nothing is cached): a ``.parquet`` or ``.arrow`` file, or a folder written by
``Dataset.save_to_disk`` (read with ``datasets.load_from_disk``; a ``DatasetDict`` folder is
refused, naming its splits: pass one split's folder). Each row is one document, its text under
the same field as for ``.jsonl`` (``--text-field``, default ``text``).

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
HF_SUFFIXES = (".parquet", ".arrow")
RAW_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + HF_SUFFIXES
#: files that datasets' save_to_disk writes into a Dataset (state.json) or DatasetDict folder
HF_DATASET_MARKERS = ("state.json", "dataset_dict.json")
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


def is_hf_dataset_dir(path: str) -> bool:
    """Whether ``path`` is a folder written by datasets' ``save_to_disk``."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in HF_DATASET_MARKERS)


def list_input_files(paths: Sequence[str]) -> List[str]:
    """Expand files and directories into the sorted list of raw text files they hold; a
    ``save_to_disk`` folder is one input, listed as itself."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: List[str] = []
    for p in paths:
        p = os.fspath(p)
        if is_hf_dataset_dir(p):
            out.append(p)
        elif os.path.isdir(p):
            found = []
            for root, dirs, files in os.walk(p):
                saved = [d for d in dirs if is_hf_dataset_dir(os.path.join(root, d))]
                found += [os.path.join(root, d) for d in saved]
                dirs[:] = sorted(d for d in dirs if d not in saved)
                found += [os.path.join(root, f) for f in files if f.endswith(RAW_SUFFIXES)]
            if not found:
                raise InputError(f"input directory {p} holds no files ending in {', '.join(RAW_SUFFIXES)} "
                                 "and no datasets save_to_disk folder")
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
        if os.path.isdir(path) or path.endswith(HF_SUFFIXES):
            yield from _hf_documents(path, text_field, stats)
        else:
            yield from _file_documents(path, text_field, stats)
        if stats.documents == before:
            stats.empty_files.append(path)
            log.warning("input file %s holds no text; skipped", path)
    if stats.empty_files:
        log.warning("%d input file(s) were empty and skipped", len(stats.empty_files))
    if stats.non_utf8_documents:
        log.warning("%d document(s) had bytes that are not UTF-8; %d replacement character(s) inserted",
                    stats.non_utf8_documents, stats.replacement_chars)


def _file_documents(path: str, text_field: str, stats: SourceStats):
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


def _hf_rows(path: str):
    """The rows of a Hugging Face dataset file or save_to_disk folder, streamed."""
    try:
        import datasets
    except ImportError as e:
        raise InputError(f"input {path}: reading Hugging Face datasets needs the datasets package: "
                         "pip install 'ttt-lm[hf]'") from e
    if os.path.isdir(path):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            raise InputError(f"input {path} is a DatasetDict with splits {sorted(ds)}; pass one split's folder "
                             f"(e.g. {os.path.join(path, sorted(ds)[0])})")
        return ds.to_iterable_dataset()
    builder = "parquet" if path.endswith(".parquet") else "arrow"
    return datasets.load_dataset(builder, data_files=[os.path.abspath(path)], split="train", streaming=True)


def _hf_documents(path: str, text_field: str, stats: SourceStats):
    try:
        for row_no, row in enumerate(_hf_rows(path)):
            if text_field not in row:
                raise InputError(f"{path}: row {row_no} has no field {text_field!r} (its columns: "
                                 f"{sorted(row)}; choose the field with --text-field)")
            text = row[text_field]
            if text is None:
                stats.empty_documents += 1
                continue
            if not isinstance(text, str):
                raise InputError(f"{path}: row {row_no}: field {text_field!r} is {type(text).__name__}, not a string")
            if not text.strip():
                stats.empty_documents += 1
                continue
            stats.documents += 1
            yield f"{path}:{row_no}", text
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow, fsspec and datasets raise their own types
        raise InputError(f"input {path}: cannot be read as a Hugging Face dataset ({type(e).__name__}: {e})") from e


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
