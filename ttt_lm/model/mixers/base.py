"""The interface every sequence mixer implements.

A mixer maps x ∈ R^{B×T×D} to y ∈ R^{B×T×D} causally, and has three forms that tests hold equal:

* ``reference(x, state, output_state)`` — the sequential recurrence (or plain attention), one
  token at a time where the math is a recurrence. It is the specification.
* ``chunked(x, state, output_state)`` — the training form: chunked / dual / parallel, the one
  ``forward`` uses unless ``impl == "reference"``. On CUDA it may call a Triton kernel from
  ``kernels/`` (``kernel_backend``: ``"auto"`` picks Triton on CUDA and PyTorch elsewhere,
  ``"torch"`` / ``"triton"`` force one).
* ``step(x, state)`` — one-token decode: x is [B, 1, D], state is the cache.

``state`` is a dict of tensors (recurrent state, conv caches, KV cache, position). Feeding the
state returned by one segment into the next gives the same outputs as one pass over the
concatenation; ``init_state`` returns the state before any token.

A mixer whose official code reads segment positions (the position of each token in its document,
0 at a document's first token; the data loader's ``position_ids``) sets ``takes_segment_pos``;
its three forms then accept ``segment_pos`` ([B, T] integers) and the block passes it through.
"""
from __future__ import annotations

import abc
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

State = Dict[str, Any]


class Mixer(nn.Module, metaclass=abc.ABCMeta):
    """Subclasses set ``self.d_model`` and implement chunked, reference, step and init_state."""

    #: set by the model: "chunked" (default) or "reference"
    impl: str = "chunked"
    #: "auto" | "torch" | "triton": which implementation of a kernels/ op the chunked form uses
    kernel_backend: str = "auto"
    #: init_weights() calls reset_parameters() on mixers after the generic init
    _mixer_init: bool = True
    #: the forms take ``segment_pos`` [B, T] (position of each token in its document)
    takes_segment_pos: bool = False

    def forward(self, x: torch.Tensor, state: Optional[State] = None,
                output_state: bool = False, **kw) -> Tuple[torch.Tensor, Optional[State]]:
        """``kw``: ``segment_pos`` for mixers that set ``takes_segment_pos``."""
        if self.impl == "reference":
            return self.reference(x, state, output_state, **kw)
        if self.impl != "chunked":
            raise ValueError(f"mixer impl must be 'chunked' or 'reference', got {self.impl!r}")
        return self.chunked(x, state, output_state, **kw)

    @abc.abstractmethod
    def chunked(self, x, state=None, output_state=False):
        """Training form: (y [B, T, D], the state after the last token if output_state else None)."""

    @abc.abstractmethod
    def reference(self, x, state=None, output_state=False):
        """Sequential form, same contract as chunked: the specification the other forms match."""

    @abc.abstractmethod
    def step(self, x: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """One token: x [B, 1, D] and the cache → (y [B, 1, D], the updated cache)."""

    @abc.abstractmethod
    def init_state(self, batch_size: int, device=None, dtype=None) -> State:
        """The state before the first token."""

    def reset_parameters(self) -> None:
        """Mixer-specific initialization, run after the model's generic init."""

    @classmethod
    def block_pre_conv(cls, cfg) -> Optional[int]:
        """Width of the causal convolution that the block runs over the residual stream before
        this mixer (TTT's ``ttt.pre_conv``), or None for none. ``cfg`` is the ModelConfig."""
        return None

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Forward FLOPs per token of this mixer beyond its dense projections (those are counted
        from parameter shapes in ttt_lm.model.flops): attention scores, inner-model updates,
        scans. ``cfg`` is the ModelConfig."""
        return 0.0

    #: whether the chunked form calls a ``kernels/`` op that ``kernel_backend`` selects (attention
    #: does not: it picks SDPA, flex or flash-attn by ``attention.backend``)
    uses_kernel_op: bool = True

    def triton_unavailable(self) -> Optional[str]:
        """Why no Triton kernel covers this layer as configured (None when one does). Mixers that
        call a ``kernels/`` op override it."""
        return "no Triton kernel for this layer kind"

    def resolve_backend(self, device) -> str:
        """What the chunked form runs on ``device``: "triton" or "torch" ("auto": Triton on CUDA
        where a kernel covers the layer, PyTorch otherwise). ``kernel_backend="triton"`` where no
        kernel applies is an error naming the reason, never a silent fallback. A mixer that uses
        no ``kernels/`` op returns "torch"."""
        kb = self.kernel_backend
        if kb not in ("auto", "torch", "triton"):
            raise ValueError(f"model.kernel_backend must be auto, torch or triton, got {kb!r}")
        if kb == "torch" or not self.uses_kernel_op:
            return "torch"
        why = self.triton_unavailable()
        if kb == "triton":
            if why is not None:
                raise ValueError(f"model.kernel_backend=triton: {type(self).__name__} has no Triton kernel: {why}; "
                                 f"use kernel_backend=auto (PyTorch where no kernel applies) or torch")
            return "triton"
        return "triton" if torch.device(device).type == "cuda" and why is None else "torch"

    def _resolve_backend(self, x: torch.Tensor) -> str:
        return self.resolve_backend(x.device)
