r"""The LaCT schedule (``reference.py`` states it) as batched matrix products, the training form.

Batch and heads are folded into one batch dimension N = B·H, tokens are rows, and w0 and w2 are
stacked into one [N, 2·d_h, d_k] matrix W₀₂, so that a chunk costs a handful of large bmm's:

    [G | H]   = [Q_c ; K_c] W₀₂ᵀ                       queries and keys of the chunk in one product
    O_c       = (silu(G_q) ⊙ H_q) w1ᵀ                  apply (weights before the chunk's write)
    A         = V_c w1
    dw1       = (lr1 ⊙ V_c)ᵀ (silu(G_k) ⊙ H_k)
    [dw0;dw2] = [lr0 ⊙ A ⊙ H_k ⊙ silu'(G_k) | lr2 ⊙ A ⊙ silu(G_k)]ᵀ K_c

(lr scales a token's row, the same as scaling k_t as the official code does). Momentum, Muon and
the row normalisation follow per chunk; Muon runs on dw0, dw2 (and dw1 when it has their shape)
as one batched Newton–Schulz. Autograd differentiates the whole schedule. ``resets`` [B, n_chunks]
(packed documents, each starting at a chunk boundary): before chunk c of a row with
resets[b, c], that row's weights, accumulators and momentum buffers go back to the stream's start
(``torch.where``, a mask in the scan).

Linear cost in T: the stream is split into chunks once before the loop (``split``) and the
outputs concatenated once after it, so backward never materialises a full-length gradient per
chunk. The Python loop runs over chunks only: the ops dispatched and the elements allocated, in
forward and in backward, grow with T / chunk_size (tests/kernels/test_lact_op.py counts both).
Within a chunk the same rule holds one level down: [G | H] of the queries and the keys is cut
into its four blocks with ``split`` (so are the lr's, and Muon's stacked result), whose backward
is one ``cat`` of the blocks' gradients; indexing it four times (``gh[:, :tq, :dh]``, ...) made
the backward of each block write a zero tensor of [G | H]'s full size and sum the four: a fifth
to a quarter of the elements the backward allocated per chunk (4 heads of 64, chunks of 64 to 256).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from kernels.lact.shapes import chunk_bounds, newton_schulz5


def _muon(dw02: torch.Tensor, dw1: torch.Tensor, dtype: Optional[torch.dtype]):
    N, two_dh, dk = dw02.shape
    dh = two_dh // 2
    parts = dw02.reshape(2 * N, dh, dk)
    if dw1.shape[-2:] == (dh, dk):   # square heads: one batched call for all three
        x02, x1 = newton_schulz5(torch.cat([parts, dw1], 0), dtype).split([2 * N, N], 0)
        return x02.reshape(N, two_dh, dk), x1
    return newton_schulz5(parts, dtype).reshape(N, two_dh, dk), newton_schulz5(dw1, dtype)


def _normed(w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return w / (w.norm(dim=-1, keepdim=True) + 1e-5) * target


def lact_schedule_torch(q: torch.Tensor, s: Dict[str, torch.Tensor], W: Dict[str, torch.Tensor],
                        n0: int, chunk_size: int, use_muon: bool, prenorm: bool,
                        muon_dtype: Optional[torch.dtype], resets: Optional[torch.Tensor] = None):
    """Same arguments and result as ``reference.lact_schedule_reference``."""
    B, H, T, dk = q.shape
    N = B * H
    L = s["k"].shape[2]
    dh = W["w0"].shape[2]
    C = chunk_size
    bounds = chunk_bounds(L, C)
    use_m = "momentum" in s

    def flat(t):
        return t.reshape(N, *t.shape[2:])

    qs = flat(q).split([max(0, en - max(st, n0)) for st, en, _ in bounds], dim=1)
    ks = flat(s["k"]).split(C, dim=1)
    vs = flat(s["v"]).split(C, dim=1)
    lr0s, lr1s, lr2s = (flat(s[n])[..., None].split(C, dim=1) for n in ("lr0", "lr1", "lr2"))   # [N, C, 1]
    ms = flat(s["momentum"]).split(C, dim=1) if use_m else None

    w02 = torch.cat([flat(W["w0"]), flat(W["w2"])], 1)          # [N, 2dh, dk]
    w1 = flat(W["w1"])                                           # [N, dv, dh]
    t02 = torch.cat([flat(W["w0_norm"]), flat(W["w2_norm"])], 1)
    t1 = flat(W["w1_norm"])
    if prenorm:
        m02_main = torch.cat([flat(W["w0_main"]), flat(W["w2_main"])], 1)
        m1_main = flat(W["w1_main"])
    if use_m:
        b02 = torch.cat([flat(W["m0"]), flat(W["m2"])], 1)
        b1 = flat(W["m1"])
    if resets is not None:   # [B, n_chunks] → [n_chunks, N, 1, 1], and the state to go back to
        rs = resets[:, None, :].expand(B, H, resets.shape[1]).reshape(N, -1).T[..., None, None]
        start = (w02, w1, m02_main, m1_main) if prenorm else (w02, w1)

    outs: List[torch.Tensor] = []
    for c, (st, en, written) in enumerate(bounds):
        if resets is not None and c > 0:
            r = rs[c]
            w02, w1 = torch.where(r, start[0], w02), torch.where(r, start[1], w1)
            if prenorm:
                m02_main, m1_main = torch.where(r, start[2], m02_main), torch.where(r, start[3], m1_main)
            if use_m:
                b02, b1 = torch.where(r, 0.0, b02), torch.where(r, 0.0, b1)
        qc = qs[c]
        tq = qc.shape[1]
        if not written:
            if tq:
                gq, hq = torch.bmm(qc, w02.transpose(1, 2)).split(dh, -1)
                outs.append(torch.bmm(F.silu(gq) * hq, w1.transpose(1, 2)))
            continue
        kc, vc = ks[c], vs[c]
        gh = torch.bmm(torch.cat([qc, kc], 1) if tq else kc, w02.transpose(1, 2))
        if tq:   # the blocks by split, not indexing: see the module docstring
            ghq, gh = gh.split([tq, kc.shape[1]], 1)
            gq, hq = ghq.split(dh, -1)
            outs.append(torch.bmm(F.silu(gq) * hq, w1.transpose(1, 2)))
        g, h = gh.split(dh, -1)                                  # G_k, H_k [N, C, dh]
        a = torch.bmm(vc, w1)                                    # [N, C, dh]
        sg = torch.sigmoid(g)
        sil = g * sg
        dw1 = torch.bmm((vc * lr1s[c]).transpose(1, 2), sil * h)
        d0 = a * h * sg * (1 + g * (1 - sg)) * lr0s[c]
        d2 = a * sil * lr2s[c]
        dw02 = torch.bmm(torch.cat([d0, d2], -1).transpose(1, 2), kc)
        if use_m:
            m = ms[c].mean(dim=1)[:, None, None]
            dw02 = dw02 + m * b02
            dw1 = dw1 + m * b1
            b02, b1 = dw02, dw1
        if use_muon:
            dw02, dw1 = _muon(dw02, dw1, muon_dtype)
        if prenorm:
            m02_main = m02_main + dw02.to(m02_main.dtype)
            m1_main = m1_main + dw1.to(m1_main.dtype)
            w02, w1 = _normed(m02_main, t02), _normed(m1_main, t1)
        else:
            w02 = _normed(w02 + dw02.to(w02.dtype), t02)
            w1 = _normed(w1 + dw1.to(w1.dtype), t1)

    def unflat(t):
        return t.reshape(B, H, *t.shape[1:])

    out = dict(W)
    out["w0"], out["w2"], out["w1"] = unflat(w02[:, :dh]), unflat(w02[:, dh:]), unflat(w1)
    if prenorm:
        out["w0_main"], out["w2_main"], out["w1_main"] = (unflat(m02_main[:, :dh]), unflat(m02_main[:, dh:]),
                                                          unflat(m1_main))
    if use_m:
        out["m0"], out["m2"], out["m1"] = unflat(b02[:, :dh]), unflat(b02[:, dh:]), unflat(b1)
    return unflat(torch.cat(outs, 1)), out
