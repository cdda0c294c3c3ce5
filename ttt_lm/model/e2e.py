r"""TTT-E2E: end-to-end test-time training (Tandon, Dalal, Li, Koceja, Rød, Buchanan, Wang, Leskovec,
Koyejo, Hashimoto, Guestrin, McCaleb, Choi, Sun 2025, "End-to-End Test-Time Training for Long
Context", arXiv 2512.23675), with the semantics of its official JAX code (github
test-time-training/e2e, ``ttt/model/transformer.py``, ``attention.py``, ``loss.py``), which this
module follows where the paper's prose differs (the prime and static MLPs run in series).

Where it lives. The inner loss of a TTT block is the next-token loss through the final norm and the
LM head, so the fast weights of every TTT block are trained by one loss over the whole suffix of the
stack: it is not a per-layer mixer. It is a model variant: ``model.ttt_e2e.enabled`` makes
``LM(cfg)`` build :class:`E2ELM` (a subclass of ``LM`` with the same ``forward(input_ids, labels,
position_ids=...) -> LMOutput(logits, loss)``), so the trainer, the ZeRO engine, data, checkpoints
and the evals that read the loss or the logits run it unchanged. ``model.layer_pattern`` and the
mixer sections are not read; ``model.ttt_e2e`` holds its settings (``ttt_lm.model.e2e_config``).

The model (L = ``n_layers`` blocks, S = ``ttt_e2e.suffix_len``, w = ``ttt_e2e.window``). A
Llama-style decoder with tied embeddings, no biases, RMSNorm (ε = ``norm_eps``, 1e-6) before and
after every branch:

    h ← h + post_a(Attn(pre_a(h)))                    every block
    h ← h + post_p(SwiGLU_W(pre_p(h)))                TTT blocks only: the prime MLP, fast weights W
    h ← h + post_f(SwiGLU(pre_f(h)))                  every block (the static MLP)
    logits = RMSNorm_f(h) · E^T                       E the token embedding

Attention: q, k, v = x W_q, x W_k, x W_v (d_model × d_model), per-head qk-norm (an RMSNorm over the
head dimension, one weight per layer shared by the heads), interleaved RoPE (pairs (x_{2i}, x_{2i+1})
rotated by pos·θ^{−2i/d}, θ = ``ttt_e2e.rope_theta``), softmax(q·k/√d) over the keys j with
t − w < j ≤ t. SwiGLU(x) = (silu(x W_1) ⊙ x W_3) W_2. Init: every linear and the embedding N(0,
``init_std``) (plain normal, no depth scaling), norm weights 1.

One sequence x_0 … x_{T−1} with targets y_t (the labels; −100 masks a target, as the official
BOS mask m_t does):

1. H = PrefixBlocks(E[x]): the first L − S blocks over all T tokens once, positions 0 … T−1.
2. W^{(0)} = the prime MLPs' parameters (per TTT block W_1, W_2, W_3: the meta-learned init). For
   chunk i of b = ``ttt_e2e.inner_batch`` tokens: the S TTT blocks run on H[chunk i] with W^{(i)}.
   Each TTT block's attention reads a cache of the previous w tokens' k (after qk-norm, before
   RoPE) and v, concatenated with the chunk's: w + b keys at local positions 0 … w+b−1, queries
   at w … w+b−1, the mask (q ≥ k) ∧ (q < k + w) ∧ (k ≥ 0) in absolute indices; the new cache is the
   last w. (Here the cache holds min(w, tokens so far) keys: the official code's keys before the
   sequence start are zeros that the mask drops.) The cache crosses chunks and keeps its graph (the cached k, v of TTT blocks after the
   first came from earlier fast weights).

       ℓ_i = Σ_t m_t CE_t / max(Σ_t m_t, 1e-10)          (over the chunk, fp32)
       g_i = ∂ℓ_i / ∂W^{(i)}                              (cache and H held fixed)
       W^{(i+1)} = W^{(i)} − η ρ clip_c(g_i),  clip_c(g) = g if ‖g‖ < c else g·c/‖g‖

   ‖g‖ is one global norm over W_1, W_2, W_3 of all TTT blocks; η = ``inner_lr``, c = ``inner_clip``;
   ρ = (ilr_init + (η − ilr_init)·min(1, s/ilr_warmup_steps))/η at optimizer step s (1-based,
   ``set_train_step``; the official (step+1) with its 0-based step), 1 without a warm-up and
   outside training (the official eval sets the step past the warm-up).
3. Sequence loss = the mean over chunks of ℓ_i(W^{(i)}) (each chunk's loss before its own update),
   unweighted; batch loss = the mean over sequences, each with its own fast weights.
4. The outer gradient goes through every inner step: g_i is taken with ``create_graph=True`` (full
   second order: Hessian-vector products through the TTT blocks, their attention, the norms and the
   head, through the clip's norm when it clips, the stale caches and into H).

Partial chunk. The official code asserts T % b = 0; here a last chunk of r < b tokens runs with the
current fast weights (token t is predicted with W^{(⌊t/b⌋)}), is not followed by an update, and its
loss counts in the chunk mean with weight r/b (full chunks weigh 1, so for T % b = 0 this is the
official mean). Within a chunk the fast weights are fixed, attention is causal and the MLPs act per
token, and W^{(i+1)} reads only targets up to token (i+1)·b, so the logits of the first r tokens
never depend on later tokens (tests/model/test_ttt_e2e.py). Training refuses a ``data.seq_len`` that
b does not divide (``TTTE2EConfig.validate_training``), so training runs the official semantics.

Without labels (``forward(input_ids)``: the logits, for the evals), the targets are the inputs
shifted by one (the last position's is unknown and masked): what an evaluation of the sequence
learns from.

Second order and memory. The TTT blocks' attention is an explicit softmax (``suffix_attention``
"math", or SDPA pinned to its math kernel, "sdpa_math"): flash and flex kernels have no double
backward, so they are refused there, naming the value (``TTTE2EConfig.validate``). The prefix
needs a first-order backward only and runs SDPA (its window through
``ttt_lm.model.window_attention``). With ``ttt_e2e.remat`` (default) the prefix runs under
``torch.utils.checkpoint`` (it saves only its input, as the official ``nothing_saveable`` policy)
and so does each chunk's inner step (non-reentrant checkpoint, which recomputes the inner
``autograd.grad(create_graph=True)`` in the backward): what a training step keeps is, per chunk, its
inputs (H's chunk, W^{(i)}, the caches), not its activations. Fast weights are held in the
accumulation dtype (fp32 under bf16, as the official ``state_dtype``) and cast to the activations'
dtype for the matmuls.

With S = 0 the model is the paper's baseline at the same architecture (sliding window, or full
attention with w ≥ T), trained on the usual token-mean loss.

Official checkpoints. ``python -m ttt_lm.convert from-e2e`` reads the official code's parameter
tree (a flat .npz/.safetensors export of its orbax ``model_weights``: the L blocks stacked in
``language_model.model.h.blocks``, the prime MLPs and their norms stacked in ``h.prime_storage``,
linears [in, out], transposed here) into this model's state dict, strictly (every tensor used, every
parameter filled, shapes checked against the config; ``ttt_lm.convert``'s docstring has the table).

Decode (``init_states``, ``prefill``, ``step``, ``generate``, and ``forward`` with ``states`` or
``output_states``; the official code has none, this follows its eval forward). The state is one
:class:`E2EState` per block: every block's window cache (k, rotated by RoPE at its token's absolute
position, and v of the last w tokens;
a TTT block's also of the open chunk's tokens, from w before the chunk's start), each TTT block's
fast weights W^{(i)} (per sequence), the open chunk (its token ids and the TTT blocks' inputs for
those tokens, the prefix's output, in the first TTT block's state) and the chunk counter i. Its
size does not grow with the context: at most (w + b) keys per TTT block, w per prefix block, b
open tokens. Token t is predicted with W^{(⌊t/b⌋)}, as in the forward. The loss of chunk i reads
the targets up to token (i+1)·b, the first token of chunk i+1, so its inner step is taken when
that token arrives (from the prompt or just sampled) and before it runs: the step that reads
token n = (i+1)·b first recomputes the TTT blocks on chunk i from the stored inputs and the caches
as they were at the chunk's start (the training forward's ``_chunk_step``), takes g_i, clips it
and sets W^{(i+1)}, trims the caches to the last w keys before n, then runs token n with
W^{(i+1)}. A prompt that ends on a chunk boundary leaves that step to the first generated token.
ρ = 1 (the warm-up is a training schedule), and there is no outer graph: g_i is a first-order
gradient w.r.t. the fast weights under ``torch.enable_grad()`` inside the no-grad decode. A piece
of r tokens runs the embedding and the prefix blocks once on all r, then the TTT blocks segment by
segment between chunk boundaries; the head runs on the last position only (and in each inner
step, on the chunk: ``state_update_head_tokens``). Each chunk costs one recomputed TTT-block
forward and backward, so a token costs the same at any context (amortised over b tokens: the step
at a chunk boundary costs more). Each key is rotated once, at its absolute position, when it enters
the cache (q·k depends only on the positions' difference, so the scores are those of the forward's
local positions up to rounding; the inner step rotates its chunk-start cache back to the training
step's local positions), and a decode step appends its key and value in place into a buffer that
holds the cache with room to grow (``_append_kv``; a copy of the cache every m/2 steps), so a
step's cost beyond the attention itself does not grow with the cache. Token-by-token decode and
chunked prefill (any piece length) equal the forward of the whole sequence in eval: float64 ~1e-14
(tests/model/test_ttt_e2e_decode.py).

Distributed. ZeRO 1–3 over data-parallel ranks (``tests/model/test_ttt_e2e_dist.py``); under ZeRO-3
the model gathers its own parameters for each step (``gathers_zero3_parameters``, below). Context
parallelism is refused with its reason (``TTTE2EConfig.validate_training``): the chunks' inner steps
are sequential, so passing fast weights from rank to rank serialises them.

Tensor parallelism (``parallel.tensor_parallel`` = p; ``parallelize_tp`` calls
:meth:`E2ELM.tensor_parallel_form`), Megatron's layout with f (identity, all-reduce backward) and
g (all-reduce, identity backward) at the region borders:

    attention   q, k, v column-parallel by heads (rank r: heads r·H/p …), o row-parallel (g);
                qk-norm acts per head with one gain per layer: replicated, its gradient summed (f)
    SwiGLU      W_1, W_3 column-parallel (rows of [F, D]), W_2 row-parallel (columns of [D, F]), g:
                every static MLP, and the prime MLPs, so each rank's fast weights W_1^(r), W_3^(r)
                [B, F/p, D], W_2^(r) [B, D, F/p] are its shards of W^{(i)}
    pre-norms   seq_norm, prime_norm, ffn_norm replicated; their outputs enter the region by f
    the rest    the embedding, every post-norm, the final norm and the (tied) head replicated

    ‖g_i‖² = Σ_r Σ_{W ∈ shards of r} ‖∂ℓ_i/∂W‖²      (one all-reduce of B numbers per inner step)

The inner gradient of a shard is the shard of the full gradient (the loss is replicated, the
collectives route the rest), so with the all-reduced norm every rank's clipped step is its slice of
the single-rank step. The inner step is differentiated again by the outer gradient, so every
collective in it is twice differentiable (f's backward is g's forward, g's is f's, Σ's is Σ's:
``ttt_lm.parallel.tensor_parallel``). Why the head is replicated, not vocab-parallel: the inner
loss and its second derivative then need no collective beyond the blocks' (the simplest exact
form); the cost is the head's V·D weights and the head's matmul (forward, inner step and their
backward, V·D per token each) on every rank instead of 1/p of them, and its gradient's optimizer
state replicated; for the 125M preset the V·D embedding is 98.5M of the 184M parameters.
Sequence parallelism is refused (validate_training and ``parallelize_tp``). Decode under TP holds
the local heads' caches and the fast weights' shards (prefill, step, generate and ``hidden`` run
as in one process); ``tests/parallel/test_ttt_e2e_tp.py`` compares losses, W^{(i)}, ‖g_i‖, the
outer gradient of every parameter and decoding with one process (float64, 1e-10).

Not built yet (refused, naming the model): labels with carried states (the sequence loss is a mean
over a whole sequence's chunks), ``compile_blocks``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ttt_lm.model.backend import Backend
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.layers import GatedMLP, RMSNorm, acc, acc_dtype
from ttt_lm.model.lm import (LM, LMHead, LMOutput, PREFILL_CHUNK, _own_storage, check_prefill_chunk,
                             check_prompt_ids)
from ttt_lm.model.mixers.attention import _KVBuffer   # the decode caches' buffer, as attention's
from ttt_lm.model.mixers.base import MixerState
from ttt_lm.model.window_attention import sliding_window_attention

MODEL_NAME = "TTT-E2E"


def not_built(what: str) -> NotImplementedError:
    return NotImplementedError(f"{MODEL_NAME} (model.ttt_e2e.enabled): {what} is not built yet")


# ---- pieces -------------------------------------------------------------------------------------
def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on pairs (x_{2i}, x_{2i+1}) of x [..., T, d] at ``positions`` [T]: rotated by
    pos·θ^{−2i/d}, computed in the accumulation dtype (fp32 for half types)."""
    d = x.shape[-1]
    xf = acc(x)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    ang = positions.to(torch.float64)[:, None] * inv                   # [T, d/2]
    cos, sin = ang.cos().to(xf.dtype), ang.sin().to(xf.dtype)
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def masked_softmax_attention(q, k, v, mask, backend: str = "math") -> torch.Tensor:
    """softmax(q·kᵀ/√d + log mask)·v for q [B, H, n, d], k, v [B, H, m, d], mask [n, m] (True:
    attend); the softmax in the accumulation dtype. Twice differentiable ("math": explicit;
    "sdpa_math": SDPA restricted to its math kernel)."""
    if backend == "sdpa_math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bhnd,bhmd->bhnm", acc(q), acc(k)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = s.softmax(-1).to(v.dtype)
    return torch.einsum("bhnm,bhmd->bhnd", p, v)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """(silu(x W_1) ⊙ x W_3) W_2 with per-sequence weights w1, w3 [B, F, D], w2 [B, D, F] (the
    nn.Linear layout, y = x·Wᵀ), cast to x's dtype."""
    z1 = torch.einsum("bnd,bfd->bnf", x, w1.to(x.dtype))
    z3 = torch.einsum("bnd,bfd->bnf", x, w3.to(x.dtype))
    return torch.einsum("bnf,bdf->bnd", F.silu(z1) * z3, w2.to(x.dtype))


class E2EAttention(nn.Module):
    """Multi-head attention with qk-norm and interleaved RoPE; a full pass (the prefix) or one chunk
    over a window cache (the TTT blocks)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, e = cfg.d_model, cfg.ttt_e2e
        self.n_heads, self.hd = cfg.n_heads, cfg.hd
        self.window, self.theta = e.window, e.rope_theta
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.norm_eps)

    def qkv(self, x: torch.Tensor):
        """q, k after qk-norm (before RoPE) and v, each [B, H, n, d]."""
        B, n, _ = x.shape
        sh = lambda t: t.view(B, n, self.n_heads, self.hd).transpose(1, 2)
        return self.q_norm(sh(self.wq(x))), self.k_norm(sh(self.wk(x))), sh(self.wv(x))

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, H, n, d = o.shape
        return self.wo(o.transpose(1, 2).reshape(B, n, H * d))

    def forward(self, x: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
        """All T tokens at positions 0 … T−1, keys t−w+1 … t (first-order backward only)."""
        T = x.shape[1]
        q, k, v = self.qkv(x)
        pos = torch.arange(T, device=x.device)
        q, k = rope_interleaved(q, pos, self.theta), rope_interleaved(k, pos, self.theta)
        if backend == "math":
            i = torch.arange(T, device=x.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] < i[None, :] + (self.window or T))
            return self.out(masked_softmax_attention(q, k, v, mask))
        if self.window is None or self.window >= T:
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.out(sliding_window_attention(q, k, v, self.window, backend=Backend.SDPA))

    def chunk(self, x: torch.Tensor, cache: Tuple[torch.Tensor, torch.Tensor], start: int,
              backend: str = "math"):
        """One chunk x [B, r, D] starting at absolute position ``start`` over ``cache`` = (k, v)
        [B, H, m, d] of the m = min(w, start) tokens before it (k before RoPE): (output, the new
        cache: the last w of cache + chunk), as the official ``Attention.__call__``, whose cache
        always holds w keys (zeros before the sequence start, masked): the keys it masks are left
        out, and RoPE at local positions (keys 0 … m+r−1, queries m … m+r−1) gives the same scores."""
        r, w = x.shape[1], self.window
        q, k, v = self.qkv(x)
        k_all = torch.cat([cache[0], k], dim=2)
        v_all = torch.cat([cache[1], v], dim=2)
        n = k_all.shape[2]
        local = torch.arange(n, device=x.device)
        q = rope_interleaved(q, local[n - r:], self.theta)
        kr = rope_interleaved(k_all, local, self.theta)
        qi = (start + torch.arange(r, device=x.device))[:, None]
        ki = (start + r - n + local)[None, :]
        mask = (qi >= ki) & (qi < ki + w)
        o = masked_softmax_attention(q, kr, v_all, mask, backend)
        keep = max(0, n - w)
        return self.out(o), (k_all[:, :, keep:], v_all[:, :, keep:])

    def extend(self, x: torch.Tensor, cache: Tuple[torch.Tensor, torch.Tensor], pos0: int, backend: str = "math",
               buf: Optional[_KVBuffer] = None, buf_end: Optional[int] = None):
        """The decode form: x [B, r, D], the r tokens at absolute positions pos0 … pos0+r−1 that
        follow the m tokens of ``cache`` = (k, v) [B, H, m, d] (k after RoPE at its own absolute
        position, the tokens right before x's): (output, the cache with x's keys appended
        [B, H, m + r, d], not trimmed: the caller keeps what it needs, the buffer holding it or
        None). RoPE at absolute positions (q·k depends on the positions' difference only, so the
        scores are :meth:`chunk`'s, whose positions are local, up to rounding), and the window
        mask (a query sees itself and the w − 1 keys before it; every key with w None) as
        :meth:`chunk`; each key is rotated once, when it is appended. ``backend`` "sdpa" (no second
        order: the prefix blocks) is SDPA with the boolean mask, else :func:`masked_softmax_attention`.
        ``buf``/``buf_end``: the buffer ``cache`` is a view of and its fill when that state was
        made (:func:`_append_kv`)."""
        r = x.shape[1]
        q, k, v = self.qkv(x)
        p = torch.arange(pos0, pos0 + r, device=x.device)
        q, k = rope_interleaved(q, p, self.theta), rope_interleaved(k, p, self.theta)
        k_all, v_all, buf = _append_kv(cache, k, v, buf, buf_end)
        n = k_all.shape[2]
        mask = None
        if r > 1 or (self.window is not None and n > self.window):
            local = torch.arange(n, device=x.device)
            qi, ki = local[n - r:, None], local[None, :]
            mask = qi >= ki
            if self.window is not None:
                mask = mask & (qi < ki + self.window)
        if backend == "sdpa":
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        else:
            if mask is None:
                mask = torch.ones(r, n, dtype=torch.bool, device=x.device)
            o = masked_softmax_attention(q, k_all, v_all, mask, backend)
        return self.out(o), (k_all, v_all), buf


#: a piece of at most this many tokens appends into a buffer (decode); longer ones concatenate
APPEND_IN_PLACE_MAX = 16


def _append_kv(cache: Tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
               buf: Optional[_KVBuffer], buf_end: Optional[int]):
    """(cached keys followed by k, the same for values, the buffer they are views of or None),
    as attention's KV buffer: a decode step (≤ ``APPEND_IN_PLACE_MAX`` tokens, nothing requiring
    grad) writes k, v in place after the cached ones while ``cache`` is the buffer's newest view
    (``buf_end`` = its fill: stepping twice from one state gives the second a copy, so neither
    overwrites the other), else a new buffer holding the cache with room for max(16, m/2) more
    tokens (a copy of m keys every m/2 steps: O(1) per token, the state at most 1.5× its keys).
    Longer pieces, and any graph through the cache, concatenate."""
    ck, cv = cache
    r, m = k.shape[2], ck.shape[2]
    if r > APPEND_IN_PLACE_MAX or (torch.is_grad_enabled() and any(t.requires_grad for t in (k, v, ck, cv))):
        return torch.cat([ck.to(k.dtype), k], dim=2), torch.cat([cv.to(v.dtype), v], dim=2), None
    if not (buf is not None and buf.end == buf_end and buf.end + r <= buf.k.shape[2] and buf.k.dtype == k.dtype
            and buf.k.device == k.device and buf.k.shape[:2] == k.shape[:2] and buf.v.dtype == v.dtype
            and buf.k.shape[3] == k.shape[3]):
        cap = m + r + max(16, m // 2)
        bk = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
        bv = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
        bk[:, :, :m], bv[:, :, :m] = ck, cv
        buf = _KVBuffer(bk, bv, m)
    buf.k[:, :, buf.end:buf.end + r] = k
    buf.v[:, :, buf.end:buf.end + r] = v
    buf.end += r
    return buf.k[:, :, buf.end - m - r:buf.end], buf.v[:, :, buf.end - m - r:buf.end], buf


class PrimeMLP(nn.Module):
    """The TTT block's prime SwiGLU: its parameters are the fast weights' initial values W^{(0)}
    (nn.Linear layout: w1, w3 [F, D], w2 [D, F])."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(d_ff, d_model))
        self.w2 = nn.Parameter(torch.empty(d_model, d_ff))

    def fast_weights(self, batch_size: int) -> List[torch.Tensor]:
        """W^{(0)} per sequence: [w1, w3, w2], each [B, ...], in the accumulation dtype."""
        return [acc(p).unsqueeze(0).expand(batch_size, *p.shape) for p in (self.w1, self.w3, self.w2)]


class E2EBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ttt: bool):
        super().__init__()
        D, eps = cfg.d_model, cfg.norm_eps
        self.ttt = ttt
        self.seq_norm, self.seq_post_norm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.attn = E2EAttention(cfg)
        if ttt:
            self.prime_norm, self.prime_post_norm = RMSNorm(D, eps), RMSNorm(D, eps)
            self.prime = PrimeMLP(D, cfg.ff)
            # g under tensor parallelism (the prime MLP's W_2 product over this rank's F/p features)
            self.prime_sum = nn.Identity()
        self.ffn_norm, self.ffn_post_norm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.mlp = GatedMLP(D, cfg.ff, "silu")   # gate_proj W_1, up_proj W_3, down_proj W_2

    def forward(self, h: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
        """A prefix block over all tokens."""
        h = h + self.seq_post_norm(self.attn(self.seq_norm(h), backend))
        return h + self.ffn_post_norm(self.mlp(self.ffn_norm(h)))

    def chunk(self, h, cache, start: int, W: List[torch.Tensor], backend: str = "math"):
        """A TTT block on one chunk with fast weights W = [w1, w3, w2]: (h, the new cache)."""
        a, cache = self.attn.chunk(self.seq_norm(h), cache, start, backend)
        h = h + self.seq_post_norm(a)
        h = h + self.prime_post_norm(self.prime_sum(swiglu(self.prime_norm(h), *W)))
        return h + self.ffn_post_norm(self.mlp(self.ffn_norm(h))), cache

    def extend(self, h, cache, pos0: int, W: Optional[List[torch.Tensor]] = None, backend: str = "math",
               buf=None, buf_end: Optional[int] = None):
        """The decode form of a block (:meth:`E2EAttention.extend`): h [B, r, D] at positions
        pos0 … after ``cache``, with fast weights W (a TTT block) or none (a prefix block): (h, the
        untrimmed cache, its buffer or None)."""
        a, cache, buf = self.attn.extend(self.seq_norm(h), cache, pos0, backend, buf, buf_end)
        h = h + self.seq_post_norm(a)
        if W is not None:
            h = h + self.prime_post_norm(self.prime_sum(swiglu(self.prime_norm(h), *W)))
        return h + self.ffn_post_norm(self.mlp(self.ffn_norm(h))), cache, buf


@dataclass
class E2ETrace:
    """What one forward did, per chunk i (for the tests and diagnostics): losses [n, B] (ℓ_i per
    sequence), weights [n] (1, or r/b for a partial chunk), grad_norms [n−1, B] (‖g_i‖ before the
    clip), fast [n][S][3] (W^{(i)}, the weights chunk i ran with), logits [B, T, V] (with
    ``keep_logits``), loss (the batch loss), hidden [B, T, D] (the final-normed hidden states, with
    ``keep_logits="hidden"``)."""
    losses: torch.Tensor
    weights: List[float]
    grad_norms: Optional[torch.Tensor]
    fast: List[List[List[torch.Tensor]]]
    logits: Optional[torch.Tensor]
    loss: torch.Tensor
    hidden: Optional[torch.Tensor] = None


@dataclass
class E2EState(MixerState):
    """One block's decode state (:meth:`E2ELM.init_states`; the decode section of the module
    docstring). k, v [B, H, m, d]: the window cache, k after qk-norm and RoPE at its token's
    absolute position, of the m tokens before the next one: a prefix block's m = min(w, pos); a TTT block's also keeps the
    open chunk's tokens, m = min(w, c) + (pos − c) with c the open chunk's first position (the
    chunk's inner step reads the cache as it was at c). TTT blocks only: fast = (w1, w3, w2)
    [B, F, D], [B, F, D], [B, D, F], W^{(i)} in the accumulation dtype. The first TTT block only:
    chunk_h [B, r, D], the open chunk's r tokens' inputs to the TTT blocks (the prefix's output),
    chunk_ids [B, r] their token ids. steps: the chunk counter i, inner steps taken (W^{(i)});
    pos: tokens read. ``kv_buf`` / ``kv_end``: the buffer k and v are views of and its fill when
    this state was made (derived: ``map`` drops them, the next step copies into a new one)."""
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    fast: Optional[Tuple[torch.Tensor, ...]] = None
    chunk_h: Optional[torch.Tensor] = None
    chunk_ids: Optional[torch.Tensor] = None
    steps: int = 0
    kv_buf: Optional[_KVBuffer] = field(default=None, repr=False, compare=False, metadata={"derived": True})
    kv_end: Optional[int] = field(default=None, repr=False, compare=False, metadata={"derived": True})


class _RegionSum(nn.Module):
    """g (all-reduce forward, f backward) on a row-parallel product computed outside an nn.Linear:
    the prime MLP's (silu(x W_1) ⊙ x W_3) W_2 over this rank's F/p features."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ttt_lm.parallel.tensor_parallel import reduce_from_tensor_parallel_region
        return reduce_from_tensor_parallel_region(x, self.ctx.group)


# ---- the model ----------------------------------------------------------------------------------
class E2ELM(LM):
    """TTT-E2E (module docstring): built by ``LM(cfg)`` when ``cfg.ttt_e2e.enabled``."""

    #: the presets take the paper's size names: ``ttt_e2e_125m`` has 184M parameters, 98.5M of
    #: them the Llama-3 vocabulary's embedding (its 1b, 1.47B)
    size_names_count_params = False
    # official_init stays None: the model inits its own weights as the official code does (every
    # linear and the embedding N(0, 0.02)) and reads no model.init scheme

    @classmethod
    def builds(cls, cfg) -> bool:
        return bool(getattr(getattr(cfg, "ttt_e2e", None), "enabled", False))

    #: the blocks are E2E blocks whatever model.layer_pattern names
    reads_layer_pattern = False
    #: plain PyTorch: no kernels/ op (ttt_lm.launch_capture captures nothing for its presets)
    runs_kernel_ops = False

    @classmethod
    def few_layer_overrides(cls, cfg: ModelConfig, n_layers: int) -> list:
        """One prefix block and at most two TTT blocks: the second TTT block attends to window keys
        that the first one's fast weights made, the one path a single TTT block lacks; each further
        TTT block repeats it at the cost of another second-order pass."""
        S = min(cfg.ttt_e2e.suffix_len, 2)
        return [f"model.n_layers={max(n_layers, S + 1)}", f"model.ttt_e2e.suffix_len={S}"]

    #: prefill, step and generate carry E2EState (the decode section of the module docstring)
    supports_decode = True
    #: the official AdamW decays every parameter, norms and the embedding included (ttt_lm.train.optim)
    weight_decay_every_parameter = True

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        cfg.validate()
        e = cfg.ttt_e2e
        if not e.enabled:
            raise ValueError("E2ELM needs model.ttt_e2e.enabled=true")
        self.cfg, self.e2e = cfg, e
        L, S = cfg.n_layers, e.suffix_len
        self.n_prefix = L - S
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(E2EBlock(cfg, ttt=i >= self.n_prefix) for i in range(L))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, cfg.loss_chunk_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()
        self.activation_checkpointing = False
        #: ρ, the inner-lr multiplier (set_train_step); 1 until a step is set, and outside training
        self.ilr_mult = 1.0

    def reset_parameters(self) -> None:
        """The official init: every linear, the embedding and the prime MLPs N(0, init_std), norms 1."""
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, PrimeMLP):
                for p in (m.w1, m.w2, m.w3):
                    nn.init.normal_(p, 0.0, std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
        """FLOPs per token (``ttt_lm.model.flops``' conventions: 2 per weight applied, attention's
        q·k and p·v over the keys a query sees). forward = 2·(blocks' matrices + head) + attention;
        the inner step of each chunk is a backward of the TTT blocks and the head (≈ 2 × their
        forward); train = 3 × (forward + inner), the outer backward taken as twice what it
        differentiates (an estimate: a second-order backward costs more than that)."""
        e, D, F_, L, S, V = cfg.ttt_e2e, cfg.d_model, cfg.ff, cfg.n_layers, cfg.ttt_e2e.suffix_len, cfg.vocab_size
        w, T = e.window, seq_len
        seen = (T + 1) / 2.0 if w is None or T <= w else (w * (w + 1) / 2.0 + (T - w) * w) / T
        attn = 4.0 * cfg.n_heads * cfg.hd * seen
        block, ttt = 4 * D * D + 3 * D * F_, 4 * D * D + 6 * D * F_
        fwd = 2.0 * ((L - S) * block + S * ttt + V * D) + L * attn
        inner = 2.0 * (2.0 * (S * ttt + V * D) + S * attn) if S else 0.0
        return {"forward": fwd, "train": 3.0 * (fwd + inner)}

    # ---- switches (the LM's, for the blocks this model has) ----------------------------------
    def set_train_step(self, step: int) -> "E2ELM":
        """ρ at optimizer step ``step`` (1-based): the official ``get_ilr_multiplier`` at its
        0-based step − 1, i.e. progress min(1, step / ilr_warmup_steps)."""
        e = self.e2e
        if e.ilr_warmup_steps > 0:
            prog = min(1.0, step / e.ilr_warmup_steps)
            self.ilr_mult = (e.ilr_init + (e.inner_lr - e.ilr_init) * prog) / e.inner_lr
        return self

    def set_impl(self, impl: str) -> "E2ELM":
        return self

    def set_kernel_backend(self, backend: str) -> "E2ELM":
        return self

    def compile_blocks(self, backend: Optional[str] = None) -> "E2ELM":
        raise not_built("torch.compile of the blocks")

    def kernel_backends(self, device):
        e = self.e2e
        out = {"e2e_prefix": f"attention:{e.prefix_attention}"}
        if e.suffix_len:
            out["e2e_ttt_blocks"] = f"attention:{e.suffix_attention}"
        return out

    def fast_parameters(self) -> List[nn.Parameter]:
        """W^{(0)} of every TTT block (w1, w3, w2 each)."""
        return [p for b in self.layers[self.n_prefix:] for p in (b.prime.w1, b.prime.w3, b.prime.w2)]

    # ---- tensor parallelism -------------------------------------------------------------------
    #: ``ttt_lm.parallel.tp_model.parallelize_tp`` hands the conversion to :meth:`tensor_parallel_form`
    #: (the layout of the module docstring, tensor parallelism); the class stays E2ELM
    converts_itself_for_tp = True
    #: the TP group's context once converted (None: one rank)
    tp_ctx = None

    @property
    def local_heads(self) -> int:
        """The attention heads this rank holds (n_heads, or n_heads/p under tensor parallelism)."""
        return self.layers[0].attn.n_heads

    def tensor_parallel_form(self, ctx) -> None:
        """Convert in place to this rank's shard (module docstring, tensor parallelism): q, k, v
        column-parallel by heads, o row-parallel, qk-norm gains replicated with their gradient
        summed over the group, every SwiGLU's W_1, W_3 by rows and W_2 by columns (the prime
        MLPs' too: their fast weights are then this rank's shards), the norms before them entering
        the TP region (f); embedding, final norm and head replicated. Every rank must hold the
        same weights (built from one seed). Refused (before any change): a group size that does
        not divide n_heads or d_ff."""
        from ttt_lm.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from ttt_lm.parallel.tp_model import SharedParamsModule, _entry_norm, _shard_param
        p = ctx.world_size
        bad = [f"{k}={v}" for k, v in (("model.n_heads", self.cfg.n_heads), ("the MLP width d_ff", self.cfg.ff)) if v % p]
        if bad:
            raise ValueError(f"{MODEL_NAME}: parallel.tensor_parallel={p} must divide {', '.join(bad)}")
        col = lambda lin: ColumnParallelLinear.from_linear(lin, ctx, input_in_region=True)
        row = lambda lin: RowParallelLinear.from_linear(lin, ctx, input_is_parallel=True)
        for blk in self.layers:
            a = blk.attn
            a.wq, a.wk, a.wv, a.wo = col(a.wq), col(a.wk), col(a.wv), row(a.wo)
            a.q_norm, a.k_norm = SharedParamsModule(a.q_norm, ctx), SharedParamsModule(a.k_norm, ctx)
            a.n_heads //= p
            blk.seq_norm = _entry_norm(blk.seq_norm, ctx)
            blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj = \
                col(blk.mlp.gate_proj), col(blk.mlp.up_proj), row(blk.mlp.down_proj)
            blk.ffn_norm = _entry_norm(blk.ffn_norm, ctx)
            if blk.ttt:
                pr = blk.prime
                pr.w1, pr.w3, pr.w2 = _shard_param(pr.w1, 0, ctx), _shard_param(pr.w3, 0, ctx), _shard_param(pr.w2, 1, ctx)
                blk.prime_norm = _entry_norm(blk.prime_norm, ctx)
                blk.prime_sum = _RegionSum(ctx)
        self.tp_ctx = ctx

    def _sum_over_tp(self, sq: torch.Tensor) -> torch.Tensor:
        """The inner clip's squared global norm: this rank's Σ‖g‖² over its fast-weight shards,
        summed over the TP group (all-reduce forward and backward, twice differentiable)."""
        if self.tp_ctx is None:
            return sq
        from ttt_lm.parallel.tensor_parallel import all_reduce_sum
        return all_reduce_sum(sq, self.tp_ctx.group)

    # ---- ZeRO-3 -------------------------------------------------------------------------------
    #: ZeRO-3 gathers and releases each module's parameters by hooks around that module's forward
    #: and backward; this model reads the prime MLPs' parameters outside any module's forward (as
    #: W^{(0)}), differentiates the TTT blocks inside its forward (the inner step) and recomputes
    #: that step in the backward, so parameters released by those hooks would be read empty. Under
    #: ZeRO-3 the engine therefore removes the hooks (``ttt_lm.train.engine`` reads this attribute)
    #: and the forward gathers every parameter itself, once, at its start, keeping them whole until
    #: ``release_parameters`` after the backward (the trainer calls it): between steps and in the
    #: checkpoints each rank holds its shard; during a step every rank holds all the parameters, as
    #: under ZeRO-1/2 (the optimizer state and the gradients stay partitioned).
    gathers_zero3_parameters = True

    def _gather_zero3(self) -> bool:
        """Under ZeRO-3 (parameters carrying DeepSpeed's ``ds_id``), gather them all unless already
        held; True when this call gathered them."""
        if getattr(self, "_zero3", None) is not None or not any(hasattr(p, "ds_id") for p in self.parameters()):
            return False
        import deepspeed
        self._zero3 = deepspeed.zero.GatheredParameters(list(self.parameters()))
        self._zero3.__enter__()
        return True

    def release_parameters(self) -> None:
        """ZeRO-3: partition the parameters again (after the backward); nothing otherwise."""
        z = getattr(self, "_zero3", None)
        if z is not None:
            self._zero3 = None
            z.__exit__(None, None, None)

    # ---- forward ------------------------------------------------------------------------------
    def rho(self) -> float:
        return self.ilr_mult if self.training else 1.0

    def _prefix(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.layers[:self.n_prefix]:
            h = b(h, self.e2e.prefix_attention)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def _chunk_step(self, start: int, update: bool, keep_logits, rho: float, outer: bool,
                    h0: torch.Tensor, targets: torch.Tensor, *flat: torch.Tensor):
        """The TTT blocks on one chunk: (ℓ_i [B], ‖g_i‖ [B] or empty, logits or empty, then
        W^{(i+1)} (or W^{(i)} without ``update``) and the new caches, flattened). ``outer``: the
        outer gradient is wanted (g_i keeps its graph). ``keep_logits`` "hidden": the final-normed
        hidden states RMSNorm_f(h) in the logits' place."""
        S = self.e2e.suffix_len
        W = [list(flat[3 * j:3 * j + 3]) for j in range(S)]
        caches = [tuple(flat[3 * S + 2 * j:3 * S + 2 * j + 2]) for j in range(S)]
        with torch.enable_grad():
            if not outer:
                W = [[w.detach().requires_grad_(update) for w in ws] for ws in W]
            h = h0
            new_caches = []
            for blk, ws, c in zip(self.layers[self.n_prefix:], W, caches):
                h, c = blk.chunk(h, c, start, ws, self.e2e.suffix_attention)
                new_caches.append(c)
            hn = self.norm(h)
            logits = self.lm_head(hn)
            lf = acc(logits)                                   # fp32 CE (fp64 stays)
            m = targets != -100
            ce = F.cross_entropy(lf.transpose(1, 2), targets.masked_fill(~m, 0), reduction="none")
            mf = m.to(ce.dtype)
            loss = (ce * mf).sum(1) / mf.sum(1).clamp_min(1e-10)
            gnorm = loss.new_zeros(0)
            if update:
                flatW = [w for ws in W for w in ws]
                g = torch.autograd.grad(loss.sum(), flatW, create_graph=outer)
                sq = self._sum_over_tp(sum(gi.pow(2).flatten(1).sum(1) for gi in g))   # [B]: one global norm
                # floored at the dtype's tiny: a chunk without targets (g = 0) gives a zero step, not NaN
                gnorm = torch.sqrt(sq.clamp_min(torch.finfo(sq.dtype).tiny))
                c = self.e2e.inner_clip
                scale = torch.where(gnorm < c, torch.ones_like(gnorm), c / gnorm)
                lr = self.e2e.inner_lr * rho
                newW = [w - lr * scale.view(-1, *([1] * (w.dim() - 1))).to(w.dtype) * gi for w, gi in zip(flatW, g)]
            else:
                newW = [w for ws in W for w in ws]
        if not outer:
            loss, gnorm, logits, hn = loss.detach(), gnorm.detach(), logits.detach(), hn.detach()
            newW = [w.detach() for w in newW]
            new_caches = [tuple(t.detach() for t in c) for c in new_caches]
        out_logits = (hn if keep_logits == "hidden" else logits) if keep_logits else loss.new_zeros(0)
        return (loss, gnorm, out_logits, *newW, *[t for c in new_caches for t in c])

    def run(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, keep_logits=False,
            keep_fast: bool = False) -> E2ETrace:
        """The forward of the module docstring, with what it did (:class:`E2ETrace`).
        ``keep_logits`` "hidden": keep the final-normed hidden states (``E2ETrace.hidden``) instead
        of the logits."""
        e = self.e2e
        B, T = input_ids.shape
        if labels is None:
            targets = torch.cat([input_ids[:, 1:], input_ids.new_full((B, 1), -100)], dim=1)
        else:
            if tuple(labels.shape) != (B, T):
                raise ValueError(f"labels must be [B, T] = {(B, T)} like input_ids, got {tuple(labels.shape)}")
            targets = labels
        outer = torch.is_grad_enabled()
        remat = e.remat and outer and self.training
        h = self.embed(input_ids)
        if self.n_prefix:
            h = checkpoint(self._prefix, h, use_reentrant=False) if remat else self._prefix(h)
        if e.suffix_len == 0:
            if keep_logits == "hidden":
                hn = self.norm(h)
                return E2ETrace(losses=hn.new_zeros(0, B), weights=[], grad_norms=None, fast=[], logits=None,
                                loss=None, hidden=hn)       # no chunks: no loss is taken
            logits = self._logits(h) if (keep_logits or labels is None) else None
            if labels is not None:
                loss = self.lm_head(self.norm(h), labels)
            else:
                loss = plain_mean_loss(logits, targets)
            return E2ETrace(losses=loss.detach()[None, None].expand(1, B), weights=[1.0], grad_norms=None,
                            fast=[], logits=logits, loss=loss)
        S, b, w = e.suffix_len, e.inner_batch, e.window
        flat = [t for blk in self.layers[self.n_prefix:] for t in blk.prime.fast_weights(B)]
        cache0 = h.new_zeros(B, self.local_heads, 0, self.cfg.hd)     # grows to w keys
        flat += [cache0] * (2 * S)
        rho = self.rho()
        losses, norms, logits, fast, weights = [], [], [], [], []
        starts = list(range(0, T, b))
        for i, s in enumerate(starts):
            en = min(s + b, T)
            update = i + 1 < len(starts)
            if keep_fast:
                fast.append([[t.detach() for t in flat[3 * j:3 * j + 3]] for j in range(S)])
            args = (s, update, keep_logits, rho, outer, h[:, s:en], targets[:, s:en], *flat)
            res = checkpoint(self._chunk_step, *args, use_reentrant=False) if remat else self._chunk_step(*args)
            loss_i, gn_i, lg_i = res[:3]
            flat = list(res[3:])
            losses.append(loss_i)
            weights.append((en - s) / b)
            if update:
                norms.append(gn_i)
            if keep_logits:
                logits.append(lg_i)
        wt = torch.tensor(weights, dtype=losses[0].dtype, device=losses[0].device)
        L = torch.stack(losses)                                               # [n, B]
        loss = ((L * wt[:, None]).sum(0) / wt.sum()).mean()
        kept = torch.cat(logits, dim=1) if keep_logits else None
        hidden = kept if keep_logits == "hidden" else None
        return E2ETrace(losses=L, weights=weights, grad_norms=torch.stack(norms) if norms else None, fast=fast,
                        logits=None if hidden is not None else kept, loss=loss, hidden=hidden)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                states=None, output_states: bool = False,
                position_ids: Optional[torch.Tensor] = None) -> LMOutput:
        """As ``LM.forward``: with ``labels`` the loss (and no logits), else the logits [B, T, V].
        ``position_ids`` are accepted and not read (the official code reads packed rows whole).

        With ``states`` (what a previous call or :meth:`init_states` returned) or
        ``output_states``, the tokens continue those states by the decode form (:meth:`advance`:
        the logits [B, T, V] equal those of the forward of the whole sequence at these positions),
        and ``output_states`` returns the new states; labels are then refused (the sequence
        loss is a mean over the chunks of a whole sequence)."""
        if self._gather_zero3() and not torch.is_grad_enabled():   # no backward follows: release now
            try:
                return self.forward(input_ids, labels, states, output_states, position_ids)
            finally:
                self.release_parameters()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        if states is not None or output_states:
            if labels is not None:
                raise ValueError(f"{MODEL_NAME}: labels with carried states (states= or output_states=True) are not "
                                 "supported: the sequence loss is the mean over the chunks of a whole sequence; "
                                 "run the forward on the whole sequence, or take the loss from the logits")
            if states is None:
                states = self.init_states(input_ids.shape[0], input_ids.device)
            logits, new = self.advance(input_ids, states, "all")
            return LMOutput(logits=logits, states=new if output_states else None)
        tr = self.run(input_ids, labels, keep_logits=labels is None)
        if labels is not None:
            return LMOutput(logits=None, loss=tr.loss)
        return LMOutput(logits=tr.logits)

    def hidden(self, input_ids: torch.Tensor, states=None, output_states: bool = False,
               position_ids: Optional[torch.Tensor] = None):
        """As ``LM.hidden``: the final-normed hidden states RMSNorm_f(h) [B, T, D] (so that
        ``lm_head(hidden)`` are ``forward``'s logits) and the new states (None without
        ``output_states``). The TTT blocks' inner steps still run the head on each chunk (their
        loss is the next-token loss, targets the inputs shifted by one as in ``forward`` without
        labels); with ``states`` or ``output_states`` the tokens continue the states by
        :meth:`advance`, as ``forward`` does. ``position_ids`` are accepted and not read."""
        if self._gather_zero3() and not torch.is_grad_enabled():   # no backward follows: release now
            try:
                return self.hidden(input_ids, states, output_states, position_ids)
            finally:
                self.release_parameters()
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
        if states is not None or output_states:
            if states is None:
                states = self.init_states(input_ids.shape[0], input_ids.device)
            h, new = self.advance(input_ids, states, "hidden")
            return h, (new if output_states else None)
        return self.run(input_ids, None, keep_logits="hidden").hidden, None

    # ---- decode -------------------------------------------------------------------------------
    def global_attention_layers(self) -> int:
        """How many blocks attend over the whole context: every one without a window (the
        full-attention baseline), none with one (read by ``ttt_lm.eval.common.check_context``,
        which holds the first to ``model.max_seq_len``)."""
        return self.cfg.n_layers if self.e2e.window is None else 0

    @property
    def state_update_head_tokens(self) -> int:
        """How many tokens one update of the decode state runs through the LM head (the inner
        step's loss over a chunk: b; 0 without TTT blocks). Read by tests that count the head's
        inputs during a prefill."""
        return self.e2e.inner_batch if self.e2e.suffix_len else 0

    def init_states(self, batch_size: int, device=None, dtype=None) -> List[E2EState]:
        """The state before any token (:class:`E2EState` per block): empty caches, W^{(0)} (the
        prime MLPs' parameters, shared by the rows until their first inner step), an empty open
        chunk, chunk counter 0. ``dtype``: the caches' (default the embedding's); the fast
        weights are in its accumulation dtype."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        p = self.embed.weight
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
        B, H, d, D = batch_size, self.local_heads, self.cfg.hd, self.cfg.d_model
        empty = torch.zeros(B, H, 0, d, device=device, dtype=dtype)
        out = []
        for j, blk in enumerate(self.layers):
            st = E2EState(pos=0, k=empty, v=empty)
            if blk.ttt:
                st.fast = tuple(w.detach().to(device=device, dtype=acc_dtype(dtype)) for w in blk.prime.fast_weights(B))
                if j == self.n_prefix:
                    st.chunk_h = torch.zeros(B, 0, D, device=device, dtype=dtype)
                    st.chunk_ids = torch.zeros(B, 0, device=device, dtype=torch.long)
            out.append(st)
        return out

    def _check_states(self, states, B: int) -> None:
        L = self.cfg.n_layers
        if not isinstance(states, (list, tuple)) or len(states) != L or \
                not all(isinstance(st, E2EState) for st in states):
            raise ValueError(f"{MODEL_NAME}: states must be the list of {L} E2EState that init_states, prefill, step "
                             f"or a forward with output_states returned, got {type(states).__name__}")
        rows = {int(st.k.shape[0]) for st in states}
        if rows != {B}:
            raise ValueError(f"{MODEL_NAME}: the states hold {sorted(rows)} rows, the tokens {B}")
        if len({st.pos for st in states}) != 1:
            raise ValueError(f"{MODEL_NAME}: the layers' states have read different numbers of tokens "
                             f"{[st.pos for st in states]}")

    def advance(self, ids: torch.Tensor, states: List[E2EState], logits: Optional[str] = "last"):
        """The decode form: the tokens ids [B, r] after ``states`` (module docstring, decode):
        (logits, the new states). ``logits``: "all" [B, r, V], "last" [B, V] (the head on the
        last position only), "hidden" (the final-normed hidden states [B, r, D] in their place) or
        None (no head but the inner steps'). The prefix blocks run once on
        the r tokens; the TTT blocks run segment by segment between chunk boundaries, and when
        token n = (i+1)·b arrives the inner step of chunk i is taken (its targets, tokens ib+1 …
        (i+1)b, are then known) before that token is run with W^{(i+1)}."""
        if logits not in ("all", "last", "hidden", None):
            raise ValueError(f"logits must be 'all', 'last', 'hidden' or None, got {logits!r}")
        e = self.e2e
        B, r = ids.shape
        self._check_states(states, B)
        n0 = states[0].pos
        P, S, b, w = self.n_prefix, e.suffix_len, e.inner_batch, e.window
        def grow(st, k, v, keep, buf):
            return E2EState(pos=n0 + r, k=k[:, :, k.shape[2] - keep:], v=v[:, :, v.shape[2] - keep:], fast=st.fast,
                            steps=st.steps, kv_buf=buf, kv_end=None if buf is None else buf.end)
        h = self.embed(ids)
        new: List[E2EState] = []
        for blk, st in zip(self.layers[:P], states[:P]):
            h, (k, v), buf = blk.extend(h, (st.k, st.v), n0, backend=e.prefix_attention, buf=st.kv_buf,
                                        buf_end=st.kv_end)
            new.append(grow(st, k, v, k.shape[2] if w is None else min(w, k.shape[2]), buf))
        if S:
            first = states[P]
            W = [list(st.fast) for st in states[P:]]
            kv = [(st.k, st.v) for st in states[P:]]
            bufs = [(st.kv_buf, st.kv_end) for st in states[P:]]
            ch, cid, steps = first.chunk_h, first.chunk_ids, first.steps
            outs = []
            s = 0
            while s < r:
                n = n0 + s                              # tokens read before this segment
                if n and n % b == 0:                    # chunk n/b − 1 is whole and its next token is here
                    W, kv = self._inner_update(ch, torch.cat([cid[:, 1:], ids[:, s:s + 1]], 1), W, kv, n - b)
                    ch, cid, steps = ch[:, :0], cid[:, :0], steps + 1
                en = min(r, s + b - n % b)
                x = h[:, s:en]
                for j, blk in enumerate(self.layers[P:]):
                    x, kv[j], buf = blk.extend(x, kv[j], n, W[j], e.suffix_attention, *bufs[j])
                    bufs[j] = (buf, None if buf is None else buf.end)
                outs.append(x)
                ch, cid = torch.cat([ch, h[:, s:en]], 1), torch.cat([cid, ids[:, s:en]], 1)
                s = en
            h = torch.cat(outs, 1) if logits in ("all", "hidden") else outs[-1]
            for j, st in enumerate(states[P:]):
                k, v = kv[j]
                ns = grow(st, k, v, k.shape[2], bufs[j][0])
                ns.fast, ns.steps = tuple(W[j]), steps
                if j == 0:
                    ns.chunk_h, ns.chunk_ids = ch, cid
                new.append(ns)
        for st in new:
            st.steps = new[-1].steps
        new = [_settle(st) for st in new]
        if logits is None:
            return None, new
        if logits == "hidden":
            return self.norm(h), new
        if logits == "all":
            return self._logits(h), new
        return self._logits(h[:, -1:])[:, 0], new

    def _inner_update(self, chunk_h, targets, W, kv, start: int):
        """The inner step of the whole chunk at ``start`` (b tokens; its inputs to the TTT blocks
        ``chunk_h``, its next tokens ``targets``), from the caches as they were at ``start`` (the
        first min(w, start) keys of each TTT block's ``kv``), with ρ = 1 and no outer graph (a
        first-order gradient w.r.t. W^{(i)} under ``torch.enable_grad``, the training forward's
        :meth:`_chunk_step`): (W^{(i+1)}, each TTT block's cache trimmed to the last
        min(w, start + b) keys, the cache at the next chunk's start)."""
        S, b, w = self.e2e.suffix_len, self.e2e.inner_batch, self.e2e.window
        m0 = min(w, start)
        # the training step reads keys before RoPE at local positions: undo the decode's absolute one
        before = torch.arange(start - m0, start, device=chunk_h.device)
        flat = [t for ws in W for t in ws] + [x for k, v in kv
                                               for x in (rope_interleaved(k[:, :, :m0], -before, self.e2e.rope_theta),
                                                         v[:, :, :m0])]
        res = self._chunk_step(start, True, False, 1.0, False, chunk_h, targets, *flat)
        newW = list(res[3:3 + 3 * S])
        keep = min(w, start + b)
        kv = [(k[:, :, k.shape[2] - keep:], v[:, :, v.shape[2] - keep:]) for k, v in kv]
        return [newW[3 * j:3 * j + 3] for j in range(S)], kv

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, states: List[E2EState], position_ids: Optional[torch.Tensor] = None):
        """One decode step: token_ids [B] → logits [B, V] and the new states (:meth:`advance`;
        the step that reads token (i+1)·b also takes chunk i's inner step). ``position_ids`` are
        accepted and not read, as in ``forward``."""
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be [B], got {tuple(token_ids.shape)}")
        return self.advance(token_ids[:, None], states, "last")

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, prefill_chunk: Optional[int] = PREFILL_CHUNK):
        """Read the prompt prompt_ids [B, T0] ``prefill_chunk`` tokens per pass (None: one pass),
        each piece by :meth:`advance` from the states the previous one left: (the logits [B, V]
        of its last position, the states after it), what ``LM.generate`` decodes from. Only the
        last piece's last position runs through the head (and the inner steps' chunks). Equal to
        the forward of the prompt at any piece length (tests/model/test_ttt_e2e_decode.py). A
        prompt that ends on a chunk boundary leaves that chunk's inner step to the next token.
        Refused as ``LM.prefill`` refuses."""
        check_prefill_chunk(prefill_chunk)
        check_prompt_ids(prompt_ids, self.cfg.vocab_size)
        T0 = prompt_ids.shape[1]
        n = T0 if prefill_chunk is None else prefill_chunk
        states = self.init_states(prompt_ids.shape[0], prompt_ids.device)
        logits = None
        for s in range(0, T0, n):
            logits, states = self.advance(prompt_ids[:, s:s + n], states, "last" if s + n >= T0 else None)
        return logits, states


def _settle(st: E2EState) -> E2EState:
    """``st`` with its tensors in storages of their own size (``_own_storage``) but for the keys
    and values that are views of a decode buffer (at most 1.5× what they hold, kept to append in
    place)."""
    if st.kv_buf is None:
        return st.map(_own_storage)
    k, v, buf, end = st.k, st.v, st.kv_buf, st.kv_end
    st.k = st.v = None
    out = st.map(_own_storage)
    out.k, out.v, out.kv_buf, out.kv_end = k, v, buf, end
    return out


def plain_mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The token-mean CE of logits [B, T, V] (fp32) over targets != −100."""
    return F.cross_entropy(acc(logits).flatten(0, 1), targets.flatten(), ignore_index=-100)
