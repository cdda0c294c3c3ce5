"""Packed documents: with ``model.reset_at_doc_boundaries`` every layer kind of the registry runs a
batch of packed rows in one mixer call per layer, and each document's outputs and gradients equal
those of the document run alone. fp32; the tolerance (2e-4 relative to the largest value) covers
the different summation order of a batch of padded documents or a masked scan against a lone
document. Each kind's own checks of its packed form (its variants, its backends) are in its own
test file; these run over ``builtin_kinds()`` with the tiny sizes every section declares
(``tests/model/packed_checks.tiny``)."""
import pytest
import torch

from ttt_lm.model.docs import DocLayout, doc_conv
from ttt_lm.model.layers import CausalConv1d
from ttt_lm.model.registry import builtin_kinds, kinds_with
from tests.model.packed_checks import ROW_LENS, V, packed_batch, refuse_padded_view, rel, tiny

KINDS = list(builtin_kinds())
#: the kinds whose forms restart inside the packed rows themselves (``handles_docs``)
NATIVE = list(kinds_with(lambda c: c.handles_docs, KINDS))


@pytest.mark.parametrize("kind", KINDS)
def test_packed_equals_each_document_alone(kind):
    m = tiny(kind)
    docs, ids, pos = packed_batch(ROW_LENS)
    w = torch.randn(ids.shape[0], ids.shape[1], V, generator=torch.Generator().manual_seed(1))

    calls = []
    hooks = [b.mixer.register_forward_hook(lambda mod, a, o: calls.append(mod)) for b in m.layers]
    packed = m(ids, position_ids=pos).logits
    for h in hooks:
        h.remove()
    assert len(calls) == m.cfg.n_layers, f"{kind}: {len(calls)} mixer calls for {m.cfg.n_layers} layers"
    (packed * w).sum().backward()
    g_packed = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()

    alone = torch.cat([torch.cat([m(d).logits for d in row], 1) for row in docs])
    (alone * w).sum().backward()
    assert rel(packed.detach(), alone.detach()) <= 2e-4, f"{kind}: logits rel err {rel(packed.detach(), alone.detach()):.2e}"
    for n, p in m.named_parameters():
        if p.grad is None:
            assert n not in g_packed
            continue
        assert rel(g_packed[n], p.grad) <= 2e-4, f"{kind}: grad of {n} rel err {rel(g_packed[n], p.grad):.2e}"
    # without document starts the later documents read the earlier ones
    with torch.no_grad():
        plain = m(ids).logits
    assert (plain[:, 5:] - alone[:, 5:]).abs().max() > 1e-5


@pytest.mark.parametrize("kind", NATIVE)
def test_cpu_path_resets_inside_the_packed_rows(kind, monkeypatch):
    """On the PyTorch path these kinds never fall back to the padded view (one document per row):
    resets are masks in their scans (TTT and Titans: restarts at the chunks of the chunk-aligned
    rows; LaCT: its documents longer than a chunk restart in the chunk-aligned rows), attention a
    document mask."""
    refuse_padded_view(monkeypatch)
    m = tiny(kind, kernel_backend="torch")
    docs, ids, pos = packed_batch(ROW_LENS)
    with torch.no_grad():
        packed = m(ids, position_ids=pos).logits
        alone = torch.cat([torch.cat([m(d).logits for d in row], 1) for row in docs])
    assert rel(packed, alone) <= 2e-4


@pytest.mark.parametrize("kind", KINDS)
def test_reference_forms_take_documents(kind):
    """impl="reference" (the sequential forms) follows the same contract."""
    m = tiny(kind).set_impl("reference")
    docs, ids, pos = packed_batch(ROW_LENS)
    with torch.no_grad():
        packed = m(ids, position_ids=pos).logits
        alone = torch.cat([torch.cat([m(d).logits for d in row], 1) for row in docs])
    assert rel(packed, alone) <= 2e-4, kind


@pytest.mark.parametrize("kind", KINDS)
def test_row_starting_inside_a_document(kind):
    """A row whose first position is not 0 (the loader cuts rows out of the packed stream) starts
    from a fresh state there: the same as the piece alone."""
    m = tiny(kind)
    _, ids, _ = packed_batch([[10, 14]])
    pos = torch.cat([torch.arange(7, 17), torch.arange(14)])[None]
    with torch.no_grad():
        packed = m(ids, position_ids=pos).logits
        alone = torch.cat([m(ids[:, :10]).logits, m(ids[:, 10:]).logits], 1)
    assert rel(packed, alone) <= 2e-4


def test_layout_views():
    pos = torch.tensor([[3, 4, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]])
    d = DocLayout.build(pos)
    assert (d.n_docs, d.max_len) == (6, 4) and d.inner_starts
    assert d.cu_seqlens.tolist() == [0, 2, 5, 6, 10, 11, 12]
    assert d.seg.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 2]]
    x = torch.arange(12.0).view(2, 6, 1)
    p = d.pad(x)
    assert p[:, :, 0].tolist() == [[0, 1, 0, 0], [2, 3, 4, 0], [5, 0, 0, 0], [6, 7, 8, 9], [10, 0, 0, 0],
                                   [11, 0, 0, 0]]
    assert torch.equal(d.unpad(p), x)
    assert not DocLayout.build(torch.arange(5)[None] + 2).inner_starts


def test_aligned_view():
    pos = torch.tensor([[3, 4, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0]])
    al = DocLayout.build(pos).aligned(4)
    # row 0: [2 | 3 | 1] → 4 + 4 + 4; row 1: [5 | 1] → 8 + 4
    assert al.length == 12 and al.resets.tolist() == [[True, True, True], [True, False, True]]
    x = torch.arange(1.0, 13.0).view(2, 6, 1)
    p = al.pad(x)
    assert p[:, :, 0].tolist() == [[1, 2, 0, 0, 3, 4, 5, 0, 6, 0, 0, 0], [7, 8, 9, 10, 11, 0, 0, 0, 12, 0, 0, 0]]
    assert torch.equal(al.unpad(p), x)
    assert al.offset[0, :6].tolist() == [0, 1, al.offset[0, 2].item(), al.offset[0, 3].item(), 0, 1]
    assert al.offset[0, 2] > 4
    # only the documents longer than 2 tokens: row 0 keeps [3], row 1 [5]
    lo = DocLayout.build(pos).aligned(4, longer_than=2)
    assert lo.length == 8 and lo.resets.tolist() == [[True, False], [True, False]]
    assert lo.kept.tolist() == [[False, False, True, True, True, False], [True] * 5 + [False]]
    p = lo.pad(x)
    assert p[:, :, 0].tolist() == [[3, 4, 5, 0, 0, 0, 0, 0], [7, 8, 9, 10, 11, 0, 0, 0]]
    assert lo.unpad(p)[:, :, 0].tolist() == [[0, 0, 3, 4, 5, 0], [7, 8, 9, 10, 11, 0]]
    assert DocLayout.build(pos).aligned(4, longer_than=5).length == 0


def test_balanced_view():
    pos = torch.tensor([[3, 4, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0]])
    al = DocLayout.build(pos).balanced(4)
    # documents of 2, 3, 1, 5, 1 tokens take 4, 4, 4, 8, 4 slots: 24 / 8 → 3 rows, the longest
    # first, each into the emptiest row: [5] [2, 1] [3, 1]
    assert (al.rows, al.length, al.packed_shape) == (3, 8, (2, 6))
    assert al.resets.tolist() == [[True, False], [True, True], [True, True]]
    x = torch.arange(1.0, 13.0).view(2, 6, 1)
    p = al.pad(x)
    assert p[:, :, 0].tolist() == [[7, 8, 9, 10, 11, 0, 0, 0], [1, 2, 0, 0, 6, 0, 0, 0], [3, 4, 5, 0, 12, 0, 0, 0]]
    assert torch.equal(al.unpad(p), x)
    assert al.offset[0, :5].tolist() == [0, 1, 2, 3, 4] and al.offset[0, 5] > 8


def test_prefixed_view():
    pos = torch.tensor([[3, 4, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0]])
    pre = DocLayout.build(pos).prefixed(2)
    # row 0: [p p 2 | p p 3 | p p 1] → 12 slots; row 1: [p p 5 | p p 1] → 10, then 2 of padding
    L = pre.layout
    assert L.shape == (2, 12) and L.n_docs == 5 and L.max_len == 7
    x = torch.arange(1.0, 13.0).view(2, 6, 1)
    prefix = torch.tensor([[-1.0], [-2.0]])
    p = pre.pad(x, prefix)
    assert p[:, :, 0].tolist() == [[-1, -2, 1, 2, -1, -2, 3, 4, 5, -1, -2, 6],
                                   [-1, -2, 7, 8, 9, 10, 11, -1, -2, 12, 0, 0]]
    assert L.offset.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]
    assert torch.equal(pre.unpad(p), x)
    assert DocLayout.build(pos).prefixed(0).layout.shape == (2, 6)


def test_doc_conv_equals_conv_of_each_document():
    torch.manual_seed(0)
    conv = CausalConv1d(3, 4)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 0, 1, 0, 1, 2]])
    x = torch.randn(1, 11, 3)
    y = doc_conv(conv, x, DocLayout.build(pos))
    ref = torch.cat([conv(x[:, a:b])[0] for a, b in [(0, 5), (5, 6), (6, 8), (8, 11)]], 1)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("pos, where", [
    ([[0, 1, 2, 0, 1], [-1, 0, 1, 2, 3]], "row 1, position 0"),
    ([[0, 1, 2, 0, 1], [0, 1, 3, 4, 5]], "row 1, position 2"),
    ([[0, 1, 1, 0, 1], [0, 1, 2, 3, 4]], "row 0, position 2"),
    ([[0, 1, 2, 5, 6], [0, 1, 2, 3, 4]], "row 0, position 3"),
])
def test_bad_positions_name_row_and_position(pos, where):
    m = tiny()   # the LM checks the positions before any layer: the default pattern
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=where):
        m(ids, position_ids=torch.tensor(pos))
    m.cfg.reset_at_doc_boundaries = False     # checked whether or not the model resets
    with pytest.raises(ValueError, match=where):
        m(ids, position_ids=torch.tensor(pos))


def test_position_shape_must_match():
    m = tiny()
    with pytest.raises(ValueError, match=r"position_ids must be \[B, T\]"):
        m(torch.zeros(2, 5, dtype=torch.long), position_ids=torch.arange(5)[None])


def test_carried_states_refused_with_resets():
    m = tiny()
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="carried states"):
        m(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), output_states=True)
