"""A float64 model is float64 throughout: every rotary table a layer builds (``rope_cos_sin``) is
in the accumulation dtype of the tensors it rotates (float64 here; float32 for bf16/fp16), for
every built-in kind, in its forward and its decode step. Float32 tables in a float64 run moved a
LaCT layer's gradients by 1.8e-6 against its float64 reference."""
import importlib
import pkgutil

import pytest
import torch

import ttt_lm.model.mixers as mixers_pkg
from ttt_lm.model.layers import acc_dtype, rope_cos_sin
from mixer_checks import make_mixer, short_cases


@pytest.fixture
def table_dtypes(monkeypatch):
    """The dtypes of every table built, through each mixer module's own ``rope_cos_sin``."""
    seen = []

    def recording(*a, **kw):
        cos, sin = rope_cos_sin(*a, **kw)
        seen.append(cos.dtype)
        return cos, sin
    for m in pkgutil.iter_modules(mixers_pkg.__path__):
        mod = importlib.import_module(f"ttt_lm.model.mixers.{m.name}")
        if getattr(mod, "rope_cos_sin", None) is rope_cos_sin:
            monkeypatch.setattr(mod, "rope_cos_sin", recording)
    return seen


@pytest.mark.parametrize("kind,variant,cfg", short_cases(8), ids=lambda v: v if isinstance(v, str) else None)
def test_a_float64_layer_builds_float64_rotary_tables(kind, variant, cfg, table_dtypes):
    m, _ = make_mixer(kind, cfg=cfg)
    x = torch.randn(2, 11, cfg.d_model, dtype=torch.float64)
    y, st = m(x, None, True)
    m.step(x[:, :1], st)
    assert all(d == torch.float64 for d in table_dtypes), (kind, table_dtypes)


def test_the_accumulation_dtype():
    assert acc_dtype(torch.bfloat16) == acc_dtype(torch.float16) == torch.float32
    assert acc_dtype(torch.float64) == torch.float64 and acc_dtype(torch.float32) == torch.float32
