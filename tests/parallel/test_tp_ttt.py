"""Tensor (and sequence) parallelism of the TTT mixers against the single-process model, with
two real gloo processes on CPU.

The workers are spawned once (a module fixture), run every check and report, per check, None or
the failure's traceback; each test asserts one check.

Tolerance: float64 throughout. The TP computation differs from the single-process one only in
the order of summation (o_proj's partial products summed by the all-reduce, post_norm's mean and
variance summed per rank then across ranks), so the differences are rounding, ~1e-15 relative.
rtol = 1e-9, atol = 1e-12 leaves margin for that and still fails on any missing, duplicated or
mis-sliced term (an O(1) relative error; the parameters are perturbed away from their
structured init so that no slice is all zeros or all ones).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.parallel.tp_common import tp_lm_vs_single
from tests.distributed import assert_all_passed, spawn_checks

pytestmark = pytest.mark.dist

TOL = dict(rtol=1e-9, atol=1e-12)
WORLD = 2


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{msg}: {m}")


_GROUPS = {}


def _groups():
    from ttt_lm.parallel.groups import build_groups
    if "g" not in _GROUPS:
        _GROUPS["g"] = build_groups(tp_size=WORLD)
    return _GROUPS["g"]


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- checks (run inside the workers) -----------------------------------------------------------
def check_layer_norm():
    """tp_layer_norm on feature shards = the slice of F.layer_norm, gradients of x, γ, β included;
    a large common offset checks the centered variance (E[x²] − μ² would lose ~8 digits here)."""
    from ttt_lm.parallel.tensor_parallel import tp_layer_norm
    g = _groups().tp_group
    p, r = dist.get_world_size(g), dist.get_rank(g)
    x = _rand(2, 3, 8, seed=1) + 1e4
    w, b, gy = _rand(8, seed=2), _rand(8, seed=3), _rand(2, 3, 8, seed=4)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    want = F.layer_norm(xr, (8,), wr, br, 1e-6)
    (want * gy).sum().backward()
    xl, wl, bl = (t.chunk(p, -1)[r].clone().requires_grad_() for t in (x, w, b))
    y = tp_layer_norm(xl, wl, bl, 1e-6, g)
    close(y, want.detach().chunk(p, -1)[r], "forward")
    (y * gy.chunk(p, -1)[r]).sum().backward()
    # x ~ 1e4 scales the LN Jacobian's rounding by the offset: 1e-9 relative still holds
    close(xl.grad, xr.grad.chunk(p, -1)[r], "x grad")
    close(wl.grad, wr.grad.chunk(p, -1)[r], "weight grad")
    close(bl.grad, br.grad.chunk(p, -1)[r], "bias grad")


def _cfg(pattern, d_ff=0, **ttt):
    from ttt_lm.model.config import ModelConfig
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, layer_pattern=list(pattern),
                      d_ff=d_ff, tie_embeddings=True, max_seq_len=64)
    cfg.ttt.mini_batch_size = 4
    for k, v in ttt.items():
        setattr(cfg.ttt, k, v)
    return cfg


def _lm_vs_single(cfg, sp):
    """6 tokens with mini-batch 4: one full and one partial TTT mini-batch (6 % p == 0 for SP); the
    5-token prefill then step() per token crosses the mini-batch boundary at position 4 with the
    local heads' decode state."""
    from ttt_lm.model.mixers.ttt import _TTTBase
    # the TTT mixers' state: heads (dim 1) or conv channels (dim 1) split by p
    tp_lm_vs_single(cfg, _groups(), sp, close, state_split=lambda blk, k, v: isinstance(blk.mixer, _TTTBase))


def _other_kind():
    """The last built-in kind outside TTT's section."""
    from ttt_lm.model.registry import builtin_kinds, mixer_class
    return next(k for k in reversed(builtin_kinds()) if mixer_class(k).config_section != "ttt")


def _global_attention():
    """The built-in kind with attention over every earlier token."""
    from ttt_lm.model.registry import builtin_kinds, kinds_with
    return kinds_with(lambda c: c.global_attention, builtin_kinds())[0]


def check_refusals():
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.tp_model import parallelize_tp
    groups = _groups()
    m = LM(_cfg(["ttt_linear"], pre_conv=True))
    try:
        parallelize_tp(m, groups, sequence_parallel=True)
    except ValueError as e:
        assert "pre_conv" in str(e) and "sequence_parallel" in str(e), str(e)
    else:
        raise AssertionError("pre_conv with sequence parallelism must be refused")
    assert type(m) is LM, "refusal must leave the model as it was"
    from unittest import mock
    from ttt_lm.model.mixers import mixer_class
    other = _other_kind()
    m = LM(_cfg(["ttt_mlp", other]))
    try:  # every built-in kind declares a plan: another kind with its plan removed stands for one without
        with mock.patch.object(mixer_class(other), "tp_plan", classmethod(lambda cls, cfg: None)):
            parallelize_tp(m, groups)
    except ValueError as e:
        assert f"[{other!r}]" in str(e) and "ttt_mlp" in str(e), str(e)
    else:
        raise AssertionError(f"a {other} layer without a plan must be refused")


CHECKS = [
    ("layer_norm", check_layer_norm),
    ("linear_attention", lambda: _lm_vs_single(_cfg(["ttt_linear", _global_attention()], d_ff=24), False)),
    ("linear_attention_sp", lambda: _lm_vs_single(_cfg(["ttt_linear", _global_attention()], d_ff=24), True)),
    ("mlp_gate_shareqk", lambda: _lm_vs_single(_cfg(["ttt_mlp"], use_gate=True, share_qk=True), False)),
    ("mlp_gate_shareqk_sp", lambda: _lm_vs_single(_cfg(["ttt_mlp"], use_gate=True, share_qk=True), True)),
    ("mlp_plain_sp", lambda: _lm_vs_single(_cfg(["ttt_mlp"]), True)),
    ("linear_preconv", lambda: _lm_vs_single(_cfg(["ttt_linear"], pre_conv=True, use_gate=True), False)),
    ("refusals", check_refusals),
]


# ---- tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_checks(WORLD, __name__, tmp_path_factory.mktemp("tp_ttt"))


@pytest.mark.parametrize("check", [n for n, _ in CHECKS])
def test_tp_ttt(results, check):
    assert_all_passed(results[0], check, results[1])
