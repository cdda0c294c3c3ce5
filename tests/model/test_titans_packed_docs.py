"""Titans' packed documents beyond the shared checks of ``test_packed_docs.py``: the MLP memory's
chunk loop and MAC's block scan."""
import pytest
import torch

from ttt_lm.model import LM
from tests.model.packed_checks import packed_equals_alone, refuse_padded_view, tiny


@pytest.mark.parametrize("kind", ["titans", "titans_mal", "titans_mac"])
def test_titans_mlp_memory_restarts(kind, monkeypatch):
    """Titans' MLP memory (its chunk loop in the mixer) restarts at chunk-aligned documents too
    (MAL: after the persistent tokens inserted before each document; MAC: in its block scan);
    gradients included."""
    refuse_padded_view(monkeypatch)
    m = tiny(kind, kernel_backend="torch")
    m.cfg.titans.memory = "mlp"
    m = LM(m.cfg)
    packed_equals_alone(m, 2e-4)


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
    refuse_padded_view(monkeypatch)
    m = tiny("titans_mac", kernel_backend="torch")
    m.cfg.titans.segment_len, m.cfg.titans.chunk_size = segment_len, chunk_size
    m.cfg.attention.backend, m.cfg.attention.num_kv_heads = backend, kv_heads
    m.cfg.titans.conv_width = conv
    torch.manual_seed(0)
    m = LM(m.cfg)
    assert m.layers[0].mixer.attention_backend(torch.device("cpu"), torch.float32) == backend
    packed_equals_alone(m, 2e-4)
