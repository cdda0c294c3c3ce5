"""The one vocabulary check (``ttt_lm.data.manifest.vocab_fits``) and the places that call it: the
data manifest's check, the evals' check, the trainer's start, the checkpoint exporter and the
Hugging Face export. Each keeps its own error and message (their tests are beside each caller)."""
import pytest

from ttt_lm.data import manifest as manifest_mod
from ttt_lm.data import vocab_fits


def test_sizes_that_fit():
    assert vocab_fits(300, 300) and vocab_fits(300, 300, allow_padding=True)
    assert vocab_fits(320, 300, allow_padding=True)            # a padded embedding table
    assert not vocab_fits(320, 300)                            # padding not allowed: exact only
    assert not vocab_fits(256, 300) and not vocab_fits(256, 300, allow_padding=True)   # ids past the table


@pytest.mark.parametrize("bad", [0, -3, 2.5, "300", None, True])
def test_bad_sizes_are_refused_naming_which(bad):
    with pytest.raises(ValueError, match=r"the model vocab_size must be a positive integer"):
        vocab_fits(bad, 300)
    with pytest.raises(ValueError, match=r"the tokenizer vocab_size must be a positive integer"):
        vocab_fits(300, bad)


def test_every_caller_goes_through_it(monkeypatch, tmp_path):
    """A spy in place of the one function: the data, eval, export and Hugging Face checks all ask
    it, and refuse what it refuses."""
    calls = []

    def spy(model_v, tok_v, allow_padding=False):
        calls.append((model_v, tok_v, allow_padding))
        return False
    monkeypatch.setattr(manifest_mod, "vocab_fits", spy)

    from ttt_lm.data import DataError, check_vocab
    with pytest.raises(DataError, match="vocabulary mismatch"):
        check_vocab({"vocab_size": 64, "root": "d"}, 64)

    from ttt_lm.eval.common import EvalError, check_vocab as eval_check
    from ttt_lm.model import LM
    from ttt_lm.model.config import ModelConfig
    lm = LM(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, layer_pattern=["attention"]).validate())
    with pytest.raises(EvalError, match="vocabulary mismatch"):
        eval_check(lm, 64, "the tokenizer", allow_padding=True)
    assert calls == [(64, 64, False), (64, 64, True)]
    import inspect

    import ttt_lm.hf.convert as hf_convert
    import ttt_lm.train.export as export
    import ttt_lm.train.trainer as trainer
    for mod in (export, trainer, hf_convert):   # the other callers import the same function
        assert "from ttt_lm.data.manifest import vocab_fits" in inspect.getsource(mod)


def test_the_trainer_refuses_a_model_vocabulary_below_the_tokenizers(tmp_path):
    """Before any step: a 32-row embedding for a 64-token tokenizer (a larger one is padding)."""
    from ttt_lm.config import ConfigError, load_config
    from ttt_lm.train import trainer

    class Data:
        @staticmethod
        def load_manifest(path):
            return {"vocab_size": 64, "tokenizer": "tok.model"}

    cfg = load_config(None, ["model.vocab_size=32", f"train.run_dir={tmp_path}", "train.device=cpu",
                             "logging.tensorboard=false", "logging.progress=false"])
    import torch.distributed as dist
    try:
        with pytest.raises(ConfigError, match=r"model.vocab_size=32 is smaller than the tokenizer's vocab_size=64"):
            trainer.train(cfg, data_api=Data())
    finally:   # the trainer has joined its (one-process) group by the time it reads the manifest
        if dist.is_initialized():
            dist.destroy_process_group()
