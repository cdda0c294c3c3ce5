"""Shared by the kinds' own tensor-parallel files (test_<kind>_tp.py): two gloo processes run a
module's ``CHECKS`` once (a module fixture), each test asserts one check, with the models and the
comparison of test_tp_mixers.py."""
from __future__ import annotations

import pytest

from tests.distributed import assert_all_passed, spawn_checks


def tp_tests(module: str, checks):
    """(the results fixture, the parametrized test) for ``module``'s ``checks`` [(name, fn)]."""
    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        return spawn_checks(2, module, tmp_path_factory.mktemp(module.rsplit(".", 1)[-1]))

    @pytest.mark.parametrize("check", [n for n, _ in checks])
    def test_tp(results, check):
        assert_all_passed(results[0], check, results[1])

    return results, test_tp
