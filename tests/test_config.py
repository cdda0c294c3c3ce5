import glob
import os
import re

import pytest

from ttt_lm.config import ConfigError, load_config, save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def _yaml_pattern(path):
    """The ``model.layer_pattern`` a YAML file writes itself (not through the config loader)."""
    import yaml
    with open(path) as f:
        return yaml.safe_load(f)["model"]["layer_pattern"]


def test_defaults_and_overrides():
    cfg = load_config(os.path.join(CONFIGS, "tiny.yaml"), ["optim.lr=1e-4", "model.ttt.mini_batch_size=8"])
    assert cfg.optim.lr == 1e-4 and cfg.model.ttt.mini_batch_size == 8
    assert cfg.model.layer_pattern == _yaml_pattern(os.path.join(CONFIGS, "tiny.yaml"))


def test_base_composition():
    cfg = load_config(os.path.join(CONFIGS, "hybrid_350m.yaml"))
    assert cfg.model.d_model == 1024 and cfg.model.n_layers == 24          # from sizes/350m.yaml
    assert cfg.model.layer_pattern == _yaml_pattern(os.path.join(CONFIGS, "arch", "hybrid.yaml"))
    assert cfg.train.run_dir == "runs/hybrid_350m"                         # from the preset itself


@pytest.mark.parametrize("override,key", [
    ("model.d_modle=3", "model.d_modle"),                # typo in a key
    ("optim.lr=fast", "optim.lr"),                       # wrong type
    ("nosuchsection.x=1", "nosuchsection"),
])
def test_bad_override_names_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(os.path.join(CONFIGS, "tiny.yaml"), [override])


def test_bad_yaml_key_names_key(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("model:\n  n_layer: 3\n")
    with pytest.raises(ConfigError, match="model.n_layer"):
        load_config(str(p))


def _misspelt_pattern():
    """A layer pattern of two built-in kinds, the second misspelt (a letter dropped)."""
    from ttt_lm.model.registry import builtin_kinds
    a, b = builtin_kinds()[-1], max(builtin_kinds(), key=len)
    return f"model.layer_pattern=[{a},{b[:-1]}]", re.escape(f"'{b[:-1]}'")


@pytest.mark.parametrize("override,match", [
    _misspelt_pattern(),
    ("model.n_layers=3", "multiple"),
    ("model.attention.num_kv_heads=3", "num_kv_heads"),
])
def test_semantic_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(CONFIGS, "tiny.yaml"), [override])


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/does_not_exist.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(os.path.join(CONFIGS, "tiny.yaml"), ["optim.lr"])


def test_save_roundtrip(tmp_path):
    cfg = load_config(os.path.join(CONFIGS, "tiny.yaml"), ["model.d_model=64"])
    save_config(cfg, str(tmp_path / "c.yaml"))
    assert load_config(str(tmp_path / "c.yaml")) == cfg


def test_every_preset_loads():
    files = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    assert len(files) >= 17
    for f in files:
        load_config(f)
