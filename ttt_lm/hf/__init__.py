"""Hugging Face interop: a ttt-lm model as a transformers ``PreTrainedModel``.

    from ttt_lm.hf import save_hf, load_hf
    save_hf(lm, "out/tiny-hf", tokenizer="data/x/tokenizer.json")    # safetensors + config.json
    lm = load_hf("out/tiny-hf")                                       # back to ttt_lm.model.LM

An export folder loads with ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``
(``config.json``'s ``auto_map`` names the copied ``configuration_ttt_lm.py`` and
``modeling_ttt_lm.py``, which import ``ttt_lm``); importing this package also registers the
classes with ``AutoConfig`` and ``AutoModelForCausalLM``, so with ttt_lm imported no remote code
is needed. Needs the ``hf`` extra (transformers, tokenizers).
"""
from __future__ import annotations

import importlib.metadata as _metadata

try:
    _metadata.version("kernels")
except _metadata.PackageNotFoundError:
    pass
else:
    # transformers imports the Hugging Face ``kernels`` distribution whenever it is installed, by its
    # import name, which is also this repository's ``kernels/`` package: it would import ours and fail
    raise ImportError(
        "the Hugging Face 'kernels' distribution is installed, and its import name is this repository's "
        "kernels/ package, which transformers then imports in its place; transformers>=5.25 requires it: "
        "pip install 'transformers>=5.0,<5.25' && pip uninstall -y kernels")

try:
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as e:  # pragma: no cover - the hf extra is part of the test extra
    raise ImportError("ttt_lm.hf needs transformers: pip install 'ttt-lm[hf]'") from e

from ttt_lm.hf.configuration_ttt_lm import TTTLMConfig
from ttt_lm.hf.convert import HFError, hf_config, load_hf, save_hf
from ttt_lm.hf.modeling_ttt_lm import TTTLMCache, TTTLMForCausalLM

AutoConfig.register(TTTLMConfig.model_type, TTTLMConfig, exist_ok=True)
AutoModelForCausalLM.register(TTTLMConfig, TTTLMForCausalLM, exist_ok=True)
# save_pretrained copies the files defining these classes into the folder and writes auto_map
TTTLMConfig.register_for_auto_class()
TTTLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["HFError", "TTTLMCache", "TTTLMConfig", "TTTLMForCausalLM", "hf_config", "load_hf", "save_hf"]
