"""Sequence mixers by the names a layer pattern uses; the registry is ``ttt_lm.model.registry``
(each mixer registers itself with ``@register_mixer`` in its own file)."""
from __future__ import annotations

from typing import Iterator, Mapping

from ttt_lm.model.mixers.base import Mixer, State
from ttt_lm.model.registry import layer_kinds, mixer_class, register_mixer


class _Mixers(Mapping):
    """Read-only view of the registry: layer kind → mixer class (built-in ones imported on
    first use)."""

    def __getitem__(self, kind: str) -> type:
        try:
            return mixer_class(kind)
        except ValueError:
            raise KeyError(kind) from None

    def __iter__(self) -> Iterator[str]:
        return iter(layer_kinds())

    def __len__(self) -> int:
        return len(layer_kinds())

    def __contains__(self, kind) -> bool:
        return kind in layer_kinds()


#: layer kind → mixer class
MIXERS: Mapping[str, type] = _Mixers()


def build_mixer(kind: str, cfg, layer_idx: int) -> Mixer:
    return mixer_class(kind)(cfg, layer_idx)


__all__ = ["Mixer", "State", "MIXERS", "mixer_class", "build_mixer", "register_mixer"]
