"""The documentation points at things that exist.

Over README.md, docs/**/*.md, kernels/*/README.md, slurm/README.md and experiments/README.md:

- every relative link or image (``[text](path)``, ``![alt](path)``) names a file or directory that
  exists, resolved from the page's own folder (the ``#anchor`` is not checked);
- every ``python -m <module>`` names an importable module and every ``python <script>.py`` a script
  in the repository, and each answers ``--help`` with exit status 0 (run once per distinct module
  or script); where a command names a subcommand (``python -m ttt_lm.eval perplexity``) and the
  ``--help`` text lists choices as ``{a,b,...}``, the subcommand is among them;
- every ``make <target>`` in a code span or block is a target of the Makefile (pattern rules such
  as ``gpu-bench-%`` count).

README.md itself must stay a front page: at most 15 KB, with no dates or commit hashes.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted({ROOT / "README.md", ROOT / "slurm" / "README.md", ROOT / "experiments" / "README.md",
                *ROOT.glob("docs/**/*.md"), *ROOT.glob("kernels/*/README.md")})

FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.S | re.M)
INLINE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
PY_MODULE = re.compile(r"(?:^|[\s`(/])python3?\s+-m\s+([A-Za-z_][\w.]*)((?:[ \t]+[^\s`|;&#]+)*)")
PY_SCRIPT = re.compile(r"(?:^|[\s`(/])python3?\s+((?:\./)?[\w./-]+\.py)\b((?:[ \t]+[^\s`|;&#]+)*)")
MAKE = re.compile(r"(?:^|[\s`(;&])make((?:[ \t]+[A-Za-z_]\w*=(?:\"[^\"]*\"|'[^']*'|\S+))*)[ \t]+([A-Za-z][\w.-]*)")
SUBCOMMAND = re.compile(r"^[a-z][a-z0-9_-]*$")
CHOICES = re.compile(r"\{([\w,-]+)\}")


def rel(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT))


def code_of(text: str) -> str:
    """The fenced blocks and inline code spans of a page, one per line."""
    return "\n".join([m.group(0) for m in FENCE.finditer(text)]
                     + [m.group(0) for m in INLINE.finditer(FENCE.sub("", text))])


def prose_of(text: str) -> str:
    """A page without its code: links inside code are not links."""
    return INLINE.sub("", FENCE.sub("", text))


def test_pages_found():
    names = {rel(p) for p in PAGES}
    assert "README.md" in names and "docs/training.md" in names and "slurm/README.md" in names, names
    assert any(n.startswith("kernels/") for n in names), names


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    size = len(text.encode())
    assert size <= 15 * 1024, f"README.md is {size} bytes; keep it at most 15 KB and move detail into docs/"
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not dates, f"README.md carries dates {dates}; results pages under docs/results/ hold setups"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"README.md carries what look like commit hashes: {hashes}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_exist(page):
    missing = []
    for target in LINK.findall(prose_of(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL, mail address or an anchor on the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{rel(page)} links to paths that do not exist: {missing}"


def commands():
    """{("module" | "script", name): [(page, words after it), ...]} over every page."""
    found: dict = {}
    for page in PAGES:
        text = page.read_text()
        for kind, pattern in (("module", PY_MODULE), ("script", PY_SCRIPT)):
            for m in pattern.finditer(text):
                found.setdefault((kind, m.group(1)), []).append((rel(page), m.group(2).split()))
    return found


def make_targets_named():
    found: dict = {}
    for page in PAGES:
        for m in MAKE.finditer(code_of(page.read_text())):
            found.setdefault(m.group(2), []).append(rel(page))
    return found


def makefile_targets():
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.%\- ]+?)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def test_commands_found():
    """The parser finds what the pages certainly name (else the tests below check nothing)."""
    cmds = commands()
    assert ("module", "ttt_lm.eval") in cmds and ("module", "ttt_lm.data.prepare") in cmds, sorted(cmds)
    assert ("script", "train.py") in cmds and ("script", "slurm/submit.py") in cmds, sorted(cmds)
    assert {"run", "test"} <= set(make_targets_named()), make_targets_named()


def test_make_targets_exist():
    have = makefile_targets()
    patterns = [re.compile("^" + re.escape(t).replace("%", ".+") + "$") for t in have if "%" in t]
    missing = {t: pages for t, pages in make_targets_named().items()
               if t not in have and not any(p.match(t) for p in patterns)}
    assert not missing, f"make targets named in the docs but not in the Makefile: {missing}"


def _help(kind: str, name: str):
    cmd = [sys.executable, "-m", name, "--help"] if kind == "module" else [sys.executable, name, "--help"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1")
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, "timed out after 300 s"
    return r.returncode, r.stdout + r.stderr


@pytest.mark.slow
def test_documented_commands_answer_help():
    """About 15 distinct CLIs, two at a time; most start-ups import torch (2-3 min in all on a loaded
    2-core machine)."""
    cmds = commands()
    problems, todo = [], []
    for (kind, name), uses in sorted(cmds.items()):
        where = sorted({p for p, _ in uses})
        if kind == "module":
            if importlib.util.find_spec(name.split(".")[0]) is None or importlib.util.find_spec(name) is None:
                problems.append(f"python -m {name} (in {where}): no such module")
                continue
        elif not (ROOT / name).is_file():
            problems.append(f"python {name} (in {where}): no such script")
            continue
        todo.append((kind, name))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(todo, pool.map(lambda kn: _help(*kn), todo)))
    for (kind, name), (rc, out) in results.items():
        shown = f"python -m {name}" if kind == "module" else f"python {name}"
        if rc != 0:
            problems.append(f"{shown} --help exited {rc}: {out.strip()[-400:]}")
            continue
        choices = {c for group in CHOICES.findall(out) for c in group.split(",")}
        if not choices:
            continue
        for page, words in cmds[(kind, name)]:
            if words and SUBCOMMAND.match(words[0]) and words[0] not in choices:
                problems.append(f"{shown} {words[0]} (in {page}): not a subcommand; it has {sorted(choices)}")
    assert not problems, "\n".join(problems)


def test_docs_hold_pages_and_figures_only():
    """Run outputs and experiment scripts live under experiments/, not docs/."""
    other = sorted(rel(p) for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix not in (".md", ".png"))
    assert not other, f"docs/ holds files that are neither pages nor figures (move them to experiments/): {other}"
    figures = sorted(rel(p) for p in (ROOT / "docs").rglob("*.png") if p.parent != ROOT / "docs" / "results" / "figures")
    assert not figures, f"figures outside docs/results/figures/: {figures}"


def test_results_pages_carry_no_dates():
    """A results page gives the latest table with its setup and command; its runs' dates and history
    are in git and in the raw reports under experiments/."""
    dated = {rel(p): re.findall(r"\b20\d\d-\d\d-\d\d\b", p.read_text()) for p in (ROOT / "docs" / "results").glob("*.md")}
    dated = {k: v for k, v in dated.items() if v}
    assert not dated, f"results pages carry dates: {dated}"
