"""Shared tests and benchmarks read the layer kinds from the registry: no file of ``tests/`` or
``benchmarks/`` names two or more layer kinds, except each kind's own files.

A file *names* a kind where a string literal of its code (docstrings and other triple-quoted prose
left out) holds the kind's name as a whole word: ``"mamba"``, ``["rglru", "local_attention"]``,
``"model.layer_pattern=[ttt_linear,attention]"``. A file is a kind's *own* where its name holds the
kind or the kind's config section as a whole ``_``-separated word: ``test_titans.py`` and
``test_titans_packed_triton.py`` are the own files of titans, titans_mag, titans_mal and titans_mac
(section ``titans``), ``test_ttt.py`` of ttt_linear and ttt_mlp (section ``ttt``),
``test_gated_deltanet.py`` of gated_deltanet only. The kinds a file names that are not its own
must number fewer than two: a shared test that needs one concrete model may name it (a preset
does better), one that runs over several kinds takes them from ``builtin_kinds()`` /
``kinds_with(...)``.

``UNCONVERTED`` lists the shared files that still name several kinds; it only shrinks: a file
on it that no longer names two kinds fails the test until it is taken off, so the list stays the
exact set of files left to convert."""
from __future__ import annotations

import io
import os
import re
import tokenize
from typing import Dict, List, Set

from ttt_lm.model.registry import builtin_kinds, mixer_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("tests", "benchmarks")
#: files that belong to another part of the house (the trainer's tests) are out of this scan
EXCLUDED_DIRS = (os.path.join("tests", "train"),)

#: shared files not yet reading the registry (relative to the repository root); only shrinks
UNCONVERTED = {
    "benchmarks/kernels.py",
    "tests/benchmarks/test_gpu_campaign.py",
    "tests/eval/test_synthetic.py",
    "tests/model/test_compile.py",
}


def _word_pattern(names) -> "re.Pattern[str]":
    """Whole words of ``names`` (longest first, so ``gated_deltanet`` is not read as ``deltanet``);
    a word is bounded by anything but a letter, digit, ``_`` or ``-`` (a hyphenated name is
    another word: the package ``flash-linear-attention``), and not preceded by a dot, which would
    make it an attribute: ``F.attention``."""
    alts = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    return re.compile(rf"(?<![A-Za-z0-9_.-])({alts})(?![A-Za-z0-9_-])")


def kinds_named(source: str, kinds) -> Set[str]:
    """The kinds whose names a string literal of ``source`` holds (triple-quoted strings left out)."""
    pat = _word_pattern(kinds)
    found: Set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.STRING:
            continue
        body = tok.string.lstrip("rRbBuUfF")
        if body.startswith(('"""', "'''")):
            continue
        found.update(m.group(1) for m in pat.finditer(body))
    return found


def own_kinds(path: str, section: Dict[str, str]) -> Set[str]:
    """The kinds (keys of ``section``: kind → its config section) ``path`` is an own file of: its
    file name holds the kind or its section as a whole ``_``-separated word, a longer name
    hiding a shorter one inside it (``gated_deltanet`` is not ``deltanet``)."""
    words = os.path.splitext(os.path.basename(path))[0].split("_")
    names = sorted({tuple(n.split("_")) for n in (set(section) | {s for s in section.values() if s})},
                   key=len, reverse=True)
    hits, i = set(), 0
    while i < len(words):   # left to right, the longest name at each word
        n = next((n for n in names if tuple(words[i:i + len(n)]) == n), None)
        if n is None:
            i += 1
        else:
            hits.add("_".join(n))
            i += len(n)
    return {k for k, s in section.items() if k in hits or s in hits}


def scanned_files() -> List[str]:
    out = []
    for top in SCANNED:
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(d, ROOT)
            if any(rel == e or rel.startswith(e + os.sep) for e in EXCLUDED_DIRS):
                dirs[:] = []
                continue
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            out.extend(os.path.join(rel, f) for f in sorted(files) if f.endswith(".py"))
    return out


def offenders() -> Dict[str, List[str]]:
    """Shared file → the kinds (not its own) it names, for files naming two or more."""
    kinds = builtin_kinds()
    section = {k: mixer_class(k).config_section for k in kinds}
    out = {}
    for rel in scanned_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            named = kinds_named(f.read(), kinds) - own_kinds(rel, section)
        if len(named) >= 2:
            out[rel.replace(os.sep, "/")] = sorted(named)
    return out


# the scanner's own checks use made-up kinds: this file names no real one
FAKE = {"alpha": "alpha", "beta_alpha": "beta_alpha", "gamma": "greek", "gamma_mag": "greek", "delta": None}


def test_kinds_named_reads_string_literals_only():
    src = ('"""delta in a docstring"""\n'
           'x = ["alpha", "beta_alpha"]\n'
           'y = "model.layer_pattern=[gamma_mag]"\n'
           'z = F.delta  # delta in a comment\n'
           'w = "F.delta" + f"{gamma}"\n'
           'v = "flash-delta-gamma"\n')
    assert kinds_named(src, tuple(FAKE)) == {"alpha", "beta_alpha", "gamma_mag", "gamma"}
    assert kinds_named('v = "flash-delta-gamma"\n', tuple(FAKE)) == set()


def test_own_kinds_by_file_name():
    assert own_kinds("tests/model/test_greek_packed.py", FAKE) == {"gamma", "gamma_mag"}
    assert own_kinds("tests/model/test_gamma.py", FAKE) == {"gamma"}
    assert own_kinds("tests/model/test_beta_alpha.py", FAKE) == {"beta_alpha"}
    assert own_kinds("tests/model/test_alpha.py", FAKE) == {"alpha"}
    assert own_kinds("tests/model/test_alphabet.py", FAKE) == set()
    assert own_kinds("tests/model/test_delta_tp.py", FAKE) == {"delta"}


def test_offenders_finds_the_unconverted_files():
    found = offenders()
    assert found, "the scan found no file naming two kinds, yet UNCONVERTED lists some"
    assert all(len(k) >= 2 for k in found.values())


def test_no_shared_file_names_two_kinds():
    found = offenders()
    new = {f: k for f, k in found.items() if f not in UNCONVERTED}
    assert not new, ("shared files naming two or more layer kinds (read them from the registry: "
                     f"builtin_kinds(), kinds_with(...), a preset): {new}")
    done = sorted(f for f in UNCONVERTED if f not in found)
    assert not done, f"these files no longer name two layer kinds: take them off UNCONVERTED: {done}"
