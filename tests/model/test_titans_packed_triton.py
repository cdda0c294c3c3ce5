"""Titans over packed documents on the Triton backend: the LMM's linear memory (kind "titans"),
and the variants that run it over the packed rows (MAG, MAL), flatten the batch to one row and
call the memory's Triton kernel once per layer forward with ``cu_seqlens`` (never the padded view,
one document per row): every document from the initial memory M_init with zero surprise, its
chunks counted from its own first token and its conv restarted at its start. Outputs, the input's
gradient and every parameter's equal the PyTorch chunked form with the same documents (chunk-aligned
rows with restarts inside the scan; tested against each document alone in test_packed_docs.py).
MAC cannot hand the memory its documents in one call (each segment's memory input depends on
the memory's retrieval): its block scan's Triton form is held equal to the PyTorch one.

The kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1, tests/conftest.py),
compiled where CUDA is present, where tl.dot needs 16-wide blocks: head_dim 16. float32; the
kernel (chunks in tiles of 16 rows, TF32×3 products on a GPU) and the PyTorch chunked form sum in
different orders, so they agree to rounding: TOL, 1e-4 of the largest value of each tensor, leaves
room for other BLAS builds and still catches a document that reads its predecessor, a chunk
counted from the row's start instead of the document's, or a wrong flattening order (errors of
O(1)). Measured (interpreter, CPU) for LMM, MAG and MAL: outputs ≤ 4.5e-7, the input's gradient
≤ 7.1e-7, parameter gradients ≤ 1.7e-6 (the gate projections'); MAC's in its test. Each packed
test takes 5-11 s under the interpreter on one core. The interpreter may warn of overflow in a multiply: the kernel's spare chunk slots
(past the last document's chunks) compute on unwritten buffers, and every store of theirs is
masked, so no result reads them.
"""
import pytest
import torch

import kernels.titans.chunk as tchunk
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.mixers.base import Mixer
from tests.model.mixer_checks import make_mixer

# two rows of 24 tokens, chunk_size 4, conv width 4: documents shorter than the conv and the chunk
# (lengths 1, 2), others across several chunk boundaries (17, 18, 5); the first row starts in
# mid-document (positions 3, 4, ... as the loader cuts rows out of the stream)
ROW_LENS = [[5, 1, 18], [2, 17, 5]]
FIRST_POS = [3, 0]
CHUNK = 4
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


def _mixer(kind, **titans):
    """A float32 mixer of two heads of 16 with a non-zero initial memory (so that a document
    starting from zero memory, or from its predecessor's, shows) and faster gates than at init."""
    m, _ = make_mixer(kind, dtype=torch.float32, d_model=32, n_heads=2,
                      titans={"chunk_size": CHUNK, "conv_width": 4, **titans})
    mem = m if kind == "titans" else m.memory
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        mem.M_init[0].copy_(0.3 * torch.randn(mem.M_init[0].shape, generator=g))
        mem.theta_proj.bias.fill_(0.0)     # θ ≈ 0.5: large inner steps
        mem.alpha_proj.bias.fill_(-2.0)    # α ≈ 0.12: visible forgetting
    return m.to(DEV)


def _run(m, backend, x, w, docs):
    m.kernel_backend = backend
    assert m.resolve_backend(x.device, x.dtype) == backend
    m.zero_grad(set_to_none=True)
    x.grad = None
    y, st = m(x, docs=docs)
    assert st is None
    (y * w).sum().backward()
    return y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _spy_and_refuse_padded(monkeypatch):
    """Record (q's shape, cu_seqlens) of each call of the memory's Triton op; the padded view (one
    document per row) fails."""
    real = tchunk.titans_linear_triton
    calls = []

    def spy(*args, **kw):
        calls.append((tuple(args[0].shape), kw.get("cu_seqlens", args[10] if len(args) > 10 else None)))
        return real(*args, **kw)

    def refuse(*a, **k):
        raise AssertionError("padded view used")
    monkeypatch.setattr(tchunk, "titans_linear_triton", spy)
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(refuse))
    monkeypatch.setattr(DocLayout, "pad", refuse)
    return calls


def check_triton_docs(m, calls, want_cu, want_T):
    """The Triton form with documents against the PyTorch chunked form with them; the op called
    once (a forward) on the batch flattened to one row of ``want_T`` tokens with ``want_cu``."""
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
    assert shape == (1, 2, want_T, 16), shape
    assert cu is not None and cu.dtype == torch.int32
    assert cu.tolist() == want_cu
    errs = {"output": rel(got[0], want[0]), "x": rel(got[1], want[1])}
    assert got[2].keys() == want[2].keys()
    errs.update({n: rel(got[2][n], want[2][n]) for n in want[2]})
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= TOL}
    assert not bad, f"rel err above {TOL}: {bad}"
    # the documents matter: without them the later documents read the earlier ones
    with torch.no_grad():
        plain, _ = m(x)
    assert (plain - got[0]).abs().max() > 1e-3
    return errs


def test_titans_memory_triton_docs_one_varlen_call(monkeypatch):
    """The LMM alone: one varlen call over [1, H, B·T], cu_seqlens the packed documents'."""
    calls = _spy_and_refuse_padded(monkeypatch)
    m = _mixer("titans")
    errs = check_triton_docs(m, calls, [0, 5, 6, 24, 26, 43, 48], 48)
    assert "M_init.0" in errs     # the initial memory's gradient (summed over the documents) checked


def test_titans_triton_docs_refuse_a_state():
    """Every document starts from the initial memory: a carried state, or asking for the final one,
    is a clear error, not a silently wrong result; so are cu_seqlens on another backend."""
    m = _mixer("titans")
    m.kernel_backend = "triton"
    docs = DocLayout.build(_positions())
    x = torch.randn(*docs.shape, m.d_model, device=DEV)
    with pytest.raises(ValueError, match="packed documents .* no state"):
        m.chunked(x, m.init_state(2, device=DEV, dtype=torch.float32), docs=docs)
    with pytest.raises(ValueError, match="packed documents .* no state"):
        m.chunked(x, None, True, docs=docs)
    inp, _ = m.inputs(x, doc_offset=docs.offset)
    inp["cu_seqlens"] = docs.cu_seqlens
    st = m.init_state(2, device=DEV, dtype=torch.float32)
    with pytest.raises(ValueError, match="no initial state"):
        m.op(inp, (st.M, st.S, st.Mh), False, Backend.TRITON)
    with pytest.raises(ValueError, match="linear memory's Triton kernel"):
        m.op(inp, None, False, Backend.TORCH)


@pytest.mark.slow
def test_titans_mag_triton_docs_one_varlen_call(monkeypatch):
    """MAG: the attention branch with its document mask (window 5), the memory branch through one
    varlen call over the packed rows, the gate per token."""
    calls = _spy_and_refuse_padded(monkeypatch)
    m = _mixer("titans_mag", window=5)
    check_triton_docs(m, calls, [0, 5, 6, 24, 26, 43, 48], 48)


@pytest.mark.slow
def test_titans_mal_triton_docs_one_varlen_call(monkeypatch):
    """MAL: the persistent tokens (2) before every document, then the memory through one varlen
    call over the rows so laid out (each document 2 tokens longer, its chunks counted from its
    first persistent token) and the attention with its document mask (window 5)."""
    calls = _spy_and_refuse_padded(monkeypatch)
    m = _mixer("titans_mal", window=5, persistent_tokens=2)
    errs = check_triton_docs(m, calls, [0, 7, 10, 30, 34, 53, 60], 60)
    assert "persistent" in errs


@pytest.mark.slow
def test_titans_mac_triton_docs_block_scan(monkeypatch):
    """MAC: the block scan over the balanced rows (blocks of gcd(chunk 4, segment 6) = 2 tokens)
    calls the memory's op once per block with its carried state, on Triton as on PyTorch (the
    kernel where a block starts a chunk, the PyTorch chunk form inside one), never the padded
    view nor ``cu_seqlens`` (each segment's memory input depends on the memory's retrieval, so the
    memory cannot take the documents in one call); equal to the PyTorch form with documents.
    Measured: output 7e-7, the input's gradient 4e-6, parameter gradients ≤ 1e-5."""
    calls = _spy_and_refuse_padded(monkeypatch)
    m = _mixer("titans_mac", segment_len=6, persistent_tokens=2)
    pos = _positions()
    docs = DocLayout.build(pos)
    al = docs.balanced(CHUNK)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*pos.shape, m.d_model, generator=g).to(DEV).requires_grad_()
    w = torch.randn(*pos.shape, m.d_model, generator=g).to(DEV)
    want = _run(m, Backend.TORCH, x, w, docs)
    assert not calls
    got = _run(m, Backend.TRITON, x, w, docs)
    assert len(calls) == al.length // 2
    assert all(shape == (al.rows, 2, 2, 16) and cu is None for shape, cu in calls)
    errs = {"output": rel(got[0], want[0]), "x": rel(got[1], want[1])}
    errs.update({n: rel(got[2][n], want[2][n]) for n in want[2]})
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= TOL}
    assert not bad, f"rel err above {TOL}: {bad}"


@pytest.mark.parametrize("kind", ["titans", "titans_mag", "titans_mal", "titans_mac"])
def test_triton_backend_follows_the_memory(kind):
    """The variants run the memory's kernel, so they resolve as the memory does: Triton on CUDA for
    the linear memory (``model.kernel_backend=triton`` accepted), and the MLP memory refused under
    triton with the memory's reason."""
    m = _mixer(kind)
    m.kernel_backend = "auto"
    assert m.resolve_backend("cuda") == Backend.TRITON
    m.kernel_backend = "triton"
    assert m.resolve_backend("cuda") == Backend.TRITON
    mlp, _ = make_mixer(kind, dtype=torch.float32, d_model=32, n_heads=2, titans={"memory": "mlp"})
    mlp.kernel_backend = "auto"
    assert mlp.resolve_backend("cuda") == Backend.TORCH
    mlp.kernel_backend = "triton"
    with pytest.raises(ValueError, match="only for the linear memory"):
        mlp.resolve_backend("cuda")
