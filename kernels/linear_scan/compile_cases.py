"""Launch configurations of the linear-scan (RG-LRU) Triton kernels for the compile gate
(``python -m kernels.compile_report``): every autotune config the pruner keeps at the default
tile of 64 steps and at the 16-step tile of the segment pass, bfloat16 and float32 inputs, the
training path's flags (states stored for the backward, no initial state). The pruner's choice
depends on the GPU family (``chunk.prune_for_arch``), so each config is compiled for the archs
that can pick it."""
from __future__ import annotations

from kernels.compile_report import ARCHS, case
from kernels.linear_scan import chunk

DTYPES = ("bf16", "fp32")
TILES = (64, chunk._SEG_BT)


def _arch_cases(kernel, config, meta, forward, **kw):
    kept = {a: chunk.prune_for_arch(list(kernel.configs), a, meta, forward) for a in ARCHS}
    out, seen = [], []
    for a in ARCHS:
        for c in kept[a]:
            if c not in seen:
                seen.append(c)
    for c in seen:
        tag = " ".join(f"{k}={v}" for k, v in c.kwargs.items())
        out.append(case(kernel, f"{config} {tag} w{c.num_warps} s{c.num_stages}", constexprs={**meta, **c.kwargs},
                        num_warps=c.num_warps, num_stages=c.num_stages,
                        archs=tuple(a for a in ARCHS if c in kept[a]), **kw))
    return out


def compile_cases():
    import triton.language as tl
    out = []
    ints = {n: "i32" for n in ("T", "D", "TILES_PER_SEG", "NT")}
    for dt in DTYPES:
        # without cu_seqlens the wrapper passes b as the (unused) CU pointer
        io = {n: dt for n in ("LA", "BX", "H", "G", "DLA", "DB", "CU")}
        for BT in TILES:
            cfg = f"{dt} BT={BT}"
            fwd = dict(HAS_H0=False, STORE_H=True, STORE_ST=True, STORE_LSUM=False, IS_VARLEN=False,
                       ACC=tl.float32, BT=BT)
            bwd = dict(HAS_X0=False, HAS_H0=False, FULL=True, IS_VARLEN=False, ACC=tl.float32, BT=BT)
            out += _arch_cases(chunk._fwd_kernel, cfg, fwd, True, scalars=ints, pointers=io, matmul=False)
            out += _arch_cases(chunk._bwd_kernel, cfg, bwd, False, scalars=ints, pointers=io, matmul=False)
    return out
