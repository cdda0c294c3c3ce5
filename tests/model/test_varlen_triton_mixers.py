"""Packed documents through the Triton kernels' variable-length path: every kind that declares
``varlen_triton_op`` (its Triton entry) with ``kernel_backend="triton"`` and a ``DocLayout``
flattens the batch to one row and calls that entry once per layer forward with ``cu_seqlens``
(never the padded view, one document per row), and equals the PyTorch chunked form with the same
documents (resets inside its scan; tested against each document alone in test_packed_docs.py):
outputs, the input's gradient and every parameter's.

The kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1, tests/conftest.py),
compiled where CUDA is present (not run there yet). float32: the two forms sum in different orders
(kernel chunks of 16 from each document start against chunks of 4 in the packed rows, and a masked
scan), so they agree to rounding: at most 5.4e-6 of the largest value of a tensor here (Gated
DeltaNet's parameter gradients; DeltaNet 4e-7, Mamba 4e-7); the bound, 1e-4 relative to the largest
value of each tensor, leaves room for other BLAS builds and still catches a document that reads its
predecessor or a wrong flattening order (errors of O(1)). Each test takes 5-10 s under the
interpreter on one core: the first such kind runs in the unit tier, the others in the slow one.
Sizes: each section's tiny ones (``short_config``, chunks of 4) at d_model 8 (the interpreter's
time grows with the channels; Mamba's d_inner is then 16).
"""
import importlib

import pytest
import torch

from ttt_lm.model.docs import DocLayout
from ttt_lm.model.registry import builtin_kinds, mixer_class, kinds_with
from tests.model.mixer_checks import make_mixer, short_config
from tests.model.packed_triton_checks import DEV, check_triton_docs, positions, refuse_padded

#: the kinds with a variable-length Triton path for packed documents
VARLEN = list(kinds_with(lambda c: c.varlen_triton_op is not None, builtin_kinds()))
#: the first in the unit tier, the others (5-10 s each under the interpreter) in the slow one
CASES = [pytest.param(k, marks=() if i == 0 else pytest.mark.slow) for i, k in enumerate(VARLEN)]
TOL = 1e-4


def _spy(monkeypatch, module, name):
    """Replace ``module.name`` (the Triton op) by a wrapper recording the batch size and
    ``cu_seqlens`` of each call."""
    real = getattr(module, name)
    calls = []

    def spy(*args, **kw):
        calls.append((args[0].shape, kw.get("cu_seqlens")))
        return real(*args, **kw)
    monkeypatch.setattr(module, name, spy)
    return calls


def _mixer(kind):
    """The kind's mixer at the tiny sizes its section declares (``short_config``), d_model 8."""
    cfg = short_config(kind, 4, vocab_size=64, d_model=8)
    sections = {n: vars(sec) for n, sec in cfg.sections().items()}
    m, _ = make_mixer(kind, dtype=torch.float32, d_model=8, **sections)
    return m.to(DEV)


@pytest.mark.parametrize("kind", CASES)
def test_triton_docs_one_varlen_call(kind, monkeypatch):
    module, name = mixer_class(kind).varlen_triton_op.split(":")
    refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, importlib.import_module(module), name)
    check_triton_docs(_mixer(kind), calls, TOL, time_dim=None)


def test_varlen_kinds_found():
    assert VARLEN, "no registered kind declares varlen_triton_op"


@pytest.mark.parametrize("kind", VARLEN)
def test_triton_docs_refuse_a_state(kind):
    """The varlen path starts every document from the zero state: an initial state, or asking for
    the final one, is a clear error, not a silently wrong result."""
    m = _mixer(kind)
    m.kernel_backend = "triton"
    docs = DocLayout.build(positions())
    x = torch.randn(*docs.shape, m.d_model, device=DEV)
    with pytest.raises(ValueError, match="packed documents .* no initial state"):
        m.chunked(x, m.init_state(2, device=DEV, dtype=torch.float32), docs=docs)
    with pytest.raises(ValueError, match="packed documents .* no initial state"):
        m.chunked(x, None, True, docs=docs)
