"""model.init: every kind's residual outs follow the default scheme, and the paper presets choose
their architecture's. Each scheme's official distributions are checked in the files of the kind
it comes from (test_ttt_init.py, test_rglru_init.py, test_mamba_init.py).

Standard deviations are estimated over ≥ 16k weights, so a relative error of 5% is ~6 standard
errors of the estimate; the alternatives the tests tell apart differ by ≥ 40%."""
import glob
import math
import os

import pytest
import torch

from ttt_lm.config import load_config
from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.lm import model_class
from ttt_lm.model.registry import builtin_kinds, mixer_class

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


@pytest.mark.parametrize("kind", builtin_kinds())
def test_gpt2_scheme_is_the_default_and_depth_scales_residual_outs(kind):
    """Every kind under gpt2: each linear of the mixer with ≥ 16k weights (smaller ones give too
    rough an estimate; Mamba's dt_proj, re-initialized by the mixer, is one) N(0, 0.02), or
    N(0, 0.02/√(2L)) where it writes into the residual stream (``_is_residual_out``); the MLP's
    gate N(0, 0.02) and down projection N(0, 0.02/√(2L))."""
    m = _lm([kind], "gpt2")
    assert ModelConfig().init == "gpt2"
    L = 4
    linears = [(n, p) for n, p in m.layers[0].mixer.named_modules()
               if isinstance(p, torch.nn.Linear) and p.weight.numel() >= 16384]
    assert linears, f"{kind}: no linear of the mixer has 16k weights at d_model 128"
    for name, p in linears:
        out = getattr(p, "_is_residual_out", False)
        try:
            _close(_std(p.weight), 0.02 / math.sqrt(2 * L) if out else 0.02)
        except AssertionError as e:
            raise AssertionError(f"{kind}: {name} (residual out: {out}): {e}") from None
    _close(_std(m.layers[0].mlp.gate_proj.weight), 0.02)
    _close(_std(m.layers[0].mlp.down_proj.weight), 0.02 / math.sqrt(2 * L))


def test_unknown_init_is_refused():
    with pytest.raises(ValueError, match="model.init must be one of"):
        _lm(builtin_kinds()[:1], "xavier")


def official_init(pattern) -> str:
    """The init a preset of ``pattern`` (its layer kinds) takes: the scheme of the official code of
    its one kind with a scheme of its own (``Mixer.official_init``; ``official_hybrid_init`` when
    the pattern mixes it with other kinds), else gpt2."""
    kinds = set(pattern)
    own = [k for k in kinds if mixer_class(k).official_init or mixer_class(k).official_hybrid_init]
    if len(own) != 1:
        return "gpt2"
    cls = mixer_class(own[0])
    return (cls.official_init if kinds == set(own) else cls.official_hybrid_init) or "gpt2"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_presets_choose_their_official_init(path):
    """The paper presets use their architecture's official init, which each mixer class declares
    (``official_init``, ``official_hybrid_init``: LaCT's official code inits N(0, 0.02)
    everywhere, the ``ttt`` scheme; Gated DeltaNet's hybrid code inits every layer as mamba_ssm
    does); the others (TTT hybrids, the Transformer, Titans, DeltaNet, the default tiny.yaml),
    whose kinds declare none, keep gpt2."""
    name = os.path.basename(path)
    cfg = load_config(path)
    cls = model_class(cfg.model)
    want = official_init(cfg.model.layer_pattern) if cls.reads_layer_pattern else cls.official_init or "gpt2"
    assert cfg.model.init == want
    if name.startswith("ttt_mlp_"):   # ttt-lm-jax's inner base-lr warmup, 10% of its steps
        assert cfg.model.ttt.base_lr_init == 0.01 and cfg.model.ttt.base_lr_warmup > 0
