r"""The LaCT schedule written plainly: the specification of ``kernels.lact``.

Per batch row and head, fast weights w0, w2 ∈ R^{d_h×d_k}, w1 ∈ R^{d_v×d_h} and

    f_W(x) = w1 (silu(w0 x) ⊙ (w2 x)).

The stream is cut into chunks of C tokens. Chunk c is first *applied*: every query of the chunk
reads the weights holding the updates of chunks < c, o_t = f_W(q_t). Then, if a token follows
the chunk, it is *written*: with g_t = w0 k_t, h_t = w2 k_t, a_t = w1ᵀ v_t and the inner loss
L = −Σ_t ⟨f_W(k_t), v_t⟩ (a sum over the chunk), the update is w ← w − lr ∇L per token,

    dw1 = Σ_t lr1_t v_t (silu(g_t) ⊙ h_t)ᵀ
    dw2 = Σ_t lr2_t (a_t ⊙ silu(g_t)) k_tᵀ
    dw0 = Σ_t lr0_t (a_t ⊙ h_t ⊙ σ(g_t)(1 + g_t (1 − σ(g_t)))) k_tᵀ

then, optionally, momentum (m = mean of the chunk's momentum; dw ← dw + m·buf, buf ← dw) and
Muon (``newton_schulz5`` on each dw), then w ← w + dw and the weight normalisation
w ← w / (‖w‖_row + 1e-5) · ‖w_init‖_row. With ``prenorm`` the sum runs on an un-normalised
accumulator w_main ← w_main + dw and the weights read are w = w_main / (‖w_main‖_row + 1e-5) ·
‖w_init‖_row. The last chunk of a stream is read and never written. With ``resets`` (packed
documents, each starting at a chunk boundary) a row's whole state (weights, accumulators,
momentum buffers) goes back to the stream's start before each chunk that starts a document.

This form loops over chunks and writes every sum as an einsum over the chunk's tokens with the
formulas above; ``torch_chunk.py`` is the batched form used for training.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from kernels.lact.shapes import chunk_bounds, newton_schulz5


def _f(w0, w1, w2, x):
    """f_W(x) for x [B, H, t, d_k] → [B, H, t, d_v]."""
    g = torch.einsum("bhik,bhtk->bhti", w0, x)
    h = torch.einsum("bhik,bhtk->bhti", w2, x)
    return torch.einsum("bhvi,bhti->bhtv", w1, F.silu(g) * h)


def lact_schedule_reference(q: torch.Tensor, s: Dict[str, torch.Tensor], W: Dict[str, torch.Tensor],
                            n0: int, chunk_size: int, use_muon: bool, prenorm: bool,
                            muon_dtype: Optional[torch.dtype], resets: Optional[torch.Tensor] = None):
    """q [B, H, T, d_k] (stream positions n0 …); ``s`` the stream (k, v, lr0, lr1, lr2 and
    momentum, [B, H, L, ·]); ``W`` the starting weights, norm targets, accumulators and momentum
    buffers (see ``shapes.start_state``); ``resets`` [B, ⌈L/C⌉] bool or None: chunk c of row b
    starts from ``W`` again. Returns (o [B, H, T, d_v], W after the last write)."""
    W0 = dict(W)
    W = dict(W)
    L = s["k"].shape[2]
    outs: List[torch.Tensor] = []
    use_m = "momentum" in s
    for c, (st, en, written) in enumerate(chunk_bounds(L, chunk_size)):
        if resets is not None and c > 0:
            r = resets[:, c, None, None, None]
            W = {key: torch.where(r, W0[key], w) for key, w in W.items()}
        qa, qb = max(st, n0) - n0, en - n0
        if qb > qa:
            outs.append(_f(W["w0"], W["w1"], W["w2"], q[:, :, qa:qb]))
        if not written:
            continue
        k, v = s["k"][:, :, st:en], s["v"][:, :, st:en]
        lr0, lr1, lr2 = (s[n][:, :, st:en] for n in ("lr0", "lr1", "lr2"))
        w0, w1, w2 = W["w0"], W["w1"], W["w2"]
        g = torch.einsum("bhik,bhtk->bhti", w0, k)
        h = torch.einsum("bhik,bhtk->bhti", w2, k)
        a = torch.einsum("bhvi,bhtv->bhti", w1, v)
        sg = torch.sigmoid(g)
        dw1 = torch.einsum("bht,bhtv,bhti->bhvi", lr1, v, F.silu(g) * h)
        dw2 = torch.einsum("bht,bhti,bhtk->bhik", lr2, a * F.silu(g), k)
        dw0 = torch.einsum("bht,bhti,bhtk->bhik", lr0, a * h * sg * (1 + g * (1 - sg)), k)
        dws = [dw0, dw1, dw2]
        if use_m:
            m = s["momentum"][:, :, st:en].mean(dim=2)[:, :, None, None]
            dws = [dw + m * W[f"m{i}"] for i, dw in enumerate(dws)]
            for i, dw in enumerate(dws):
                W[f"m{i}"] = dw
        if use_muon:
            dws = [newton_schulz5(dw.flatten(0, 1), muon_dtype).view_as(dw) for dw in dws]
        for i, dw in enumerate(dws):
            name = f"w{i}"
            base = W[f"{name}_main"] if prenorm else W[name]
            new = base + dw.to(base.dtype)
            if prenorm:
                W[f"{name}_main"] = new
            W[name] = new / (new.norm(dim=-1, keepdim=True) + 1e-5) * W[f"{name}_norm"]
    return torch.cat(outs, dim=2), W
