"""Launch configurations of the SSD's Triton kernels, for the ahead-of-time compile gate
(``python -m kernels.compile_report``): the mamba2 presets' heads (state size n = 128 as d_k,
head dim p = 64 as d_v) and a small one (n = p = 64), bfloat16 inputs (the training dtype), chunk
64 asked for (capped per GPU family by ``chunk.launch_meta``; mamba2's chunk_size 256 gets the same
cap), fixed-length batches and packed ones (``cu_seqlens``, configs named "varlen") with an
initial and a final state — one case per arch (sm_90, sm_80). The kernels are the delta-rule
family's (``kernels/delta_rule/core.py``) with ``USE_G = True`` and ``USE_DELTA = False``
(configs named "NO_DELTA USE_G"): ``_fwd_state``, ``_fwd_o``, ``_bwd_dv_local``, ``_bwd_state``,
``_bwd_dqk`` and ``_bwd_beta``; β (the step Δ) and dβ are float32."""
from __future__ import annotations

from typing import List

import torch

from kernels.compile_report import ARCHS
from kernels.delta_rule import core
from kernels.ssd import chunk

HEAD_DIMS = ((128, 64), (64, 64))     # (n, p) = (d_k, d_v)
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
                    out += core.gate_launches(mt, arch, dt, dk, dv, min(mt["C"], CHUNK), varlen, use_g=True,
                                              use_delta=False)
    return out


#: the kernels among them that call no ``tl.dot`` (no tensor-core instruction to expect)
NO_DOT = ("_bwd_beta",)


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    import dataclasses

    from kernels.compile_report import cases_from_launches

    return [dataclasses.replace(c, matmul=c.kernel not in NO_DOT) for c in cases_from_launches(launch_configs())]
