"""Which implementation each layer kind runs (``LM.kernel_backends``), asked for device "cuda"
on a CPU machine: the decision needs no GPU. No silent fallback: ``kernel_backend=triton`` where
no kernel covers a layer raises, naming the layer kind."""
import pytest

from kernels.selective_scan import has_triton_backend as mamba_has_triton
from ttt_lm.config import load_config
from ttt_lm.model import LM


def _model(preset, *overrides):
    return LM(load_config(f"configs/{preset}.yaml", ["model.n_layers=" + ("3" if "griffin" in preset else "4"), *overrides]).model)


def test_auto_picks_triton_on_cuda_and_torch_on_cpu():
    m = _model("tiny_hybrid")                           # ttt_linear ×3, then attention
    cuda = m.kernel_backends("cuda")
    assert cuda["ttt_linear"] == "triton"
    assert cuda["attention"].startswith("attention:")  # attention does not use kernels/
    assert m.kernel_backends("cpu")["ttt_linear"] == "torch"


@pytest.mark.parametrize("preset,kind", [("tiny_ttt_mlp", "ttt_mlp"), ("tiny_deltanet", "deltanet"),
                                         ("tiny_griffin", "rglru")])
def test_kernels_that_exist_are_used_on_cuda(preset, kind):
    assert _model(preset).kernel_backends("cuda")[kind] == "triton"
    assert _model(preset, "model.kernel_backend=triton").kernel_backends("cuda")[kind] == "triton"


def test_torch_forces_the_pytorch_form():
    assert set(_model("tiny_hybrid", "model.kernel_backend=torch").kernel_backends("cuda").values()) == {
        "torch", "attention:auto"}


def test_titans_mlp_memory_runs_torch_under_auto_and_fails_loudly_under_triton():
    """The Titans kernel covers the linear memory only; the presets use the MLP memory."""
    assert _model("tiny_titans_lmm").kernel_backends("cuda")["titans"] == "torch"
    assert _model("tiny_titans_lmm", "model.titans.memory=linear").kernel_backends("cuda")["titans"] == "triton"
    m = _model("tiny_titans_lmm", "model.kernel_backend=triton")
    with pytest.raises(ValueError, match=r"layer kind 'titans' \(layer 0\).*linear memory"):
        m.kernel_backends("cuda")
    # the chunked form itself refuses too, on any device
    import torch
    with pytest.raises(ValueError, match="linear memory"):
        m(torch.zeros(1, 8, dtype=torch.long))


def test_mamba_without_a_triton_scan_fails_loudly_under_triton():
    m = _model("tiny_mamba", "model.kernel_backend=triton")
    if mamba_has_triton():
        assert m.kernel_backends("cuda")["mamba"] == "triton"
    else:
        assert _model("tiny_mamba").kernel_backends("cuda")["mamba"] == "torch"
        with pytest.raises(ValueError, match=r"layer kind 'mamba'.*selective_scan has no Triton kernel"):
            m.kernel_backends("cuda")


def test_gated_deltanet_backend_follows_the_op():
    """Gated DeltaNet runs kernels.gated_delta_rule: Triton on CUDA under auto when the op lists a
    Triton backend, PyTorch otherwise; kernel_backend=triton without one fails naming the layer."""
    import kernels.gated_delta_rule as gdr
    m = _model("tiny_gated_deltanet")
    if "triton" in gdr.BACKENDS:
        assert m.kernel_backends("cuda")["gated_deltanet"] == "triton"
    else:
        assert m.kernel_backends("cuda")["gated_deltanet"] == "torch"
        with pytest.raises(ValueError, match=r"layer kind 'gated_deltanet'.*gated_delta_rule has only"):
            _model("tiny_gated_deltanet", "model.kernel_backend=triton").kernel_backends("cuda")
    assert m.kernel_backends("cpu")["gated_deltanet"] == "torch"
