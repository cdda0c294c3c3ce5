r"""Titans linear neural memory with momentum and forgetting (Behrouz et al. 2025):

    S_t = η_t S_{t−1} − θ_t ∇ℓ(M̂_t; k_t, v_t),   M_t = (1 − α_t) M_{t−1} + S_t,   o_t = M_t(q_t)

with ℓ(M; k, v) = ‖Mᵀk − v‖² and gradients within a chunk taken at the memory at the chunk's start
(see ``reference.py``, the specification). ``torch_chunk.py`` is the chunk-parallel form; its
``chunk_decays`` / ``chunk_memory_step`` also serve the MLP memory of the Titans mixer.

Variable-length batches: ``cu_seqlens`` (int32 [N+1], cumulative lengths, B = 1) packs N
sequences along T. Each starts at a chunk boundary (``offset`` a multiple of ``chunk_size``) from
row n of ``initial_state`` ((M, S[, M̂]), each [N, H, d_k, d_v]) or from zero memory; the final
(M, S, M̂) is stacked [N, H, d_k, d_v]. Sequences may be empty (final state = initial state, with
M̂ = M). The "triton" backend launches each of its kernels once over the whole packed batch
(per-sequence state restart, chunks that never straddle two sequences, chunk tables built on the
device: ``chunk._layout``); "torch" and "reference" run once on each sequence.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Sequence, Tuple

import torch

from kernels.contract import OpContract, Requirement, backends_listed
from kernels.titans.reference import _acc, _initial, check_titans_inputs, titans_linear_reference
from kernels.titans.torch_chunk import (chunk_decays, chunk_memory_step, chunk_spans,
                                        titans_linear_chunk_torch)

#: implementations ``titans_linear`` can dispatch to
BACKENDS = ("torch", "reference", "triton")
#: what the Triton backend covers (``kernels.contract``): the linear memory (``memory``), which
#: this op is; a caller's MLP memory runs ``torch_chunk``'s chunk steps in PyTorch
CONTRACT = OpContract("kernels.titans", backends_listed(sys.modules[__name__]),
                      requires=(Requirement("memory", lambda m: m == "linear",
                                            "kernels/titans has a Triton kernel only for the linear memory, "
                                            "not {name}={value!r}"),))


def titans_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor,
                  log_eta: torch.Tensor, log_keep: torch.Tensor,
                  initial_state: Optional[Sequence[torch.Tensor]] = None, output_final_state: bool = False,
                  backend: str = "torch", chunk_size: int = 16, offset: int = 0,
                  cu_seqlens: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """q, k [B, H, T, d_k]; v [B, H, T, d_v]; theta (θ_t), log_eta (log η_t), log_keep
    (log(1 − α_t)) [B, H, T]; initial_state None or (M, S) or (M, S, M̂), each [B, H, d_k, d_v].

    ``offset``: tokens of the current chunk already consumed (their chunk's anchor is M̂).
    Returns (o [B, H, T, d_v] in v's dtype, (M, S, M̂) in the accumulation dtype or None).
    With ``cu_seqlens`` (int32 [N+1], B = 1) the N packed sequences each start from their row of
    ``initial_state`` [N, …]: in one launch per kernel with "triton", one after another with the
    other backends (see the module docstring)."""
    n_states = None
    if cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        n_states = cu_seqlens.numel() - 1
    check_titans_inputs("titans_linear", q, k, v, theta, log_eta, log_keep, initial_state, chunk_size,
                        offset, n_states)
    if cu_seqlens is not None and backend == "triton":
        from kernels.titans.chunk import titans_linear_triton
        return titans_linear_triton(q, k, v, theta, log_eta, log_keep, initial_state, output_final_state,
                                    chunk_size, offset, cu_seqlens)
    if cu_seqlens is not None:
        return _titans_varlen(q, k, v, theta, log_eta, log_keep, initial_state, output_final_state,
                              backend, chunk_size, offset, cu_seqlens)
    if backend == "torch":
        return titans_linear_chunk_torch(q, k, v, theta, log_eta, log_keep, initial_state,
                                         output_final_state, chunk_size, offset)
    if backend == "triton":
        # imported here so that importing kernels.titans neither needs triton nor fixes
        # TRITON_INTERPRET before a caller sets it
        from kernels.titans.chunk import titans_linear_triton
        return titans_linear_triton(q, k, v, theta, log_eta, log_keep, initial_state,
                                    output_final_state, chunk_size, offset)
    if backend == "reference":
        return titans_linear_reference(q, k, v, theta, log_eta, log_keep, initial_state,
                                       output_final_state, chunk_size, offset)
    raise ValueError(f"titans_linear: unknown backend {backend!r}; available: {list(BACKENDS)}")


def _seq_bounds(cu_seqlens: torch.Tensor, B: int, T: int) -> List[int]:
    """The packed batch's offsets on the host, checked."""
    if B != 1:
        raise ValueError(f"titans_linear: cu_seqlens needs packed input with B = 1, got B = {B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"titans_linear: cu_seqlens must be an integer tensor [N+1] with N ≥ 1, "
                         f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"titans_linear: cu_seqlens must rise from 0 to T = {T} without decreasing, got {bounds}")
    return bounds


def _titans_varlen(q, k, v, theta, log_eta, log_keep, initial_state, output_final_state, backend,
                   chunk_size, offset, cu_seqlens):
    """One ``titans_linear`` call per sequence of the packed batch (the PyTorch backends); outputs
    concatenated along T, final states stacked along the batch axis."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    bounds = _seq_bounds(cu_seqlens, B, T)
    N = len(bounds) - 1
    if offset % chunk_size:
        raise ValueError(f"titans_linear: with cu_seqlens every sequence must start at a chunk boundary "
                         f"(offset a multiple of chunk_size = {chunk_size}), got offset = {offset}")
    if initial_state is not None:
        # at a chunk boundary the anchor M̂ is M itself, so a given M̂ is never read
        initial_state = tuple(initial_state[:2])
        for name, s in zip(("M", "S"), initial_state):
            if s.shape != (N, H, dk, dv):
                raise ValueError(f"titans_linear: with cu_seqlens initial {name} must be [N, H, d_k, d_v] = "
                                 f"{(N, H, dk, dv)}, got {tuple(s.shape)}")
    outs, finals = [], []
    for n, (t0, t1) in enumerate(zip(bounds[:-1], bounds[1:])):
        st = None if initial_state is None else tuple(s[n:n + 1] for s in initial_state)
        if t1 > t0:
            o, fin = titans_linear(*(x[:, :, t0:t1] for x in (q, k, v, theta, log_eta, log_keep)), st,
                                   output_final_state, backend, chunk_size, 0)
            outs.append(o)
        elif output_final_state:
            M, S, _ = _initial(st, 1, H, dk, dv, _acc(k[..., :0]))
            fin = (M, S, M)
        else:
            fin = None
        finals.append(fin)
    o = torch.cat(outs, 2) if outs else v.new_zeros(1, H, 0, dv)
    if not output_final_state:
        return o, None
    return o, tuple(torch.cat([f[i] for f in finals], 0) for i in range(3))


__all__ = ["CONTRACT", "titans_linear", "titans_linear_reference", "titans_linear_chunk_torch", "chunk_decays",
           "chunk_memory_step", "chunk_spans", "BACKENDS"]
