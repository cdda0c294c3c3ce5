"""The one registry of layer kinds: kind name → mixer class, and config section → its schema.

A mixer registers itself in its own file, with its config section beside it::

    @dataclass
    class GatedSumConfig:                        # read from model.gated_sum
        chunk_size: int = option(16, ge=1)

    @register_mixer("gated_sum", config=GatedSumConfig)
    class GatedSum(Mixer): ...

``config`` is a dataclass (the section's schema); it becomes ``model.<section>`` of the model
config, where ``section`` defaults to the kind (kinds that share one, as TTT-Linear and TTT-MLP
share ``model.ttt``, name it: ``register_mixer("ttt_mlp", config=TTTConfig, section="ttt")``).
``ModelConfig`` (``ttt_lm.model.config``) is built from the registered sections, so dotted
overrides (``model.gated_sum.chunk_size=32``), YAML presets, type checks and the did-you-mean hint
for a misspelt key all come from the dataclass. Its checks come from it too: a field made with
:func:`option` carries its allowed values or range, and a ``validate(self, model)`` method (``model``
the whole ModelConfig) checks what spans fields; both raise a ValueError naming
``model.<section>.<field>``. Every registered section is part of every model config, whichever
kinds the layer pattern names, and is checked by ``ModelConfig.validate``.

What other code needs to know about a kind is a class attribute of its mixer (``ttt_lm/model/
mixers/base.py``: ``global_attention``, ``takes_segment_pos``, ``cp_form``, ...), read through
:func:`mixer_class`; no module keeps a list of kinds.

The mixers that ship with the package are the modules of ``ttt_lm.model.mixers``:
:func:`load_builtin_mixers` imports them all (each registers its kinds), which the first question
about a kind or a section does. A mixer defined elsewhere (a plugin, or the example of
``docs/adding_a_mixer.md``) registers by the decorator alone once its module is imported; a run
names such modules in ``model.mixer_modules`` so that its config can be read. A kind or a section
belongs to one class / dataclass; registering another under a taken name is an error.

This module imports nothing heavy (importing the mixers, and torch, happens on first use).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

#: the package whose modules are the built-in mixers
MIXER_PACKAGE = "ttt_lm.model.mixers"

#: kind → class, filled by ``register_mixer`` as mixer modules are imported
_REGISTERED: Dict[str, type] = {}
#: section name → (schema dataclass, the module that declared it first)
_SECTIONS: Dict[str, Tuple[type, str]] = {}
#: None: not loaded; False: loading; True: loaded
_BUILTINS_LOADED: Optional[bool] = None


def option(default: Any, *, choices: Optional[Sequence] = None, ge=None, gt=None, le=None, lt=None):
    """A section field with its allowed values: ``chunk_size: int = option(64, ge=1)``,
    ``memory: str = option("linear", choices=("linear", "mlp"))``. ``None`` values (an unset
    Optional field) are not checked. Checked by ``ModelConfig.validate`` (:func:`check_section`)."""
    meta = {k: v for k, v in (("choices", tuple(choices) if choices is not None else None),
                               ("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, metadata=meta)


_BOUNDS = {"ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
           "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<")}


def check_section(name: str, section: Any, model: Any) -> None:
    """Refuse a section whose values break its fields' :func:`option` limits or its own
    ``validate(model)``; the ValueError names ``model.<name>.<field>``."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if v is None:
            continue
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ValueError(f"model.{name}.{f.name} must be one of {list(choices)}, got {v!r}")
        for key, (ok, sym) in _BOUNDS.items():
            if key in f.metadata and not ok(v, f.metadata[key]):
                raise ValueError(f"model.{name}.{f.name} must be {sym} {f.metadata[key]}, got {v!r}")
    validate = getattr(section, "validate", None)
    if callable(validate):
        validate(model)


def register_mixer(kind: str, config: Optional[type] = None, section: Optional[str] = None) -> Callable[[type], type]:
    """Class decorator: ``kind`` names this mixer in ``model.layer_pattern``; ``config`` (a
    dataclass, optional) is its config section, read from ``model.<section>`` (``section``:
    the kind unless given). Sets ``cls.layer_kind``, ``cls.config_section`` (None without a
    section) and ``cls.config_class``. A kind can be registered once (re-registering the same
    class, e.g. on a module reload, is allowed); a section name belongs to one dataclass (kinds
    may share it by passing the same one)."""
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ValueError(f"register_mixer: a layer kind must be an identifier string, got {kind!r}")
    if config is not None and not (isinstance(config, type) and dataclasses.is_dataclass(config)):
        raise TypeError(f"register_mixer({kind!r}): config must be a dataclass (the section's schema), got {config!r}")
    if section is not None and config is None:
        raise ValueError(f"register_mixer({kind!r}): section={section!r} needs its config dataclass")
    name = (section or kind) if config is not None else None
    if name is not None and not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"register_mixer({kind!r}): a config section must be an identifier string, got {name!r}")

    def deco(cls: type) -> type:
        from ttt_lm.model.mixers.base import Mixer, check_contract
        if not (isinstance(cls, type) and issubclass(cls, Mixer)):
            raise TypeError(f"register_mixer({kind!r}): {cls!r} is not a subclass of ttt_lm.model.mixers.Mixer")
        check_contract(cls)
        if not cls.__module__.startswith(MIXER_PACKAGE + "."):
            load_builtin_mixers()   # a name a built-in mixer has taken is refused below
        old = _REGISTERED.get(kind)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"register_mixer({kind!r}): kind already registered by "
                             f"{old.__module__}.{old.__qualname__}; pick another name")
        if name is not None:
            have = _SECTIONS.get(name)
            if have is not None and (have[0].__module__, have[0].__qualname__) != (config.__module__, config.__qualname__):
                raise ValueError(f"register_mixer({kind!r}): config section {name!r} is already declared by "
                                 f"{have[1]} with {have[0].__qualname__}; pick another section name")
            if have is None or have[0] is not config:
                _SECTIONS[name] = (config, cls.__module__)
        cls.layer_kind = kind
        cls.config_section = name
        cls.config_class = config
        _REGISTERED[kind] = cls
        return cls
    return deco


def load_builtin_mixers() -> None:
    """Import every module of ``ttt_lm.model.mixers`` (each registers its kinds and sections)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED is not None:
        return
    _BUILTINS_LOADED = False
    try:
        pkg = importlib.import_module(MIXER_PACKAGE)
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            importlib.import_module(f"{MIXER_PACKAGE}.{info.name}")
    except BaseException:
        _BUILTINS_LOADED = None
        raise
    _BUILTINS_LOADED = True


def _builtin_module_order(module: str) -> Tuple[int, str]:
    return (0, module) if module.startswith(MIXER_PACKAGE + ".") else (1, "")


def builtin_kinds() -> Tuple[str, ...]:
    """The kinds that ship with the package, by module name, then in each module's order."""
    load_builtin_mixers()
    kinds = [k for k, c in _REGISTERED.items() if c.__module__.startswith(MIXER_PACKAGE + ".")]
    return tuple(sorted(kinds, key=lambda k: _builtin_module_order(_REGISTERED[k].__module__)))


def layer_kinds() -> Tuple[str, ...]:
    """Every kind a layer pattern may name: the built-in ones, then those registered since."""
    builtin = builtin_kinds()
    return builtin + tuple(k for k in _REGISTERED if k not in builtin)


def mixer_class(kind: str) -> type:
    """The class registered for ``kind`` (importing the built-in mixers first)."""
    if kind not in _REGISTERED:
        load_builtin_mixers()
    if kind not in _REGISTERED:
        raise ValueError(f"unknown layer kind {kind!r}{did_you_mean(kind, layer_kinds())}; "
                         f"known: {list(layer_kinds())}")
    return _REGISTERED[kind]


def registered() -> Dict[str, type]:
    """kind → class of every kind registered so far (with the built-in ones)."""
    load_builtin_mixers()
    return dict(_REGISTERED)


def sections() -> Dict[str, type]:
    """Config section name → its schema dataclass, for every registered mixer: the built-in
    ones (by module), then those registered since. ``ModelConfig`` has one field per entry."""
    load_builtin_mixers()
    names = sorted(_SECTIONS, key=lambda n: _builtin_module_order(_SECTIONS[n][1]))   # stable: plugins keep their order
    return {n: _SECTIONS[n][0] for n in names}


def plugin_sections() -> Dict[str, str]:
    """Config section → the module of the mixer that declared it, for the sections declared by
    mixers registered outside the package (plugins)."""
    return {n: module for n, (_, module) in _SECTIONS.items() if not module.startswith(MIXER_PACKAGE + ".")}


def kinds_with(predicate: Callable[[type], bool], kinds: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """The kinds (of ``kinds``; default every registered one) whose mixer class satisfies
    ``predicate``: ``kinds_with(lambda c: c.global_attention, cfg.layer_kinds())``."""
    return tuple(k for k in (layer_kinds() if kinds is None else kinds) if predicate(mixer_class(k)))


def import_mixer_modules(modules: Sequence[str]) -> None:
    """Import the modules that register mixers outside the package (``model.mixer_modules``):
    a dotted module name importable from ``sys.path``, or the path of a ``.py`` file (imported
    as a module named after the file)."""
    import os
    import sys
    for m in modules or ():
        if not isinstance(m, str) or not m:
            raise ValueError(f"model.mixer_modules: each entry is a module name or a .py path, got {m!r}")
        if m.endswith(".py") or os.sep in m:
            path = os.path.abspath(m)
            name = os.path.splitext(os.path.basename(path))[0]
            if not os.path.isfile(path):
                raise ValueError(f"model.mixer_modules: no such file {path}")
            have = sys.modules.get(name)
            if have is not None and os.path.abspath(getattr(have, "__file__", "") or "") == path:
                continue
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            try:
                importlib.import_module(m)
            except ImportError as e:
                raise ValueError(f"model.mixer_modules: cannot import {m!r}: {e}") from e


def did_you_mean(word: str, candidates) -> str:
    """`` (did you mean 'x'?)`` for the candidates closest to ``word``, or ``""``."""
    import difflib
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=3, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


__all__ = ["register_mixer", "option", "check_section", "load_builtin_mixers", "builtin_kinds", "layer_kinds",
           "mixer_class", "registered", "sections", "kinds_with", "import_mixer_modules", "did_you_mean"]
