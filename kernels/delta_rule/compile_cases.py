"""Launch configurations of the delta-rule Triton kernels, for the ahead-of-time compile gate
(``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (the presets' head dims), chunk 64
(DeltaNet's ``chunk_size`` in every preset), bfloat16 and float32 inputs, fixed-length batches
and packed ones (``cu_seqlens``, the configs named "varlen") with an initial and a final state —
the kernel chunk, tiles, precisions, warps and stages that
``delta_rule_triton`` takes from ``chunk.launch_meta`` for each GPU family (sm_90, sm_80): one
case per arch, named with the kernel chunk and the arch. The kernels are the delta-rule family's
(``core.py``) with ``USE_G = False`` (the decay's pointers constexpr None); the gated delta rule's
``compile_cases.py`` compiles the same kernels with ``USE_G = True``."""
from __future__ import annotations

from typing import List

import torch

from kernels.compile_report import ARCHS
from kernels.delta_rule import chunk, core

HEAD_DIMS = (64, 128)
CHUNK = 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def launch_configs() -> List[dict]:
    """One dict per launch: name, kernel, config, signature (every non-constexpr argument → its
    Triton type), constexprs, num_warps, num_stages, archs."""
    out = []
    for arch in ARCHS:
        for varlen in (False, True):
            for dt, tdt in DTYPES.items():
                for d in HEAD_DIMS:
                    out += _launches(arch, dt, tdt, d, varlen)
    return out


def _launches(arch: int, dt: str, tdt: torch.dtype, d: int, varlen: bool = False) -> List[dict]:
    mt = chunk.launch_meta(d, d, tdt, arch)
    return core.gate_launches(mt, arch, dt, d, d, min(mt["C"], CHUNK), varlen, use_g=False)


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    from kernels.compile_report import cases_from_launches

    return cases_from_launches(launch_configs())
