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
from omegaconf.errors import OmegaConfBaseException

from ttt_lm.data.config import DataConfig
from ttt_lm.model.config import ModelConfig
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
        raise ConfigError(f"config file not found: {path}")
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


def _schema():
    return OmegaConf.structured(ExperimentConfig)


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (), schema=None) -> ExperimentConfig:
    """Return the resolved config as an ExperimentConfig object (validated)."""
    cfg = _schema() if schema is None else schema
    layers = _read_yaml(path) if path else []
    for i, layer in enumerate(layers):
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(f"config {path}: {_explain(e)}") from e
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([ov]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {ov!r}: {_explain(e)}") from e
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from e
    try:
        obj.model.validate()
        if isinstance(obj, ExperimentConfig):
            check_training_config(obj)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return obj


def _explain(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    if key:
        return f"key '{key}': {msg}"
    return msg


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(to_yaml(cfg))
    os.replace(tmp, path)


def load_model_config(path: str, overrides: Sequence[str] = ()) -> ModelConfig:
    """The model section of an experiment YAML (or of a saved run config)."""
    return load_config(path, overrides).model
