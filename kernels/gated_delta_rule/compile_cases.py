"""Launch configurations of the gated delta rule's Triton kernels, for the ahead-of-time compile
gate (``python -m kernels.compile_report``): d_k ∈ {64, 128} with d_v = 2·d_k (the official
layer's value heads are twice its key heads; the presets' d_k = 96 and 128 take the tiles of
d_k = 128), chunk 64 (``gated_deltanet.chunk_size`` in every preset), bfloat16 and float32 inputs,
fixed-length batches and packed ones (``cu_seqlens``, the configs named "varlen") with an
initial and a final state — the kernel chunk, tiles, precisions, warps and stages that
``gated_delta_rule_triton`` takes from ``chunk.launch_meta`` for each GPU family (sm_90, sm_80):
one case per arch, named with the kernel chunk and the arch. The kernels are the delta-rule
family's (``kernels/delta_rule/core.py``) with ``USE_G = True``; their configs are named "USE_G"."""
from __future__ import annotations

from typing import List

import torch

from kernels.compile_report import ARCHS
from kernels.delta_rule import core
from kernels.gated_delta_rule import chunk

HEAD_DIMS = ((64, 128), (128, 256))
CHUNK = 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def launch_configs() -> List[dict]:
    """One dict per launch: name, kernel, config, signature (every non-constexpr argument → its
    Triton type), constexprs, num_warps, num_stages, archs."""
    out = []
    for arch in ARCHS:
        for varlen in (False, True):
            for dt, tdt in DTYPES.items():
                for dk, dv in HEAD_DIMS:
                    out += _launches(arch, dt, tdt, dk, dv, varlen)
    return out


def _launches(arch: int, dt: str, tdt: torch.dtype, dk: int, dv: int, varlen: bool = False) -> List[dict]:
    mt = chunk.launch_meta(dk, dv, tdt, arch)
    return core.gate_launches(mt, arch, dt, dk, dv, min(mt["C"], CHUNK), varlen, use_g=True)


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    from kernels.compile_report import cases_from_launches

    return cases_from_launches(launch_configs())
