"""What a run reports about itself: MFU's peak FLOP/s per device, the git commit, and the resolved
config and hyperparameters in TensorBoard."""
import subprocess

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from ttt_lm.config import ConfigError, load_config
from ttt_lm.train.metrics import MetricsWriter, git_commit, mfu, peak_flops_for, resolve_peak_flops


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA GH200 480GB", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("NVIDIA A10G", 70), ("NVIDIA A10", 125),
    ("NVIDIA L4", 121), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA GeForce RTX 4090", 165.2),
    ("Tesla V100-SXM2-32GB", 125), ("Tesla V100-PCIE-16GB", 112), ("Tesla V100S-PCIE-32GB", 130),
])
def test_peak_flops_by_device_name(name, tflops):
    assert peak_flops_for(name) == pytest.approx(tflops * 1e12)


def test_unknown_devices_and_cpu_report_no_mfu_unless_configured():
    assert peak_flops_for("Tesla T4") is None and peak_flops_for("Some Future GPU") is None
    peak, why = resolve_peak_flops(None, torch.device("cpu"))
    assert peak is None and "set logging.peak_flops" in why
    assert mfu(1000.0, 1e9, None, 8) is None
    assert resolve_peak_flops(1e14, "cpu") == (1e14, "logging.peak_flops")
    assert mfu(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
    assert load_config(None, ["logging.peak_flops=2e14"]).logging.peak_flops == 2e14
    with pytest.raises(ConfigError, match="logging.peak_flops must be > 0"):
        load_config(None, ["logging.peak_flops=-1"])


def test_git_commit_of_a_checkout_and_outside_one(tmp_path):
    assert git_commit(str(tmp_path)) is None
    repo = tmp_path / "repo"
    repo.mkdir()
    def run(*a):
        return subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)
    run("init", "-q")
    (repo / "f.txt").write_text("a\n")
    run("add", "f.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    sha = run("rev-parse", "HEAD").stdout.strip()
    assert git_commit(str(repo)) == sha
    (repo / "f.txt").write_text("b\n")
    assert git_commit(str(repo)) == sha + "-dirty"


def test_tensorboard_gets_the_resolved_config_commit_and_hparams(tmp_path):
    cfg = load_config(None, ["model.d_model=48", "logging.tensorboard=true", "optim.lr=0.002"])
    w = MetricsWriter(str(tmp_path), cfg, enabled=True,
                      run_info={"git_commit": "abc123", "n_params": 1234, "peak_flops_from": "cpu"})
    w.log({"kind": "val", "step": 1, "loss": 2.5})
    w.close()
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    text = {t: ea.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in ea.Tags()["tensors"]
            if t.endswith("text_summary")}
    assert "d_model: 48" in text["run/config/text_summary"] and "lr: 0.002" in text["run/config/text_summary"]
    assert "git_commit: abc123" in text["run/info/text_summary"]
    content = ea.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model.d_model"].number_value == 48
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.002)
    assert start.hparams["run.git_commit"].string_value == "abc123"
    assert start.hparams["model.layer_pattern"].string_value == str(list(cfg.model.layer_pattern))
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in exp.metric_infos} == {"val/loss", "train/loss"}
    assert [e.value for e in ea.Scalars("val/loss")] == [2.5]


def test_wandb_config_gets_the_resolved_config_and_run_info(tmp_path, monkeypatch):
    import sys
    import types
    calls = []
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(None, ["logging.tensorboard=false", "logging.wandb=true", "model.d_model=48"])
    MetricsWriter(str(tmp_path), cfg, enabled=True, run_info={"git_commit": "abc123"}).close()
    config = calls[0]["config"]
    assert config["model"]["d_model"] == 48 and config["run"] == {"git_commit": "abc123"}
