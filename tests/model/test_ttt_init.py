"""model.init for TTT: the ttt scheme (ttt-lm-pytorch / ttt-lm-jax) and TTT-MLP's inner base-lr
warmup, which follows ttt-lm-jax.

Standard deviations are estimated over ≥ 16k weights, so a relative error of 5% is ~6 standard
errors of the estimate; the alternatives the tests tell apart differ by ≥ 40%."""
import pytest
import torch

from tests.model.test_init import _close, _lm, _std


def test_ttt_scheme_is_plain_normal_002():
    """ttt-lm-pytorch / ttt-lm-jax: N(0, 0.02) for every linear and the embedding, o_proj and
    the MLP's down projection not depth-scaled; inner W1, W2 and θ_η N(0, 0.02)."""
    m = _lm(["ttt_mlp"], "ttt")
    mx = m.layers[0].mixer
    for p in (mx.q_proj.weight, mx.k_proj.weight, mx.v_proj.weight, mx.o_proj.weight,
              m.layers[0].mlp.down_proj.weight, m.layers[0].mlp.gate_proj.weight, m.embed.weight, mx.W1, mx.W2):
        _close(_std(p), 0.02)


def test_ttt_mlp_base_lr_warmup_matches_ttt_lm_jax():
    """η_base(s) = init + min(1, (s − 1)/n)·(peak − init) in training (ttt-lm-jax
    get_ttt_lr_mult); evaluation and decoding use the peak."""
    m = _lm(["ttt_mlp"], "ttt", ttt={"base_lr_init": 0.01, "base_lr_warmup": 10})
    mx = m.layers[0].mixer
    x = torch.randn(1, 5, 128)
    peak = mx._eta(x)
    assert mx.base_lr == 0.1
    m.train()
    for step, base in [(1, 0.01), (6, 0.01 + 0.5 * 0.09), (11, 0.1), (500, 0.1)]:
        m.set_train_step(step)
        torch.testing.assert_close(mx._eta(x), peak * base / 0.1, rtol=1e-6, atol=0)
    m.set_train_step(1)
    m.eval()
    torch.testing.assert_close(mx._eta(x), peak, rtol=0, atol=0)
    # without a warmup the step changes nothing
    m2 = _lm(["ttt_mlp"], "ttt").train()
    e = m2.layers[0].mixer._eta(x)
    m2.set_train_step(1)
    torch.testing.assert_close(m2.layers[0].mixer._eta(x), e, rtol=0, atol=0)


def test_base_lr_warmup_needs_both_keys():
    with pytest.raises(ValueError, match="base_lr_init and model.ttt.base_lr_warmup go together"):
        _lm(["ttt_mlp"], "ttt", ttt={"base_lr_init": 0.01})
    with pytest.raises(ValueError, match="go together"):
        _lm(["ttt_mlp"], "ttt", ttt={"base_lr_warmup": 10})
