r"""LaCT: large-chunk test-time training (Zhang et al. 2025, "Test-Time Training Done Right"),
the SwiGLU fast-weight layer with sliding-window attention in the same layer, after the official
code (a1600012888/LaCT, ``lact_llm/lact_model/layer_lact_swiglu.py``).

One projection [q | k | v] = W_qkv x feeds two paths, and the layer returns W_o (attention + fast):

* sliding-window attention over H heads of width d (RoPE at the token's position, window w =
  ``lact.window``: keys t − w + 1 … t);
* the fast path over F = ``lact.num_heads`` heads of width e = H·d / F:

      q̂ = q ⊙ s_q + o_q,  k̂ = k ⊙ s_k + o_k           (learned per-channel scale and offset)
      q̃, k̃, ṽ = SiLU(q̂), SiLU(k̂), SiLU(v)  per head;  q̃, k̃ ← x / (‖x‖ + 1e-5)
      q̃, k̃ ← RoPE(q̃), RoPE(k̃)                      (the attention's RoPE, over its d-wide heads)
      lr_{j,t} = softplus(W_lr x_t + softplus⁻¹(0.001)) per head, j = 0, 1, 2 (one per matrix)
      m_t = σ(W_m x_t) per head                       (momentum)
      y_t = f_{W_c}(q̃_t),  f_W(x) = w1 (silu(w0 x) ⊙ (w2 x))
      fast_t = RMSNorm(y_t) ⊙ SiLU(W_s x_t)           (RMSNorm over one head, SiLU gate per head)

  where W_c are the fast weights after the updates of the chunks (of C = ``lact.chunk_size``
  tokens) before t's chunk: ``kernels.lact.block_causal_lact_swiglu`` (apply, then update; the
  update of a chunk is one step on −Σ_t ⟨f_W(k̃_t), ṽ_t⟩ with the lr's above, then momentum,
  optionally Muon, and the rows renormalised to the initial weights' row norms; its docstring has
  the formulas). The initial fast weights are parameters: w0, w2 ∈ R^{F×d_h×e} (d_h = e ·
  ``lact.inter_multi``), or with ``lact.low_rank`` = r > 0, W_left W_right + 0.5·I with
  W_left ∈ R^{F×d_h×r}, W_right ∈ R^{F×r×e}; w1 ∈ R^{F×e×d_h}.

Init (the official ``_init_weights``): every linear N(0, 0.02) with zero bias (``model.init:
ttt`` in the presets), s = 1, o = 0, w1 ~ N(0, 1/d_h), full-rank w0, w2 ~ N(0, 1/e), low-rank
factors N(0, g²/r) and N(0, g²/e) with g = ``lact.fw_init_gain`` = 0.5.

Paper and code. The paper (arXiv 2505.23884) gives the design (large-chunk apply-then-update,
SwiGLU fast weights, window attention in the layer, momentum and Muon as optional fast-weight
optimizers); this file was checked against the official code, not line by line against the
paper's equations, and follows the code wherever it fixes a detail: the learning rates
are per token, head and matrix; momentum is the chunk's mean of σ(W_m x); the Muon steps run in
bfloat16 (``lact.muon_dtype``); the weight normalisation's targets are the row norms of the
initial weights, not detached; the fast path's RoPE rotates its e-wide heads as H d-wide pieces.
Two differences from the official code: it ignores document boundaries in the fast path (its
note: "current implementation ignores cu_seqlens for ttt-layer"), while here a packed document
starts from the initial weights (``model.reset_at_doc_boundaries``, below); and it rounds the learning rates and momentum to float32 whatever the model's dtype, while here
they stay in the model's dtype (float32 under half precision, as there). The fast weights are
kept in float32 under half-precision inputs (the official ``fp32_states``). The presets tie the
LM head to the embedding (the official 760M config unties it; see configs/lact_760m.yaml).

Packed documents (``docs``, one call for the batch). Alone, a document of L tokens has its
chunks counted from its first token; chunk 0 reads the initial weights, and only a document of
L > C tokens writes (the last chunk never does). The chunked form runs the packed rows as they
are for everything but the writes: RoPE at each token's offset in its document, the window
attention under a document mask (``ttt_lm.model.window_attention``: blocked SDPA with a
per-block document mask, flex's document block mask on CUDA, flash-attn's varlen kernel with
``cu_seqlens`` where installed), and f_{W_init}(q̃_t) for every query (chunk 0 of every
document). The documents longer than C alone are laid out at chunk boundaries
(``DocLayout.aligned(C, longer_than=C)``: each padded to a multiple of C in its row, the short
ones left out) and run through the op once with ``resets`` at their first chunks (the weights,
accumulators and momentum buffers restart inside the scan); their tokens take that result. With
many documents shorter than a chunk the op's loop is then shorter than for the unpacked rows.
The reference form runs on the padded view (one document per row, ``Mixer.run_padded``).

Forms: ``reference`` runs the op's plain schedule and the explicit windowed softmax; ``chunked``
the op's batched form and ``sliding_window_attention`` (O(T·w): blocked SDPA, flex, flash-attn); ``step`` one token: the attention reads its KV cache
(the last w − 1 keys), the fast path applies the current weights and appends the token to the
open chunk, which is written when it is full and the next token arrives. The state carries the
fast weights, the norm targets, the momentum buffers, the open chunk and the KV cache, so two
segments with the state passed equal one pass, and context parallelism passes it from rank to
rank (``cp_form = "state_passing"``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels import lact as _lact
from ttt_lm.model.backend import Backend, resolve
from ttt_lm.model.layers import RMSNorm, acc, apply_rope, rope_cos_sin
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer
from ttt_lm.model.window_attention import sliding_window_attention, window_mask

#: model.lact.muon_dtype → the dtype of the Newton–Schulz steps (None: the state's)
_MUON_DTYPES = {"bfloat16": torch.bfloat16, "state": None}


@dataclass
class LaCTConfig:
    """``model.lact``: large-chunk test-time training with SwiGLU fast weights and sliding-window
    attention in one layer (Zhang et al. 2025)."""
    num_heads: int = 4                  # fast-weight heads (each d_model / num_heads wide)
    chunk_size: int = option(2048, ge=1)  # tokens per fast-weight update
    window: int = option(2048, ge=1)    # sliding window of the layer's attention (keys t-window+1..t)

    def short(self, n: int) -> "LaCTConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return replace(self, chunk_size=n, window=n)

    def tiny(self, n: int) -> "LaCTConfig":
        """This section for the tests' tiny models (``tests/model/mixer_checks.short_config``):
        ``short(n)`` with the attention's window one token longer than a chunk."""
        return replace(self, chunk_size=n, window=n + 1)
    inter_multi: float = 1.0            # fast-weight hidden width d_h = inter_multi × head width
    low_rank: int = option(0, ge=0)     # > 0: initial w0, w2 = W_left W_right + 0.5·I of this rank; 0: full
    fw_init_gain: float = 0.5           # gain of the low-rank factors' init
    use_momentum: bool = True
    use_muon: bool = False
    # dtype of the Newton–Schulz steps: bfloat16 (official) | state
    muon_dtype: str = option("bfloat16", choices=tuple(_MUON_DTYPES))
    prenorm: bool = False               # the official prenorm variant of the weight normalisation
    base_lr: float = option(0.001, gt=0)  # lr = softplus(W_lr x + softplus⁻¹(base_lr))
    rope_theta: float = 10000.0


def inv_softplus(y: float) -> float:
    """softplus⁻¹(y) = y + log(−expm1(−y))."""
    return y + math.log(-math.expm1(-y))


@dataclass
class LaCTState(MixerState):
    """k, v [B, H, n, d]: the attention's KV cache (the last ≤ w − 1 keys, RoPE applied);
    the fast weights w0, w2 [B, F, d_h, e], w1 [B, F, e, d_h] (float32 for half inputs), their
    row-norm targets w*_norm [B, F, rows, 1], with ``lact.prenorm`` the accumulators w*_main,
    with momentum the buffers m0, m1, m2; the open chunk fk, fv [B, F, n_c, e] and its lr0, lr1,
    lr2 (and momentum fm) [B, F, n_c]; pos (tokens read)."""
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    w0: Optional[torch.Tensor] = None
    w1: Optional[torch.Tensor] = None
    w2: Optional[torch.Tensor] = None
    w0_norm: Optional[torch.Tensor] = None
    w1_norm: Optional[torch.Tensor] = None
    w2_norm: Optional[torch.Tensor] = None
    w0_main: Optional[torch.Tensor] = None
    w1_main: Optional[torch.Tensor] = None
    w2_main: Optional[torch.Tensor] = None
    m0: Optional[torch.Tensor] = None
    m1: Optional[torch.Tensor] = None
    m2: Optional[torch.Tensor] = None
    fk: Optional[torch.Tensor] = None
    fv: Optional[torch.Tensor] = None
    lr0: Optional[torch.Tensor] = None
    lr1: Optional[torch.Tensor] = None
    lr2: Optional[torch.Tensor] = None
    fm: Optional[torch.Tensor] = None

    #: op state key ↔ field
    _RENAME = {"k": "fk", "v": "fv", "momentum": "fm"}

    def op_state(self) -> Dict[str, torch.Tensor]:
        """The fast-weight part as ``kernels.lact`` takes it."""
        back = {v: k for k, v in self._RENAME.items()}
        return {back.get(f.name, f.name): getattr(self, f.name) for f in fields(self)
                if f.name not in ("pos", "k", "v") and getattr(self, f.name) is not None}

    @classmethod
    def from_op(cls, st: Dict[str, torch.Tensor], k, v, pos: int) -> "LaCTState":
        return cls(k=k, v=v, pos=pos, **{cls._RENAME.get(key, key): t for key, t in st.items()})


class LowRankFastWeight(nn.Module):
    """The initial fast weight W_left W_right + 0.5·I ([F, rows, cols]; I the rectangular identity)."""

    def __init__(self, heads: int, rows: int, cols: int, rank: int, gain: float):
        super().__init__()
        self.rank, self.gain = rank, gain
        self.left = nn.Parameter(torch.empty(heads, rows, rank))
        self.right = nn.Parameter(torch.empty(heads, rank, cols))
        for p in (self.left, self.right):
            p._flops_not_per_token = True   # applied once per step, not to each token
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.left.normal_(0.0, self.gain / math.sqrt(self.rank))
            self.right.normal_(0.0, self.gain / math.sqrt(self.right.shape[-1]))

    def forward(self) -> torch.Tensor:
        W = self.left @ self.right
        eye = torch.eye(W.shape[-2], W.shape[-1], device=W.device, dtype=W.dtype)
        return W + 0.5 * eye


@register_mixer("lact", config=LaCTConfig)
class LaCT(Mixer):
    official_init = "ttt"          # LaCT's official code: N(0, 0.02) everywhere
    #: the fast weights are a nonlinear recurrence over chunks: ranks hand the state on
    cp_form = "state_passing"

    #: its sliding-window attention attends over earlier tokens: not a pure recurrence
    attends = True

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.lact
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.hd = cfg.hd
        inner = self.n_heads * self.hd
        if isinstance(c.num_heads, bool) or not isinstance(c.num_heads, int) or c.num_heads <= 0 \
                or inner % c.num_heads:
            raise ValueError(f"model.lact.num_heads={c.num_heads!r} must be a positive int dividing "
                             f"n_heads·head_dim = {inner}")
        # chunk_size, window, muon_dtype, low_rank and base_lr: checked by LaCTConfig (ModelConfig.validate)
        self.n_fw = c.num_heads
        self.fw_hd = inner // c.num_heads
        self.d_h = int(self.fw_hd * c.inter_multi)
        if self.d_h <= 0:
            raise ValueError(f"model.lact.inter_multi={c.inter_multi} gives a fast-weight width of {self.d_h}")
        self.chunk_size, self.window = c.chunk_size, c.window
        self.use_momentum, self.use_muon, self.prenorm = c.use_momentum, c.use_muon, c.prenorm
        self.muon_dtype = _MUON_DTYPES[c.muon_dtype]
        self.rope_theta = c.rope_theta
        self.base_lr_inv = inv_softplus(c.base_lr)
        self.low_rank, self.fw_init_gain = c.low_rank, c.fw_init_gain

        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)
        self.o_proj._is_residual_out = True
        self.qk_scale = nn.Parameter(torch.ones(inner, 2))
        self.qk_offset = nn.Parameter(torch.zeros(inner, 2))
        F_, e, dh = self.n_fw, self.fw_hd, self.d_h
        if self.low_rank > 0:
            self.w0 = LowRankFastWeight(F_, dh, e, self.low_rank, self.fw_init_gain)
            self.w2 = LowRankFastWeight(F_, dh, e, self.low_rank, self.fw_init_gain)
        else:
            self.w0 = nn.Parameter(torch.empty(F_, dh, e))
            self.w2 = nn.Parameter(torch.empty(F_, dh, e))
        self.w1 = nn.Parameter(torch.empty(F_, e, dh))
        # ``flops_per_token`` counts what these do per token (ttt_lm.model.flops skips them)
        for p in (self.qk_scale, self.qk_offset, self.w1) + (() if self.low_rank > 0 else (self.w0, self.w2)):
            p._flops_not_per_token = True
        self.lr_proj = nn.Linear(cfg.d_model, 3 * F_)          # per head: lr0, lr1, lr2
        self.momentum_proj = nn.Linear(cfg.d_model, F_) if self.use_momentum else None
        self.scale_proj = nn.Linear(cfg.d_model, F_)           # W_s: SiLU gate of each head's output
        self.ttt_norm = RMSNorm(e, 1e-5)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.qk_scale.fill_(1.0)
            self.qk_offset.zero_()
            if self.low_rank > 0:
                self.w0.reset_parameters()
                self.w2.reset_parameters()
            else:
                self.w0.normal_(0.0, 1.0 / math.sqrt(self.fw_hd))
                self.w2.normal_(0.0, 1.0 / math.sqrt(self.fw_hd))
            self.w1.normal_(0.0, 1.0 / math.sqrt(self.d_h))
            self.ttt_norm.weight.fill_(1.0)

    def fast_weights(self):
        """The initial fast weights (w0, w1, w2) as [F, ...]."""
        w0 = self.w0() if self.low_rank > 0 else self.w0
        w2 = self.w2() if self.low_rank > 0 else self.w2
        return w0, self.w1, w2

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """The attention heads and the fast-weight heads split together: W_qkv by columns ([q | k |
        v] fused, each part split, so rank r holds channels r·D/p … of each, i.e. attention heads
        r·H/p … and fast heads r·F/p …), the per-channel scale and offset and the initial fast
        weights by heads, W_lr, W_m, W_s by columns (heads), W_o by rows; the per-head RMSNorm is
        shared."""
        lr = ("w0.left", "w0.right", "w2.left", "w2.right") if cfg.lact.low_rank > 0 else ("w0", "w2")
        col = ("qkv", "lr_proj", "scale_proj") + (("momentum_proj",) if cfg.lact.use_momentum else ())
        return TPPlan(column=col, row=("o_proj",), head_params=("qk_scale", "qk_offset", "w1") + lr,
                      shared_modules=("ttt_norm",), fused=(("qkv", 3),), head_counts=("n_heads", "n_fw"))

    # ---- pieces ------------------------------------------------------------------------------
    def _paths(self, x: torch.Tensor, pos0: int, positions: Optional[torch.Tensor] = None):
        """Attention q, k, v [B, H, T, d] (RoPE applied at pos0 … pos0 + T − 1, or at
        ``positions`` [B, T]: packed documents' in-document offsets) and the op's inputs."""
        B, T, _ = x.shape
        H, d, Fh, e = self.n_heads, self.hd, self.n_fw, self.fw_hd
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        rd = acc(x).dtype  # the tables in the accumulation dtype: float64 in a float64 run
        if positions is not None:
            cos, sin = rope_cos_sin(positions[:, None], d, self.rope_theta, dtype=rd)          # [B, 1, T, d]
        else:
            cos, sin = rope_cos_sin(torch.arange(pos0, pos0 + T, device=x.device), d, self.rope_theta, dtype=rd)
        fq = q * self.qk_scale[:, 0] + self.qk_offset[:, 0]
        fk = k * self.qk_scale[:, 1] + self.qk_offset[:, 1]

        def fast(t, rope: bool):
            t = F.silu(t.view(B, T, Fh, e))
            if not rope:
                return t.transpose(1, 2)
            ta = acc(t)
            t = (ta / (ta.norm(dim=-1, keepdim=True) + 1e-5)).to(t.dtype)
            t = apply_rope(t.reshape(B, T, H, d).transpose(1, 2), cos, sin)     # the attention's heads
            return t.transpose(1, 2).reshape(B, T, Fh, e).transpose(1, 2)

        aq, ak, av = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))
        aq, ak = apply_rope(aq, cos, sin), apply_rope(ak, cos, sin)
        lr = F.softplus(acc(self.lr_proj(x)) + self.base_lr_inv).view(B, T, Fh, 3).permute(3, 0, 2, 1)
        inp = {"q": fast(fq, True), "k": fast(fk, True), "v": fast(v, False),
               "lr0": lr[0], "lr1": lr[1], "lr2": lr[2],
               "momentum": (torch.sigmoid(acc(self.momentum_proj(x))).transpose(1, 2)
                            if self.use_momentum else None)}
        return (aq, ak, av), inp

    def _attend(self, q, k, v, backend) -> torch.Tensor:
        """Windowed causal attention of q [B, H, tq, d] over k, v [B, H, tk, d] (a cache before the
        queries' own keys): the explicit softmax for the reference form, else
        ``sliding_window_attention`` by the backend "local_attention" resolves to (flash-attn,
        flex_attention on CUDA, blocked SDPA: O(T·w) everywhere)."""
        if backend == Backend.REFERENCE:
            tq, tk = q.shape[2], k.shape[2]
            s = (acc(q) @ acc(k).transpose(-1, -2)) / math.sqrt(self.hd)
            s = s.masked_fill(~window_mask(tq, tk, self.window, q.device), float("-inf"))
            return (s.softmax(-1) @ acc(v)).to(q.dtype)
        return sliding_window_attention(q, k, v, self.window, resolve("local_attention", "auto", q.device, q.dtype))

    def _attend_docs(self, q, k, v, docs) -> torch.Tensor:
        """Windowed causal attention within each document of packed rows (q, k, v [B, H, T, d]):
        ``sliding_window_attention`` with the documents (flash-attn's varlen kernel, flex's document
        block mask, or blocked SDPA under a per-block document mask)."""
        return sliding_window_attention(q, k, v, self.window, resolve("local_attention", "auto", q.device, q.dtype),
                                        docs=docs)

    def _fast_out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head, times SiLU(W_s x) per head: [B, F, T, e] → [B, T, F·e]."""
        B, Fh, T, e = y.shape
        g = F.silu(self.scale_proj(x)).transpose(1, 2)[..., None]
        return (self.ttt_norm(y.to(x.dtype)) * g).transpose(1, 2).reshape(B, T, Fh * e)

    def _run(self, x, state: Optional[LaCTState], output_state: bool, backend):
        B, T, _ = x.shape
        pos0 = 0 if state is None else int(state.pos)
        (q, k, v), inp = self._paths(x, pos0)
        if state is not None and state.k is not None:
            k_all = torch.cat([state.k.to(k.dtype), k], 2)
            v_all = torch.cat([state.v.to(v.dtype), v], 2)
        else:
            k_all, v_all = k, v
        attn = self._attend(q, k_all, v_all, backend)
        attn = attn.transpose(1, 2).reshape(B, T, self.n_heads * self.hd)
        op_backend = "reference" if backend == Backend.REFERENCE else "torch"
        init = None if state is None else state.op_state()
        w0, w1, w2 = (None, None, None) if init is not None else self.fast_weights()
        y, fst = _lact.block_causal_lact_swiglu(
            inp["q"], inp["k"], inp["v"], inp["lr0"], inp["lr1"], inp["lr2"], w0, w1, w2,
            chunk_size=self.chunk_size, use_muon=self.use_muon, momentum=inp["momentum"], prenorm=self.prenorm,
            muon_dtype=self.muon_dtype, initial_state=init, output_final_state=output_state, backend=op_backend)
        out = self.o_proj(attn + self._fast_out(y, x))
        if not output_state:
            return out, None
        keep = self.window - 1
        k_keep = k_all[:, :, max(0, k_all.shape[2] - keep):]
        v_keep = v_all[:, :, max(0, v_all.shape[2] - keep):]
        return out, LaCTState.from_op(fst, k_keep, v_keep, pos0 + T)

    def _op_kw(self, backend: str):
        return dict(chunk_size=self.chunk_size, use_muon=self.use_muon, prenorm=self.prenorm,
                    muon_dtype=self.muon_dtype, backend=backend)

    def _fast_docs(self, inp, docs) -> torch.Tensor:
        """The fast path over packed rows, each document from the initial weights with its chunks
        counted from its first token, as alone: [B, F, T, e].

        Chunk 0 of every document reads the initial weights: one application of f_{W_init} to all
        queries of the rows (the op with one chunk as long as the rows, which it never writes).
        The documents of more than C tokens (the only ones that write, and whose later chunks read
        the writes) are laid out at chunk boundaries (``docs.aligned(C, longer_than=C)``; the
        others left out) and run through the op once with ``resets`` at their first chunks; their
        tokens take that result."""
        w0, w1, w2 = self.fast_weights()
        T = inp["q"].shape[2]
        args = lambda d: (d["q"], d["k"], d["v"], d["lr0"], d["lr1"], d["lr2"], w0, w1, w2)
        first, _ = _lact.block_causal_lact_swiglu(*args(inp), **dict(self._op_kw("torch"), chunk_size=T),
                                                  momentum=inp["momentum"])
        al = docs.aligned(self.chunk_size, longer_than=self.chunk_size)
        if al.length == 0:
            return first
        # [B, F, T, ...] → the view [B, F, T′, ...]: tokens along dim 1 for AlignedDocs
        to_view = lambda t: al.pad(t.transpose(1, 2)).transpose(1, 2)
        view = {key: (None if t is None else to_view(t)) for key, t in inp.items()}
        y, _ = _lact.block_causal_lact_swiglu(*args(view), **self._op_kw("torch"), momentum=view["momentum"],
                                              resets=al.resets)
        y = al.unpad(y.transpose(1, 2)).transpose(1, 2)
        return torch.where(al.kept[:, None, :, None], y, first)

    def _run_docs(self, x: torch.Tensor, docs):
        """Packed documents in one call (PyTorch form): RoPE at the in-document offsets, the
        window attention under a document mask on the packed rows, the fast path by
        ``_fast_docs``."""
        B, T, _ = x.shape
        (q, k, v), inp = self._paths(x, 0, positions=docs.offset)
        attn = self._attend_docs(q, k, v, docs).transpose(1, 2).reshape(B, T, self.n_heads * self.hd)
        return self.o_proj(attn + self._fast_out(self._fast_docs(inp, docs), x)), None

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents (``docs``): the chunked form runs the packed rows once (``_run_docs``:
    #: a document mask, in-scan restarts of the long documents); the reference form runs on the
    #: padded view (``Mixer.run_padded``, one document per row)
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, Backend.REFERENCE)

    op_contract = _lact.CONTRACT

    def contract_args(self):
        return {"d_k": self.fw_hd, "d_v": self.fw_hd}

    def chunked(self, x, state=None, output_state=False, docs=None):
        backend = self._resolve_backend(x)
        if docs is not None:
            return self._run_docs(x, docs)
        return self._run(x, state, output_state, backend)

    def step(self, x, state):
        return self._run(x, state, True, self._resolve_backend(x))

    def init_state(self, batch_size: int, device=None, dtype=None) -> LaCTState:
        """No token read: an empty KV cache and open chunk, the fast weights at their initial
        values (their row norms the targets), zero momentum buffers."""
        dtype = dtype or self.w1.dtype
        sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        B, H, d, Fh, e = batch_size, self.n_heads, self.hd, self.n_fw, self.fw_hd
        kw = dict(device=device, dtype=dtype)
        st: Dict[str, torch.Tensor] = {}
        for name, w in zip(("w0", "w1", "w2"), self.fast_weights()):
            w = w.to(device=device, dtype=sd)
            st[name] = w.expand(B, *w.shape).clone()
            st[f"{name}_norm"] = w.norm(dim=-1, keepdim=True).expand(B, *w.shape[:-1], 1).clone()
            if self.prenorm:
                st[f"{name}_main"] = st[name].clone()
            if self.use_momentum:
                st["m" + name[1]] = torch.zeros_like(st[name])
        st["k"] = torch.zeros(B, Fh, 0, e, device=device, dtype=sd)
        st["v"] = torch.zeros(B, Fh, 0, e, device=device, dtype=sd)
        for key in ("lr0", "lr1", "lr2") + (("momentum",) if self.use_momentum else ()):
            st[key] = torch.zeros(B, Fh, 0, device=device, dtype=sd)
        z = torch.zeros(B, H, 0, d, **kw)
        return LaCTState.from_op(st, z, z.clone(), 0)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Forward FLOPs per token beyond the dense projections (W_qkv, W_o, W_lr, W_m, W_s count
        from their shapes), at sequence length T = seq_len:

        * windowed attention: 4·H·d·(keys seen per query, averaged over the sequence);
        * the fast weights (per head, e = head width, d_h hidden): the query apply 6·e·d_h for
          every token; a written chunk's key forward 4·e·d_h, the gradient products 8·e·d_h (w1ᵀv,
          dw1, dw0, dw2) per token: 12·e·d_h times the fraction of tokens in written chunks
          ((⌈T/C⌉ − 1)·C / T; the last chunk is never written);
        * Muon: five Newton–Schulz steps on each dw (m ≤ n its sides: 4m²n + 2m³ each) per written
          chunk, spread over the sequence.

        The initial fast weights are not counted from their shapes (low-rank factors are applied
        once per step; the full-rank w0, w1, w2 are the 6·e·d_h above)."""
        c = cfg.lact
        inner = cfg.n_heads * cfg.hd
        e = inner // c.num_heads
        dh = int(e * c.inter_multi)
        T = max(int(seq_len), 1)
        w = c.window
        seen = (T + 1) / 2.0 if T <= w else (w * (w + 1) / 2.0 + (T - w) * w) / T
        attn = 4.0 * cfg.n_heads * cfg.hd * seen
        n_written = (-(-T // c.chunk_size)) - 1
        frac = n_written * c.chunk_size / T
        fast = c.num_heads * e * dh * (6.0 + 12.0 * frac)
        muon = 0.0
        if c.use_muon:
            for a, b in ((dh, e), (e, dh), (dh, e)):
                m, n = min(a, b), max(a, b)
                muon += 5 * (4.0 * m * m * n + 2.0 * m ** 3)
            muon *= c.num_heads * n_written / T
        return attn + fast + muon
