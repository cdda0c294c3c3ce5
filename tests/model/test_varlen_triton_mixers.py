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

from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.mixers.base import Mixer
from tests.model.mixer_checks import make_mixer

# two rows of 24 tokens: documents shorter than the convolution (width 4: lengths 1, 2), than the
# PyTorch chunk (4) and the Mamba kernel's tile (4), and longer than the delta-rule kernels'
# chunk of 16 (17, 18: they cross a kernel chunk boundary); the first row starts in mid-document
# (positions 3, 4, ... as the loader cuts rows out of the stream)
ROW_LENS = [[5, 1, 18], [2, 17, 5]]
FIRST_POS = [3, 0]
TOL = 1e-4
#: the compiled kernels where CUDA is present, else the interpreter on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _positions():
    rows = []
    for lens, p0 in zip(ROW_LENS, FIRST_POS):
        pos = torch.cat([torch.arange(n) for n in lens])
        pos[:lens[0]] += p0
        rows.append(pos)
    return torch.stack(rows).to(DEV)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _run(m, backend, x, w, docs):
    m.kernel_backend = backend
    assert m.resolve_backend(x.device, x.dtype) == backend
    m.zero_grad(set_to_none=True)
    x.grad = None
    y, st = m(x, docs=docs)
    assert st is None
    (y * w).sum().backward()
    return y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


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


def _refuse_padded(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("padded view used")
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(refuse))


def check_triton_docs(m, calls, time_dim):
    """The Triton form with documents against the PyTorch chunked form with them; the op called
    once (a forward) with the batch flattened to one row (``time_dim``: the op's time axis) and
    the layout's ``cu_seqlens``."""
    pos = _positions()
    docs = DocLayout.build(pos)
    B, T = pos.shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, m.d_model, generator=g).to(DEV).requires_grad_()
    w = torch.randn(B, T, m.d_model, generator=g).to(DEV)
    want = _run(m, Backend.TORCH, x, w, docs)
    assert not calls
    got = _run(m, Backend.TRITON, x, w, docs)
    assert len(calls) == 1, f"{len(calls)} calls of the Triton op for one layer forward"
    shape, cu = calls[0]
    assert shape[0] == 1 and shape[time_dim] == B * T, shape
    assert cu is not None and cu.dtype == torch.int32
    assert cu.tolist() == [0, 5, 6, 24, 26, 43, 48]
    assert rel(got[0], want[0]) <= TOL, f"output rel err {rel(got[0], want[0]):.2e}"
    assert rel(got[1], want[1]) <= TOL, f"grad of x rel err {rel(got[1], want[1]):.2e}"
    assert got[2].keys() == want[2].keys()
    for n in want[2]:
        assert rel(got[2][n], want[2][n]) <= TOL, f"grad of {n} rel err {rel(got[2][n], want[2][n]):.2e}"
    # the documents matter: without them the later documents read the earlier ones
    with torch.no_grad():
        plain, _ = m(x)
    assert (plain - got[0]).abs().max() > 1e-3


def test_deltanet_triton_docs_one_varlen_call(monkeypatch):
    import kernels.delta_rule as dr
    _refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, dr, "delta_rule_triton")
    m, _ = make_mixer("deltanet", dtype=torch.float32, deltanet={"chunk_size": 4})
    check_triton_docs(m.to(DEV), calls, time_dim=2)


@pytest.mark.slow
def test_gated_deltanet_triton_docs_one_varlen_call(monkeypatch):
    import kernels.gated_delta_rule as gdr
    _refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, gdr, "gated_delta_rule_triton")
    m, _ = make_mixer("gated_deltanet", dtype=torch.float32, gated_deltanet={"chunk_size": 4})
    check_triton_docs(m.to(DEV), calls, time_dim=2)


@pytest.mark.slow
def test_mamba_triton_docs_one_varlen_call(monkeypatch):
    import kernels.selective_scan.chunk as ssc
    _refuse_padded(monkeypatch)
    calls = _spy(monkeypatch, ssc, "selective_scan_triton")
    # d_inner = 16, d_state = 4: the interpreter's time grows with the channels
    m, _ = make_mixer("mamba", dtype=torch.float32, d_model=8, mamba={"chunk_size": 4, "d_state": 4})
    check_triton_docs(m.to(DEV), calls, time_dim=1)


@pytest.mark.parametrize("kind", ["deltanet", "gated_deltanet", "mamba"])
def test_triton_docs_refuse_a_state(kind):
    """The varlen path starts every document from the zero state: an initial state, or asking for
    the final one, is a clear error, not a silently wrong result."""
    m, _ = make_mixer(kind, dtype=torch.float32, d_model=8)
    m = m.to(DEV)
    m.kernel_backend = "triton"
    docs = DocLayout.build(_positions())
    x = torch.randn(*docs.shape, m.d_model, device=DEV)
    with pytest.raises(ValueError, match="packed documents .* no initial state"):
        m.chunked(x, m.init_state(2, device=DEV, dtype=torch.float32), docs=docs)
    with pytest.raises(ValueError, match="packed documents .* no initial state"):
        m.chunked(x, None, True, docs=docs)
