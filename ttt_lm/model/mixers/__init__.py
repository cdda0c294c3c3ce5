"""Registry of sequence mixers by the names a layer pattern uses."""
from __future__ import annotations

import importlib

from ttt_lm.model.mixers.base import Mixer, State

#: layer kind -> "module:Class" (imported on first use)
MIXERS = {
    "attention": "ttt_lm.model.mixers.attention:Attention",
    "local_attention": "ttt_lm.model.mixers.attention:LocalAttention",
    "ttt_linear": "ttt_lm.model.mixers.ttt:TTTLinear",
    "ttt_mlp": "ttt_lm.model.mixers.ttt:TTTMLP",
    "titans": "ttt_lm.model.mixers.titans:TitansMemory",
    "titans_mag": "ttt_lm.model.mixers.titans:TitansMAG",
    "titans_mac": "ttt_lm.model.mixers.titans:TitansMAC",
    "titans_mal": "ttt_lm.model.mixers.titans:TitansMAL",
    "deltanet": "ttt_lm.model.mixers.deltanet:DeltaNet",
    "rglru": "ttt_lm.model.mixers.rglru:RGLRUBlock",
    "mamba": "ttt_lm.model.mixers.mamba:Mamba",
}


def mixer_class(kind: str) -> type:
    if kind not in MIXERS:
        raise ValueError(f"unknown layer kind {kind!r}; known: {sorted(MIXERS)}")
    mod, cls = MIXERS[kind].split(":")
    return getattr(importlib.import_module(mod), cls)


def build_mixer(kind: str, cfg, layer_idx: int) -> Mixer:
    return mixer_class(kind)(cfg, layer_idx)


__all__ = ["Mixer", "State", "MIXERS", "mixer_class", "build_mixer"]
