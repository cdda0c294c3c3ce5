"""The trainer with Titans layers: model.kernel_backend=triton with a layer no Triton kernel covers
(Titans' MLP memory) stops before training, naming the layer kind."""
import os

import pytest

from launch import run


@pytest.mark.dist
def test_triton_refused_for_titans_mlp_memory(tmp_path):
    r = run(str(tmp_path / "bad"), ["train.max_steps=1", "model.layer_pattern=[titans]", "model.titans.memory=mlp",
                                    "model.kernel_backend=triton"], expect=2)
    out = r.output()
    assert "error: layer kind 'titans' (layer 0): model.kernel_backend=triton" in out and "linear memory" in out
    assert not os.path.exists(str(tmp_path / "bad" / "metrics.jsonl"))   # stopped before any step
