"""The document layout is built on the host and read nothing back from the device.

``LM.forward`` builds the ``DocLayout`` from the loader's CPU ``position_ids`` and moves its
tensors to the model's device; every view (``aligned``, ``balanced``, ``prefixed``,
``cu_seqlens``, ``pad``/``unpad``) takes its sizes from the layout's host copies. The proof
without a GPU: the "meta" device holds no data, so any read of a meta tensor to the host
(``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``.cpu()``) raises. The layout moved to
"meta", every view of it, and a whole forward and backward of an LM with every layer kind on
"meta" (positions on the CPU) must therefore run; the sizes must equal those of the same views
on the CPU, which the packed-document tests check against each document run alone."""
import random

import pytest
import torch

from tests.model.mixer_checks import short_config
from ttt_lm.model import LM
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.registry import layer_kinds

META = torch.device("meta")


def random_rows(B, T, seed):
    """position_ids [B, T] of packed rows cut out of a stream: random document lengths (1 … T),
    a row's first document possibly begun before the row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(B):
        pos, t = [], 0
        first = rng.randrange(0, 5)
        while t < T:
            n = min(rng.choice([1, 2, 3, 5, 8, 13, T]), T - t)
            pos += list(range(first, first + n))
            first, t = 0, t + n
        rows.append(pos)
    return torch.tensor(rows)


def doc_lengths(pos):
    """Each row's document lengths, from plain Python."""
    out = []
    for row in pos.tolist():
        lens = []
        for t, p in enumerate(row):
            if t == 0 or p == 0:
                lens.append(0)
            lens[-1] += 1
        out.append(lens)
    return out


def views(d, C=4, n=3):
    """Every view of layout d, and the views of the prefixed layout, as (name, size-or-tensor)."""
    B, T = d.shape
    x = torch.zeros(B, T, 5, device=d.starts.device)
    al, lo, ba, pre = d.aligned(C), d.aligned(C, longer_than=C), d.balanced(C), d.prefixed(n)
    out = {
        "n_docs": d.n_docs, "max_len": d.max_len, "inner_starts": d.inner_starts,
        "cu_seqlens": d.cu_seqlens.shape, "seg": d.seg.shape, "doc_index": d.doc_index.shape,
        "pad": d.pad(x).shape, "unpad": d.unpad(d.pad(x)).shape,
        "aligned": (al.length, al.offset.shape, al.resets.shape, al.pad(x).shape, al.unpad(al.pad(x)).shape),
        "aligned_long": (lo.length, lo.kept.shape, lo.pad(x).shape, lo.unpad(lo.pad(x)).shape),
        "balanced": (ba.rows, ba.length, ba.resets.shape, ba.pad(x).shape, ba.unpad(ba.pad(x)).shape),
        "prefixed": (pre.layout.shape, pre.layout.n_docs, pre.layout.max_len,
                     pre.pad(x, torch.zeros(n, 5, device=x.device)).shape),
    }
    L = pre.layout
    y = torch.zeros(*L.shape, 5, device=x.device)
    out["prefixed_views"] = (L.cu_seqlens.shape, L.seg.shape, L.pad(y).shape, L.balanced(C).length,
                             L.balanced(C).rows, L.aligned(C).length, pre.unpad(y).shape)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_views_of_a_layout_moved_to_meta_read_nothing_back(seed):
    pos = random_rows(3, 29, seed)
    host = DocLayout.build(pos)
    on_cpu = views(host)
    on_meta = views(host.to(META))            # a host read of any meta tensor raises
    assert on_meta == on_cpu
    # the host lengths are the documents' own, and the sizes follow from them
    lens = doc_lengths(pos)
    assert host.host_lengths.tolist() == [n for row in lens for n in row]
    C = 4
    assert on_cpu["aligned"][0] == max(sum(-(-n // C) * C for n in row) for row in lens)
    assert on_cpu["aligned_long"][0] == max(sum(-(-n // C) * C for n in row if n > C) for row in lens)
    assert on_cpu["prefixed"][0] == (3, 29 + 3 * max(len(row) for row in lens))


def test_prefixed_layout_equals_the_one_built_from_its_positions():
    """``prefixed`` makes its layout from host sizes instead of ``DocLayout.build``: the same
    layout (tensors, counts, lengths, every view's size)."""
    for seed in range(4):
        pre = DocLayout.build(random_rows(3, 23, seed)).prefixed(2).layout
        ref = DocLayout.build(pre.offset)
        for f in ("position_ids", "starts", "offset"):
            assert torch.equal(getattr(pre, f), getattr(ref, f)), f
        assert (pre.n_docs, pre.max_len) == (ref.n_docs, ref.max_len)
        assert torch.equal(pre.host_lengths, ref.host_lengths)
        assert views(pre) == views(ref)


def test_layout_built_on_a_device_reads_there():
    """Positions on a device are read back (the layout built there: its check and sizes), which is
    what the meta device reports; the host build of the same positions is the LM's path."""
    pos = random_rows(2, 17, 3)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        DocLayout.build(pos.to(META))
    d = DocLayout.build(pos)
    assert d.to(META).starts.device == META and d.to(META).host_lengths is d.host_lengths


def hybrid() -> LM:
    """Two rows' worth of every layer kind, with chunk sizes small enough that the views have
    several chunks and documents shorter than a chunk."""
    torch.manual_seed(0)
    # every section at its tiny sizes of 4 tokens (windows of 5, Titans' segments of 6)
    return LM(short_config(list(layer_kinds()), 4, vocab_size=37, d_model=16, n_heads=2,
                           reset_at_doc_boundaries=True))


def test_lm_with_every_kind_reads_nothing_back_on_meta():
    """A forward and backward of every layer kind with document resets on the meta device, the
    loader's positions on the CPU: no host read of a device tensor anywhere (the layout, its
    views, the mixers' forms). impl="reference" too: the forms on the padded view (pad/unpad),
    but the RG-LRU's (see below)."""
    m = hybrid()
    pos = random_rows(2, 26, 0)
    ids = torch.randint(0, 37, pos.shape)
    assert DocLayout.build(pos).inner_starts
    m = m.to(META)
    for impl in ("chunked", "reference"):
        m.set_impl(impl)
        if impl == "reference":
            # the RG-LRU's sequential reference splits its rows at the resets on the host
            # (kernels.linear_scan.linear_scan_reset): a read by design of the spec form
            for b in m.layers:
                if b.kind == "rglru":
                    b.mixer.impl = "chunked"
        logits = m(ids.to(META), position_ids=pos).logits
        assert logits.shape == (2, 26, 37) and logits.device == META
        logits.sum().backward()
        assert all(p.grad is not None and p.grad.device == META for p in m.parameters()
                   if p.requires_grad and p.grad is not None)
        m.zero_grad()
