"""``tests.distributed.spawn_checks``, the harness of the multi-process tests: a failing check is
reported per rank with its traceback and does not hide the checks after it, unless
``stop_on_failure``, which ends the ranks there and returns the spawn's error."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed import assert_all_passed, spawn_checks

pytestmark = pytest.mark.dist


def _fails():
    raise ZeroDivisionError(f"rank {dist.get_rank()} divides by zero")


CHECKS = [("ok", lambda: None), ("fails", _fails), ("after", lambda: dist.get_world_size())]


def _per_rank(rank, world):
    return {"rank": lambda: rank * 10 + world, "fails": _fails, "after": lambda: "ran"}


def test_failures_reported_per_check(tmp_path):
    res, err = spawn_checks(2, __name__, tmp_path)
    assert err is None
    assert [r["ok"] for r in res] == [None, None]
    assert [r["after"] for r in res] == [2, 2]
    for rank, r in enumerate(res):
        assert f"ZeroDivisionError: rank {rank} divides by zero" in r["fails"]
    assert_all_passed(res, "ok")
    with pytest.raises(AssertionError, match="(?s)rank 1:.*ZeroDivisionError: rank 1"):
        assert_all_passed(res, "fails")
    with pytest.raises(AssertionError, match="not run"):
        assert_all_passed(res, "missing")


def test_stop_on_failure_and_per_rank_checks(tmp_path):
    res, err = spawn_checks(2, __name__, tmp_path, "_per_rank", stop_on_failure=True, timeout_s=30)
    assert err is not None
    assert [r["rank"] for r in res] == [2, 12]
    assert all("ZeroDivisionError" in r["fails"] and "after" not in r for r in res)


def _env_checks(rank, world):
    import os
    return {"env": lambda: (os.environ.get("TTT_HARNESS_PROBE"), os.environ.get("TTT_HARNESS_GONE"))}


def test_ranks_get_the_callers_environment_at_the_call(tmp_path, monkeypatch):
    """The fork server started earlier, with another environment: a rank still sees the one the
    caller has when it calls spawn_checks (variables added and removed since)."""
    monkeypatch.setenv("TTT_HARNESS_GONE", "1")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    spawn_checks(2, __name__, tmp_path / "a", names=["after"])   # the server may start here
    monkeypatch.delenv("TTT_HARNESS_GONE")
    monkeypatch.setenv("TTT_HARNESS_PROBE", "seen")
    res, err = spawn_checks(2, __name__, tmp_path / "b", "_env_checks")
    assert err is None and res == [{"env": ("seen", None)}] * 2


def test_names_select_checks(tmp_path):
    res, err = spawn_checks(2, __name__, tmp_path, names=["after"])
    assert err is None and res == [{"after": 2}, {"after": 2}]
