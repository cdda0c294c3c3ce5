"""The RG-LRU section widens with the ladder's models (``RGLRUConfig.scaled``): an explicit
recurrence width grows with d_model (to a multiple of the head width) and its gate blocks follow
the heads; the family's section is left as it was."""
from ttt_lm.model.config import ModelConfig
from ttt_lm.scaling import ladder as Lm


def test_lru_width_and_gate_blocks_follow_the_width():
    fam = ModelConfig(d_model=128, n_heads=4, n_layers=3, layer_pattern=["rglru", "rglru", "local_attention"])
    fam.rglru.lru_width, fam.rglru.num_heads = 192, 4
    m = Lm.shaped(fam, 6, 64, 64)   # d_model 384, 6 heads of 64
    assert (m.d_model, m.n_heads) == (384, 6)
    assert (m.rglru.lru_width, m.rglru.num_heads) == (576, 6) and fam.rglru.lru_width == 192
