"""Launch configurations of the delta-rule Triton kernels for the compile gate
(``python -m kernels.compile_report``): d_k = d_v ∈ {64, 128} (the presets' head dims), chunk 64
(every preset), bfloat16 and float32 inputs, the blocks ``DeltaRuleChunkFunction`` picks, packed
(``cu_seqlens``) and not."""
from __future__ import annotations

from kernels.compile_report import arg_names, case
from kernels.delta_rule import chunk

HEAD_DIMS = (64, 128)
CHUNK = 64
DTYPES = ("bf16", "fp32")


def compile_cases():
    import triton.language as tl
    out = []
    ints = {"T": "i32", "H": "i32"}
    for dt in DTYPES:
        io = {n: dt for n in ("q", "k", "v", "beta", "o", "do", "dq", "dk", "dv", "dbeta")}
        prec = "ieee" if dt == "fp32" else "tf32"
        for d in HEAD_DIMS:
            BK = chunk._pow2(d)
            BV = min(chunk._pow2(d), chunk.BV_MAX)
            common = dict(DK=d, DV=d, C=CHUNK, BK=BK, BV=BV, IS_VARLEN=False, ACC=tl.float32, PREC=prec)
            # without cu_seqlens the wrapper passes None for the packing tensors
            nopack = dict(cu_seqlens=None, chunk_offsets=None, chunk_indices=None)
            cfg = f"{dt} dk=dv={d} C={CHUNK}"
            for kern, extra in ((chunk._wy_fwd, {}), (chunk._fwd_state, dict(USE_H0=True, STORE_HT=True)),
                                (chunk._bwd_state, dict(USE_DHT=True, STORE_DH0=True)), (chunk._bwd_chunk, {})):
                cx = dict(common, **extra, **{n: None for n in nopack if n in arg_names(kern)})
                out.append(case(kern, cfg, constexprs=cx, scalars=ints, pointers=io))
    return out
