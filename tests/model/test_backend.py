"""The one backend resolver (``ttt_lm.model.backend``): what "auto" picks per op and device, what
a requested backend gives, and errors that name the op, the request and the reason. Devices are
named, not used: the decisions need no GPU. The attention mixer's and a kernel mixer's own errors
are checked in their files (test_attention.py, test_titans.py)."""
import pytest
import torch

from ttt_lm.model import backend as bk
from ttt_lm.model.backend import Backend, resolve
from ttt_lm.model.registry import builtin_kinds, kinds_with, mixer_class

#: the ops the resolver is asked about, from the registry: a kernels/ op that some kind calls
#: (its op_name), the op of the kind with global attention and of one with a window
KERNEL_OP = next(mixer_class(k).op_name for k in builtin_kinds() if mixer_class(k).op_name)
GLOBAL_OP = mixer_class(kinds_with(lambda c: c.global_attention, builtin_kinds())[0]).backend_op
LOCAL_OP = mixer_class(kinds_with(lambda c: not c.uses_kernel_op and not c.global_attention,
                                  builtin_kinds())[0]).backend_op


def test_kernel_op_auto_picks_triton_on_cuda_and_torch_elsewhere():
    assert resolve(KERNEL_OP, "auto", "cuda") is Backend.TRITON
    assert resolve(KERNEL_OP, "auto", "cpu") is Backend.TORCH
    # an op's own limit sends auto to the next backend, and a forced request to an error
    limits = {Backend.TRITON: "covers the linear memory only"}
    assert resolve(KERNEL_OP, "auto", "cuda", limits=limits) is Backend.TORCH
    with pytest.raises(ValueError, match=rf"{KERNEL_OP}: backend 'triton' was requested but is unavailable: "
                                         r"covers the linear memory only"):
        resolve(KERNEL_OP, "triton", "cuda", limits=limits)


def test_requested_backends_and_members_equal_their_strings():
    for name in ("torch", "triton", "reference"):
        b = resolve(KERNEL_OP, name, "cuda")
        assert b is Backend(name) and b == name and f"{b}" == name


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(bk, "TRITON_INTERPRET", False)
    with pytest.raises(ValueError, match=rf"{KERNEL_OP}: backend 'triton' .* CUDA tensors .* not on cpu"):
        resolve(KERNEL_OP, "triton", "cpu")
    monkeypatch.setattr(bk, "TRITON_INTERPRET", True)
    assert resolve(KERNEL_OP, "triton", "cpu") is Backend.TRITON
    monkeypatch.setattr(bk, "HAS_TRITON", False)
    with pytest.raises(ValueError, match="triton package is not installed"):
        resolve(KERNEL_OP, "triton", "cpu")
    assert resolve(KERNEL_OP, "auto", "cuda") is Backend.TORCH   # auto falls back where triton is absent


def test_unknown_or_foreign_backend_names_the_op_and_the_choices():
    with pytest.raises(ValueError, match=rf"{KERNEL_OP}: unknown backend 'flash'; choose auto or one of \['torch'"):
        resolve(KERNEL_OP, "flash", "cuda")
    with pytest.raises(ValueError, match=rf"{GLOBAL_OP}: unknown backend 'triton'; choose auto or one of \['sdpa'"):
        resolve(GLOBAL_OP, "triton", "cuda")


@pytest.mark.parametrize("flash", [False, True])
def test_attention_auto_order(monkeypatch, flash):
    monkeypatch.setattr(bk, "_flash_attn_func", (lambda *a, **k: None) if flash else None)
    first = [Backend.FLASH] if flash else []
    assert resolve(GLOBAL_OP, "auto", "cuda", torch.bfloat16) is (first + [Backend.SDPA])[0]
    assert resolve(LOCAL_OP, "auto", "cuda", torch.bfloat16) is (first + [Backend.FLEX])[0]
    # flash-attn takes half precision only: float32 on CUDA goes on to the next backend
    assert resolve(LOCAL_OP, "auto", "cuda", torch.float32) is Backend.FLEX
    assert resolve(GLOBAL_OP, "auto", "cuda", torch.float32) is Backend.SDPA
    for op in (GLOBAL_OP, LOCAL_OP):
        assert resolve(op, "auto", "cpu", torch.bfloat16) is Backend.SDPA


def test_attention_requested_backends_and_their_checks(monkeypatch):
    for name in ("sdpa", "math", "flex"):
        assert resolve(LOCAL_OP, name, "cpu", torch.float32) == name
    monkeypatch.setattr(bk, "_flash_attn_func", None)
    with pytest.raises(ValueError, match=rf"{GLOBAL_OP}: backend 'flash' was requested but is unavailable: "
                                         r"the flash-attn package is not installed"):
        resolve(GLOBAL_OP, "flash", "cuda", torch.bfloat16)
    monkeypatch.setattr(bk, "_flash_attn_func", lambda *a, **k: None)
    assert resolve(GLOBAL_OP, "flash", "cuda", torch.bfloat16) is Backend.FLASH
    assert resolve(GLOBAL_OP, "flash", "cuda") is Backend.FLASH          # dtype not known yet
    with pytest.raises(ValueError, match="flash-attn runs on CUDA, not on cpu"):
        resolve(GLOBAL_OP, "flash", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="flash-attn takes bfloat16/float16 inputs, not torch.float32"):
        resolve(GLOBAL_OP, "flash", "cuda", torch.float32)
    monkeypatch.setattr(bk, "HAS_FLEX", False)
    with pytest.raises(ValueError, match=rf"{LOCAL_OP}: backend 'flex' .* has no torch.nn.attention.flex_attention"):
        resolve(LOCAL_OP, "flex", "cuda")
