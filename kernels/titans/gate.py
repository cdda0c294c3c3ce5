"""Launch configurations of the Titans linear-memory Triton kernels for the compile gate
(``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (the presets' head dims), chunk 16
(the presets' ``titans.chunk_size``), bfloat16 and float32 inputs, with the blocks, precision
and ``num_warps`` that ``TitansLinearChunkFunction`` picks."""
from __future__ import annotations

import torch

from kernels.compile_report import case
from kernels.titans import chunk

HEAD_DIMS = (64, 128)
CHUNK = 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compile_cases():
    import triton.language as tl
    out = []
    ints = {n: "i32" for n in ("T", "N", "DK", "DV", "BH", "C")}
    for dt, tdt in DTYPES.items():
        io = {n: dt for n in ("q_ptr", "k_ptr", "v_ptr", "th_ptr", "le_ptr", "lk_ptr", "y_ptr", "dy_ptr")}
        for d in HEAD_DIMS:
            BK, BV, nw = chunk._blocks(d, d)
            cx = dict(BC=chunk._tile(CHUNK), BK=BK, BV=BV, ACC=tl.float32, PREC=chunk._precision(tdt))
            cfg = f"{dt} dk=dv={d} C={CHUNK}"
            for kern in (chunk._titans_fwd_kernel, chunk._titans_bwd_kernel):
                out.append(case(kern, cfg, constexprs=cx, scalars=ints, pointers=io, num_warps=nw))
    return out
