"""``kernels.compile_report.run``: which cases it compiles (the compiles themselves are
``test_compile_gate.py``'s). The compile worker is replaced by a stub that records its calls."""
from kernels import compile_report as cr

ROW = {"status": "ok", "error": None, "registers": 32, "stack": 0, "spill_stores": 0, "spill_loads": 0,
       "shared": 1024, "wgmma": 0, "mma": 4, "compile_s": 1.0}


def _case(config, x):
    return cr.Case(op="op", module="mod", kernel="k", config=config, signature={}, constexprs={"X": x},
                   num_warps=4, num_stages=1, matmul=True, archs=(90, 80))


def _stub(monkeypatch, tmp_path):
    calls = []

    def compile(self, c, arch, timeout):
        calls.append((c.config, arch))
        return dict(ROW, shared=ROW["shared"] * (1 + c.constexprs["X"]))

    monkeypatch.setenv("TTT_LM_AOT_CACHE", str(tmp_path))
    monkeypatch.setattr(cr, "RESULTS_FILE", tmp_path / "kept.json")     # none of the repository's
    # the key stands in for Triton's: here a case's compile is decided by X and the target alone
    monkeypatch.setattr(cr, "cache_key", lambda c, arch: f"{c.kernel}:{c.constexprs['X']}:{arch}")
    monkeypatch.setattr(cr._Worker, "compile", compile)
    return calls


def test_identical_cases_are_compiled_once_and_share_the_row(monkeypatch, tmp_path):
    calls = _stub(monkeypatch, tmp_path)
    rows = cr.run([_case("a", 1), _case("b", 1), _case("c", 2)], (90, 80), jobs=2, use_cache=False)
    assert sorted(calls) == [("a", 80), ("a", 90), ("c", 80), ("c", 90)]
    assert [(r["config"], r["arch"]) for r in rows] == [(c, a) for c in "abc" for a in (90, 80)]
    by = {(r["config"], r["arch"]): r for r in rows}
    for arch in (90, 80):
        assert by[("b", arch)]["same_as"] == "k[a]" and by[("b", arch)]["shared"] == by[("a", arch)]["shared"]
        assert "same_as" not in by[("a", arch)] and "same_as" not in by[("c", arch)]
        assert by[("c", arch)]["shared"] != by[("a", arch)]["shared"]
    assert all(r["passed"] for r in rows)
    assert "=" in cr.format_table(rows).splitlines()[4]   # b's first row says whose result it is


def test_a_cached_result_is_not_compiled_again(monkeypatch, tmp_path):
    calls = _stub(monkeypatch, tmp_path)
    cr.run([_case("a", 1)], (90,), jobs=1)
    rows = cr.run([_case("a", 1), _case("c", 2)], (90,), jobs=1)
    assert calls == [("a", 90), ("c", 90)]
    assert [r["cached"] for r in rows] == [True, False]
