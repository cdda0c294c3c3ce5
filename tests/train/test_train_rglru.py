"""The trainer with RG-LRU layers: a split count of the kind's own (its gate blocks, rglru.num_heads)
that parallel.tensor_parallel does not divide stops the run in the config check, naming it and
the layer."""
import pytest

from ttt_lm.config import ExperimentConfig
from ttt_lm.model.registry import builtin_kinds
from ttt_lm.train.engine import ParallelConfigError, check_parallel


def test_split_counts_refused_before_any_work():
    cfg = ExperimentConfig()
    cfg.model.layer_pattern, cfg.model.n_layers = [builtin_kinds()[0], "rglru"], 2
    cfg.model.n_heads, cfg.model.vocab_size, cfg.model.d_model = 4, 64, 32
    cfg.data.seq_len = 16
    cfg.parallel.tensor_parallel = 4
    cfg.model.rglru.num_heads = 2
    with pytest.raises(ParallelConfigError, match=r"tensor_parallel=4 must divide num_heads=2 of layer 1 \(rglru\)"):
        check_parallel(cfg, world_size=4)
    cfg.model.rglru.num_heads = 4
    check_parallel(cfg, world_size=4)  # everything divides
