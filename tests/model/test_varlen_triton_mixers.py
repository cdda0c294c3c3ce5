"""Packed documents through the Triton kernels' variable-length path: DeltaNet, Gated DeltaNet and
Mamba with ``kernel_backend="triton"`` and a ``DocLayout`` flatten the batch to one row and call
their op once per layer forward with ``cu_seqlens`` (never the padded view, one document per row),
and equal the PyTorch chunked form with the same documents (resets inside its scan; tested against
each document alone in test_packed_docs.py): outputs, the input's gradient and every parameter's.

The kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1, tests/conftest.py),
compiled where CUDA is present (not run there yet). float32: the two forms sum in different orders
(kernel chunks of 16 from each document start against chunks of 4 in the packed rows, and a masked
scan), so they agree to rounding: at most 5.4e-6 of the largest value of a tensor here (Gated
DeltaNet's parameter gradients; DeltaNet 4e-7, Mamba 4e-7); the bound, 1e-4 relative to the largest
value of each tensor, leaves room for other BLAS builds and still catches a document that reads its
predecessor or a wrong flattening order (errors of O(1)). Each test takes 5-10 s under the
interpreter on one core.
"""
import pytest
import torch

from ttt_lm.model.docs import DocLayout
from tests.model.mixer_checks import make_mixer
from tests.model.packed_triton_checks import DEV, check_triton_docs, positions, refuse_padded

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


def test_deltanet_triton_docs_one_varlen_call(monkeypatch):
    import kernels.delta_rule as dr
    refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, dr, "delta_rule_triton")
    m, _ = make_mixer("deltanet", dtype=torch.float32, deltanet={"chunk_size": 4})
    check_triton_docs(m.to(DEV), calls, TOL, time_dim=2)


@pytest.mark.slow
def test_gated_deltanet_triton_docs_one_varlen_call(monkeypatch):
    import kernels.gated_delta_rule as gdr
    refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, gdr, "gated_delta_rule_triton")
    m, _ = make_mixer("gated_deltanet", dtype=torch.float32, gated_deltanet={"chunk_size": 4})
    check_triton_docs(m.to(DEV), calls, TOL, time_dim=2)


@pytest.mark.slow
def test_mamba_triton_docs_one_varlen_call(monkeypatch):
    import kernels.selective_scan.chunk as ssc
    refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, ssc, "selective_scan_triton")
    # d_inner = 16, d_state = 4: the interpreter's time grows with the channels
    m, _ = make_mixer("mamba", dtype=torch.float32, d_model=8, mamba={"chunk_size": 4, "d_state": 4})
    check_triton_docs(m.to(DEV), calls, TOL, time_dim=1)


@pytest.mark.parametrize("kind", ["deltanet", "gated_deltanet", "mamba"])
def test_triton_docs_refuse_a_state(kind):
    """The varlen path starts every document from the zero state: an initial state, or asking for
    the final one, is a clear error, not a silently wrong result."""
    m, _ = make_mixer(kind, dtype=torch.float32, d_model=8)
    m = m.to(DEV)
    m.kernel_backend = "triton"
    docs = DocLayout.build(positions())
    x = torch.randn(*docs.shape, m.d_model, device=DEV)
    with pytest.raises(ValueError, match="packed documents .* no initial state"):
        m.chunked(x, m.init_state(2, device=DEV, dtype=torch.float32), docs=docs)
    with pytest.raises(ValueError, match="packed documents .* no initial state"):
        m.chunked(x, None, True, docs=docs)
