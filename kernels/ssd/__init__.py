r"""Mamba-2's state-space dual layer (SSD; Dao & Gu 2024, "Transformers are SSMs", arXiv 2405.21060):
per head a scalar-decayed outer-product memory S ∈ R^{p×n},

    S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ,     y_t = S_t C_t + D x_t     (then ∘ SiLU(z_t) when z is given)

in mamba_ssm's layout and semantics (``mamba_chunk_scan_combined``). ``reference.py`` is the
sequential specification; ``torch_chunk.py`` the chunked (SSD) form, finite under any decay (its
docstring says how). Every backend checks shapes and dtypes at entry (``shapes.py``); the public
function also checks A ≤ 0 and Δ ≥ 0. Design notes: ``kernels/ssd/README.md``.

Backends: "reference" and "torch". The Triton kernels (chunked forward and backward, varlen) are
not written yet: ``backend="triton"`` is refused with that reason.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch

from kernels.contract import OpContract, backends_listed
from kernels.ssd.reference import ssd_reference
from kernels.ssd.shapes import check_ssd_inputs, check_ssd_values
from kernels.ssd.torch_chunk import ssd_chunk_torch

#: implementations ``ssd`` can dispatch to
BACKENDS = ("torch", "reference")
#: what the Triton backend covers (``kernels.contract``): not built yet, which the reason says.
#: A caller passes the head sizes h, p, n and the groups g (``shapes.py``'s names) for limits here.
CONTRACT = OpContract("kernels.ssd", backends_listed(sys.modules[__name__]))


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
    or "reference" (sequential). ``cu_seqlens`` [N + 1] (b = 1): a packed batch of N sequences,
    each from its own row of ``initial_state`` (or zero) and with its own final state, in one
    call (both backends restart the state inside the scan)."""
    check_ssd_inputs("ssd", x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, cu_seqlens)
    if backend == "triton":
        raise ValueError("ssd: no Triton backend yet (the chunked forward and backward kernels are not written); "
                         f"available: {list(BACKENDS)}")
    if backend not in BACKENDS:
        raise ValueError(f"ssd: unknown backend {backend!r}; available: {list(BACKENDS)}")
    if not torch.compiler.is_compiling():
        check_ssd_values("ssd", dt, A, dt_bias, dt_softplus)
    if backend == "torch":
        return ssd_chunk_torch(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state, output_final_state,
                               chunk_size, cu_seqlens)
    return ssd_reference(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state, output_final_state, cu_seqlens)


__all__ = ["CONTRACT", "ssd", "ssd_reference", "ssd_chunk_torch", "BACKENDS"]
