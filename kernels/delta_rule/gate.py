"""Launch configurations of the delta-rule Triton kernels, for the ahead-of-time compile gate
(``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (the presets' head dims), chunk 64
(DeltaNet's ``chunk_size`` in every preset), bfloat16 and float32 inputs, fixed-length batches
and packed ones (``cu_seqlens``, the configs named "varlen") with an initial and a final state —
the kernel chunk, tiles, precisions, warps and stages that
``delta_rule_triton`` takes from ``chunk.launch_meta`` for each GPU family (sm_90, sm_80): one
case per arch, named with the kernel chunk and the arch."""
from __future__ import annotations

from typing import List

import torch
import triton.language as tl

from kernels.compile_report import ARCHS
from kernels.delta_rule import chunk

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
    C = min(mt["C"], CHUNK)
    io = lambda *names: {n: "*" + dt for n in names}
    acc = lambda *names: {n: "*fp32" for n in names}
    ints = {"T": "i32", "H": "i32"}
    base = dict(C=C, IS_VARLEN=False, ACC=tl.float32, EMU=False, cu_seqlens=None, chunk_offsets=None)
    entries = [
        (chunk._wy_inv, {**io("k", "beta"), **acc("Tm"), **ints},
         dict(base, chunk_indices=None, DK=d, BK=mt["BK"], PK=mt["PREC"], PS=mt["PS"]), mt["warps_inv"]),
        (chunk._wy_fwd, {**io("k", "v", "beta"), **acc("Tm", "W", "U"), **ints},
         dict(base, chunk_indices=None, DK=d, DV=d, BK=mt["BKW"], BV=mt["BVW"], PS=mt["PS"]), mt["warps_wy"]),
        (chunk._fwd_state, {**io("k"), **acc("W", "U", "Hs", "VN", "h0", "ht"), **ints},
         dict(base, DK=d, DV=d, BK=mt["BKS"], BV=mt["BV"], USE_H0=True, STORE_HT=True,
              PS=mt["PS"]), mt["warps_state"]),
        (chunk._fwd_o, {**io("q", "k"), **acc("VN", "Hs"), **io("o"), **ints},
         dict(base, chunk_indices=None, DK=d, DV=d, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_o"]),
        (chunk._bwd_dv_local, {**io("q", "k", "do"), **acc("dVN"), **ints},
         dict(base, chunk_indices=None, DK=d, DV=d, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_o"]),
        (chunk._bwd_state, {**io("q", "k", "do"), **acc("W", "dht", "dHs", "dVN", "dh0"), **ints},
         dict(base, DK=d, DV=d, BK=mt["BKS"], BV=mt["BV"], USE_DHT=True, STORE_DH0=True,
              PS=mt["PS"]), mt["warps_state"]),
        (chunk._bwd_dqk, {**io("q", "k", "do", "dq"), **acc("VN", "dVN", "Hs", "dHs", "dk_part", "dw"),
                          **ints},
         dict(base, chunk_indices=None, DK=d, DV=d, BK=mt["BK"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_chunk"]),
        (chunk._bwd_wy, {**io("k", "v", "beta", "dk", "dv", "dbeta"), **acc("Tm", "dVN", "dk_part", "dw"),
                         **ints},
         dict(base, chunk_indices=None, DK=d, DV=d, BK=mt["BKS"], BV=mt["BV"], PREC=mt["PREC"],
              PS=mt["PS"]), mt["warps_chunk"]),
    ]
    out = []
    for fn, sig, cex, warps in entries:
        if varlen:   # packed batches pass the offsets and chunk tables (int32) that are None above
            tables = [n for n in ("cu_seqlens", "chunk_offsets", "chunk_indices") if n in cex]
            sig = {**sig, **{n: "*i32" for n in tables}}
            cex = {n: v for n, v in cex.items() if n not in tables} | {"IS_VARLEN": True}
        cfg = f"{dt} dk=dv={d} C={C}{' varlen' if varlen else ''} sm_{arch}"
        out.append(dict(name=f"{fn.__name__}[{cfg}]", kernel=fn, config=cfg, signature=sig,
                        constexprs=cex, num_warps=warps, num_stages=mt["stages"], archs=(arch,)))
    return out


def compile_cases():
    """``launch_configs`` as ``kernels.compile_report`` cases."""
    from kernels.compile_report import cases_from_launches

    return cases_from_launches(launch_configs())
