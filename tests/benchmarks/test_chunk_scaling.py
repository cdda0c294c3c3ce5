"""benchmarks/chunk_scaling.py takes its rows from the registry: every kind that does not attend,
one row per declared variant, and the LaCT op."""
import importlib.util
from pathlib import Path

import pytest

from ttt_lm.model.registry import builtin_kinds, mixer_class

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chunk_scaling.py"
_spec = importlib.util.spec_from_file_location("chunk_scaling_bench", SCRIPT)
cs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cs)


def test_rows_are_the_recurrent_kinds_and_their_variants():
    rows = cs.mixers()
    kinds = {k for k, _ in rows.values() if k is not None}
    assert kinds == {k for k in builtin_kinds() if not mixer_class(k).attends}
    assert kinds and all(not mixer_class(k).attends for k in kinds)
    for name, (kind, sub) in rows.items():
        if kind is None:
            assert name == "lact_op" and sub == cs.LACT_OP
            continue
        variants = mixer_class(kind).variants
        if variants:
            assert name[len(kind) + 1:] in variants and sub == variants[name[len(kind) + 1:]]
        else:
            assert name == kind and sub == {}
    assert list(rows)[-1] == "lact_op"


def test_build_applies_the_variant_settings():
    for name, (kind, sub) in cs.mixers().items():
        if kind is None or not sub:
            continue
        m = cs.build(name, 32, 2)
        section = getattr(m.cfg if hasattr(m, "cfg") else None, mixer_class(kind).config_section, None)
        for field, value in sub.items():
            got = getattr(section, field) if section is not None else getattr(m, field)
            assert got == value, (name, field, got)
        assert m.kernel_backend == "torch" and m.impl == "chunked"


def test_unknown_row_is_refused_by_name():
    with pytest.raises(ValueError, match="'no_such_row'"):
        cs.build("no_such_row", 32, 2)
