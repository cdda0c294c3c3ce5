"""Experiment configuration: structured omegaconf schemas, YAML presets, dotted overrides.

``load_config("configs/x.yaml", ["optim.lr=3e-4"])`` merges, in order: the schema defaults, the
presets a YAML names under ``_base_`` (paths relative to that YAML, applied first), the YAML
itself, then the command-line overrides. An unknown key or a value of the wrong type raises
``ConfigError`` naming the key, before any work starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ttt_lm.data.config import DataConfig
from ttt_lm.model import registry
from ttt_lm.model.config import ModelConfig, model_config_class
from ttt_lm.train.config import (CheckpointConfig, EvalConfig, LoggingConfig, OptimConfig,
                                 ParallelConfig, TrainConfig, check_training_config)


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def _read_yaml(path: str, seen: tuple = ()) -> List[DictConfig]:
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"config {path}: _base_ cycle")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}{_similar_files(path)}")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:  # yaml syntax errors
        raise ConfigError(f"config {path}: cannot parse YAML: {e}") from e
    bases = raw.pop("_base_", None) if isinstance(raw, DictConfig) else None
    out: List[DictConfig] = []
    if bases is not None:
        for b in ([bases] if isinstance(bases, str) else list(bases)):
            out += _read_yaml(os.path.join(os.path.dirname(path), b), seen + (path,))
    out.append(raw)
    return out


def _similar_files(path: str) -> str:
    """`` (did you mean '<dir>/x.yaml'?)`` for the YAML files beside a missing ``path`` whose names
    are closest to its name; where its folder does not exist either, the presets under
    ``configs/`` of the working directory and of the repository are the candidates."""
    folder, name = os.path.split(path)
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    dirs = [folder] if os.path.isdir(folder) else [os.path.abspath("configs"), here]
    by_name: dict = {}
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if n.endswith((".yaml", ".yml")) and os.path.isfile(os.path.join(d, n)):
                by_name.setdefault(n, os.path.relpath(os.path.join(d, n)))
    import difflib
    stem = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    close = difflib.get_close_matches(stem, list(by_name), n=3, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(by_name[c]) for c in close) + "?)"


_SCHEMAS: dict = {}


def _schema():
    """The structured schema of ExperimentConfig, built once per set of registered mixer sections
    (a registration rebuilds ModelConfig). Never modified: ``OmegaConf.merge`` copies its first
    argument."""
    key = model_config_class()
    if key not in _SCHEMAS:
        _SCHEMAS[key] = OmegaConf.structured(ExperimentConfig)
    return _SCHEMAS[key]


def _mixer_modules(layers: Sequence[DictConfig], model_key: Optional[str] = "model") -> List[str]:
    """``model.mixer_modules`` as the layers (YAML files, then overrides) set it, the last one
    winning, read before the schema exists: the modules register the mixer sections the schema
    is built from."""
    out: List[str] = []
    for layer in layers:
        node = layer.get(model_key) if model_key and isinstance(layer, DictConfig) else layer
        if isinstance(node, DictConfig) and "mixer_modules" in node:
            mods = node.get("mixer_modules")
            out = [] if mods is None else [str(mods)] if isinstance(mods, str) else [str(m) for m in mods]
    return out


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (), schema=None) -> ExperimentConfig:
    """Return the resolved config as an ExperimentConfig object (validated). The modules named
    in ``model.mixer_modules`` (by the YAML or an override) are imported first, so the mixers
    they register have their config sections in the schema."""
    layers = _read_yaml(path) if path else []
    dots = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        try:
            dots.append(OmegaConf.from_dotlist([ov]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {ov!r}: {_explain(e)}") from e
    try:
        registry.import_mixer_modules(_mixer_modules(layers + dots))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    base = _schema() if schema is None else schema
    try:
        # one merge (one copy of the schema); on an error, again layer by layer to name the culprit
        cfg = OmegaConf.merge(base, *layers, *dots)
    except OmegaConfBaseException as combined:
        cfg = base
        for layer in layers:
            try:
                cfg = OmegaConf.merge(cfg, layer)
            except OmegaConfBaseException as e:
                raise ConfigError(f"config {path}: {_explain(e, cfg)}") from e
        for ov, dot in zip(overrides, dots):
            try:
                cfg = OmegaConf.merge(cfg, dot)
            except OmegaConfBaseException as e:
                raise ConfigError(f"override {ov!r}: {_explain(e, cfg)}") from e
        raise ConfigError(_explain(combined, cfg)) from combined   # each layer merged alone
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e, cfg)) from e
    try:
        obj.model.validate()
        if isinstance(obj, ExperimentConfig):
            check_training_config(obj)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return obj


def _explain(e: OmegaConfBaseException, schema=None) -> str:
    """One line naming the key; for a key the schema lacks, the closest keys beside it (a mixer's
    section suggests its own fields: ``model.ttt.mini_batch_siz`` → 'mini_batch_size')."""
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if not key:
        return msg
    hint = ""
    if isinstance(e, ConfigKeyError) and schema is not None and "did you mean" not in msg.lower():
        *parent, last = str(key).split(".")
        node = schema
        try:
            for p in parent:
                node = node[p]
        except Exception:  # noqa: BLE001 - no hint where the path itself is unknown
            node = None
        if isinstance(node, DictConfig):
            hint = registry.did_you_mean(last, list(node.keys()))
    return f"key '{key}': {msg}{hint}"


def describe_config(section: Optional[str] = None) -> str:
    """The config's keys with their types and defaults, one per line (``optim.lr: float = 0.0003``),
    as ``python train.py --help`` lists them: every section with the mixers' sub-sections of
    ``model`` folded into one line each, or all of one section (``optim``, ``model.ttt``).
    A section that does not exist raises ConfigError with the closest names."""
    import dataclasses
    obj, prefix = ExperimentConfig(), ""
    if section:
        for part in section.split("."):
            subs = [f.name for f in dataclasses.fields(obj) if dataclasses.is_dataclass(getattr(obj, f.name))]
            if part not in subs:
                raise ConfigError(f"no config section {prefix + part!r}{registry.did_you_mean(part, subs)}; "
                                  f"the sections{' of ' + prefix[:-1] if prefix else ''}: {', '.join(subs)}")
            obj, prefix = getattr(obj, part), prefix + part + "."
    lines: List[str] = []

    def walk(o, pre: str, fold: bool) -> None:
        for f in dataclasses.fields(o):
            v = getattr(o, f.name)
            if dataclasses.is_dataclass(v):
                if fold:
                    n = len(dataclasses.fields(v))
                    lines.append(f"{pre}{f.name}.*  ({n} keys: python train.py --help {pre}{f.name})")
                else:
                    walk(v, f"{pre}{f.name}.", fold=not section)
                continue
            t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            lines.append(f"{pre}{f.name}: {t} = {v!r}")

    walk(obj, prefix, fold=False)
    return "\n".join(lines)


def _unsaved_sections(model) -> List[str]:
    """Sections of mixers registered outside the package in this process (a plugin imported by
    other code) that this config neither uses nor names in ``model.mixer_modules``: saving them
    would make the file unreadable by a process that does not import that plugin."""
    import os
    from ttt_lm.model import registry
    named = set()
    for m in getattr(model, "mixer_modules", None) or ():
        named.add(m)
        if m.endswith(".py") or os.sep in m:
            named.add(os.path.splitext(os.path.basename(m))[0])
    used = set(getattr(model, "layer_pattern", None) or ())
    out = []
    for name, (_, module) in list(registry._SECTIONS.items()):
        if module.startswith(registry.MIXER_PACKAGE + ".") or module in named:
            continue
        kinds = {k for k, c in registry._REGISTERED.items() if c.__module__ == module}
        if not kinds & used:
            out.append(name)
    return out


def to_yaml(cfg) -> str:
    node = OmegaConf.structured(cfg)
    drop = _unsaved_sections(cfg.model if hasattr(cfg, "model") else cfg)
    if drop:
        container = OmegaConf.to_container(node)
        sect = container.get("model", container) if "model" in container else container
        for name in drop:
            sect.pop(name, None)
        return OmegaConf.to_yaml(container)
    return OmegaConf.to_yaml(node)


def save_config(cfg, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(cfg))
    os.replace(tmp, path)
