"""The layer-kind registry: one table of kinds, filled by the mixers' own decorators."""
from __future__ import annotations

import importlib

import pytest

from ttt_lm.model import registry
from ttt_lm.model.config import LAYER_KINDS, ModelConfig
from ttt_lm.model.mixers import MIXERS, Mixer, mixer_class, register_mixer


def test_every_builtin_kind_is_registered_by_its_listed_module():
    for kind, module in registry.BUILTIN_KINDS.items():
        cls = mixer_class(kind)
        assert cls.__module__ == module and cls.layer_kind == kind
        assert issubclass(cls, Mixer)
    # and no listed module registers a kind that the table does not list
    for module in set(registry.BUILTIN_KINDS.values()):
        importlib.import_module(module)
    for kind, cls in registry.registered().items():
        if cls.__module__.startswith("ttt_lm."):
            assert registry.BUILTIN_KINDS.get(kind) == cls.__module__, kind


def test_layer_kinds_and_mixers_derive_from_the_registry():
    assert LAYER_KINDS == tuple(registry.BUILTIN_KINDS)
    assert tuple(MIXERS) == registry.layer_kinds()
    assert MIXERS["rglru"] is mixer_class("rglru")
    with pytest.raises(KeyError):
        MIXERS["no_such_kind"]
    with pytest.raises(ValueError, match="unknown layer kind 'no_such_kind'"):
        mixer_class("no_such_kind")


def test_a_builtin_kind_cannot_be_taken_by_another_class():
    with pytest.raises(ValueError, match="belongs to ttt_lm.model.mixers.attention"):
        @register_mixer("attention")
        class Impostor(Mixer):  # noqa: F841
            pass
    with pytest.raises(TypeError, match="not a subclass"):
        register_mixer("not_a_mixer_kind")(object)
    with pytest.raises(ValueError, match="identifier"):
        register_mixer("bad kind")


def test_unknown_kind_in_a_pattern_names_it():
    with pytest.raises(ValueError, match=r"unknown layer kind\(s\) \['nope'\]"):
        ModelConfig(layer_pattern=["nope"]).validate()
