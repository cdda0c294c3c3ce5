"""Launch configurations of the gated delta rule's Triton kernels, for the ahead-of-time compile
gate (``python -m kernels.compile_report``): d_k ∈ {64, 128} with d_v = 2·d_k (the official
layer's value heads are twice its key heads; the presets' d_k = 96 and 128 take the tiles of
d_k = 128), chunk 64 (``gated_deltanet.chunk_size`` in every preset), bfloat16 and float32 inputs,
fixed-length batches and packed ones (``cu_seqlens``, the configs named "varlen") with an
initial and a final state — the kernel chunk, tiles, precisions, warps and stages that
``gated_delta_rule_triton`` takes from ``chunk.launch_meta`` for each GPU family (sm_90, sm_80):
one case per arch, named with the kernel chunk and the arch."""
from __future__ import annotations

from typing import List

import torch
import triton.language as tl

from kernels.compile_report import ARCHS
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
    C = min(mt["C"], CHUNK)
    io = lambda *names: {n: "*" + dt for n in names}
    acc = lambda *names: {n: "*fp32" for n in names}
    ints = {"T": "i32", "H": "i32"}
    base = dict(C=C, IS_VARLEN=False, ACC=tl.float32, EMU=False, cu_seqlens=None, chunk_offsets=None)
    entries = [
        (chunk._gdr_wy_inv, {**io("k", "beta"), **acc("g", "Tm"), **ints},
         dict(base, chunk_indices=None, DK=dk, BK=mt["BK"], PK=mt["PREC"], PS=mt["PS"]), mt["warps_inv"]),
        (chunk._gdr_wy_fwd, {**io("k", "v", "beta"), **acc("g", "Tm", "W", "U"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKW"], BV=mt["BVW"], PS=mt["PS"]), mt["warps_wy"]),
        (chunk._gdr_fwd_state, {**io("k"), **acc("g", "W", "U", "Hs", "VN", "h0", "ht"), **ints},
         dict(base, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], USE_H0=True, STORE_HT=True,
              PS=mt["PS"]), mt["warps_state"]),
        (chunk._gdr_fwd_o, {**io("q", "k"), **acc("g", "VN", "Hs"), **io("o"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_o"]),
        (chunk._gdr_bwd_dv_local, {**io("q", "k"), **acc("g"), **io("do"), **acc("dVN"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_o"]),
        (chunk._gdr_bwd_state, {**io("q", "k"), **acc("g", "W"), **io("do"), **acc("dht", "dHs", "dVN", "dh0"),
                                **ints},
         dict(base, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV"], USE_DHT=True, STORE_DH0=True,
              PS=mt["PS"]), mt["warps_state"]),
        (chunk._gdr_bwd_dqk, {**io("q", "k"), **acc("g", "VN"), **io("do"), **acc("dVN", "Hs", "dHs"), **io("dq"),
                              **acc("dk_part", "dw", "dg_part"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BK"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_chunk"]),
        (chunk._gdr_bwd_wy, {**io("k", "v", "beta"), **acc("g", "Tm", "dVN", "dk_part", "dw", "dg_part"),
                             **io("dk", "dv", "dbeta"), **acc("dg"), **ints},
         dict(base, chunk_indices=None, DK=dk, DV=dv, BK=mt["BKS"], BV=mt["BV_bwd_wy"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_bwd_wy"]),
    ]
    out = []
    for fn, sig, cex, warps in entries:
        if varlen:   # packed batches pass the offsets and chunk tables (int32) that are None above
            tables = [n for n in ("cu_seqlens", "chunk_offsets", "chunk_indices") if n in cex]
            sig = {**sig, **{n: "*i32" for n in tables}}
            cex = {n: v for n, v in cex.items() if n not in tables} | {"IS_VARLEN": True}
        cfg = f"{dt} dk={dk} dv={dv} C={C}{' varlen' if varlen else ''} sm_{arch}"
        out.append(dict(name=f"{fn.__name__}[{cfg}]", kernel=fn, config=cfg, signature=sig,
                        constexprs=cex, num_warps=warps, num_stages=mt["stages"], archs=(arch,)))
    return out


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    from kernels.compile_report import cases_from_launches

    return cases_from_launches(launch_configs())
