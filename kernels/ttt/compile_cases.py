"""Launch configurations of the TTT Triton kernels for the compile gate
(``python -m kernels.compile_report``): the presets' head dims (64; 128 at 1.3B, and 96 at 760M,
which runs in the same 128-wide tiles), TTT-MLP's 4x inner width, mini-batch 16 (every preset)
and 64, bfloat16 and float32 inputs, with the tile sizes and launch options the wrappers in
``chunk.py`` (TTT-Linear, per GPU family: one case per arch, named with it) and ``mlp_chunk.py``
(TTT-MLP; its per-mini-batch backward per GPU family, named likewise) pick. TTT-Linear and TTT-MLP
also run packed batches (``cu_seqlens``, one launch over all sequences): those variants take the
offsets and mini-batch tables (int32 pointers, None above) with VARLEN = True, configs named
"varlen". The TTT-Linear head of a state begun mid-mini-batch (pos > 0) is a launch of the same
variants: every launch of its output kernel and per-mini-batch backward passes a pointer ZH and its
row count NZH (0 without a head). TTT-MLP's head passes ZH1, GW2 and NZH to the same output kernel
(NZH = 0 without a head) and runs a variant of its per-mini-batch backward (HEAD = True, configs
named "head", with its own column block and warps)."""
from __future__ import annotations

import torch

from kernels.compile_report import ARCHS, arg_names, case
from kernels.ttt import chunk, mlp_chunk

HEAD_DIMS = (64, 128)
LINEAR_MINI_BATCHES = (16, 64)
MLP_MINI_BATCHES = (16,)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: the TTT-MLP serial kernels' pointer arguments that only packed launches pass (None otherwise):
#: the offsets, the first slots, and the carry's per-sequence last-mini-batch gradients
MLP_VARLEN_ONLY = ("CU", "CS", "DL1", "DLB1", "DL2", "DLB2")


def compile_cases():
    out = []
    ints = {"T": "i32", "NMB": "i32", "LAST": "i32", "H": "i32", "NC": "i32", "NZH": "i32", "eps": "fp32"}
    io_names = ("XQ", "XK", "XV", "ETA", "OUT", "DOUT", "DXQ", "DXK", "DXV", "DETA")
    for dt, tdt in DTYPES.items():
        for d in HEAD_DIMS:
            for b in LINEAR_MINI_BATCHES:
                for arch, varlen in ((a, v) for v in (False, True) for a in ARCHS):
                    # TTT-Linear picks its warps per GPU family; packed batches ("varlen") pass tables
                    cfg = f"{dt} d={d} b={b}{' varlen' if varlen else ''} sm_{arch}"
                    tables = {"VARLEN": True} if varlen else {"CU": None, "CS": None, "CI": None, "VARLEN": False}
                    for kern, extra, part in ((chunk._ttt_linear_state_kernel, {}, "state"),
                                              (chunk._ttt_linear_out_kernel, {}, "out"),
                                              (chunk._ttt_linear_bwd_mb_kernel, {}, "bwd_mb"),
                                              (chunk._ttt_linear_bwd_kernel, {}, "bwd")):
                        BD, BT, kw = chunk._launch_cfg(d, b, part, half=dt == "bf16", arch=arch, packed=varlen)
                        names = set(arg_names(kern))
                        ptrs = {n: dt for n in io_names if n in names}
                        if varlen:
                            ptrs.update(CU="i32", CS="i32", CI="i32")
                        if dt == "bf16":
                            ptrs["WS"] = ptrs["GS"] = "bf16"      # see _linear_mini_batch_buffers
                        tiles = {k: kw[k] for k in ("BC", "RB") if k in kw}
                        out.append(case(kern, cfg, constexprs=dict(D=d, BD=BD, MB=b, BT=BT, PREC=chunk._precision(tdt),
                                                                   **tiles, **extra, **tables),
                                        scalars=ints, pointers=ptrs, num_warps=kw["num_warps"],
                                        num_stages=kw["num_stages"], archs=(arch,)))
            for b, varlen in ((b, v) for b in MLP_MINI_BATCHES for v in (False, True)):
                m = 4 * d
                BD, BM, BT, kw = mlp_chunk._mlp_launch_cfg(d, m, b, packed=varlen)
                cfg = f"{dt} d={d} m={m} b={b}{' varlen' if varlen else ''}"
                prec = chunk._precision(tdt)
                fwd = {"BK": mlp_chunk._mlp_col_block(BD, prec, packed=varlen)}
                # the per-mini-batch backward picks its column block per GPU family: one case per arch
                per_arch = [(mlp_chunk._ttt_mlp_bwd_mb_kernel, f"{cfg} sm_{arch}",
                             {"BK": mlp_chunk._mlp_col_block(BD, prec, "bwd_mb", arch=arch), "HEAD": False}, (arch,), kw)
                            for arch in ARCHS]
                # its head variant (HEAD = True: the launch completing a mini-batch begun in the
                # state), with its own column block and warps per GPU family
                for arch in ARCHS:
                    hbk, hkw = mlp_chunk._mlp_head_bwd_cfg(BD, prec, arch)
                    per_arch.append((mlp_chunk._ttt_mlp_bwd_mb_kernel, f"{cfg} head sm_{arch}",
                                     {"BK": hbk, "HEAD": True}, (arch,), hkw))
                # the carry's own launch options (``_mlp_carry_opts``: the packed bf16 one, num_stages 2)
                serial = [(mlp_chunk._ttt_mlp_fwd_kernel, cfg, fwd, ARCHS, kw),
                          (mlp_chunk._ttt_mlp_bwd_kernel, cfg, fwd, ARCHS, mlp_chunk._mlp_carry_opts(kw, BD, prec, varlen))]
                # a packed batch runs the output and per-mini-batch backward kernels as they are (on
                # its slot-major copy): only the serial ones have packed variants
                parallel = [] if varlen else [(mlp_chunk._ttt_mlp_out_kernel, cfg, fwd, ARCHS, kw)] + per_arch
                for kern, name, extra, archs, kw in serial + parallel:
                    names = set(arg_names(kern))
                    ptrs = {n: dt for n in io_names if n in names}
                    # packed batches ("varlen") pass the offsets and tables; the others None
                    tables = {n: None for n in MLP_VARLEN_ONLY if n in names}
                    if "VARLEN" in names:
                        tables["VARLEN"] = varlen
                    if varlen:
                        ptrs.update({n: "i32" for n in ("CU", "CS") if n in names})
                        tables = {"VARLEN": True}
                    out.append(case(kern, name, constexprs=dict(D=d, BD=BD, M=m, BM=BM, MB=b, BT=BT, PREC=prec,
                                                                **extra, **tables),
                                    scalars={**ints, "R": "i32", "NS": "i32"}, pointers=ptrs,
                                    num_warps=kw.get("num_warps", 4), num_stages=kw.get("num_stages", 1),
                                    archs=archs))
    return out
