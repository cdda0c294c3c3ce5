"""Helpers of the packed-documents tests (``test_packed_docs.py`` and each kind's own file): a tiny
LM of one kind with ``model.reset_at_doc_boundaries``, packed rows of documents, and the check
that the packed rows equal each document run alone."""
from __future__ import annotations

import torch

from ttt_lm.model import LM
from tests.model.mixer_checks import short_config

V = 53
# two rows of 24 tokens: documents shorter than a conv width (4) and a chunk (4) included
ROW_LENS = [[5, 1, 9, 2, 7], [3, 12, 4, 1, 4]]


def tiny(kind=None, **kw) -> LM:
    """Two layers of ``kind`` (None: the config's default pattern) with every section's tiny sizes
    (``short_config`` with n = 4: chunks and mini-batches of 4, windows of 5, Titans MAC's segments
    of 6), resetting at document starts; ``kw``: ModelConfig fields."""
    torch.manual_seed(0)
    return LM(short_config(kind, 4, vocab_size=V, n_layers=2, reset_at_doc_boundaries=True, **kw))


def packed_batch(row_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(0, V, (1, n), generator=g) for n in lens] for lens in row_lens]
    ids = torch.cat([torch.cat(r, 1) for r in docs])
    pos = torch.cat([torch.cat([torch.arange(n) for n in lens])[None] for lens in row_lens])
    return docs, ids, pos


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def refuse_padded_view(monkeypatch) -> None:
    """Make ``Mixer.run_padded`` (the fallback to one document per row) fail the test."""
    from ttt_lm.model.mixers.base import Mixer

    def refuse(*a, **k):
        raise AssertionError("padded view used")
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(refuse))


def packed_equals_alone(m, tol):
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
