"""The export directory: one writer, one set of readers (ttt_lm.artifacts)."""
import pytest
import torch

from ttt_lm import artifacts
from ttt_lm.config import ExperimentConfig
from ttt_lm.model import LM
from ttt_lm.model.config import ModelConfig


def tiny():
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_pattern=["attention"]))


def test_what_the_writer_writes_every_reader_reads(tmp_path):
    model = tiny()
    d = artifacts.save_export(model, ExperimentConfig(model=model.cfg), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.joinpath("out").iterdir()) == [artifacts.CONFIG, artifacts.WEIGHTS]
    ids = torch.randint(0, 64, (2, 8))
    back = artifacts.load_pretrained(d)
    assert not back.training and torch.equal(back(ids).logits, model.eval()(ids).logits)
    fresh = LM(model.cfg)
    artifacts.load_state_dict_into(fresh, d)
    assert torch.equal(fresh.eval()(ids).logits, back(ids).logits)


def test_unusable_files_are_named(tmp_path):
    model = tiny()
    d = artifacts.save_export(model, ExperimentConfig(model=model.cfg), str(tmp_path / "out"))
    other = LM(ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, layer_pattern=["attention"]))
    with pytest.raises(artifacts.ArtifactError, match=r"model\.pt do not belong.*shape mismatch"):
        artifacts.load_state_dict_into(other, d)
    (tmp_path / "out" / artifacts.WEIGHTS).write_bytes(b"not a zip")
    with pytest.raises(artifacts.ArtifactError, match=r"model\.pt cannot be read as a PyTorch state dict"):
        artifacts.load_pretrained(d)
    with pytest.raises(artifacts.ArtifactError, match="is not an export directory"):
        artifacts.read_export(str(tmp_path))
