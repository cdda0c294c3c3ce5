"""The one backend resolver (``ttt_lm.model.backend``): what "auto" picks per op and device, what
a requested backend gives, and errors that name the op, the request and the reason. Devices are
named, not used: the decisions need no GPU."""
import pytest
import torch

from tests.model.mixer_checks import make_mixer
from ttt_lm.model import backend as bk
from ttt_lm.model.backend import Backend, resolve


def test_kernel_op_auto_picks_triton_on_cuda_and_torch_elsewhere():
    assert resolve("delta_rule", "auto", "cuda") is Backend.TRITON
    assert resolve("delta_rule", "auto", "cpu") is Backend.TORCH
    # an op's own limit sends auto to the next backend, and a forced request to an error
    limits = {Backend.TRITON: "covers the linear memory only"}
    assert resolve("titans", "auto", "cuda", limits=limits) is Backend.TORCH
    with pytest.raises(ValueError, match=r"titans: backend 'triton' was requested but is unavailable: "
                                         r"covers the linear memory only"):
        resolve("titans", "triton", "cuda", limits=limits)


def test_requested_backends_and_members_equal_their_strings():
    for name in ("torch", "triton", "reference"):
        b = resolve("linear_scan", name, "cuda")
        assert b is Backend(name) and b == name and f"{b}" == name


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(bk, "TRITON_INTERPRET", False)
    with pytest.raises(ValueError, match=r"ttt_linear: backend 'triton' .* CUDA tensors .* not on cpu"):
        resolve("ttt_linear", "triton", "cpu")
    monkeypatch.setattr(bk, "TRITON_INTERPRET", True)
    assert resolve("ttt_linear", "triton", "cpu") is Backend.TRITON
    monkeypatch.setattr(bk, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="triton package is not installed"):
        resolve("ttt_linear", "triton", "cpu")
    assert resolve("ttt_linear", "auto", "cuda") is Backend.TORCH   # auto falls back where triton is absent


def test_unknown_or_foreign_backend_names_the_op_and_the_choices():
    with pytest.raises(ValueError, match=r"mamba: unknown backend 'flash'; choose auto or one of \['torch'"):
        resolve("mamba", "flash", "cuda")
    with pytest.raises(ValueError, match=r"attention: unknown backend 'triton'; choose auto or one of \['sdpa'"):
        resolve("attention", "triton", "cuda")


@pytest.mark.parametrize("flash", [False, True])
def test_attention_auto_order(monkeypatch, flash):
    monkeypatch.setattr(bk, "_flash_attn_func", (lambda *a, **k: None) if flash else None)
    first = [Backend.FLASH] if flash else []
    assert resolve("attention", "auto", "cuda", torch.bfloat16) is (first + [Backend.SDPA])[0]
    assert resolve("local_attention", "auto", "cuda", torch.bfloat16) is (first + [Backend.FLEX])[0]
    # flash-attn takes half precision only: float32 on CUDA goes on to the next backend
    assert resolve("local_attention", "auto", "cuda", torch.float32) is Backend.FLEX
    assert resolve("attention", "auto", "cuda", torch.float32) is Backend.SDPA
    for op in ("attention", "local_attention"):
        assert resolve(op, "auto", "cpu", torch.bfloat16) is Backend.SDPA


def test_attention_requested_backends_and_their_checks(monkeypatch):
    for name in ("sdpa", "math", "flex"):
        assert resolve("local_attention", name, "cpu", torch.float32) == name
    monkeypatch.setattr(bk, "_flash_attn_func", None)
    with pytest.raises(ValueError, match=r"attention: backend 'flash' was requested but is unavailable: "
                                         r"the flash-attn package is not installed"):
        resolve("attention", "flash", "cuda", torch.bfloat16)
    monkeypatch.setattr(bk, "_flash_attn_func", lambda *a, **k: None)
    assert resolve("attention", "flash", "cuda", torch.bfloat16) is Backend.FLASH
    assert resolve("attention", "flash", "cuda") is Backend.FLASH          # dtype not known yet
    with pytest.raises(ValueError, match="flash-attn runs on CUDA, not on cpu"):
        resolve("attention", "flash", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="flash-attn takes bfloat16/float16 inputs, not torch.float32"):
        resolve("attention", "flash", "cuda", torch.float32)
    monkeypatch.setattr(bk, "HAS_FLEX", False)
    with pytest.raises(ValueError, match=r"local_attention: backend 'flex' .* has no torch.nn.attention.flex_attention"):
        resolve("local_attention", "flex", "cuda")


@pytest.mark.parametrize("name", ["sdpa", "math", "flex"])
def test_attention_mixer_runs_through_the_resolver(name):
    """Every attention.backend string gives the reference's outputs on CPU, and the mixer's
    resolver names its op; a bad string fails at the config."""
    m, _ = make_mixer("local_attention", attention={"window": 3, "backend": name})
    assert m.resolve_backend("cpu") == name
    x = torch.randn(2, 9, m.d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():   # flex_attention has no backward on CPU
        y, _ = m.chunked(x)
        y_ref, _ = m.reference(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-9)   # float64: summation order only
    m.backend = "flash"
    with pytest.raises(ValueError, match="local_attention: backend 'flash' was requested but is unavailable"):
        m.chunked(x)


def test_bad_attention_backend_fails_at_the_config():
    with pytest.raises(ValueError, match="model.attention.backend must be auto, sdpa, flex, flash or math, got 'cudnn'"):
        make_mixer("attention", attention={"backend": "cudnn"})


def test_kernel_mixer_errors_name_the_config_key_and_the_reason():
    m, _ = make_mixer("titans", titans={"memory": "mlp"})
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match=r"model.kernel_backend=triton: TitansMemory has no Triton kernel: "
                                         r"titans: backend 'triton' was requested but is unavailable: .*linear memory"):
        m.resolve_backend("cuda")
    m.kernel_backend = "auto"
    assert m.resolve_backend("cuda") is Backend.TORCH
