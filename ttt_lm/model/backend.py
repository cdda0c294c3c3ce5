"""The one backend resolver: which implementation of an op a mixer runs.

Every mixer's training form calls one op: a ``kernels/`` op (``ttt_linear``, ``delta_rule``,
``linear_scan``, …), which has a PyTorch and a Triton implementation, or attention, which has
torch's SDPA, ``flex_attention``, flash-attn and an explicit softmax ("math"). A mixer asks
``resolve(op, requested, device)`` which one to run; ``requested`` is the config string
(``model.kernel_backend`` for a ``kernels/`` op, ``attention.backend`` for attention), "auto"
letting the resolver pick the first available backend in the op's order of preference for the
device. Each backend has one availability check (``unavailable``); an op's own limits (a Triton
kernel that covers the linear Titans memory only) come from the mixer as ``limits``. A requested
backend that cannot run is an error naming the op, the request and the reason, never a silent
fallback.

``Backend`` is a ``StrEnum``: its members compare equal to the config strings and the ``backend``
strings the ``kernels/`` entry points take.
"""
from __future__ import annotations

import enum
import importlib.util
import os
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch


class Backend(enum.StrEnum):
    REFERENCE = "reference"   # the op's sequential specification (impl="reference")
    TORCH = "torch"           # the PyTorch chunked form of a kernels/ op
    TRITON = "triton"         # the Triton kernel of a kernels/ op
    SDPA = "sdpa"             # torch.nn.functional.scaled_dot_product_attention
    FLEX = "flex"             # torch.nn.attention.flex_attention with a block mask
    FLASH = "flash"           # flash-attn's flash_attn_func
    MATH = "math"             # the explicit softmax in PyTorch


_BY_NAME = {b.value: b for b in Backend}
#: a kernels/ op's backends, and the order "auto" tries them in on CUDA and elsewhere
KERNEL_BACKENDS = (Backend.TORCH, Backend.TRITON, Backend.REFERENCE)
KERNEL_AUTO = {"cuda": (Backend.TRITON, Backend.TORCH), "other": (Backend.TORCH,)}
#: attention's backends (the attention.backend strings besides "auto")
ATTENTION_BACKENDS = (Backend.SDPA, Backend.FLEX, Backend.FLASH, Backend.MATH, Backend.REFERENCE)
#: attention ops: "attention" (causal, every earlier key), "local_attention" (a sliding window;
#: flex_attention's block mask skips the blocks outside it)
ATTENTION_AUTO = {
    "attention": {"cuda": (Backend.FLASH, Backend.SDPA), "other": (Backend.SDPA,)},
    "local_attention": {"cuda": (Backend.FLASH, Backend.FLEX, Backend.SDPA), "other": (Backend.SDPA,)},
}


def _device_type(device) -> str:
    return torch.device(device).type


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# what the availability checks read, found once at import (the checks run inside compiled code,
# where an import or a module search would break the graph)
HAS_TRITON = _importable("triton")
HAS_FLEX = _importable("torch.nn.attention.flex_attention")
#: Triton's interpreter runs the kernels on CPU tensors; it must be set before triton is imported
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:  # optional extra
    from flash_attn import flash_attn_func as _flash_attn_func  # type: ignore
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func  # type: ignore
except Exception:  # noqa: BLE001 - any import problem means "not available"
    _flash_attn_func = None
    _flash_attn_varlen_func = None


def flash_attn_func() -> Optional[Callable]:
    """flash-attn's ``flash_attn_func``, or None where the package does not import."""
    return _flash_attn_func


def flash_attn_varlen_func() -> Optional[Callable]:
    """flash-attn's ``flash_attn_varlen_func`` (documents of packed rows through ``cu_seqlens``),
    or None where the package does not import."""
    return _flash_attn_varlen_func


def _capturing() -> bool:
    from kernels._launch_cache import capture_arch
    return capture_arch() is not None


def _triton(device, dtype) -> Optional[str]:
    if not HAS_TRITON:
        return "the triton package is not installed"
    if _device_type(device) == "meta" and _capturing():
        return None     # kernels._launch_cache.capture: launches are recorded for a stand-in GPU
    if _device_type(device) != "cuda" and not TRITON_INTERPRET:
        return f"Triton kernels run on CUDA tensors (or on CPU under TRITON_INTERPRET=1), not on {_device_type(device)}"
    return None


def _flex(device, dtype) -> Optional[str]:
    if not HAS_FLEX:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def _flash(device, dtype) -> Optional[str]:
    if flash_attn_func() is None:
        return "the flash-attn package is not installed (or does not import)"
    if _device_type(device) != "cuda":
        return f"flash-attn runs on CUDA, not on {_device_type(device)}"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn takes bfloat16/float16 inputs, not {dtype}"
    return None


def _always(device, dtype) -> Optional[str]:
    return None


#: the one availability check of each backend: (device, dtype or None) → why not, None if it runs
CHECKS: Dict[Backend, Callable[..., Optional[str]]] = {
    Backend.REFERENCE: _always, Backend.TORCH: _always, Backend.SDPA: _always, Backend.MATH: _always,
    Backend.TRITON: _triton, Backend.FLEX: _flex, Backend.FLASH: _flash,
}


def op_backends(op: str) -> Tuple[Backend, ...]:
    """The backends ``op`` has."""
    return ATTENTION_BACKENDS if op in ATTENTION_AUTO else KERNEL_BACKENDS


def auto_order(op: str, device) -> Tuple[Backend, ...]:
    """The backends "auto" tries for ``op`` on ``device``, in order (the last always runs)."""
    where = "cuda" if _device_type(device) == "cuda" else "other"
    if op not in ATTENTION_AUTO and _device_type(device) == "meta" and HAS_TRITON and _capturing():
        where = "cuda"      # a launch capture stands in for a GPU: its kernels/ ops choose as there
    return (ATTENTION_AUTO[op] if op in ATTENTION_AUTO else KERNEL_AUTO)[where]


def unavailable(op: str, backend: Backend, device, dtype=None,
                limits: Optional[Mapping[Backend, Optional[str]]] = None) -> Optional[str]:
    """Why ``backend`` cannot run ``op`` on ``device`` (None when it can): the op's own limit
    for it, if any, else the backend's availability check."""
    why = (limits or {}).get(backend)
    return why if why is not None else CHECKS[backend](device, dtype)


def resolve(op: str, requested, device, dtype=None,
            limits: Optional[Mapping[Backend, Optional[str]]] = None) -> Backend:
    """The backend that runs ``op`` on ``device`` (and ``dtype``, where known) for the config
    string ``requested``: "auto" → the first available one of ``auto_order``; a backend name →
    that backend, or a ValueError naming the op, the request and why it cannot run. ``limits``:
    backend → why this op as configured has no such implementation (None: no limit)."""
    if requested == "auto":
        order = auto_order(op, device)
        for b in order:
            if unavailable(op, b, device, dtype, limits) is None:
                return b
        raise ValueError(f"{op}: no backend of {[str(b) for b in order]} is available on {device}")
    choices = op_backends(op)
    b = _BY_NAME.get(requested)
    if b is None or b not in choices:
        raise ValueError(f"{op}: unknown backend {requested!r}; choose auto or one of {[str(c) for c in choices]}")
    why = unavailable(op, b, device, dtype, limits)
    if why is not None:
        raise ValueError(f"{op}: backend {requested!r} was requested but is unavailable: {why}")
    return b


__all__ = ["Backend", "resolve", "unavailable", "auto_order", "op_backends", "CHECKS", "flash_attn_func"]
