"""Tensor (and sequence) parallelism of Titans' own settings against the single-process model,
with two real gloo processes on CPU (the models and tolerance of test_tp_mixers.py): MAG's and
MAL's sliding window shorter than the rows (3 of 10 tokens; the section's default is longer than
any test row), and MAC with the MLP memory, whose norm gains (``_no_weight_decay``) are head
parameters: their slices keep the flag."""
from __future__ import annotations

import dataclasses

import pytest

from tests.parallel.kind_tp import tp_tests
from tests.parallel.test_tp_mixers import RESET_N, _cfg, _lm_vs_single, _resets

pytestmark = pytest.mark.dist


def _titans(kind, n=None, **section):
    cfg = _cfg([kind], d_ff=24, **({} if n is None else {"n": n}))
    cfg.titans = dataclasses.replace(cfg.titans, **section)
    return cfg.validate()


CHECKS = [
    ("titans_mag_window_sp", lambda: _lm_vs_single(_titans("titans_mag", window=3), True)),
    ("titans_mal_window_sp", lambda: _lm_vs_single(_titans("titans_mal", window=3), True)),
    ("titans_mac_mlp_memory_sp", lambda: _lm_vs_single(_titans("titans_mac", memory="mlp"), True)),
    ("titans_mac_mlp_memory_resets",
     lambda: _lm_vs_single(_resets(_titans("titans_mac", RESET_N, memory="mlp")), False, decode=False)),
]

results, test_titans_tp = tp_tests(__name__, CHECKS)
