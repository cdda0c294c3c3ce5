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
from tests.model.mixer_checks import make_mixer
from tests.model.packed_triton_checks import (DEV, check_triton_docs, errors, inputs, positions, refuse_padded,
                                             run_backend)

CHUNK = 4
TOL = 1e-4


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


def _spy_and_refuse_padded(monkeypatch):
    """Record (q's shape, cu_seqlens) of each call of the memory's Triton op; the padded view (one
    document per row) fails."""
    real = tchunk.titans_linear_triton
    calls = []

    def spy(*args, **kw):
        calls.append((tuple(args[0].shape), kw.get("cu_seqlens", args[10] if len(args) > 10 else None)))
        return real(*args, **kw)
    monkeypatch.setattr(tchunk, "titans_linear_triton", spy)
    refuse_padded(monkeypatch)
    return calls


def _check(m, calls, want_cu, want_T):
    """``check_triton_docs`` on the memory's op: [1, 2 heads, want_T, 16]."""
    errs = check_triton_docs(m, calls, TOL, want_cu=want_cu, want_T=want_T)
    assert calls[0][0] == (1, 2, want_T, 16), calls[0][0]
    return errs


def test_titans_memory_triton_docs_one_varlen_call(monkeypatch):
    """The LMM alone: one varlen call over [1, H, B·T], cu_seqlens the packed documents'."""
    calls = _spy_and_refuse_padded(monkeypatch)
    m = _mixer("titans")
    errs = _check(m, calls, [0, 5, 6, 24, 26, 43, 48], 48)
    assert "M_init.0" in errs     # the initial memory's gradient (summed over the documents) checked


def test_titans_triton_docs_refuse_a_state():
    """Every document starts from the initial memory: a carried state, or asking for the final one,
    is a clear error, not a silently wrong result; so are cu_seqlens on another backend."""
    m = _mixer("titans")
    m.kernel_backend = "triton"
    docs = DocLayout.build(positions())
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
    _check(m, calls, [0, 5, 6, 24, 26, 43, 48], 48)


@pytest.mark.slow
def test_titans_mal_triton_docs_one_varlen_call(monkeypatch):
    """MAL: the persistent tokens (2) before every document, then the memory through one varlen
    call over the rows so laid out (each document 2 tokens longer, its chunks counted from its
    first persistent token) and the attention with its document mask (window 5)."""
    calls = _spy_and_refuse_padded(monkeypatch)
    m = _mixer("titans_mal", window=5, persistent_tokens=2)
    errs = _check(m, calls, [0, 7, 10, 30, 34, 53, 60], 60)
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
    docs, x, w = inputs(m)
    al = docs.balanced(CHUNK)
    want = run_backend(m, Backend.TORCH, x, w, docs)
    assert not calls
    got = run_backend(m, Backend.TRITON, x, w, docs)
    assert len(calls) == al.length // 2
    assert all(shape == (al.rows, 2, 2, 16) and cu is None for shape, cu in calls)
    bad = {n: f"{e:.2e}" for n, e in errors(got, want).items() if not e <= TOL}
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
