"""Launch configurations of the Titans linear-memory Triton kernels, for the ahead-of-time
compile gate (``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (the presets' head
dims), chunk 16 (``titans.chunk_size`` of every preset), bfloat16 and float32 inputs, with the
blocks, precision and warps ``titans_linear_triton`` takes from ``chunk._blocks`` and
``chunk._precision``."""
from __future__ import annotations

from typing import List

import torch
import triton.language as tl

from kernels.titans import chunk

HEAD_DIMS = (64, 128)
CHUNK = 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_IO = ("q_ptr", "k_ptr", "v_ptr", "th_ptr", "le_ptr", "lk_ptr", "y_ptr", "dy_ptr")
_INTS = ("T", "N", "DK", "DV", "BH", "C")


def launch_configs() -> List[dict]:
    """One dict per launch: name, kernel, config, signature (every non-constexpr argument → its
    Triton type), constexprs, num_warps, num_stages."""
    out = []
    for dt, tdt in DTYPES.items():
        for d in HEAD_DIMS:
            cfg = f"{dt} dk=dv={d} C={CHUNK}"
            for fn in (chunk._titans_fwd_kernel, chunk._titans_bwd_kernel):
                BK, BV, nw = chunk._blocks(d, d, forward=fn is chunk._titans_fwd_kernel)
                cex = dict(BC=chunk._tile(CHUNK), BK=BK, BV=BV, ACC=tl.float32, PREC=chunk._precision(tdt))
                names = fn.arg_names
                sig = {n: ("i32" if n in _INTS else "*" + (dt if n in _IO else "fp32"))
                       for n in names if n not in cex}
                out.append(dict(name=f"{fn.__name__}[{cfg}]", kernel=fn, config=cfg, signature=sig,
                                constexprs=dict(cex), num_warps=nw, num_stages=chunk.NUM_STAGES))
    return out


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    from kernels.compile_report import cases_from_launches

    return cases_from_launches(launch_configs())
