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

No shared file is exempt: a new kind adds its own files and edits no shared test (the scanner's
own checks below plant files in a scratch tree: one naming two kinds, one a kind's own)."""
from __future__ import annotations

import io
import os
import re
import tokenize
from typing import Dict, List, Set

from ttt_lm.model.registry import builtin_kinds, mixer_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("tests", "benchmarks")


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


def scanned_files(root: str = ROOT) -> List[str]:
    out = []
    for top in SCANNED:
        for d, dirs, files in os.walk(os.path.join(root, top)):
            rel = os.path.relpath(d, root)
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            out.extend(os.path.join(rel, f) for f in sorted(files) if f.endswith(".py"))
    return out


def offenders(root: str = ROOT) -> Dict[str, List[str]]:
    """Shared file (of the tree at ``root``) → the kinds (not its own) it names, for files naming
    two or more."""
    kinds = builtin_kinds()
    section = {k: mixer_class(k).config_section for k in kinds}
    out = {}
    for rel in scanned_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
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


def test_offenders_finds_a_shared_file_naming_two_kinds(tmp_path):
    """A scratch tree: a shared test naming two real kinds is found (with both), in tests/train as
    anywhere else; one naming a single kind is not, and neither is the first kind's own file naming
    both."""
    a, b = builtin_kinds()[:2]
    two = f"x = [{a!r}, {b!r}]\n"
    for rel, text in [("tests/model/test_shared.py", two), ("benchmarks/bench.py", f"y = {a!r}\n"),
                      (f"tests/model/test_{a}.py", two), ("tests/train/test_loop.py", two)]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert offenders(str(tmp_path)) == {"tests/model/test_shared.py": sorted([a, b]),
                                        "tests/train/test_loop.py": sorted([a, b])}


def test_no_shared_file_names_two_kinds():
    found = offenders()
    assert not found, ("shared files naming two or more layer kinds (read them from the registry: "
                       f"builtin_kinds(), kinds_with(...), a preset): {found}")
