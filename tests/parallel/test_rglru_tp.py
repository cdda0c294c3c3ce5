"""Tensor parallelism refuses an RG-LRU whose gate blocks (``rglru.num_heads``) the TP size does
not divide, before any change to the model (two real gloo processes on CPU)."""
from __future__ import annotations

import pytest
import torch

from tests.parallel.kind_tp import tp_tests
from tests.parallel.test_tp_mixers import _cfg, _groups

pytestmark = pytest.mark.dist


def check_refuses_one_head_block():
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.tp_model import parallelize_tp
    bad = _cfg(["rglru"])
    bad.rglru.num_heads = 1
    m = LM(bad)
    try:
        parallelize_tp(m, _groups())
    except ValueError as e:
        assert "num_heads=1" in str(e), str(e)
    else:
        raise AssertionError("1 RG-LRU head block cannot be split over 2 ranks")
    assert type(m) is LM and isinstance(m.layers[0].mixer.linear_x, torch.nn.Linear), "refusal must change nothing"


CHECKS = [("refuses_one_head_block", check_refuses_one_head_block)]

results, test_rglru_tp = tp_tests(__name__, CHECKS)
