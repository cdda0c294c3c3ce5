"""Launch configurations of the selective-scan (Mamba) Triton kernels for the compile gate
(``python -m kernels.compile_report``): Mamba's state size N = 16, the tiles that
``tile_sizes`` gives for chunk sizes 4, 8 and 16 (the presets use 16), bfloat16 and float32
inputs, the training path's flags (tile states stored, no initial state, no ``cu_seqlens``) and,
at the presets' tile, packed sequences with an initial state and its gradient. The kernels are
elementwise scans (no ``tl.dot``): no tensor-core instructions are expected."""
from __future__ import annotations

from kernels.compile_report import case
from kernels.selective_scan import chunk

N_STATE = 16
DTYPES = ("bf16", "fp32")


def compile_cases():
    import triton.language as tl
    out = []
    ints = {n: "i32" for n in ("T", "TOTAL", "DI", "N", "NT")}
    for dt in DTYPES:
        for cs, varlen in ((4, False), (8, False), (16, False), (16, True)):
            BT, BD, BN = chunk.tile_sizes(cs, N_STATE, interpreting=False)
            # x, B, C and ∂x in the input dtype; Δ, A, y, ∂y, the states and the other gradients
            # float32; without cu_seqlens the wrapper passes x as the (unused) CU pointer
            io = {n: dt for n in ("X", "BM", "CM", "DX")}
            io["CU"] = "i32" if varlen else dt
            cfg = f"{dt} N={N_STATE} BT={BT}" + (" varlen h0" if varlen else "")
            base = dict(IS_VARLEN=varlen, ACC=tl.float32, BT=BT, BLOCK_D=BD, BLOCK_N=BN)
            fwd = dict(base, HAS_H0=varlen, STORE_ST=True)
            bwd = dict(base, HAS_GHT=varlen, HAS_H0=varlen)
            fsc = {k: v for k, v in ints.items() if k != "TOTAL"}
            out.append(case(chunk._selective_scan_fwd, cfg, constexprs=fwd, scalars=fsc, pointers=io,
                            num_warps=chunk.NUM_WARPS, matmul=False))
            out.append(case(chunk._selective_scan_bwd, cfg, constexprs=bwd, scalars=ints, pointers=io,
                            num_warps=chunk.NUM_WARPS, matmul=False))
    return out
