r"""Mamba-2's state-space dual layer (SSD; Dao & Gu 2024, "Transformers are SSMs", arXiv 2405.21060):
per head a scalar-decayed outer-product memory S ∈ R^{p×n},

    S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ,     y_t = S_t C_t + D x_t     (then ∘ SiLU(z_t) when z is given)

in mamba_ssm's layout and semantics (``mamba_chunk_scan_combined``). ``reference.py`` is the
sequential specification; ``torch_chunk.py`` the chunked (SSD) form, finite under any decay (its
docstring says how). Every backend checks shapes and dtypes at entry (``shapes.py``); the public
function also checks A ≤ 0 and Δ ≥ 0. Design notes: ``kernels/ssd/README.md``.

Backends: "reference", "torch" and "triton" (``chunk.py``: the delta-rule family's chunked
kernels with the delta term switched off, forward and backward, packed batches in one launch per
kernel; n ≤ 128, p ≤ 256).
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract, backends_listed
from kernels.gated_delta_rule.shapes import MAX_DK, MAX_DV
from kernels.ssd.reference import ssd_reference
from kernels.ssd.shapes import check_ssd_inputs, check_ssd_values
from kernels.ssd.torch_chunk import ssd_chunk_torch

try:
    from kernels.ssd.chunk import ssd_triton
except ImportError:  # no triton installed: the PyTorch forms still work
    ssd_triton = None

#: implementations ``ssd`` can dispatch to
BACKENDS = ("torch", "reference") + (("triton",) if ssd_triton is not None else ())
#: what the Triton backend covers (``kernels.contract``): the delta-rule family's head sizes, the
#: state size n as its d_k and the head dim p as its d_v. A caller passes h, p, n and the groups g
#: (``shapes.py``'s names).
CONTRACT = OpContract("kernels.ssd", backends_listed(sys.modules[__name__]),
                      max_dims={"n": MAX_DK, "p": MAX_DV})


def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
        dt_softplus: bool = False, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
        backend: str = "torch", chunk_size: int = 256, cu_seqlens: Optional[torch.Tensor] = None
        ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [b, T, h, p]; dt [b, T, h]; A [h] (≤ 0); B, C [b, T, g, n] (g divides h; head i reads
    group i // (h / g)); D [h] or [h, p]; z [b, T, h, p] (the output is gated by SiLU(z) after D);
    dt_bias [h]; Δ = softplus(dt + dt_bias) when ``dt_softplus``, else dt + dt_bias;
    initial_state [N, h, p, n] or None.

    Returns (y [b, T, h, p] in x's dtype, final state [N, h, p, n] in the accumulation dtype —
    float32 for half inputs — or None unless ``output_final_state``). ``backend``: "torch"
    (chunked, ``chunk_size`` tokens per chunk, a power of two; the result does not depend on it)
    "triton" (``chunk.py``; n ≤ 128, p ≤ 256; kernel chunk ``chunk_size`` capped per dtype and GPU)
    or "reference" (sequential). ``cu_seqlens`` [N + 1] (b = 1): a packed batch of N sequences,
    each from its own row of ``initial_state`` (or zero) and with its own final state, in one
    call (both backends restart the state inside the scan)."""
    check_ssd_inputs("ssd", x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, cu_seqlens)
    if backend not in BACKENDS:
        raise ValueError(f"ssd: unknown backend {backend!r}; available: {list(BACKENDS)}")
    if not torch.compiler.is_compiling():
        check_ssd_values("ssd", dt, A, dt_bias, dt_softplus)
    if backend == "triton":
        return ssd_triton(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state, output_final_state,
                          chunk_size, cu_seqlens)
    if backend == "torch":
        return ssd_chunk_torch(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state, output_final_state,
                               chunk_size, cu_seqlens)
    return ssd_reference(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state, output_final_state, cu_seqlens)


__all__ = ["CONTRACT", "ssd", "ssd_reference", "ssd_chunk_torch", "ssd_triton", "BACKENDS"]
