"""benchmarks/results_md.py: a benchmark's --record replaces its own section of RESULTS.md."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "results_md", Path(__file__).resolve().parents[2] / "benchmarks" / "results_md.py")
results_md = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_md)
put_section, record_section = results_md.put_section, results_md.record_section

TEXT = "# Benchmark results\n\nintro\n\n## A (`a.py`)\n\n- Date: old\n\n| x |\n\n### sub\n\nold sub\n\n## B\n\nb stays\n"


def test_replaces_its_section_only():
    out = put_section(TEXT, "## A (`a.py`)", "- Date: new\n\n| y |\n")
    assert out == "# Benchmark results\n\nintro\n\n## A (`a.py`)\n\n- Date: new\n\n| y |\n\n## B\n\nb stays\n"


def test_appends_a_new_heading_and_replaces_the_last_section():
    out = put_section(TEXT, "## C", "c")
    assert out == TEXT + "\n## C\n\nc\n"
    assert put_section(out, "## C", "c2").endswith("b stays\n\n## C\n\nc2\n")


def test_refuses_bad_headings():
    with pytest.raises(ValueError, match="'### A'"):
        put_section(TEXT, "### A", "x")
    with pytest.raises(ValueError, match="2 sections"):
        put_section(TEXT + "\n## B\n\nagain\n", "## B", "x")


def test_record_section_writes_the_file(tmp_path):
    p = tmp_path / "RESULTS.md"
    record_section("## A", "one", p)
    record_section("## A", "two", p)
    assert p.read_text() == "# Benchmark results\n\n## A\n\ntwo\n"
