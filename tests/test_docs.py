"""The documentation points at things that exist.

Over README.md, docs/**/*.md, kernels/*/README.md, slurm/README.md and experiments/README.md:

- every relative link or image (``[text](path)``, ``![alt](path)``) names a file or directory that
  exists, resolved from the page's own folder;
- every ``#anchor`` of a link to a Markdown page (``file.md#anchor``, or ``#anchor`` on the page
  itself) is the slug of a heading of that page by GitHub's rules (lower case; punctuation other
  than ``-`` and ``_`` dropped; each space a ``-``; a repeated slug takes ``-1``, ``-2``, ...), or an
  ``id``/``name`` of an HTML element on it;
- every ``python -m <module>`` names an importable module and every ``python <script>.py`` a script
  in the repository, and each answers ``--help`` with exit status 0 (run once per distinct module
  or script); where a command names a subcommand (``python -m ttt_lm.eval perplexity``) and the
  ``--help`` text lists choices as ``{a,b,...}``, the subcommand is among them;
- every ``make <target>`` in a code span or block is a target of the Makefile (pattern rules such
  as ``gpu-bench-%`` count).

README.md itself must stay a front page: at most 15 KB, with no dates or commit hashes.
"""
from __future__ import annotations

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


BARE_PY = re.compile(r"^\s*(?:python3?|torchrun)\s", re.M)
ACTIVATE = re.compile(r"(?:source|\.)\s+\.venv/bin/activate")


def test_readme_commands_say_which_python():
    """`make run` installs into .venv, so a bare `python` has no torch: before the README's first
    command that runs one, its code says to activate the environment."""
    text = (ROOT / "README.md").read_text()
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    first = next((i for i, b in enumerate(blocks) if BARE_PY.search(b)), None)
    assert first is not None, "README.md has no python command in a code block (the parser found none)"
    before = "\n".join(blocks[:first]) + blocks[first][:BARE_PY.search(blocks[first]).start()]
    assert ACTIVATE.search(before), (
        "README.md runs a bare python before saying `source .venv/bin/activate`: "
        f"{BARE_PY.search(blocks[first]).group(0).strip()!r} in block {first + 1}")


def test_readme_says_what_make_test_costs():
    """`make test` runs for about half an hour on 2 cores and, as root, installs Slurm and munge with
    apt-get (tests/slurm/cluster.py): the README's paragraph on it says both."""
    text = (ROOT / "README.md").read_text()
    start = text.index("`make test` is what CI runs")
    para = text[start:text.find("\n\n", start)]
    assert re.search(r"\d+\s*(?:–|-|to)\s*\d+ minutes", para), f"README.md does not say how long make test takes: {para!r}"
    from tests.slurm.cluster import PACKAGES
    missing = [w for w in ["apt-get", "root", *PACKAGES] if w not in para]
    assert not missing, f"README.md's paragraph on make test does not name {missing}: {para!r}"


def test_evaluation_page_says_each_thing_once():
    """docs/evaluation.md gives the harness's CLI command and its Python entry once each (in its
    lm-evaluation-harness section), not again in the task list."""
    text = (ROOT / "docs" / "evaluation.md").read_text()
    for needle in ("python -m ttt_lm.eval.lm_eval_cli --model ttt_lm", "lm_eval.simple_evaluate(",
                   "a dataset that cannot be loaded"):
        n = text.lower().count(needle.lower())
        assert n == 1, f"docs/evaluation.md says {needle!r} {n} times; say it once and link to it"


def test_limitations_do_not_contradict_the_tested_resume():
    """A run resumes on another tensor-parallel size (tests/train/test_resume_tp.py; docs/training.md
    says so): docs/limitations.md does not list it as something that cannot change."""
    assert (ROOT / "tests" / "train" / "test_resume_tp.py").is_file()
    text = (ROOT / "docs" / "limitations.md").read_text()
    for item in re.split(r"\n- ", text):
        said = " ".join(item.split())
        for m in re.finditer(r"[^.;()]*cannot change[^.;()]*", said):
            assert "tensor" not in m.group(0), f"docs/limitations.md: {m.group(0).strip()!r}"


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


HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ID = re.compile(r"<[a-z][^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w is Unicode: letters, digits, underscore
    return text.replace(" ", "-")


def anchors_of(page: pathlib.Path) -> set:
    """Every anchor a page has: its headings' slugs (outside fenced code) and HTML ids."""
    text = page.read_text()
    found, seen = set(), {}
    for m in HEADING.finditer(FENCE.sub("", text)):
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    found.update(HTML_ID.findall(text))
    return found


def test_github_slug():
    assert github_slug("On another layout: data-parallel ranks, tensor-parallel size") == \
        "on-another-layout-data-parallel-ranks-tensor-parallel-size"
    assert github_slug("Verifying checksums (`data.verify_checksums`)") == "verifying-checksums-dataverify_checksums"
    assert github_slug("Compile gate (no GPU needed)") == "compile-gate-no-gpu-needed"
    assert github_slug("[LaCT](x.md) & Muon") == "lact--muon"


def test_anchors_of_counts_repeats_and_skips_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n## Usage\n```bash\n# not a heading\n```\n### Usage\n<a id=\"here\"></a>\n")
    assert anchors_of(page) == {"top", "usage", "usage-1", "here"}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_anchors_resolve(page):
    broken = []
    for target in LINK.findall(prose_of(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        dest = (page.parent / path.split("?", 1)[0]) if path else page
        if dest.suffix != ".md" or not dest.is_file():
            continue  # a missing file is test_relative_links_exist's; other files have no headings
        if anchor not in anchors_of(dest):
            broken.append(f"{target} (no heading of {rel(dest.resolve())} has the anchor #{anchor})")
    assert not broken, f"{rel(page)} links to anchors that do not exist: {broken}"


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


#: answers ``--help`` for every CLI given (a JSON list of [kind, name]) in a process of its own
#: each, forked from one that imported torch once (the start-up most of them share; nothing of the
#: project is imported before the fork, so each CLI imports its own modules as a fresh process does),
#: two at a time; prints {"kind name": [exit status, output]} as JSON
_HELP_DRIVER = r"""
import json, os, runpy, sys, tempfile, time
import torch  # noqa: F401  (imported once, before the forks)
todo, running, done = [tuple(x) for x in json.loads(sys.argv[1])], {}, {}
def start(kind, name):
    out = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            sys.argv = [name, "--help"]
            if kind == "module":
                sys.path[0] = os.getcwd()
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(name))
                runpy.run_path(name, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr), 1)[1]
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    running[pid] = (kind, name, out, time.monotonic())
while todo or running:
    while todo and len(running) < 2:
        start(*todo.pop(0))
    pid, status = os.waitpid(-1, 0)
    kind, name, out, t0 = running.pop(pid)
    out.seek(0)
    done[kind + " " + name] = [os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")]
print(json.dumps(done))
"""


def _helps(todo):
    """{(kind, name): (exit status or None, output)} of ``--help`` for every CLI in ``todo``."""
    import json
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1")
    try:
        r = subprocess.run([sys.executable, "-c", _HELP_DRIVER, json.dumps(todo)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {kn: (None, "timed out after 600 s (all the --help runs together)") for kn in todo}
    if r.returncode != 0:
        return {kn: (None, f"the --help driver exited {r.returncode}: {r.stderr[-2000:]}") for kn in todo}
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return {(kind, name): tuple(got[f"{kind} {name}"]) for kind, name in todo}


@pytest.mark.slow
def test_documented_commands_answer_help():
    """About 20 distinct CLIs, each in a process of its own forked from one that imported torch,
    two at a time."""
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
    results = _helps(todo)
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
