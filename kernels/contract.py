r"""An op's contract: what its Triton backend covers, declared once in the op's folder.

Each op exports ``CONTRACT`` (``kernels.<op>.CONTRACT``; ``kernels.ttt`` has one per op,
``TTT_LINEAR`` and ``TTT_MLP``), an :class:`OpContract`: whether the Triton kernels are built
(``built``), the input dtypes they take, the largest head sizes (``max_dims``: an argument's name
→ its limit), the values of an option they cover (``requires``), and whether they take packed
sequences (``varlen``: ``cu_seqlens`` in one launch) and initial states. The model's backend
resolver asks it (``OpContract.triton_unavailable``) with the arguments a layer will pass and
picks PyTorch, or refuses ``backend="triton"``, with the reason it gives; the layers hold no copy
of these limits.

An argument's name in a reason is the caller's ``labels`` entry where it gives one (the config
key the value comes from, e.g. ``titans.memory``), else the op's own name for it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

#: the floating-point inputs every Triton kernel of kernels/ reads (float64 in IEEE arithmetic)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class Requirement:
    """An option value the Triton kernels cover: ``ok(value)``; else ``reason`` formatted with
    ``name`` (the caller's label for the argument) and ``value``."""
    arg: str
    ok: Callable[[Any], bool]
    reason: str


@dataclasses.dataclass(frozen=True)
class OpContract:
    #: the op, as its folder is imported (``kernels.kda``)
    op: str
    #: why the Triton backend is not built (None: it is); read when asked, not at import
    built: Callable[[], Optional[str]]
    dtypes: Tuple[torch.dtype, ...] = FLOAT_DTYPES
    #: head-size limits: argument → the largest value the kernels take
    max_dims: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: option values the kernels cover, checked in order after the head sizes
    requires: Tuple[Requirement, ...] = ()
    #: packed sequences (``cu_seqlens``) in one launch per kernel
    varlen: bool = True
    #: an initial state in and a final state out
    initial_state: bool = True

    def triton_unavailable(self, dtype: Optional[torch.dtype] = None, *, varlen: bool = False,
                           initial_state: bool = False, labels: Optional[Mapping[str, str]] = None,
                           **args) -> Optional[str]:
        """Why the Triton kernels do not cover a call with these arguments (None when they do).
        ``dtype``: the inputs' (None: not known yet); ``varlen`` / ``initial_state``: whether the
        call needs them; ``args``: the call's head sizes and options by the op's names for them
        (every ``max_dims`` and ``requires`` argument must be given); ``labels``: argument →
        the name a reason gives it."""
        why = self.built()
        if why is not None:
            return why
        labels = labels or {}
        missing = [a for a in list(self.max_dims) + [r.arg for r in self.requires] if a not in args]
        if missing:
            raise ValueError(f"{self.op}'s contract needs the call's {missing} to decide; got {sorted(args)}")
        if dtype is not None and dtype not in self.dtypes:
            return f"its Triton kernels take inputs of {[str(d) for d in self.dtypes]}, not {dtype}"
        over = {a: m for a, m in self.max_dims.items() if args[a] > m}
        if over:
            limits = " and ".join(f"{labels.get(a, a)} ≤ {m}" for a, m in self.max_dims.items())
            have = ", ".join(f"{labels.get(a, a)} = {args[a]}" for a in self.max_dims)
            return f"its Triton kernel takes {limits}; this layer has {have}"
        for r in self.requires:
            if not r.ok(args[r.arg]):
                return r.reason.format(name=labels.get(r.arg, r.arg), value=args[r.arg])
        if varlen and not self.varlen:
            return f"{self.op}'s Triton kernels take no packed sequences (cu_seqlens)"
        if initial_state and not self.initial_state:
            return f"{self.op}'s Triton kernels take no initial state"
        return None


def backends_listed(module) -> Callable[[], Optional[str]]:
    """``OpContract.built`` for an op whose ``BACKENDS`` tuple lists "triton" when its kernels
    import (``module``: the op's package, ``sys.modules[__name__]`` while it imports): the reason
    names what it lists. The tuple is read when asked (a test may replace it), by an attribute
    read, with no import (the resolver runs inside compiled graphs)."""
    def built() -> Optional[str]:
        backends = module.BACKENDS
        return None if "triton" in backends else f"{module.__name__} has only {list(backends)}"
    return built


__all__ = ["OpContract", "Requirement", "FLOAT_DTYPES", "backends_listed"]
