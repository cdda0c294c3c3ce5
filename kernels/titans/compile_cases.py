"""Launch configurations of the Titans linear-memory Triton kernels, for the ahead-of-time
compile gate (``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (the presets' head
dims), chunk 16 (``titans.chunk_size`` of every preset), bfloat16 and float32 inputs, with the
blocks, precision and warps ``titans_linear_triton`` takes from ``chunk.launch_meta`` for each
GPU family (sm_90, sm_80): one case per arch, named with the arch; fixed-length batches, and
packed ones (``cu_seqlens``, one launch over the batch: the config named "varlen")."""
from __future__ import annotations

from typing import List

import torch
import triton.language as tl

from kernels.compile_report import ARCHS
from kernels.titans import chunk

HEAD_DIMS = (64, 128)
CHUNK = 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_IO = ("q_ptr", "k_ptr", "v_ptr", "th_ptr", "le_ptr", "lk_ptr", "y_ptr", "dy_ptr")
_INTS = ("T", "H", "NCH", "DK", "DV", "BH", "C")
_TABLES = ("cu_seqlens", "chunk_offsets", "chunk_indices")


def launch_configs() -> List[dict]:
    """One dict per launch: name, kernel, config, signature (every non-constexpr argument → its
    Triton type), constexprs, num_warps, num_stages, archs."""
    out = []
    for arch in ARCHS:
        for varlen in (False, True):
            for dt, tdt in DTYPES.items():
                for d in HEAD_DIMS:
                    mt = chunk.launch_meta(d, d, tdt, arch)
                    cfg = f"{dt} dk=dv={d} C={CHUNK}{' varlen' if varlen else ''} sm_{arch}"
                    serial, par = (mt["BK"], mt["BV"]), (mt["BK_chunk"], mt["BV_chunk"])
                    for fn, (bk, bv), nw in ((chunk._titans_fwd_state_kernel, serial, mt["warps_state"]),
                                             (chunk._titans_fwd_kernel, par, mt["warps_fwd"]),
                                             (chunk._titans_bwd_state_kernel, serial, mt["warps_state"]),
                                             (chunk._titans_bwd_kernel, par, mt["warps_bwd"])):
                        cex = dict(BC=chunk._tile(CHUNK), BK=bk, BV=bv, IS_VARLEN=varlen, ACC=tl.float32,
                                   PREC=mt["PREC"])
                        out.append(_launch(fn, cfg, dt, cex, nw, arch, varlen))
                    cex = dict(BC=chunk._tile(CHUNK), IS_VARLEN=varlen, ACC=tl.float32, PREC=mt["PREC"])
                    out.append(_launch(chunk._titans_bwd_gates_kernel, cfg, dt, cex, mt["warps_gates"], arch,
                                       varlen))
    return out


def _launch(fn, cfg: str, dt: str, cex: dict, nw: int, arch: int, varlen: bool) -> dict:
    if not varlen:   # fixed-length launches pass None for the chunk tables
        cex = {**cex, **{n: None for n in _TABLES if n in fn.arg_names}}

    def ty(n):
        if n in _TABLES:
            return "*i32"
        return "i32" if n in _INTS else "*" + (dt if n in _IO else "fp32")
    sig = {n: ty(n) for n in fn.arg_names if n not in cex}
    return dict(name=f"{fn.__name__}[{cfg}]", kernel=fn, config=cfg, signature=sig, constexprs=cex, num_warps=nw,
                num_stages=chunk.NUM_STAGES, archs=(arch,))


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    from kernels.compile_report import cases_from_launches

    return cases_from_launches(launch_configs())
