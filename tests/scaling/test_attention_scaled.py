"""The attention section widens with the ladder's models (``AttentionConfig.scaled``): GQA keeps
its query heads per KV head; the family's section is left as it was."""
from ttt_lm.model.config import ModelConfig
from ttt_lm.scaling import ladder as Lm


def test_gqa_keeps_its_query_heads_per_kv_head():
    fam = ModelConfig(d_model=128, n_heads=4, n_layers=3, layer_pattern=["local_attention", "attention"])
    fam.attention.num_kv_heads = 2
    m = Lm.shaped(fam, 6, 64, 64)   # d_model 384, 6 heads of 64
    assert (m.d_model, m.n_heads) == (384, 6)
    assert m.attention.num_kv_heads == 3 and fam.attention.num_kv_heads == 2
