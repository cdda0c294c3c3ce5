r"""Sliding-window causal attention in O(T·w) time and memory on every device: the one path that
every layer with a window uses (``local_attention``, LaCT, Titans MAG and MAL).

For query position t (the queries are the last T_q of the T_k key positions: a KV cache may come
first) and window w:

    o_t = Σ_{s ∈ S(t)} softmax_s( q_t·k_s / √d ) v_s,    S(t) = { s : t − w < s ≤ t, doc(s) = doc(t) }

(doc(·) only with packed documents). Backends, as ``ttt_lm.model.backend.resolve`` picks them:

* ``flash``: flash-attn's ``flash_attn_func`` with ``window_size=(w − 1, 0)`` (its varlen kernel
  with ``cu_seqlens`` for packed documents);
* ``flex``: ``flex_attention`` with a block mask (built once per shape and shared by the layers;
  a document ``mask_mod`` for packed rows); square layouts only, a KV cache takes the blocked path;
* ``sdpa`` (every device, the CPU's path): **blocked** attention. The positions are cut into
  blocks of b ≥ w − 1 tokens; the queries of block j attend to the keys of blocks j − 1 and j
  (2b keys), which hold every key of their windows, under one boolean mask [b, 2b] (block 0's
  left half masked; with documents and'ed with "same document" per block). One SDPA call over
  the blocks folded into the batch, [B·n_blocks, H, b, ·] (4-D, so that SDPA runs its fused
  kernels: on the CPU its flash kernel, which never holds the scores): work and masks are
  B·H·T·2b, never T × T. Where that is not fewer scores than one call over T_q × T_k (T_k ≤ 2b, or
  a KV cache whose queries fill few blocks) it is plain SDPA with the dense mask;
* ``math``: the explicit masked softmax over T_q × T_k (a reference, not a fast path).

A KV cache (T_k > T_q): only the last T_q + w − 1 keys can be seen, so the rest are dropped; the
queries are then padded on the left to the keys' length (the padding's outputs are discarded).
Padded positions on the right see themselves (their own key), so no softmax row is empty and no
NaN reaches a gradient. GQA: k, v may have fewer heads (H_kv dividing H), passed to SDPA as they
are (``enable_gqa``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ttt_lm.model.backend import Backend, flash_attn_func, flash_attn_varlen_func


def check_window(window, what: str = "window") -> int:
    """``window`` as an int ≥ 1, or a ValueError naming it."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{what} must be an integer >= 1 (keys t-window+1..t), got {window!r}")
    return window


def window_mask(tq: int, tk: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean [tq, tk], True where query i may see key j: causal, within ``window`` (None: no
    window); the last query and the last key are the same position."""
    qpos = torch.arange(tq, device=device)[:, None] + (tk - tq)
    kpos = torch.arange(tk, device=device)[None, :]
    m = kpos <= qpos
    if window is not None:
        m = m & (kpos > qpos - window)
    return m


def same_doc(seg: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool from ``seg`` [B, T] (each token's document in its row): query t and key s
    are in the same document."""
    return (seg[:, :, None] == seg[:, None, :])[:, None]


def default_block(window: int) -> int:
    """The blocked path's block: the window less one (the fewest keys per query, 2(w − 1)), at
    least 16 tokens so that tiny windows do not make thousands of one-token blocks."""
    return max(window - 1, 16)


def _explicit(q, k, v, mask) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(acc) @ kk.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv.to(acc)).to(q.dtype)


def _blocks_with_previous(t: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """[B, H, n·b, d] → [B·n, H, 2b, d]: each block preceded by the block before it (zeros before
    block 0), the blocks folded into the batch."""
    B, H, _, d = t.shape
    tb = t.view(B, H, n, b, d)
    prev = torch.cat([tb.new_zeros(B, H, 1, b, d), tb[:, :, :-1]], dim=2)
    return torch.cat([prev, tb], dim=3).transpose(1, 2).reshape(B * n, H, 2 * b, d)


def _blocked(q, k, v, window: int, seg: Optional[torch.Tensor], block: int) -> torch.Tensor:
    """The blocked SDPA path for square q, k, v [B, H(_kv), L, d] (module docstring). The blocks
    are folded into the batch, so that SDPA sees 4-D inputs and runs its fused kernels (on the CPU
    its flash kernel, which never holds the scores: a 5-D call falls back to the explicit form)."""
    B, H, L, d = q.shape
    b = block
    n = -(-L // b)
    pad = n * b - L
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    kk, vv = _blocks_with_previous(k, n, b), _blocks_with_previous(v, n, b)
    qq = q.view(B, H, n, b, d).transpose(1, 2).reshape(B * n, H, b, d)
    r = torch.arange(b, device=q.device)[:, None]
    c = torch.arange(2 * b, device=q.device)[None, :]
    rel = c - b - r                                        # key position − query position
    base = (rel <= 0) & (rel > -window)                  # [b, 2b]
    first = base & (c >= b)                                # block 0 has no previous block
    mask = torch.cat([first[None], base[None].expand(n - 1, b, 2 * b)], dim=0)   # [n, b, 2b]
    if seg is not None:
        s = F.pad(seg, (0, pad), value=-1) if pad else seg          # padding: a document of its own
        sq = s.view(B, n, b)
        sk = torch.cat([torch.cat([sq.new_full((B, 1, b), -2), sq[:, :-1]], dim=1), sq], dim=2)
        mask = mask[None] & (sq[:, :, :, None] == sk[:, :, None, :])            # [B, n, b, 2b]
    else:
        mask = mask[None].expand(B, n, b, 2 * b)
    mask = mask.reshape(B * n, 1, b, 2 * b)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=kk.shape[1] != H)
    return o.view(B, n, H, b, d).transpose(1, 2).reshape(B, H, n * b, d)[:, :, :L]


@functools.lru_cache(maxsize=16)
def flex_block_mask(T: int, window: Optional[int], device: str):
    """flex_attention's block mask for causal (windowed) attention over T tokens, built once per
    (T, window, device) and shared by every layer (building one visits all T × T blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, qi, ki):
        ok = ki <= qi
        if window is not None:
            ok = ok & (ki > qi - window)
        return ok

    return create_block_mask(mask_mod, None, None, T, T, device=device)


def flex_doc_block_mask(seg: torch.Tensor, window: Optional[int], device: str):
    """flex_attention's block mask for causal (windowed) attention within the documents of packed
    rows (``seg`` [B, T])."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, T = seg.shape

    def mask_mod(b, h, qi, ki):
        ok = (ki <= qi) & (seg[b, qi] == seg[b, ki])
        if window is not None:
            ok = ok & (ki > qi - window)
        return ok

    return create_block_mask(mask_mod, B, None, T, T, device=device)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             backend=Backend.SDPA, docs=None, block: Optional[int] = None) -> torch.Tensor:
    """Causal attention of q [B, H, T_q, d] over k, v [B, H_kv, T_k, d] (T_k ≥ T_q; the last query
    and key the same position) within ``window`` keys: o [B, H, T_q, d] (module docstring).

    ``docs``: packed documents (a ``DocLayout``: ``seg``, ``cu_seqlens``, ``max_len``, ``cache``;
    square q and k: the rows themselves). ``backend``: flash | flex | sdpa | math (the caller
    resolves it). ``block``: the blocked path's block (≥ window − 1; default ``default_block``)."""
    window = check_window(window)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"sliding_window_attention: q [B, H, T_q, d] and k = v [B, H_kv, T_k, d], got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    if H % hk:
        raise ValueError(f"sliding_window_attention: {hk} key heads must divide {H} query heads")
    if tk < tq:
        raise ValueError(f"sliding_window_attention: {tk} keys for {tq} queries (the keys end at the last query)")
    if docs is not None and tk != tq:
        raise ValueError("sliding_window_attention: packed documents take square q and k (no KV cache)")
    b = default_block(window) if block is None else block
    if isinstance(b, bool) or not isinstance(b, int) or b < max(window - 1, 1):
        raise ValueError(f"sliding_window_attention: block must be an integer >= window - 1 = {window - 1} "
                         f"(a query's window must lie in its own block and the one before), got {block!r}")
    gqa = hk != H
    seg = None if docs is None else docs.seg
    if backend == Backend.FLASH:
        ws = (window - 1, 0)
        if docs is None:
            o = flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=ws)
            return o.transpose(1, 2)
        if flash_attn_varlen_func() is not None:
            cu = docs.cu_seqlens
            flat = lambda t: t.transpose(1, 2).reshape(B * tq, t.shape[1], d)
            o = flash_attn_varlen_func()(flat(q), flat(k), flat(v), cu, cu, docs.max_len, docs.max_len,
                                         causal=True, window_size=ws)
            return o.view(B, tq, H, d).transpose(1, 2)
    if backend == Backend.MATH:
        mask = window_mask(tq, tk, window, q.device)
        return _explicit(q, k, v, mask if seg is None else mask & same_doc(seg))
    if backend == Backend.FLEX and tq == tk:
        from torch.nn.attention.flex_attention import flex_attention
        if docs is None:
            bm = flex_block_mask(tq, window, str(q.device))
        else:
            key = ("flex_doc_mask", window, str(q.device))
            if key not in docs.cache:
                docs.cache[key] = flex_doc_block_mask(seg, window, str(q.device))
            bm = docs.cache[key]
        return flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa)
    # SDPA (and flash / flex where they cannot run this layout): blocked
    if tk > tq + window - 1:                  # keys no query can see
        k, v = k[:, :, tk - tq - window + 1:], v[:, :, tk - tq - window + 1:]
        tk = k.shape[2]
    n = -(-tk // b)
    if tk <= 2 * b or tq * tk <= n * b * 2 * b:      # one or two blocks, or fewer scores as one call
        mask = window_mask(tq, tk, window, q.device)
        if seg is not None:
            mask = mask & same_doc(seg)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    off = tk - tq
    qq = F.pad(q, (0, 0, off, 0)) if off else q
    o = _blocked(qq, k, v, window, seg, b)
    return o[:, :, off:] if off else o
