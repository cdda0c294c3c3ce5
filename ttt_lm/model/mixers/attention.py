r"""Causal multi-head attention with grouped/multi-query KV heads, RoPE and an optional sliding
window (Vaswani et al. 2017; GQA: Ainslie et al. 2023; local attention as in Griffin, De et al. 2024).

For head h and query position t (RoPE applied to q and k, Su et al. 2021):

    o_t = Σ_{s ∈ S(t)} softmax_s( q_t·k_s / √d_h ) v_s,     S(t) = { s : t − w < s ≤ t }

with window w = ∞ for global ("attention") layers and w = ``attention.window`` for
"local_attention" layers. KV head g serves query heads g·H/H_kv … (g+1)·H/H_kv − 1.

Implementations: ``reference`` is the explicit softmax above; ``chunked`` (the training form)
runs the backend that the one resolver (``ttt_lm.model.backend.resolve``) picks for
``attention.backend``: under "auto" flash-attn's ``flash_attn_func`` when installed, on CUDA, in
half precision; else ``flex_attention`` for a window on CUDA; else torch's
``scaled_dot_product_attention``. A window runs through ``ttt_lm.model.window_attention`` (shared
with every layer that has one): on SDPA, queries in blocks of about w attend to their block and
the one before, so time and memory are O(T·w), never a T × T mask. The decode state is the KV
cache, holding at most w − 1 past keys for a local layer, so its memory is flat in the sequence
length.

The cache lives in a preallocated buffer (``_KVBuffer``): a step writes its key and value in
place after the cached ones and the state's "k" / "v" are views of the filled part, so decoding
does not copy the whole cache per token (``torch.cat``). The buffer doubles when full (for a
local layer it is rebuilt from the last w − 1 keys), an amortized O(1) copy per token. A state
appends in place only while it is the buffer's newest (its ``kv_end`` equals the buffer's fill):
stepping twice from the same state (two continuations of one prompt) gives the second a copy,
so neither overwrites the other. Where gradients flow through the cache, steps concatenate as
before (in-place writes would alter tensors saved for the backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ttt_lm.model.backend import Backend, flash_attn_func, flash_attn_varlen_func
from ttt_lm.model.layers import acc, acc_dtype, apply_rope, rope_cos_sin
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer
from ttt_lm.model.window_attention import (flex_block_mask, flex_doc_block_mask, same_doc,
                                          sliding_window_attention, window_mask)


#: model.attention.backend: SDPA, flex attention, flash-attn, or the explicit softmax; auto picks
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "flash", "math")


@dataclass
class AttentionConfig:
    """``model.attention``: global and local attention (one section for both kinds; the
    attention branches of Titans MAG, MAL and MAC read num_kv_heads, rope_theta and backend)."""
    num_kv_heads: Optional[int] = option(None, ge=1)  # grouped/multi-query attention; None = n_heads
    window: int = option(1024, ge=1)    # sliding window of "local_attention" layers (keys t-window+1..t)
    rope_theta: float = 10000.0
    backend: str = "auto"               # auto | sdpa | flex | flash | math

    def tiny(self, n: int) -> "AttentionConfig":
        """This section for the tests' tiny models (``tests/model/mixer_checks.short_config``):
        local attention's window one token longer than their chunks of ``n``, so that documents and
        sequences of a few chunks cross it and windows and chunks do not line up. (It has no
        ``short``: the synthetic tasks keep the window.)"""
        return replace(self, window=n + 1)

    def validate(self, model) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention.backend must be auto, sdpa, flex, flash or math, got {self.backend!r}")
        kv = self.num_kv_heads
        if kv is not None and model.n_heads % kv != 0:
            raise ValueError(f"model.attention.num_kv_heads={kv} must divide model.n_heads={model.n_heads}")

    def scaled(self, family, model) -> "AttentionConfig":
        """This section for ``model``, the family's model ``family`` at another width
        (``ttt_lm.scaling.ladder``): the query heads per KV head kept where they divide."""
        kv = self.num_kv_heads
        if kv is None:
            return self
        group = max(1, family.n_heads // kv)
        n = max(1, model.n_heads // group)
        return replace(self, num_kv_heads=n if model.n_heads % n == 0 else 1)

class _KVBuffer:
    """Keys and values [B, H_kv, capacity, d_h] and how far they are filled (``end``)."""
    __slots__ = ("k", "v", "end")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, end: int):
        self.k, self.v, self.end = k, v, end


@dataclass
class AttentionState(MixerState):
    """The KV cache: k, v [B, H_kv, n, d_h] (n cached keys: all so far, or the last w − 1 for a
    local layer), and pos. ``kv_buf`` / ``kv_end``: the buffer k and v are views of and its fill
    when this state was made (derived: ``map`` drops them, the next step copies into a new one)."""
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    kv_buf: Optional[_KVBuffer] = field(default=None, repr=False, compare=False, metadata={"derived": True})
    kv_end: Optional[int] = field(default=None, repr=False, compare=False, metadata={"derived": True})


@register_mixer("attention", config=AttentionConfig)
class Attention(Mixer):
    window: Optional[int] = None
    #: every earlier key: cost and RoPE range grow with the context (LocalAttention: False)
    global_attention = True
    #: attends over earlier tokens (LocalAttention too, within its window)
    attends = True
    #: context parallelism gathers the keys and values of earlier ranks
    cp_form = "kv_exchange"

    #: attention picks SDPA / flex / flash-attn / math by attention.backend (through the one
    #: resolver, ``ttt_lm.model.backend``), not by kernel_backend
    uses_kernel_op = False
    backend_op = "attention"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        a = cfg.attention
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.n_kv = a.num_kv_heads or cfg.n_heads
        self.hd = cfg.hd
        self.rope_theta = a.rope_theta
        self.backend = a.backend
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.d_model, bias=False)
        self.o_proj._is_residual_out = True

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state: Optional[AttentionState] = None, output_state: bool = False,
               positions: Optional[torch.Tensor] = None, docs=None):
        """q [B, H, T, d_h], k, v [B, H_kv, T, d_h] with RoPE at positions state.pos + t (or at
        ``positions`` [B, T]: packed documents, each at its own offsets); the carry is the next
        position (the KV cache is built by the forms). ``docs`` (packed documents: a ``DocLayout``,
        or context parallelism's ``SliceDocs`` whose offsets count from each piece's first token
        wherever it lies): positions = ``docs.offset``."""
        if docs is not None:
            positions = docs.offset
        B, T, _ = x.shape
        pos0 = int(state.pos) if state is not None else 0
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        if positions is not None:
            cos, sin = rope_cos_sin(positions[:, None], self.hd, self.rope_theta, dtype=acc_dtype(q.dtype))   # [B, 1, T, d_h]
            return {"q": apply_rope(q, cos, sin), "k": apply_rope(k, cos, sin), "v": v}, None
        cos, sin = rope_cos_sin(torch.arange(pos0, pos0 + T, device=x.device), self.hd, self.rope_theta,
                                dtype=acc_dtype(q.dtype))
        return {"q": apply_rope(q, cos, sin), "k": apply_rope(k, cos, sin), "v": v}, \
            (AttentionState(pos=pos0 + T) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """Causal (windowed) attention of q over k, v, where k and v may be longer than q (keys
        before the queries' own, the last query and key being the same position): the explicit
        softmax for backend "reference", else ``attention.backend``'s implementation. Attention
        keeps no op state (the KV cache is the forms').

        Packed documents: ``inp["docs"]`` (a ``DocLayout``, square q and k: the rows themselves)
        or ``inp["doc_mask"]`` [B, 1, T_q, T_k] bool, True where query i and key j are in the same
        document (context parallelism's queries of one slice over the keys gathered up to its end,
        ``cp_kv_exchange``), and'ed with the causal (windowed) mask; see ``_attend_masked``."""
        if initial_state is not None or output_final_state:
            raise ValueError("attention's op keeps no state; the KV cache belongs to the forms")
        q, k, v, docs, doc_mask = inp["q"], inp["k"], inp["v"], inp.get("docs"), inp.get("doc_mask")
        if docs is not None and doc_mask is not None:
            raise ValueError("attention's op takes packed documents as docs or as doc_mask, not both")
        if doc_mask is not None and (doc_mask.dtype != torch.bool or doc_mask.dim() != 4 or doc_mask.shape[1] != 1
                                     or tuple(doc_mask.shape[2:]) != (q.shape[2], k.shape[2])):
            raise ValueError(f"attention: doc_mask must be bool [B, 1, T_q, T_k] = [B, 1, {q.shape[2]}, {k.shape[2]}], "
                             f"got {doc_mask.dtype} {tuple(doc_mask.shape)}")
        if backend == Backend.REFERENCE:
            rep = self.n_heads // self.n_kv
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (acc(q) @ acc(kk).transpose(-1, -2)) / math.sqrt(self.hd)
            m = window_mask(q.shape[2], kk.shape[2], self.window, q.device)
            if docs is not None:
                m = m & same_doc(docs.seg)
            if doc_mask is not None:
                m = m & doc_mask
            s = s.masked_fill(~m, float("-inf"))
            return (s.softmax(-1) @ acc(vv)).to(q.dtype), None
        if docs is not None:
            return self._attend_docs(q, k, v, docs), None
        if doc_mask is not None:
            return self._attend_masked(q, k, v, doc_mask), None
        return self._attend(q, k, v), None

    def requested_backend(self) -> str:
        return self.backend

    def backend_limits(self, dtype=None):
        return {}

    def op_backend(self, x: torch.Tensor) -> Backend:
        """As ``Mixer.op_backend``, checked for x's device only: q, k, v may be in another dtype
        than x (autocast); ``op`` checks theirs."""
        return Backend.REFERENCE if self.impl == "reference" else self.resolve_backend(x.device)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # o: [B, H, T, hd]
        B, H, T, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))

    def context_state(self, x_before, valid, start: int) -> AttentionState:
        return AttentionState(pos=start)

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads are independent: q, k, v split by heads (rank r holds query heads r·H/p … and KV
        heads r·H_kv/p …, so each query head keeps its KV head under GQA), o_proj by rows."""
        return TPPlan(column=("q_proj", "k_proj", "v_proj"), row=("o_proj",), head_counts=("n_heads", "n_kv"))

    def init_state(self, batch_size: int, device=None, dtype=None) -> AttentionState:
        z = torch.zeros(batch_size, self.n_kv, 0, self.hd, device=device, dtype=dtype)
        return AttentionState(k=z, v=z.clone(), pos=0)

    def _cat_cache(self, state: Optional[AttentionState], k, v):
        """(cached keys followed by k, the same for values, the buffer holding them or None)."""
        if state is None:
            return k, v, None
        ck, cv = state.k, state.v
        if torch.is_grad_enabled() and any(t.requires_grad for t in (k, v, ck, cv)):
            # differentiating through the cache: in-place writes would change tensors that the
            # backward of earlier steps saved, so concatenate
            return torch.cat([ck.to(k.dtype), k], dim=2), torch.cat([cv.to(v.dtype), v], dim=2), None
        n, T = ck.shape[2], k.shape[2]
        buf = state.kv_buf
        if (buf is not None and buf.end == state.kv_end and buf.end + T <= buf.k.shape[2]
                and buf.k.dtype == k.dtype and buf.k.device == k.device and buf.k.shape[:2] == k.shape[:2]):
            buf.k[:, :, buf.end:buf.end + T] = k
            buf.v[:, :, buf.end:buf.end + T] = v
            buf.end += T
        else:  # a new buffer with room to grow: twice what it holds now
            cap = max(2 * (n + T), 16)
            bk = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            bv = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            bk[:, :, :n], bv[:, :, :n] = ck, cv
            bk[:, :, n:n + T], bv[:, :, n:n + T] = k, v
            buf = _KVBuffer(bk, bv, n + T)
        s0 = buf.end - n - T
        return buf.k[:, :, s0:buf.end], buf.v[:, :, s0:buf.end], buf

    def _new_state(self, k_all, v_all, pos_end: int, buf: Optional[_KVBuffer] = None) -> AttentionState:
        if self.window is not None and k_all.shape[2] > self.window - 1:
            keep = self.window - 1
            k_all, v_all = k_all[:, :, k_all.shape[2] - keep:], v_all[:, :, v_all.shape[2] - keep:]
        return AttentionState(k=k_all, v=v_all, pos=pos_end, kv_buf=buf, kv_end=None if buf is None else buf.end)

    # ---- forms -------------------------------------------------------------------------------
    def _run(self, x, state, output_state, backend: str, docs=None):
        pos0 = int(state.pos) if state is not None else 0
        # packed documents: RoPE at each token's offset in its document, as for the document alone
        inp, _ = self.inputs(x, state, positions=None if docs is None else docs.offset)
        k_all, v_all, buf = self._cat_cache(state, inp["k"], inp["v"])
        o, _ = self.op({"q": inp["q"], "k": k_all, "v": v_all, "docs": docs}, backend=backend)
        st = None
        if output_state:
            st = self._new_state(k_all, v_all, pos0 + x.shape[1], None if backend == "reference" else buf)
        return self.output(o, x), st

    #: packed documents: a document mask on the packed rows (``_attend``), one call for the batch
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        return self._run(x, state, output_state, "reference", docs)

    def chunked(self, x, state=None, output_state=False, docs=None):
        return self._run(x, state, output_state, self.resolve_backend(x.device), docs)

    def step(self, x, state):
        return self.chunked(x, state, output_state=True)

    def _attend(self, q, k, v):
        """Attention by the backend that ``resolve_backend`` picks for q's device and dtype. A
        window: ``sliding_window_attention`` (O(T·w) on every backend but "math"). Global: flash-attn,
        the explicit softmax, flex (square layouts; where keys outnumber queries, a KV cache, SDPA
        with the causal mask, the same softmax) or SDPA."""
        tq, tk = q.shape[2], k.shape[2]
        be = self.resolve_backend(q.device, q.dtype)
        if self.window is not None:
            return sliding_window_attention(q, k, v, self.window, be)
        if be == Backend.FLASH:
            o = flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            return o.transpose(1, 2)
        if be == Backend.MATH:
            rep = self.n_heads // self.n_kv
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (acc(q) @ acc(kk).transpose(-1, -2)) / math.sqrt(self.hd)
            s = s.masked_fill(~window_mask(tq, tk, None, q.device), float("-inf"))
            return (s.softmax(-1) @ acc(vv)).to(q.dtype)
        if be == Backend.FLEX and tq == tk:
            return self._flex(q, k, v)
        gqa = self.n_kv != self.n_heads
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(tq, tk, None, q.device), enable_gqa=gqa)

    def _attend_docs(self, q, k, v, docs):
        """Attention within each document of packed rows (q, k, v [B, H, T, d], no cache): the
        causal (windowed) mask of ``_attend`` and'ed with "same document" (``docs.seg``). A window:
        ``sliding_window_attention`` with the documents. Global: flash-attn's varlen kernel over
        the batch flattened to [B·T] with ``docs.cu_seqlens``; flex: a document ``mask_mod`` (its
        block mask built once per batch and shared by the layers); SDPA and math: the
        block-diagonal boolean mask [B, 1, T, T]."""
        be = self.resolve_backend(q.device, q.dtype)
        if self.window is not None:
            return sliding_window_attention(q, k, v, self.window, be, docs=docs)
        B, H, T, hd = q.shape
        gqa = self.n_kv != self.n_heads
        if be == Backend.FLASH and flash_attn_varlen_func() is not None:
            cu = docs.cu_seqlens
            flat = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], hd)
            o = flash_attn_varlen_func()(flat(q), flat(k), flat(v), cu, cu, docs.max_len, docs.max_len, causal=True)
            return o.view(B, T, H, hd).transpose(1, 2)
        if be == Backend.FLEX:
            from torch.nn.attention.flex_attention import flex_attention
            key = ("flex_doc_mask", None, str(q.device))
            if key not in docs.cache:
                docs.cache[key] = flex_doc_block_mask(docs.seg, None, str(q.device))
            return flex_attention(q, k, v, block_mask=docs.cache[key], enable_gqa=gqa)
        mask = window_mask(T, T, None, q.device) & same_doc(docs.seg)
        if be == Backend.MATH:
            rep = self.n_heads // self.n_kv
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (acc(q) @ acc(kk).transpose(-1, -2)) / math.sqrt(self.hd)
            return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ acc(vv)).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def _attend_masked(self, q, k, v, doc_mask):
        """Attention of q [B, H, T_q, d] over k, v [B, H_kv, T_k, d] (T_k ≥ T_q, the last query and
        the last key the same position) under the causal (windowed) mask and'ed with ``doc_mask``
        [B, 1, T_q, T_k] (same document). "math": the explicit masked softmax; every other backend
        runs SDPA with the boolean mask (flash-attn's varlen path and flex's block mask take square
        layouts with ``cu_seqlens`` / segment ids of the queries' own rows, so they fall back to
        SDPA here, the same masked softmax)."""
        mask = window_mask(q.shape[2], k.shape[2], self.window, q.device) & doc_mask
        if self.resolve_backend(q.device, q.dtype) == Backend.MATH:
            rep = self.n_heads // self.n_kv
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (acc(q) @ acc(kk).transpose(-1, -2)) / math.sqrt(self.hd)
            return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ acc(vv)).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)

    def _flex(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention
        bm = flex_block_mask(q.shape[2], self.window, str(q.device))
        return flex_attention(q, k, v, block_mask=bm, enable_gqa=self.n_kv != self.n_heads)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        # q·k and p·v: 2 matmuls × 2 FLOPs × H × d_h × (average keys seen per query)
        return 4.0 * cfg.n_heads * cfg.hd * (seq_len + 1) / 2.0


@register_mixer("local_attention", config=AttentionConfig, section="attention")
class LocalAttention(Attention):
    """Sliding-window attention: keys t − window + 1 … t (``attention.window``)."""

    backend_op = "local_attention"
    global_attention = False

    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.window = cfg.attention.window

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        w = cfg.attention.window
        T = seq_len
        seen = (T + 1) / 2.0 if T <= w else (w * (w + 1) / 2.0 + (T - w) * w) / T
        return 4.0 * cfg.n_heads * cfg.hd * seen
