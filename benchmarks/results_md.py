"""One section per benchmark in ``benchmarks/RESULTS.md``: a script's ``--record`` replaces the
section under its heading with the latest table (earlier runs stay in git history) and leaves
every other section as it is; a heading not yet in the file is appended."""
from __future__ import annotations

from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def put_section(text: str, heading: str, body: str) -> str:
    """``text`` with the section that starts at the line ``heading`` (a ``## `` heading, up to the
    next ``## `` line or the end) replaced by ``heading`` and ``body``, or with them appended."""
    if not heading.startswith("## ") or "\n" in heading:
        raise ValueError(f"put_section: heading must be one '## ' line, got {heading!r}")
    section = heading + "\n\n" + body.strip("\n") + "\n"
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.rstrip("\n") == heading]
    if len(starts) > 1:
        raise ValueError(f"put_section: {heading!r} heads {len(starts)} sections; expected one")
    if not starts:
        return text.rstrip("\n") + "\n\n" + section
    i = starts[0]
    j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    rest = "".join(lines[j:])
    return "".join(lines[:i]) + section + ("\n" + rest if rest else "")


def record_section(heading: str, body: str, path: Path = RESULTS_MD) -> None:
    """Write ``body`` under ``heading`` in ``path`` (see :func:`put_section`)."""
    path = Path(path)
    path.write_text(put_section(path.read_text() if path.exists() else "# Benchmark results\n", heading, body))
