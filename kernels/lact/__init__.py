r"""LaCT: large-chunk test-time training with SwiGLU fast weights (Zhang et al. 2025, "Test-Time
Training Done Right"), the op of the ``lact`` mixer.

    f_W(x) = w1 (silu(w0 x) ⊙ (w2 x)),   w0, w2 ∈ R^{d_h×d_k},  w1 ∈ R^{d_v×d_h}

Apply, then update, one chunk of ``chunk_size`` tokens at a time: a chunk's queries read the
weights written by the chunks before it, then its keys and values write (the inner loss
−Σ_t ⟨f_W(k_t), v_t⟩ with per-token learning rates lr0, lr1, lr2), optionally with momentum and
Muon, followed by a row normalisation back to the initial weights' row norms. The last chunk of a
stream is never written. ``reference.py`` writes the schedule and its formulas out;
``torch_chunk.py`` is the batched form (large bmm's over all heads) used for training;
``shapes.py`` holds the entry checks and the stream state. See README.md.
"""
from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import torch

from kernels.contract import OpContract, backends_listed
from kernels.lact.reference import lact_schedule_reference
from kernels.lact.shapes import (NS_COEFFS, PENDING, check_lact_inputs, newton_schulz5, start_state,
                                 state_dtype, stream)
from kernels.lact.torch_chunk import lact_schedule_torch

#: implementations ``block_causal_lact_swiglu`` can dispatch to
BACKENDS = ("torch", "reference")
#: no Triton backend (``kernels.contract``)
CONTRACT = OpContract("kernels.lact", backends_listed(sys.modules[__name__]))

_SCHEDULES = {"torch": lact_schedule_torch, "reference": lact_schedule_reference}


def block_causal_lact_swiglu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             lr0: torch.Tensor, lr1: torch.Tensor, lr2: torch.Tensor,
                             w0: Optional[torch.Tensor], w1: Optional[torch.Tensor], w2: Optional[torch.Tensor],
                             chunk_size: int = 2048, use_muon: bool = False,
                             momentum: Optional[torch.Tensor] = None, prenorm: bool = False,
                             muon_dtype: Optional[torch.dtype] = torch.bfloat16,
                             initial_state: Optional[Dict[str, torch.Tensor]] = None,
                             output_final_state: bool = False, backend: str = "torch",
                             resets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[Dict[str, torch.Tensor]]]:
    """Block-causal LaCT with SwiGLU fast weights.

    q, k [B, H, T, d_k]; v [B, H, T, d_v]; lr0, lr1, lr2 and momentum (None: no momentum)
    [B, H, T]; w0, w2 [H, d_h, d_k] or [B, H, d_h, d_k]; w1 [H, d_v, d_h] or [B, H, d_v, d_h]
    (the weights at the start of the stream; ignored, and may be None, when ``initial_state`` is
    given). ``use_muon``: orthogonalise each update with five Newton–Schulz steps run in
    ``muon_dtype`` (bfloat16 as the official code; None: the state's dtype). ``prenorm``: the
    official prenorm variant (the updates accumulate on un-normalised weights). ``resets``
    [B, ⌈T/chunk_size⌉] bool (packed documents, each starting at a chunk boundary; no
    ``initial_state``): before chunk c of row b with resets[b, c] the row starts again from w0, w1,
    w2 (zero momentum), so each document's outputs are those of the document alone; the write of
    a document's last chunk is discarded by the next reset.

    The fast weights live in the weights' dtype (float32 for half-precision weights); the
    products run in that dtype (an autocast region the caller opens applies to them).

    Returns (o [B, H, T, d_v] in v's dtype, final_state or None). ``final_state`` (a dict, see
    ``shapes.py``) holds the weights the last token was read with and what continues the stream
    exactly: passed as ``initial_state`` to the next call, two calls equal one call over the
    concatenation, and a full open chunk is written when the next token arrives.
    """
    B, H, T, dk, dv, dh = check_lact_inputs(q, k, v, lr0, lr1, lr2, w0, w1, w2, chunk_size, momentum,
                                            muon_dtype, initial_state, backend, BACKENDS)
    if resets is not None:
        n_chunks = -(-T // chunk_size)
        if not isinstance(resets, torch.Tensor) or resets.dtype != torch.bool or tuple(resets.shape) != (B, n_chunks):
            raise ValueError(f"block_causal_lact_swiglu: resets must be a bool tensor [B, ⌈T/chunk_size⌉] = "
                             f"{[B, n_chunks]}, got {getattr(resets, 'dtype', type(resets).__name__)} "
                             f"{tuple(getattr(resets, 'shape', ()))}")
        if initial_state is not None:
            raise ValueError("block_causal_lact_swiglu: resets restart from w0, w1, w2 and cannot be combined "
                             "with an initial_state")
    if initial_state is not None:
        if ("w0_main" in initial_state) != bool(prenorm):
            raise ValueError(f"block_causal_lact_swiglu: initial_state was made with prenorm="
                             f"{'w0_main' in initial_state}, but prenorm={prenorm}")
        sd = state_dtype(initial_state["w0"].dtype)
    else:
        sd = state_dtype(w0.dtype)
    W = start_state(w0, w1, w2, B, prenorm, momentum is not None, sd, initial_state)
    s, n0 = stream(q, k, v, lr0, lr1, lr2, momentum, sd, initial_state)
    o, W = _SCHEDULES[backend](q.to(sd), s, W, n0, chunk_size, use_muon, prenorm, muon_dtype, resets)
    o = o.to(v.dtype)
    if not output_final_state:
        return o, None
    L = s["k"].shape[2]
    start = ((L - 1) // chunk_size) * chunk_size   # the open chunk: the last, never written
    final = dict(W)
    for key in PENDING + (("momentum",) if momentum is not None else ()):
        final[key] = s[key][:, :, start:]
    return o, final


__all__ = ["CONTRACT", "block_causal_lact_swiglu", "lact_schedule_reference", "lact_schedule_torch", "newton_schulz5",
           "NS_COEFFS", "BACKENDS"]
