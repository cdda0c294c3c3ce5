"""Attention's packed documents beyond the shared checks of ``test_packed_docs.py``: every
backend's document mask."""
import pytest
import torch

from ttt_lm.model.docs import DocLayout
from tests.model.packed_checks import ROW_LENS, packed_batch, rel, tiny


@pytest.mark.parametrize("backend", ["sdpa", "math", pytest.param("flex", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["attention", "local_attention"])
def test_attention_document_mask_backends(kind, backend):
    # flex on CPU runs its unfused path, tens of seconds per case here: the slow tier
    """Each attention backend's document mask (SDPA's and math's boolean mask, flex's mask_mod)
    gives each document's own attention; window 5 with documents of up to 12 tokens."""
    m = tiny(kind)
    assert m.cfg.attention.window == 5
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
