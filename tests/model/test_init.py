"""model.init: each scheme gives the dense layers the official code's distribution, the paper
presets choose their architecture's, and TTT-MLP's inner base-lr warmup follows ttt-lm-jax.

Standard deviations are estimated over ≥ 16k weights, so a relative error of 5% is ~6 standard
errors of the estimate; the alternatives the tests tell apart differ by ≥ 40%."""
import glob
import math
import os

import pytest
import torch

from ttt_lm.config import load_config
from ttt_lm.model import LM, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lm(pattern, init, n_layers=4, d_ff=None, **sub) -> LM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=128, n_heads=4, n_layers=n_layers, layer_pattern=list(pattern),
                      init=init, d_ff=d_ff)
    for name, kv in sub.items():
        for k, v in kv.items():
            setattr(getattr(cfg, name), k, v)
    return LM(cfg)


def _std(p: torch.Tensor) -> float:
    return float(p.detach().double().std())


def _close(actual: float, expected: float, rel: float = 0.05) -> None:
    assert abs(actual - expected) <= rel * expected, f"std {actual:.5f}, expected {expected:.5f}"


def test_gpt2_scheme_is_the_default_and_depth_scales_residual_outs():
    m = _lm(["ttt_linear"], "gpt2")
    assert ModelConfig().init == "gpt2"
    L = 4
    _close(_std(m.layers[0].mixer.q_proj.weight), 0.02)
    _close(_std(m.layers[0].mixer.o_proj.weight), 0.02 / math.sqrt(2 * L))
    _close(_std(m.layers[0].mlp.down_proj.weight), 0.02 / math.sqrt(2 * L))


def test_ttt_scheme_is_plain_normal_002():
    """ttt-lm-pytorch / ttt-lm-jax: N(0, 0.02) for every linear and the embedding, o_proj and
    the MLP's down projection not depth-scaled; inner W1, W2 and θ_η N(0, 0.02)."""
    m = _lm(["ttt_mlp"], "ttt")
    mx = m.layers[0].mixer
    for p in (mx.q_proj.weight, mx.k_proj.weight, mx.v_proj.weight, mx.o_proj.weight,
              m.layers[0].mlp.down_proj.weight, m.layers[0].mlp.gate_proj.weight, m.embed.weight, mx.W1, mx.W2):
        _close(_std(p), 0.02)


def test_griffin_scheme_follows_recurrentgemma():
    """recurrentgemma: N(0, 1/fan_in), out projections N(0, (2/L)/fan_in): linear_x, linear_y
    N(0, 1/width), linear_out N(0, (2/L)/lru_width), attention q/k/v N(0, 1/width) and o
    N(0, (2/L)/width), MLP up N(0, 1/width) and down N(0, (2/L)/d_ff); biases 0."""
    L, d, lru, ff = 3, 128, 192, 384
    m = _lm(["rglru", "rglru", "local_attention"], "griffin", n_layers=L, d_ff=ff, rglru={"lru_width": lru},
            attention={"num_kv_heads": 1})
    r, a = m.layers[0].mixer, m.layers[2].mixer
    _close(_std(r.linear_x.weight), 1 / math.sqrt(d))
    _close(_std(r.linear_y.weight), 1 / math.sqrt(d))
    _close(_std(r.linear_out.weight), math.sqrt(2 / L / lru))
    assert r.linear_x.bias.abs().max() == 0 and r.linear_out.bias.abs().max() == 0
    _close(_std(a.q_proj.weight), 1 / math.sqrt(d))
    _close(_std(a.o_proj.weight), math.sqrt(2 / L / d))
    _close(_std(m.layers[1].mlp.up_proj.weight), 1 / math.sqrt(d))
    _close(_std(m.layers[1].mlp.down_proj.weight), math.sqrt(2 / L / ff))
    # the RG-LRU's own parameters keep their official init under every scheme
    a_sq = torch.sigmoid(r.Lambda.detach().double()) ** 2
    assert 0.81 - 1e-6 <= float(a_sq.min()) and float(a_sq.max()) <= 0.999 ** 2 + 1e-6


@pytest.mark.parametrize("d_ff,n_res", [(0, 1), (None, 2)])
def test_mamba_scheme_follows_mamba_ssm(d_ff, n_res):
    """mamba_ssm: linears keep PyTorch's kaiming-uniform (a = √5: U(±1/√fan_in), std
    1/√(3 fan_in)), out_proj that divided by √(n_residuals_per_layer · L) (1 without an MLP, 2
    with one); dt_proj, A_log, D keep Mamba's own init."""
    L, d = 4, 128
    m = _lm(["mamba"], "mamba", n_layers=L, d_ff=d_ff)
    mx = m.layers[0].mixer
    fan = d
    assert float(mx.in_proj.weight.detach().abs().max()) <= 1 / math.sqrt(fan)
    _close(_std(mx.in_proj.weight), 1 / math.sqrt(3 * fan))
    fan_out_proj = mx.d_inner
    _close(_std(mx.out_proj.weight), 1 / math.sqrt(3 * fan_out_proj) / math.sqrt(n_res * L))
    r = mx.dt_rank ** -0.5
    assert float(mx.dt_proj.weight.detach().abs().max()) <= r and float(mx.dt_proj.bias.detach().abs().max()) > 0
    torch.testing.assert_close(mx.A_log[0].detach().exp(), torch.arange(1, 17, dtype=torch.float32))


def test_unknown_init_is_refused():
    with pytest.raises(ValueError, match="model.init must be one of"):
        _lm(["attention"], "xavier")


PRESET_INIT = {"ttt_linear_": "ttt", "ttt_mlp_": "ttt", "tiny_ttt_": "ttt", "griffin_": "griffin",
               "hawk_": "griffin", "tiny_griffin": "griffin", "tiny_hawk": "griffin", "mamba_": "mamba",
               "tiny_mamba": "mamba", "lact_": "ttt", "tiny_lact": "ttt", "gated_deltanet_": "mamba",
               "tiny_gated_deltanet": "mamba", "gdn_hybrid_": "mamba", "tiny_gdn_hybrid": "mamba"}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_presets_choose_their_official_init(path):
    """The paper presets use their architecture's official init (LaCT's official code: N(0, 0.02)
    everywhere, the ``ttt`` scheme; Gated DeltaNet's hybrids too: the official hybrid code inits
    every layer as mamba_ssm does); the others (TTT hybrids, the
    Transformer, Titans, DeltaNet, the default tiny.yaml) keep gpt2."""
    name = os.path.basename(path)
    cfg = load_config(path)
    expected = next((v for k, v in PRESET_INIT.items() if name.startswith(k)), "gpt2")
    assert cfg.model.init == expected
    if name.startswith("ttt_mlp_"):   # ttt-lm-jax's inner base-lr warmup, 10% of its steps
        assert cfg.model.ttt.base_lr_init == 0.01 and cfg.model.ttt.base_lr_warmup > 0


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
