"""Packed documents: with ``model.reset_at_doc_boundaries`` every layer kind runs a batch of packed
rows in one mixer call per layer, and each document's outputs and gradients equal those of the
document run alone. fp32; the tolerance (2e-4 relative to the largest value) covers the different
summation order of a batch of padded documents or a masked scan against a lone document."""
import pytest
import torch

from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.docs import DocLayout, doc_conv
from ttt_lm.model.layers import CausalConv1d
from ttt_lm.model.registry import layer_kinds

KINDS = list(layer_kinds())
V = 53
# two rows of 24 tokens: documents shorter than a conv width (4) and a TTT mini-batch (4) included
ROW_LENS = [[5, 1, 9, 2, 7], [3, 12, 4, 1, 4]]


def tiny(kind, **kw) -> LM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=2, layer_pattern=[kind],
                      reset_at_doc_boundaries=True, **kw)
    cfg.attention.window = 5
    cfg.ttt.mini_batch_size = 4
    cfg.titans.chunk_size = 4
    cfg.titans.segment_len = 6
    cfg.deltanet.chunk_size = 4
    cfg.gated_deltanet.chunk_size = 4
    cfg.lact.chunk_size, cfg.lact.window, cfg.lact.num_heads = 4, 5, 2
    cfg.mamba.chunk_size = 4
    cfg.rglru.chunk_size = 4
    return LM(cfg)


def packed_batch(row_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, V, (1, n), generator=g) for n in lens] for lens in row_lens]
    ids = torch.cat([torch.cat(r, 1) for r in docs])
    pos = torch.cat([torch.cat([torch.arange(n) for n in lens])[None] for lens in row_lens])
    return docs, ids, pos


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


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


@pytest.mark.parametrize("kind", ["ttt_linear", "ttt_mlp"])
def test_ttt_mamba_backbone_restarts(kind):
    """TTT's block pre-conv and its shared-QK convolutions (the Mamba backbone) restart at
    document starts too, in the mini-batch-aligned PyTorch form; gradients included. float64: some
    gradients here (learnable_token_idx) are sums that cancel to ~1e-6, below fp32's resolution
    of a relative check, so exactness is checked at 1e-9 in double precision."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=1, layer_pattern=[kind],
                      reset_at_doc_boundaries=True)
    cfg.ttt.mini_batch_size = 4
    cfg.ttt.pre_conv = cfg.ttt.share_qk = cfg.ttt.use_gate = True
    m = LM(cfg).double()
    assert m.layers[0].pre_conv is not None and m.layers[0].mixer.share_qk
    _packed_equals_alone(m, 1e-9)



def _packed_equals_alone(m, tol):
    """The packed rows' logits and every parameter's gradient (of Σ logits²) equal those of each
    document run alone, within ``tol`` relative."""
    docs, ids, pos = packed_batch(ROW_LENS)
    packed = m(ids, position_ids=pos).logits
    packed.square().sum().backward()
    g = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    alone = torch.cat([torch.cat([m(d).logits for d in row], 1) for row in docs])
    alone.square().sum().backward()
    assert rel(packed.detach(), alone.detach()) <= tol
    for n, p in m.named_parameters():
        # a parameter the outputs do not reach (LaCT's W_lr when no chunk is written) has none either way
        assert (g[n] is None) == (p.grad is None), n
        if p.grad is not None:
            assert rel(g[n], p.grad) <= tol, n

NATIVE = ["attention", "local_attention", "rglru", "ttt_linear", "ttt_mlp", "deltanet", "gated_deltanet", "mamba",
          "titans", "titans_mag", "lact", "titans_mal", "titans_mac"]


@pytest.mark.parametrize("kind", NATIVE)
def test_cpu_path_resets_inside_the_packed_rows(kind, monkeypatch):
    """On the PyTorch path these kinds never fall back to the padded view (one document per row):
    resets are masks in their scans (TTT and Titans: restarts at the chunks of the chunk-aligned
    rows; LaCT: its documents longer than a chunk restart in the chunk-aligned rows), attention a
    document mask."""
    from ttt_lm.model.mixers.base import Mixer

    def refuse(*a, **k):
        raise AssertionError("padded view used")
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(refuse))
    m = tiny(kind, kernel_backend="torch")
    docs, ids, pos = packed_batch(ROW_LENS)
    with torch.no_grad():
        packed = m(ids, position_ids=pos).logits
        alone = torch.cat([torch.cat([m(d).logits for d in row], 1) for row in docs])
    assert rel(packed, alone) <= 2e-4


@pytest.mark.parametrize("kind", ["titans", "titans_mal", "titans_mac"])
def test_titans_mlp_memory_restarts(kind, monkeypatch):
    """Titans' MLP memory (its chunk loop in the mixer) restarts at chunk-aligned documents too
    (MAL: after the persistent tokens inserted before each document; MAC: in its block scan);
    gradients included."""
    from ttt_lm.model.mixers.base import Mixer
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(lambda *a, **k: (_ for _ in ()).throw(AssertionError)))
    m = tiny(kind, kernel_backend="torch")
    m.cfg.titans.memory = "mlp"
    m = LM(m.cfg)
    _packed_equals_alone(m, 2e-4)


@pytest.mark.parametrize("chunk", [2, 16])
def test_lact_long_and_short_documents(chunk, monkeypatch):
    """LaCT's packed rows with chunks of 2 (almost every document writes) and of 16 (no document
    of ROW_LENS is longer than a chunk: f_{W_init} alone, no aligned view); gradients included."""
    from ttt_lm.model.mixers.base import Mixer
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(lambda *a, **k: (_ for _ in ()).throw(AssertionError)))
    m = tiny("lact", kernel_backend="torch")
    m.cfg.lact.chunk_size = chunk
    m = LM(m.cfg)
    _packed_equals_alone(m, 2e-4)


@pytest.mark.parametrize("segment_len,chunk_size,backend,kv_heads,conv", [
    (8, 4, "sdpa", None, 4),     # segments a multiple of the chunk: blocks of a chunk
    (3, 4, "math", None, 4),     # segments shorter than a chunk: blocks of one token
    (6, 4, "sdpa", 1, 0),        # blocks of gcd = 2, grouped-query attention, no conv
])
def test_titans_mac_block_scan(segment_len, chunk_size, backend, kv_heads, conv, monkeypatch):
    """titans_mac's packed scan (blocks of gcd(chunk, segment) tokens, per-row restarts of the
    memory at document starts and of R at segment starts, the memory's conv reading the slots
    before each block) equals each document alone, gradients included, for segment lengths above,
    below and across the chunk size; documents of up to 12 tokens span up to 4 segments."""
    from ttt_lm.model.mixers.base import Mixer
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(lambda *a, **k: (_ for _ in ()).throw(AssertionError)))
    m = tiny("titans_mac", kernel_backend="torch")
    m.cfg.titans.segment_len, m.cfg.titans.chunk_size = segment_len, chunk_size
    m.cfg.attention.backend, m.cfg.attention.num_kv_heads = backend, kv_heads
    m.cfg.titans.conv_width = conv
    torch.manual_seed(0)
    m = LM(m.cfg)
    assert m.layers[0].mixer.attention_backend(torch.device("cpu"), torch.float32) == backend
    _packed_equals_alone(m, 2e-4)


@pytest.mark.parametrize("backend", ["sdpa", "math", pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["attention", "local_attention"])
def test_attention_document_mask_backends(kind, backend):
    # flex on CPU runs its unfused path, tens of seconds per case here: the slow tier
    """Each attention backend's document mask (SDPA's and math's boolean mask, flex's mask_mod)
    gives each document's own attention; window 5 with documents of up to 12 tokens."""
    m = tiny(kind)
    mix = m.layers[0].mixer
    mix.backend = backend
    assert mix.resolve_backend(torch.device("cpu"), torch.float32) == backend
    _, _, pos = packed_batch(ROW_LENS)
    x = torch.randn(2, pos.shape[1], 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = mix(x, docs=DocLayout.build(pos))[0]
        alone = []
        for b, lens in enumerate(ROW_LENS):
            starts = [0] + torch.tensor(lens).cumsum(0)[:-1].tolist()
            alone.append(torch.cat([mix(x[b:b + 1, a:a + n])[0] for a, n in zip(starts, lens)], 1))
    assert rel(packed, torch.cat(alone)) <= 2e-4


def test_reference_forms_take_documents():
    """impl="reference" (the sequential forms) follows the same contract."""
    for kind in ("attention", "local_attention", "rglru", "ttt_linear", "lact", "titans_mal"):
        m = tiny(kind).set_impl("reference")
        docs, ids, pos = packed_batch(ROW_LENS)
        with torch.no_grad():
            packed = m(ids, position_ids=pos).logits
            alone = torch.cat([torch.cat([m(d).logits for d in row], 1) for row in docs])
        assert rel(packed, alone) <= 2e-4, kind


@pytest.mark.parametrize("kind", ["gated_deltanet", "titans_mal"])
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
    m = tiny("rglru")
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=where):
        m(ids, position_ids=torch.tensor(pos))
    m.cfg.reset_at_doc_boundaries = False     # checked whether or not the model resets
    with pytest.raises(ValueError, match=where):
        m(ids, position_ids=torch.tensor(pos))


def test_position_shape_must_match():
    m = tiny("attention")
    with pytest.raises(ValueError, match=r"position_ids must be \[B, T\]"):
        m(torch.zeros(2, 5, dtype=torch.long), position_ids=torch.arange(5)[None])


def test_carried_states_refused_with_resets():
    m = tiny("mamba")
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="carried states"):
        m(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), output_states=True)
