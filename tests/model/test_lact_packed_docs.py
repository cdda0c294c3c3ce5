"""LaCT's packed documents beyond the shared checks of ``test_packed_docs.py``: chunks shorter and
longer than every document."""
import pytest

from ttt_lm.model import LM
from tests.model.packed_checks import packed_equals_alone, refuse_padded_view, tiny


@pytest.mark.parametrize("chunk", [2, 16])
def test_lact_long_and_short_documents(chunk, monkeypatch):
    """LaCT's packed rows with chunks of 2 (almost every document writes) and of 16 (no document
    of ROW_LENS is longer than a chunk: f_{W_init} alone, no aligned view); gradients included."""
    refuse_padded_view(monkeypatch)
    m = tiny("lact", kernel_backend="torch")
    m.cfg.lact.chunk_size = chunk
    m = LM(m.cfg)
    packed_equals_alone(m, 2e-4)
