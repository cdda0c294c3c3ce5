"""The mixer contract: declarations that fit together, public stages that compose to the
training form, and a parallel package that reads only those declarations."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from ttt_lm.model import registry
from ttt_lm.model.mixers import Mixer, build_mixer, mixer_class, register_mixer
from ttt_lm.model.mixers.base import check_contract
from tests.model.mixer_checks import short_config

LAYER_KINDS = registry.builtin_kinds()
PARALLEL = pathlib.Path(__file__).resolve().parents[2] / "ttt_lm" / "parallel"


def _cfg(kind):
    """One layer of ``kind``, every section at its tiny sizes of 3 tokens (chunks and mini-batches
    of 3, windows of 4: the 7-token input spans several)."""
    return short_config(kind, 3, d_model=16, n_heads=2, vocab_size=32)


@pytest.mark.parametrize("kind", [k for k in LAYER_KINDS if callable(getattr(mixer_class(k), "inputs", None))])
def test_stages_compose_to_the_chunked_form(kind):
    """inputs → op → output from a state built by context_state (no earlier tokens: the halo is
    all invalid) is the chunked form from no state. float64; the RG-LRU's conv takes its masked
    path when handed a cache, another summation order, so 1e-12 rather than exact."""
    torch.manual_seed(0)
    m = build_mixer(kind, _cfg(kind), 0).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    n, st = m.cp_halo, None
    if hasattr(m, "context_state"):
        st = m.context_state(torch.zeros(2, n, 16, dtype=torch.float64), torch.zeros(n, dtype=torch.bool), 0)
    inp, _ = m.inputs(x, st)
    y, _ = m.op(inp, backend=m.op_backend(x))
    want, _ = m.chunked(x)
    torch.testing.assert_close(m.output(y, x), want, rtol=1e-12, atol=1e-12)


def test_inconsistent_declarations_are_refused():
    class NoStages(Mixer):
        cp_form = "summary"
        op_name = "linear_scan"
    with pytest.raises(TypeError, match="does not define the public stage"):
        check_contract(NoStages)

    class BadForm(Mixer):
        cp_form = "ring"
    with pytest.raises(ValueError, match="cp_form must be one of"):
        check_contract(BadForm)

    class BadOp(NoStages):
        op_name = "fft"
        inputs = op = output = context_state = lambda self, *a: None
    with pytest.raises(ValueError, match="op_name must be one of"):
        check_contract(BadOp)
    # registering runs the same checks: a class whose declarations do not fit is never registered
    for cls, err, msg in [(NoStages, TypeError, "does not define the public stage"),
                          (BadForm, ValueError, "cp_form must be one of"),
                          (BadOp, ValueError, "op_name must be one of")]:
        with pytest.raises(err, match=msg):
            register_mixer("bad_contract_kind")(cls)
    assert "bad_contract_kind" not in registry.registered()


def test_parallel_names_no_mixer_class_and_no_private_mixer_method():
    registry.load_builtin_mixers()
    names = {cls.__name__ for cls in registry.registered().values()}
    names |= {base.__name__ for cls in registry.registered().values() for base in cls.__mro__
              if base.__module__.startswith("ttt_lm.model.mixers.") and base is not Mixer}
    for path in sorted(PARALLEL.glob("*.py")):
        src = path.read_text()
        for name in names:
            assert not re.search(rf"\b{name}\b", src), f"{path.name} names the mixer class {name}"
        assert not re.search(r"ttt_lm\.model\.mixers\.(?!base\b)", src), f"{path.name} imports a mixer module"
        hits = re.findall(r"\b(?:mixer|mx|m)\._[a-z]\w*", src)
        assert not hits, f"{path.name} calls private mixer members {hits}"
