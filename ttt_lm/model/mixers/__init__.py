"""Sequence mixers by the names a layer pattern uses; the registry is ``ttt_lm.model.registry``
(each mixer registers itself with ``@register_mixer`` in its own file)."""
from __future__ import annotations

from ttt_lm.model.mixers.base import Mixer, State
from ttt_lm.model.registry import mixer_class, register_mixer


def build_mixer(kind: str, cfg, layer_idx: int) -> Mixer:
    return mixer_class(kind)(cfg, layer_idx)


__all__ = ["Mixer", "State", "mixer_class", "build_mixer", "register_mixer"]
