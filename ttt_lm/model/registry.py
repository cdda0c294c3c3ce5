"""The one registry of layer kinds: kind name → mixer class.

A mixer registers itself in its own file with ``@register_mixer("kind")``. The mixers that ship
with the package are also listed here, kind → module, so that a config can be checked and a
kind's class found without importing every mixer (and torch) up front: ``mixer_class`` imports
the listed module on first use, and the decorator refuses a built-in kind registered from any
other module or a module that leaves a listed kind unregistered (``tests/model/test_registry.py``
imports every listed module and checks both directions). A mixer defined outside the package
(a plugin, or the toy mixer of ``docs/adding_a_mixer.md``) registers a new kind by the decorator
alone; ``layer_kinds()`` then includes it.

This module imports nothing heavy: ``ttt_lm.model.config`` reads it to validate layer patterns.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Tuple

#: the built-in layer kinds and the module whose ``@register_mixer`` defines each
BUILTIN_KINDS: Dict[str, str] = {
    "attention": "ttt_lm.model.mixers.attention",
    "local_attention": "ttt_lm.model.mixers.attention",
    "ttt_linear": "ttt_lm.model.mixers.ttt",
    "ttt_mlp": "ttt_lm.model.mixers.ttt",
    "titans": "ttt_lm.model.mixers.titans",
    "titans_mag": "ttt_lm.model.mixers.titans",
    "titans_mac": "ttt_lm.model.mixers.titans",
    "titans_mal": "ttt_lm.model.mixers.titans",
    "deltanet": "ttt_lm.model.mixers.deltanet",
    "gated_deltanet": "ttt_lm.model.mixers.gated_deltanet",
    "rglru": "ttt_lm.model.mixers.rglru",
    "mamba": "ttt_lm.model.mixers.mamba",
    "lact": "ttt_lm.model.mixers.lact",
}

#: kind → class, filled by ``register_mixer`` as mixer modules are imported
_REGISTERED: Dict[str, type] = {}


def register_mixer(kind: str) -> Callable[[type], type]:
    """Class decorator: ``kind`` names this mixer in ``model.layer_pattern``. Sets ``cls.layer_kind``.
    A kind can be registered once (re-registering the same class, e.g. on a module reload, is
    allowed); a built-in kind only from the module ``BUILTIN_KINDS`` lists for it."""
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ValueError(f"register_mixer: a layer kind must be an identifier string, got {kind!r}")

    def deco(cls: type) -> type:
        from ttt_lm.model.mixers.base import Mixer, check_contract
        if not (isinstance(cls, type) and issubclass(cls, Mixer)):
            raise TypeError(f"register_mixer({kind!r}): {cls!r} is not a subclass of ttt_lm.model.mixers.Mixer")
        check_contract(cls)
        home = BUILTIN_KINDS.get(kind)
        if home is not None and cls.__module__ != home:
            raise ValueError(f"register_mixer({kind!r}): the built-in kind {kind!r} belongs to {home}, "
                             f"not to {cls.__module__}.{cls.__qualname__}; pick another name")
        old = _REGISTERED.get(kind)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"register_mixer({kind!r}): kind already registered by "
                             f"{old.__module__}.{old.__qualname__}")
        cls.layer_kind = kind
        _REGISTERED[kind] = cls
        return cls
    return deco


def layer_kinds() -> Tuple[str, ...]:
    """Every kind a layer pattern may name: the built-in ones, then those registered since."""
    return tuple(BUILTIN_KINDS) + tuple(k for k in _REGISTERED if k not in BUILTIN_KINDS)


def mixer_class(kind: str) -> type:
    """The class registered for ``kind`` (importing its module first for a built-in kind)."""
    if kind not in _REGISTERED and kind in BUILTIN_KINDS:
        importlib.import_module(BUILTIN_KINDS[kind])
        if kind not in _REGISTERED:
            raise RuntimeError(f"{BUILTIN_KINDS[kind]} did not register the layer kind {kind!r}")
    if kind not in _REGISTERED:
        raise ValueError(f"unknown layer kind {kind!r}; known: {list(layer_kinds())}")
    return _REGISTERED[kind]


def registered() -> Dict[str, type]:
    """kind → class of every kind registered so far (built-in kinds appear once imported)."""
    return dict(_REGISTERED)


__all__ = ["BUILTIN_KINDS", "register_mixer", "layer_kinds", "mixer_class", "registered"]
