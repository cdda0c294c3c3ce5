"""Tensor (and sequence) parallelism of attention's own settings, with two real gloo processes on
CPU: grouped-query attention (2 key/value heads for 4 query heads) and multi-head attention (4),
global and windowed, tied and untied heads, against the single-process LM; and the refusal of
a key/value head count the TP size does not divide.

Tolerance: float64; the TP computation differs from the single-process one only in the order of
summation (``test_tensor_parallel.py``): rtol = 1e-9, atol = 1e-12."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import assert_all_passed, spawn_checks
from tests.parallel.tp_common import tp_lm_vs_single

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-9, atol=1e-12)


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{msg}: {m}")


_GROUPS = {}


def _groups():
    from ttt_lm.parallel.groups import build_groups
    if "g" not in _GROUPS:
        _GROUPS["g"] = build_groups(tp_size=dist.get_world_size())
    return _GROUPS["g"]


def _cfg(pattern, d_ff, tie=True, kv=2):
    from ttt_lm.model.config import AttentionConfig, ModelConfig
    return ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, layer_pattern=list(pattern),
                       d_ff=d_ff, tie_embeddings=tie, max_seq_len=64,
                       attention=AttentionConfig(num_kv_heads=kv, window=3))


def _lm_vs_single(cfg, sp, checkpointing=False):
    # the structured init as it is: tied/untied heads and GQA are what is checked here
    tp_lm_vs_single(cfg, _groups(), sp, close, T=8, n_masked=3, perturb=False, checkpointing=checkpointing,
                    nonzero_grads=False)


def check_gqa(sp):
    tie = not sp  # cover untied heads in one of the two runs
    _lm_vs_single(_cfg(["attention", "local_attention"], d_ff=0, tie=tie), sp)


def check_mha(sp):
    _lm_vs_single(_cfg(["local_attention", "attention"], d_ff=24, kv=4), sp, checkpointing=sp)


def check_refuses_one_kv_head():
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.tp_model import parallelize_tp
    bad = _cfg(["attention"], d_ff=0, kv=1)  # 1 KV head cannot be split over 2 ranks
    try:
        parallelize_tp(LM(bad), _groups())
    except ValueError as e:
        assert "num_kv_heads=1" in str(e), str(e)
    else:
        raise AssertionError("num_kv_heads=1 with tensor_parallel=2 must be refused")


CHECKS = [("gqa", lambda: check_gqa(False)), ("gqa_sp", lambda: check_gqa(True)),
          ("mha", lambda: check_mha(False)), ("mha_sp", lambda: check_mha(True)),
          ("refuses_one_kv_head", check_refuses_one_kv_head)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_checks(2, __name__, tmp_path_factory.mktemp("attention_tp"))


@pytest.mark.parametrize("check", [n for n, _ in CHECKS])
def test_attention_tp(results, check):
    assert_all_passed(results[0], check, results[1])
