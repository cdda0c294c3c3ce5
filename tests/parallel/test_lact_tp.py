"""Tensor (and sequence) parallelism of LaCT's low-rank fast weights (initial w0, w2 = W_left
W_right + 0.5·I of rank 2, Muon's iterations in the state's dtype) against the single-process
model, with two real gloo processes on CPU (the models and tolerance of test_tp_mixers.py)."""
from __future__ import annotations

import dataclasses

import pytest

from tests.parallel.kind_tp import tp_tests
from tests.parallel.test_tp_mixers import RESET_N, _cfg, _lm_vs_single, _resets

pytestmark = pytest.mark.dist


def _low_rank(**kw):
    cfg = _cfg(["lact"], d_ff=24, **kw)
    cfg.lact = dataclasses.replace(cfg.lact, num_heads=2, low_rank=2, muon_dtype="state")
    return cfg.validate()


CHECKS = [
    ("lact_low_rank", lambda: _lm_vs_single(_low_rank(), False)),
    ("lact_low_rank_sp", lambda: _lm_vs_single(_low_rank(), True)),
    ("lact_low_rank_resets", lambda: _lm_vs_single(_resets(_low_rank(n=RESET_N)), False, decode=False)),
]

results, test_lact_tp = tp_tests(__name__, CHECKS)
