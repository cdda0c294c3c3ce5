"""The Hugging Face configuration of a ttt-lm language model.

``config.json`` carries the whole :class:`ttt_lm.model.ModelConfig` under ``ttt_lm`` (the one
place the model's shape lives; the sections of plugin mixers it neither uses nor imports left out), plus the few keys that transformers and other tools read by
their usual names (vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
max_position_embeddings, tie_word_embeddings), which are derived from it and never read back.

This file is copied into every Hugging Face export (``auto_map`` in config.json), and it
imports ``ttt_lm``: loading an export with ``trust_remote_code=True`` needs the package
installed.
"""
from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig

#: keys derived from ``ttt_lm``; a value given for one of them must agree with it
_DERIVED = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len",
            "tie_word_embeddings": "tie_embeddings"}


def model_config_from_dict(d: Optional[dict]):
    """A validated :class:`ttt_lm.model.ModelConfig` from its dict (None: the defaults); an
    unknown key or a wrong type raises a ValueError naming it."""
    from omegaconf.errors import OmegaConfBaseException

    from ttt_lm.model.config import model_config_from_dict as from_dict
    try:
        mc = from_dict(d)
    except OmegaConfBaseException as e:
        raise ValueError(f"config.json: the ttt_lm model config is not valid: {e}") from None
    return mc.validate()


class TTTLMConfig(PretrainedConfig):
    model_type = "ttt_lm"

    def __init__(self, ttt_lm: Optional[dict] = None, use_cache: bool = True, **kwargs):
        from ttt_lm.model.config import model_config_dict
        mc = model_config_from_dict(ttt_lm)
        for key, ours in _DERIVED.items():
            given = kwargs.pop(key, None)
            if given is not None and given != getattr(mc, ours):
                raise ValueError(f"config.json: {key}={given!r} disagrees with ttt_lm.{ours}={getattr(mc, ours)!r}")
        super().__init__(tie_word_embeddings=mc.tie_embeddings, **kwargs)
        # set after the base class, which may give its own fields their defaults
        self.ttt_lm = model_config_dict(mc)
        self.vocab_size = mc.vocab_size
        self.hidden_size = mc.d_model
        self.num_hidden_layers = mc.n_layers
        self.num_attention_heads = mc.n_heads
        self.max_position_embeddings = mc.max_seq_len
        self.tie_word_embeddings = mc.tie_embeddings
        self.use_cache = use_cache

    def model_config(self):
        """The :class:`ttt_lm.model.ModelConfig` this config describes."""
        return model_config_from_dict(self.ttt_lm)
