"""train.py's own options: --help lists the config's sections, keys, types and defaults;
--print-config prints the resolved config of a preset with overrides; both refuse bad input
with exit status 2, as a training command line does (nothing is run)."""
import importlib.util
import pathlib

import pytest
from omegaconf import OmegaConf

from ttt_lm.config import ExperimentConfig, describe_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cli():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # its __main__ block does not run
    return mod.cli


def test_help_lists_every_section_with_keys_and_defaults(cli, capsys):
    assert cli(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python train.py [config.yaml] [dotted.key=value ...]")
    e = ExperimentConfig()
    for line in (f"optim.lr: float = {e.optim.lr!r}", f"train.max_steps: int = {e.train.max_steps!r}",
                 f"parallel.tensor_parallel: int = {e.parallel.tensor_parallel!r}",
                 f"model.layer_pattern: List[str] = {e.model.layer_pattern!r}", "data.path: str = "):
        assert line in out, line
    for section in ("model", "data", "optim", "train", "parallel", "checkpoint", "eval", "logging"):
        assert f"\n{section}." in out, section
    # a mixer's section is one line pointing at its own listing
    assert "model.ttt.*  (" in out and "python train.py --help model.ttt)" in out
    assert "model.ttt.mini_batch_size" not in out


def test_help_of_one_section_lists_it_in_full(cli, capsys):
    assert cli(["--help", "model.ttt"]) == 0
    out = capsys.readouterr().out
    assert f"model.ttt.mini_batch_size: int = {ExperimentConfig().model.ttt.mini_batch_size!r}" in out
    assert "optim.lr:" not in out
    assert describe_config("model.ttt") in out
    assert cli(["configs/tiny.yaml", "--help"]) == 0  # anywhere on the line
    assert "optim.lr: float" in capsys.readouterr().out


def test_print_config_resolves_a_preset_with_overrides(cli, capsys):
    assert cli(["--print-config", str(ROOT / "configs" / "tiny.yaml"), "optim.lr=0.01", "train.max_steps=7"]) == 0
    cfg = OmegaConf.create(capsys.readouterr().out)
    assert cfg.optim.lr == 0.01 and cfg.train.max_steps == 7
    preset = OmegaConf.load(ROOT / "configs" / "tiny.yaml")
    assert cfg.model.d_model == preset.model.d_model  # the preset's own value, not the schema default
    assert cli(["--print-config", "optim.lr=0.02"]) == 0  # the default preset
    assert OmegaConf.create(capsys.readouterr().out).optim.lr == 0.02


@pytest.mark.parametrize("argv, said", [
    (["--help", "optimm"], "no config section 'optimm' (did you mean 'optim'?)"),
    (["--help", "model.tt"], "no config section 'model.tt' (did you mean 'ttt'?)"),
    (["--help", "optim", "train"], "--help takes at most one section"),
    (["--print-config", "optim.lrr=1"], "optim.lrr"),
    (["--print-config", "configs/tiny.yml"], "not found"),
    (["--dry-run"], "unknown option '--dry-run'"),
])
def test_refused_input_exits_2_naming_it(cli, capsys, argv, said):
    assert cli(argv) == 2
    assert said in capsys.readouterr().err


def test_a_training_command_line_is_left_to_the_trainer(cli):
    assert cli([]) is None and cli(["configs/tiny.yaml", "optim.lr=1e-3"]) is None
    assert cli(["configs/tiny.yaml", "--local_rank=0"]) is None
