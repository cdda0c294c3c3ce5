"""Fixtures for the eval tests: a tiny prepared corpus and tiny exported models."""
import os
import random

import pytest
import torch

from ttt_lm.config import ExperimentConfig
from ttt_lm.eval.checkpoint import save_export
from ttt_lm.model import LM

WORDS = ("the quick brown fox jumps over a lazy dog and then the cat sat on my mat while seven old "
         "kings sang loud songs of war and peace").split()
VOCAB = 300  # the smallest vocabulary the project's SentencePiece recipe accepts


def tiny_model(pattern=None, vocab_size=VOCAB, max_seq_len=256, seed=0, n_layers=2) -> LM:
    """An LM of the layer kinds ``pattern`` (default: global attention) at d_model 32, every
    section at its tiny sizes of 8 tokens (``short_config``: chunks and mini-batches of 8, windows
    of 9), in eval mode."""
    from tests.model.mixer_checks import short_config
    torch.manual_seed(seed)
    cfg = short_config(list(pattern) if pattern is not None else [global_kind()], 8, vocab_size=vocab_size,
                       d_model=32, n_layers=n_layers, n_heads=2, max_seq_len=max_seq_len)
    return LM(cfg).eval()


def global_kind() -> str:
    """The built-in kind with attention over every earlier token (evals refuse contexts beyond
    model.max_seq_len for it)."""
    from ttt_lm.model.registry import builtin_kinds, kinds_with
    return kinds_with(lambda c: c.global_attention, builtin_kinds())[0]


def windowed_kind() -> str:
    """The first built-in attention kind with a sliding window (KV exchange, not global)."""
    from ttt_lm.model.registry import builtin_kinds, kinds_with
    return kinds_with(lambda c: c.cp_form == "kv_exchange" and not c.global_attention, builtin_kinds())[0]


def recurrent_kind() -> str:
    """The first built-in kind that does not attend (a pure recurrence)."""
    from ttt_lm.model.registry import builtin_kinds, kinds_with
    return kinds_with(lambda c: not c.attends, builtin_kinds())[0]


def preset_pattern() -> tuple:
    """The default preset's layer pattern (configs/tiny.yaml): the one concrete hybrid of a test
    that needs one."""
    from tests.model.mixer_checks import preset_config
    return tuple(preset_config().layer_pattern)


def export_model(model: LM, out_dir: str, data_path=None) -> str:
    e = ExperimentConfig(model=model.cfg)
    if data_path:
        e.data.path = data_path
    return save_export(model, out_dir, e)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """24 documents of ~400 words (~1300 tokens each); the validation split holds 3 of them."""
    from ttt_lm.data.prepare import prepare
    raw = str(tmp_path_factory.mktemp("raw"))
    rng = random.Random(0)
    for i in range(24):
        with open(os.path.join(raw, f"d{i:02d}.txt"), "w") as f:
            f.write(" ".join(rng.choice(WORDS) for _ in range(400)) + "\n")
    out = str(tmp_path_factory.mktemp("prepared"))
    prepare([raw], out, vocab_size=VOCAB, shard_tokens=4000, val_fraction=0.1, workers=1, progress=False,
            overwrite=True)
    return out


@pytest.fixture(scope="session")
def tokenizer(prepared):
    from ttt_lm.data import load_tokenizer
    return load_tokenizer(prepared)


@pytest.fixture(scope="session")
def attn_export(tmp_path_factory, prepared):
    return export_model(tiny_model((global_kind(),), max_seq_len=512), str(tmp_path_factory.mktemp("attn")), prepared)
