"""Launch configurations of KDA's Triton kernels, for the ahead-of-time compile gate
(``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (Kimi Linear's heads are 128 wide
for keys and values), chunk 64, bfloat16 inputs (the training dtype), fixed-length batches and
packed ones (``cu_seqlens``, the configs named "varlen") with an initial and a final state — the
kernel chunk, tiles, precisions, warps and stages that ``kda_triton`` takes from
``chunk.launch_meta`` for each GPU family (sm_90, sm_80): one case per arch, named with the kernel
chunk and the arch. The kernels are the delta-rule family's (``kernels/delta_rule/core.py``) with
``USE_GK = True`` (configs named "USE_GK"), and its three USE_GK kernels (γ, the decayed scores,
their gradients)."""
from __future__ import annotations

from typing import List

import torch

from kernels.compile_report import ARCHS
from kernels.delta_rule import core
from kernels.kda import chunk

HEAD_DIMS = ((64, 64), (128, 128))
CHUNK = 64
DTYPES = {"bf16": torch.bfloat16}


def launch_configs() -> List[dict]:
    """One dict per launch: name, kernel, config, signature (every non-constexpr argument → its
    Triton type), constexprs, num_warps, num_stages, archs."""
    out = []
    for arch in ARCHS:
        for varlen in (False, True):
            for dt, tdt in DTYPES.items():
                for dk, dv in HEAD_DIMS:
                    mt = chunk.launch_meta(dk, dv, tdt, arch)
                    out += core.gate_launches(mt, arch, dt, dk, dv, min(mt["C"], CHUNK), varlen, use_g=False,
                                              use_gk=True)
    return out


#: the kernels among them that call no ``tl.dot`` (no tensor-core instruction to expect)
NO_DOT = ("_gk_cumsum",)


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    import dataclasses

    from kernels.compile_report import cases_from_launches

    return [dataclasses.replace(c, matmul=c.kernel not in NO_DOT) for c in cases_from_launches(launch_configs())]
