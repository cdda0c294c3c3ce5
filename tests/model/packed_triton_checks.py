"""What the packed-document tests of the Triton forms share: one batch of packed rows, the run of a
mixer's forward and backward on one backend, and the check of the Triton form with documents
against the PyTorch chunked form with them (tests/model/test_varlen_triton_mixers.py,
tests/model/test_titans_packed_triton.py)."""
from __future__ import annotations

from typing import Optional

import torch

from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.mixers.base import Mixer

#: two rows of 24 tokens: documents of 1 and 2 tokens (shorter than a conv of width 4 and a chunk
#: of 4), others of 17 and 18 (across chunk boundaries, the delta-rule kernels' chunk of 16
#: included); the first row starts in mid-document (positions 3, 4, ... as the loader cuts rows
#: out of the stream)
ROW_LENS = [[5, 1, 18], [2, 17, 5]]
FIRST_POS = [3, 0]
#: the batch flattened to one row: its documents' cumulative lengths
CU_SEQLENS = [0, 5, 6, 24, 26, 43, 48]
#: the compiled kernels where CUDA is present, else the interpreter on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def positions() -> torch.Tensor:
    rows = []
    for lens, p0 in zip(ROW_LENS, FIRST_POS):
        pos = torch.cat([torch.arange(n) for n in lens])
        pos[:lens[0]] += p0
        rows.append(pos)
    return torch.stack(rows).to(DEV)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def run_backend(m, backend, x, w, docs):
    """Forward with ``docs`` on ``backend`` (which the mixer must resolve to), backward of
    Σ y·w: (y, x's gradient, every parameter's gradient)."""
    m.kernel_backend = backend
    assert m.resolve_backend(x.device, x.dtype) == backend
    m.zero_grad(set_to_none=True)
    x.grad = None
    y, st = m(x, docs=docs)
    assert st is None
    (y * w).sum().backward()
    return y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def refuse_padded(monkeypatch) -> None:
    """The padded view (one document per row) fails if any form takes it."""
    def refuse(*a, **k):
        raise AssertionError("padded view used")
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(refuse))
    monkeypatch.setattr(DocLayout, "pad", refuse)


def inputs(m):
    """The layout of ``positions()`` and x, w [B, T, d_model] (x requiring its gradient)."""
    pos = positions()
    docs = DocLayout.build(pos)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*pos.shape, m.d_model, generator=g).to(DEV).requires_grad_()
    w = torch.randn(*pos.shape, m.d_model, generator=g).to(DEV)
    return docs, x, w


def errors(got, want) -> dict:
    """Relative errors of the output, x's gradient and every parameter's gradient."""
    assert got[2].keys() == want[2].keys()
    errs = {"output": rel(got[0], want[0]), "x": rel(got[1], want[1])}
    errs.update({n: rel(got[2][n], want[2][n]) for n in want[2]})
    return errs


def check_triton_docs(m, calls, tol: float, time_dim: Optional[int] = 2, want_cu=CU_SEQLENS, want_T: int = 48) -> dict:
    """The Triton form with documents against the PyTorch chunked form with them, each error
    within ``tol``; the op (``calls``: (its first input's shape, cu_seqlens) per call) called once
    for the forward, on the batch flattened to one row of ``want_T`` tokens (``time_dim``: the
    op's time axis; None: any axis but the first) with ``want_cu``; without the documents the output differs. Returns the errors."""
    docs, x, w = inputs(m)
    want = run_backend(m, Backend.TORCH, x, w, docs)
    assert not calls
    got = run_backend(m, Backend.TRITON, x, w, docs)
    assert len(calls) == 1, f"{len(calls)} calls of the Triton op for one layer forward"
    shape, cu = calls[0]
    if time_dim is None:   # the op's time axis: whichever holds the want_T tokens
        assert shape[0] == 1 and want_T in shape[1:], shape
    else:
        assert shape[0] == 1 and shape[time_dim] == want_T, shape
    assert cu is not None and cu.dtype == torch.int32
    assert cu.tolist() == want_cu
    errs = errors(got, want)
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= tol}
    assert not bad, f"rel err above {tol}: {bad}"
    # the documents matter: without them the later documents read the earlier ones
    with torch.no_grad():
        plain, _ = m(x)
    assert (plain - got[0]).abs().max() > 1e-3
    return errs
