"""The layer-kind registry: kinds and config sections, filled by the mixers' own decorators; the
model config built from the sections (overrides, checks and did-you-mean hints from the section's
dataclass)."""
from __future__ import annotations

import dataclasses
import importlib
import pickle
import pkgutil
import re
from dataclasses import dataclass
from typing import Optional

import pytest

from ttt_lm.model import registry
from ttt_lm.model.config import ModelConfig, model_config_class
from ttt_lm.model.mixers import Mixer, mixer_class, register_mixer
from ttt_lm.model.registry import option

#: what every model has; everything else in ModelConfig is a registered section
GENERAL = {f.name for f in dataclasses.fields(ModelConfig)}


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test stay inside it."""
    registry.load_builtin_mixers()
    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))
    monkeypatch.setattr(registry, "_SECTIONS", dict(registry._SECTIONS))


def test_every_module_of_the_mixer_package_is_loaded_and_its_kinds_are_the_builtin_ones():
    pkg = importlib.import_module(registry.MIXER_PACKAGE)
    modules = {f"{registry.MIXER_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)}
    kinds = registry.builtin_kinds()
    assert kinds and len(set(kinds)) == len(kinds)
    for kind in kinds:
        cls = mixer_class(kind)
        assert cls.__module__ in modules and cls.layer_kind == kind and issubclass(cls, Mixer)
    # nothing else in the package registers a kind
    assert {k for k, c in registry.registered().items() if c.__module__ in modules} == set(kinds)


def test_an_unknown_kind_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="unknown layer kind 'no_such_kind'"):
        mixer_class("no_such_kind")
    kind = max(registry.builtin_kinds(), key=len)     # a kind misspelt: its last letter dropped
    with pytest.raises(ValueError, match=rf"unknown layer kind '{kind[:-1]}' \(did you mean [^)]*'{kind}'"):
        mixer_class(kind[:-1])


def test_every_builtin_section_is_declared_in_its_mixers_file_and_is_a_model_config_field():
    secs = registry.sections()
    cfg = ModelConfig()
    assert set(f.name for f in dataclasses.fields(cfg)) == GENERAL | set(secs)
    for kind in registry.builtin_kinds():
        cls = mixer_class(kind)
        if cls.config_section is None:
            continue
        assert secs[cls.config_section] is cls.config_class
        assert type(getattr(cfg, cls.config_section)) is cls.config_class
        # the section's dataclass lives in a mixer module, not in the config module
        assert cls.config_class.__module__.startswith(registry.MIXER_PACKAGE + ".")
    # the model config module declares no section and reads none
    import ttt_lm.model.config as config_module
    src = open(config_module.__file__).read()
    assert re.findall(r"^class (\w+)", src, flags=re.M) == ["ModelConfig"]
    for name in secs:
        assert not re.search(rf"\bself\.{name}\b|^\s+{name}:", src, flags=re.M), name


def test_model_config_is_one_class_per_set_of_sections_and_pickles():
    kind = next(k for k in registry.builtin_kinds() if mixer_class(k).config_section)
    section = mixer_class(kind).config_section
    cfg = ModelConfig(d_model=64, layer_pattern=[kind])
    assert isinstance(cfg, ModelConfig) and type(cfg) is model_config_class() and type(cfg).__name__ == "ModelConfig"
    assert type(ModelConfig()) is type(cfg)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert getattr(dataclasses.replace(cfg, d_model=32), section) == getattr(cfg, section)


def test_a_builtin_kind_cannot_be_taken_by_another_class(scratch_registry):
    kind = registry.builtin_kinds()[0]
    owner = mixer_class(kind)
    with pytest.raises(ValueError, match=re.escape(f"already registered by {owner.__module__}.{owner.__qualname__}")):
        @register_mixer(kind)
        class Impostor(Mixer):  # noqa: F841
            pass
    with pytest.raises(TypeError, match="not a subclass"):
        register_mixer("not_a_mixer_kind")(object)
    with pytest.raises(ValueError, match="identifier"):
        register_mixer("bad kind")
    with pytest.raises(TypeError, match="config must be a dataclass"):
        register_mixer("toy", config=dict)


def test_a_section_belongs_to_one_dataclass(scratch_registry):
    @dataclass
    class OtherTTT:
        x: int = 1

    with pytest.raises(ValueError, match=r"config section 'ttt' is already declared by ttt_lm.model.mixers.ttt"):
        @register_mixer("toy_ttt", config=OtherTTT, section="ttt")
        class Toy(Mixer):  # noqa: F841
            pass

    @dataclass
    class Clash:
        x: int = 1

    @register_mixer("d_model", config=Clash)
    class Clashing(Mixer):  # noqa: F841
        pass
    with pytest.raises(ValueError, match=r"section\(s\) \['d_model'\].*clash with ModelConfig's own fields"):
        ModelConfig()


def test_unknown_kind_in_a_pattern_names_it():
    with pytest.raises(ValueError, match=r"unknown layer kind\(s\) \['nope'\]"):
        ModelConfig(layer_pattern=["nope"]).validate()
    with pytest.raises(ValueError, match=r"unknown layer kind\(s\) \['mambaa'\] \(did you mean 'mamba'"):
        ModelConfig(layer_pattern=["mambaa"]).validate()


@dataclass
class ToyConfig:
    width: Optional[int] = option(None, ge=1)
    mode: str = option("sum", choices=("sum", "max"))
    gain: float = 1.0

    def validate(self, model) -> None:
        if self.width is not None and self.width % model.n_heads:
            raise ValueError(f"model.toy.width={self.width} must be a multiple of model.n_heads={model.n_heads}")


def _register_toy():
    @register_mixer("toy", config=ToyConfig)
    class Toy(Mixer):
        def __init__(self, cfg, layer_idx):
            super().__init__()
            self.width = cfg.toy.width or cfg.d_model
    return Toy


def test_a_new_section_is_read_overridden_and_checked(scratch_registry, tmp_path):
    from ttt_lm.config import ConfigError, load_config
    toy = _register_toy()
    assert toy.config_section == "toy" and toy.config_class is ToyConfig
    cfg = ModelConfig(layer_pattern=["toy"])
    assert cfg.toy == ToyConfig()
    assert "toy" in cfg.sections()
    y = tmp_path / "toy.yaml"
    y.write_text("model:\n  layer_pattern: [toy]\n  toy:\n    gain: 2.5\n")
    got = load_config(str(y), ["model.toy.width=8", "model.toy.mode=max"]).model
    assert (got.toy.width, got.toy.mode, got.toy.gain) == (8, "max", 2.5)
    for ov, msg in [("model.toy.widht=8", r"key 'model\.toy\.widht'.*'width'"),
                    ("model.toy.width=x", r"key 'model\.toy\.width'"),
                    ("model.toy.width=0", r"model\.toy\.width must be >= 1, got 0"),
                    ("model.toy.mode=min", r"model\.toy\.mode must be one of \['sum', 'max'\], got 'min'"),
                    ("model.toy.width=6", r"model\.toy\.width=6 must be a multiple of model\.n_heads=4")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(str(y), [ov])


def _bounded_int_field(section_class):
    """The first int field of a section with a lower bound ``ge`` (from ``option``), or None."""
    return next((f for f in dataclasses.fields(section_class)
                 if "ge" in f.metadata and f.type in (int, "int", "Optional[int]")), None)


def test_a_section_of_a_kind_the_pattern_does_not_use_is_kept_and_checked():
    """tiny.yaml's pattern leaves some sections unused: an override of each is kept, and a value
    below a field's bound is refused naming it."""
    from ttt_lm.config import ConfigError, load_config
    used = {mixer_class(k).config_section for k in load_config("configs/tiny.yaml", []).model.layer_kinds()}
    unused = {n: _bounded_int_field(c) for n, c in registry.sections().items() if n not in used}
    unused = {n: f for n, f in unused.items() if f is not None}
    assert len(unused) >= 2, f"tiny.yaml leaves too few sections with a bounded int field unused: {unused}"
    over = {n: f.metadata["ge"] + 7 for n, f in unused.items()}
    cfg = load_config("configs/tiny.yaml", [f"model.{n}.{unused[n].name}={v}" for n, v in over.items()]).model
    for n, v in over.items():
        assert getattr(getattr(cfg, n), unused[n].name) == v, n
    n, f = next(iter(unused.items()))
    low = f.metadata["ge"] - 1
    with pytest.raises(ConfigError, match=rf"model\.{n}\.{f.name} must be >= {f.metadata['ge']}, got {low}"):
        load_config("configs/tiny.yaml", [f"model.{n}.{f.name}={low}"])


def test_mixer_modules_are_imported_before_the_config_is_read(scratch_registry, tmp_path):
    """``model.mixer_modules`` (here a .py path) registers its kinds and sections before the
    overrides that use them are read; a module that cannot be imported is named."""
    import sys

    from ttt_lm.config import ConfigError, load_config
    f = tmp_path / "path_toy_mixer.py"
    f.write_text("from dataclasses import dataclass\n"
                 "from ttt_lm.model.mixers import Mixer, register_mixer\n\n\n"
                 "@dataclass\nclass PathToyConfig:\n    depth: int = 3\n\n\n"
                 "@register_mixer('path_toy', config=PathToyConfig)\nclass PathToy(Mixer):\n    pass\n")
    try:
        with pytest.raises(ConfigError, match=r"key 'model\.path_toy'"):
            load_config("configs/tiny.yaml", ["model.path_toy.depth=5"])
        cfg = load_config("configs/tiny.yaml", [f"model.mixer_modules=[{f}]", "model.path_toy.depth=5"]).model
        assert cfg.path_toy.depth == 5 and cfg.mixer_modules == [str(f)]
        assert mixer_class("path_toy").config_section == "path_toy"
    finally:
        sys.modules.pop("path_toy_mixer", None)
    with pytest.raises(ConfigError, match="model.mixer_modules: cannot import 'no_such_mixer_module'"):
        load_config("configs/tiny.yaml", ["model.mixer_modules=[no_such_mixer_module]"])


def test_a_saved_config_leaves_out_plugin_sections_it_neither_uses_nor_imports(scratch_registry, tmp_path):
    """A plugin registered by other code in this process (``_register_toy``) adds its section to
    ModelConfig; a config that does not use it and does not name it in ``model.mixer_modules`` is
    saved without it, so a process without the plugin can read the file back. A config that uses
    the kind keeps the section."""
    from ttt_lm.config import load_config, save_config
    _register_toy()
    cfg = load_config("configs/tiny.yaml")
    assert hasattr(cfg.model, "toy")
    save_config(cfg, str(tmp_path / "c.yaml"))
    text = (tmp_path / "c.yaml").read_text()
    assert "toy:" not in text and "ttt:" in text
    registry._SECTIONS.pop("toy")
    registry._REGISTERED.pop("toy")
    assert load_config(str(tmp_path / "c.yaml")).model.layer_pattern == cfg.model.layer_pattern
    _register_toy()
    used = load_config("configs/tiny.yaml", ["model.layer_pattern=[toy]", "model.toy.width=8"])
    save_config(used, str(tmp_path / "u.yaml"))
    assert "toy:" in (tmp_path / "u.yaml").read_text()
