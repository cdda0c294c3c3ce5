r"""Titans neural long-term memory (Behrouz et al. 2025, "Titans: Learning to Memorize at Test Time").

Variants here: the memory alone as a sequence layer (LMM, kind "titans", ``TitansMemory``),
memory as a gate (MAG, kind "titans_mag", ``TitansMAG``: a sliding-window attention branch and the
memory branch, combined by a gate), memory as a context (MAC, kind "titans_mac", ``TitansMAC``:
attention within segments over persistent tokens, the memory's retrieval and the segment) and
memory as a layer (MAL, kind "titans_mal", ``TitansMAL``: persistent tokens, the memory, then
sliding-window attention); their equations are in their classes. MAG has no persistent tokens.

Per head, with q_t, k_t, v_t = SiLU(Conv(W_Q x)_t), … (short causal depthwise conv, then q and k
L2-normalized), data-dependent gates

    θ_t = σ(W_θ x_t + b_θ),   η_t = σ(W_η x_t + b_η),   α_t = σ(W_α x_t + b_α),

the associative loss ℓ(M; k, v) (below, per memory) and the memory M (its weights; the surprise S
has the same shape), the update and retrieval are

    S_t = η_t S_{t−1} − θ_t ∇ℓ(M̂_t; k_t, v_t)        (momentary surprise with momentum)
    M_t = (1 − α_t) M_{t−1} + S_t                     (forgetting gate)
    y_t = M_t(q_t)
    o_t = W_O [RMSNorm(y_t^{(h)}) ⊙ SiLU(W_G x_t)^{(h)}]_h

Chunked gradients (the paper's parallel training, §3.2): positions are cut into chunks of
C = ``titans.chunk_size`` tokens counted from the start of the sequence, and every gradient in a
chunk is taken at the memory at the start of that chunk, M̂_t = M_{τ(t)−1} (τ(t) the chunk's first
position). C = 1 is the per-token rule M̂_t = M_{t−1}. The S and M recurrences stay per token, so
y_t reads the memory after every update up to and including token t. All three forms use these
semantics; the decode state therefore carries M̂ and the position besides M and S.

Memory (``titans.memory``), in the row layout M(k) = k W:

* ``linear``: M(k) = k W, W ∈ R^{d×d}, ℓ = ‖k W − v‖² (the paper's), ∇_W ℓ = 2 kᵀ (k W − v).
  Update and retrieval are ``kernels.titans.titans_linear``.
* ``mlp``: M(k) = k + γ ⊙ RMSNorm(GELU(k W₁) W₂), W₁ ∈ R^{d×d_h}, W₂ ∈ R^{d_h×d}
  (d_h = ``titans.memory_expansion`` · d), γ ∈ R^d a learned per-head gain (an outer parameter,
  never updated by the inner loop), RMSNorm(z) = z r, r = (mean_i z_i² + ε)^{−1/2} without
  weights, and ℓ = (1/d) ‖M(k) − v‖² (the mean over the d features). With h = k W₁, a = GELU(h),
  z = a W₂, ẑ = z r, e = (2/d)(k + γ ⊙ ẑ − v) and δ = r [γ ⊙ e − ẑ · mean(ẑ ⊙ γ ⊙ e)] (e through
  the norm): ∇_{W₂} ℓ = aᵀ δ, ∇_{W₁} ℓ = kᵀ [(δ W₂ᵀ) ⊙ GELU′(h)]. Both are rank one per token, so
  the chunk-parallel form (``kernels.titans.chunk_memory_step``) runs each layer as decayed linear
  attention; the read adds q + γ ⊙ RMSNorm(·) to the second layer's output. Init: W₁ ~ N(0, 1) (k
  is unit-norm, so h = k W₁ ~ N(0, 1) per unit, GELU's nonlinear range), W₂ ~ N(0, 1/d_h), γ = 1.

Step size and stability. The gates are the paper's, θ_t ∈ (0, 1), η_t ∈ (0, 1), α_t ∈ (0, 1)
(b_θ, b_η, b_α give 0.1, 0.9 and 0.01 at init).

* Linear memory: per token, W ↦ W − 2θ kᵀ(k W − v) = (I − 2θ kᵀk) W + 2θ kᵀv. For ‖k‖ = 1 the
  matrix I − 2θ kᵀk has eigenvalues 1 (orthogonal to k) and 1 − 2θ (along k), and |1 − 2θ| ≤ 1
  for θ ∈ [0, 1]: θ = σ(·) keeps the per-token update non-expansive (contractive along k), and
  the heavy-ball recurrence with momentum η stays stable while 2θ < 2(1 + η), which θ < 1
  satisfies. Inside a chunk the gradients are all taken at M̂, so the chunk applies
  I − 2 Σ_t θ_t k_tᵀk_t: contractive when the chunk's keys are spread (‖Σ_t θ_t k_tᵀk_t‖ ≤ 1), but
  C copies of one key act as one step of C·θ, which overshoots for θ > 1/C; that case is damped
  only by the forgetting gate.
* MLP memory, why it is parametrized as above: with the paper's plain M(k) = GELU(k W₁) W₂ and
  ℓ = ‖M(k) − v‖², the read grows like the square of the weights' scale s and the gradient like
  s³, so an overshooting step makes the next one larger. At the 125M shape (d = 64, 12 heads,
  chunk 16, the gates at init) ‖W₁‖ went from 10 to 2·10⁵ in 5 chunks and to NaN (0 · ∞ behind
  GELU) at token 96, in the reference and the chunked form alike. What bounds it now: (1) the
  read no longer grows with the weights, |RMSNorm(z)_i| ≤ √d, so ‖M(k)‖ ≤ 1 + √d ‖γ‖_∞ and the
  error e that drives every step is bounded independently of the memory; (2) the step on W₂ is
  orthogonal to W₂ (at the anchor, Σ_t ⟨W₂, a_tᵀ δ_t⟩ = Σ_t ⟨z_t, δ_t⟩ = 0: the norm's Jacobian
  removes z's own direction) and its size carries the factor r ∝ 1/‖W₂‖, so a large step grows W₂
  and shrinks the next one (the self-limiting step of scale-invariant weights); W₁'s gradient
  passes through the same factor r. The mean over d keeps the error's size, hence θ's meaning,
  independent of the head width. Measured (float32, one layer at the 125M shape, random inputs):
  at the init gates the largest ‖W₁‖, ‖W₂‖ over heads settle near 3 and stay there over 16,384
  tokens; with the gates at their limits (θ ≈ 1, η ≈ 0.9997, α ≈ 10⁻⁴), where momentum integrates
  the bounded steps, they grow about linearly (‖W₂‖ ≈ 3.7·10³ after 4,096 tokens), far from
  overflow. ``tests/model/test_health.py`` runs every preset at its own length.

Where this departs from the paper and from titans-pytorch (lucidrains): the paper's MLP memory
has no residual and no norm, and its loss sums over the features; titans-pytorch wraps its memory
MLP in the same residual + norm (a LayerNorm with gain 1 + γ′, as in the TTT layer) and averages
its loss over the features, as here. Its inner step is max_lr · σ(·) with max_lr = 1 by default
in ``NeuralMemory`` (the transform's own default of 0.01 is overridden), the same range (0, 1) as
θ_t = σ(·) here. The linear memory keeps the paper's equations.

The inner gradients are closed-form tensor expressions (``reference`` for the MLP memory takes
them with ``torch.func.grad``), never written into parameters, so the outer loss reaches W_Q, W_K,
W_V and the gate projections through every memory update. The memory at the start of the sequence
(W, or W₁ and W₂) is a learned parameter; S starts at zero. Inside a chunk the momentum and decay
recurrences are cumulative products taken in log space (log η_t = log σ(·),
log(1 − α_t) = log σ(−·)).

We follow the paper's equations, not titans-pytorch (lucidrains), which departs from them:
there the momentum and forgetting gates are computed once per chunk from a pooled chunk
representation and S, M advance once per chunk (the chunk's gradients summed), where the paper
(and this file) has per-token gates and per-token S_t, M_t; retrieval there reads the memory as
it was after the previous chunk (its weights shifted by one chunk), here y_t = M_t(q_t) reads
the memory after token t's own update; its persistent memory (MAC) is a learned key and value
per head and slot (zero at init) placed before the attention's keys and values, here, as in the
paper's Eq. 22, learned tokens p_1 … p_{N_p} (N(0, 1) at init, the scale of the normed input)
prepended to the segment and projected by W_K and W_V like any token; and it adds options the
paper does not have (q/k RMSNorm, spectral-normed surprises, higher-order or learned momentum,
weight residuals across layers).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import titans as _tk
from kernels.titans.torch_chunk import split_spans, titans_linear_chunk_torch
from ttt_lm.model.backend import Backend, resolve
from ttt_lm.model.docs import masked_conv, unflatten_heads, varlen_heads
from ttt_lm.model.layers import CausalConv1d, RMSNorm, acc, acc_dtype, apply_rope, rope_cos_sin
from ttt_lm.model.mixers.attention import Attention, AttentionState, LocalAttention
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer


@dataclass
class TitansConfig:
    """``model.titans``: Titans neural memory (Behrouz et al. 2025), one section for the four
    kinds (their attention branches also read ``model.attention``)."""
    memory: str = option("linear", choices=("linear", "mlp"))
    memory_expansion: int = option(2, ge=1)  # MLP memory hidden = expansion × head_dim
    chunk_size: int = option(16, ge=1)  # tokens whose gradients are taken at one memory state
    conv_width: int = 4
    window: int = option(256, ge=1)     # sliding window of the attention in titans_mag and titans_mal
    segment_len: int = option(64, ge=1)  # titans_mac: tokens per segment (attention within a segment)
    persistent_tokens: int = option(4, ge=0)  # titans_mac, titans_mal: learned persistent memory tokens

    def short(self, n: int) -> "TitansConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return dataclasses.replace(self, chunk_size=n)

    def tiny(self, n: int) -> "TitansConfig":
        """This section for the tests' tiny models (``tests/model/mixer_checks.short_config``):
        ``short(n)`` and MAC's segments of 1.5 chunks (6 tokens for n = 4), so that sequences of
        a few chunks hold several segments and segments and chunks do not line up; MAG's and MAL's
        sliding window one token longer than a chunk (as ``attention.tiny``), so that sequences
        of a few chunks cross it."""
        return dataclasses.replace(self.short(n), segment_len=n + n // 2, window=n + 1)


def _gelu_grad(h: torch.Tensor) -> torch.Tensor:
    """d/dh GELU(h) = Φ(h) + h φ(h) (exact, erf form)."""
    return 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@dataclass
class TitansMemoryState(MixerState):
    """Per memory layer (one for the linear memory, two for the MLP): M the memory, S the
    surprise (momentum) and Mh = M̂ the memory at the current chunk's start, each a tuple of
    [B, H, d_in, d_out] (float32 for half inputs); conv [B, 3·H·d, w − 1]: the short conv's cache
    of [q | k | v] (None without ``titans.conv_width``); pos: tokens read."""
    M: Tuple[torch.Tensor, ...] = ()
    S: Tuple[torch.Tensor, ...] = ()
    Mh: Tuple[torch.Tensor, ...] = ()
    conv: Optional[torch.Tensor] = None


@dataclass
class TitansMAGState(MixerState):
    """attn: the sliding-window attention's KV cache; mem: the memory's state; pos: tokens read."""
    attn: Optional[AttentionState] = None
    mem: Optional[TitansMemoryState] = None


@dataclass
class TitansMALState(MixerState):
    """mem: the memory's state; attn: the attention's KV cache over the memory's outputs (both
    after the persistent tokens); pos: tokens read, the persistent ones not counted."""
    mem: Optional[TitansMemoryState] = None
    attn: Optional[AttentionState] = None


@dataclass
class TitansMACState(MixerState):
    """mem: the LMM's state; R: the memory at the current segment's start (M^{(i)}, one
    [B, H, d_in, d_out] per memory layer), read by retrieval; seg [B, n, D]: the current
    segment's inputs so far (n < ``titans.segment_len``); pos: tokens read."""
    mem: Optional[TitansMemoryState] = None
    R: Tuple[torch.Tensor, ...] = ()
    seg: Optional[torch.Tensor] = None


@register_mixer("titans", config=TitansConfig)
class TitansMemory(Mixer):
    """The long-term memory module (LMM) as a sequence layer.

    Packed documents (``docs``): each document runs as if alone, from M = M_init, S = 0, with its
    chunks counted from its first token and its conv from zero history (taps into the previous
    document masked). The PyTorch chunked form lays the documents out at chunk boundaries and
    restarts inside its scan; the Triton form (linear memory) flattens the batch to one row and
    runs the kernel's variable-length path (``cu_seqlens``) in one call; the reference form runs
    on the padded view (one document per row)."""

    #: gate values at initialization: θ (inner step), η (momentum), α (forgetting)
    theta_init, eta_init, alpha_init = 0.1, 0.9, 0.01

    #: the two memories as benchmark rows (titans_linear, titans_mlp)
    variants = {"linear": {"memory": "linear"}, "mlp": {"memory": "mlp"}}
    #: (the linear memory's; the MLP memory runs PyTorch)
    triton_custom_op = "kernels::titans_linear_fwd"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.titans   # ranges checked by TitansConfig (ModelConfig.validate)
        self.d_model = cfg.d_model
        self.n_heads = H = cfg.n_heads
        self.hd = d = cfg.hd
        self.memory = c.memory
        self.chunk_size = c.chunk_size
        inner = H * d
        self.q_proj = nn.Linear(cfg.d_model, inner, bias=False)    # W_Q
        self.k_proj = nn.Linear(cfg.d_model, inner, bias=False)    # W_K
        self.v_proj = nn.Linear(cfg.d_model, inner, bias=False)    # W_V
        self.theta_proj = nn.Linear(cfg.d_model, H)                 # W_θ, b_θ
        self.eta_proj = nn.Linear(cfg.d_model, H)                   # W_η, b_η
        self.alpha_proj = nn.Linear(cfg.d_model, H)                 # W_α, b_α
        self.conv = CausalConv1d(3 * inner, c.conv_width, bias=False) if c.conv_width > 0 else None
        if c.memory == "linear":
            self.M_init = nn.ParameterList([nn.Parameter(torch.zeros(H, d, d))])
        else:
            e = c.memory_expansion * d
            self.M_init = nn.ParameterList([nn.Parameter(torch.zeros(H, d, e)), nn.Parameter(torch.zeros(H, e, d))])
            # γ of the memory's output norm, per head (an outer parameter: the inner loop never updates it)
            self.mem_norm_weight = nn.Parameter(torch.ones(H, d))
            self.mem_norm_weight._no_weight_decay = True
        self.mem_eps = cfg.norm_eps
        self.g_proj = nn.Linear(cfg.d_model, inner, bias=False)    # W_G
        self.o_norm = RMSNorm(d, cfg.norm_eps)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)    # W_O
        self.o_proj._is_residual_out = True
        self.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads are independent (each has its own memory, surprise and gates): W_Q, W_K, W_V,
        W_G and the gate projections W_θ, W_η, W_α (one output per head) by columns, the short
        conv per channel (its [q | k | v] channels fused: each part split by heads), the initial
        memory by heads, W_O by rows; o_norm (over one head's features) is shared by all heads."""
        conv = ("conv.conv",) if cfg.titans.conv_width > 0 else ()
        mem = ("M_init.0",) if cfg.titans.memory == "linear" else ("M_init.0", "M_init.1", "mem_norm_weight")
        return TPPlan(column=("q_proj", "k_proj", "v_proj", "g_proj", "theta_proj", "eta_proj", "alpha_proj"),
                      row=("o_proj",), channel_convs=conv, fused=tuple((n, 3) for n in conv), head_params=mem,
                      shared_modules=("o_norm",), head_counts=("n_heads",))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.theta_proj.bias.fill_(_logit(self.theta_init))
            self.eta_proj.bias.fill_(_logit(self.eta_init))
            self.alpha_proj.bias.fill_(_logit(self.alpha_init))
            if self.memory == "linear":
                self.M_init[0].zero_()
            else:
                # the MLP memory cannot start at zero: both of its gradients would vanish. W₁ ~ N(0, 1):
                # k is unit-norm, so h = k W₁ ~ N(0, 1) per unit, GELU's nonlinear range; W₂ ~ N(0, 1/d_h)
                W1, W2 = self.M_init
                nn.init.normal_(W1, std=1.0)
                nn.init.normal_(W2, std=1.0 / math.sqrt(W2.shape[1]))
                self.mem_norm_weight.fill_(1.0)

    @property
    def n_mem(self) -> int:
        return len(self.M_init)

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state: Optional[TitansMemoryState] = None, output_state: bool = False,
               doc_offset: Optional[torch.Tensor] = None):
        """The op's arguments: q, k, v [B, H, T, d]; θ, log η, log(1 − α) [B, H, T] (accumulation
        dtype); the chunk size and ``offset`` (the state's position: chunks are counted from the
        stream start). The carry is the conv cache and the next position. ``doc_offset`` [B, T]
        (each token's index in its document, no state): the conv restarts at document starts."""
        B, T, _ = x.shape
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        cache = None
        if self.conv is not None and doc_offset is not None:
            qkv = masked_conv(self.conv.conv, qkv, doc_offset)
        elif self.conv is not None:
            qkv, cache = self.conv(qkv, None if state is None else state.conv, output_cache=True)
        q, k, v = (F.silu(t).view(B, T, self.n_heads, self.hd).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        q = F.normalize(acc(q), p=2.0, dim=-1, eps=1e-6)
        k = F.normalize(acc(k), p=2.0, dim=-1, eps=1e-6)
        theta = torch.sigmoid(acc(self.theta_proj(x))).transpose(1, 2)
        log_eta = F.logsigmoid(acc(self.eta_proj(x))).transpose(1, 2)
        log_keep = F.logsigmoid(-acc(self.alpha_proj(x))).transpose(1, 2)
        pos0 = 0 if state is None else int(state.pos)
        inp = {"q": q, "k": k, "v": acc(v), "theta": theta, "log_eta": log_eta, "log_keep": log_keep,
               "chunk_size": self.chunk_size, "offset": pos0}
        return inp, (TitansMemoryState(conv=cache, pos=pos0 + T) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """The memory update and read over the sequence: ``kernels.titans.titans_linear`` for the
        linear memory, the MLP memory's token-by-token (backend "reference") or chunked form
        here. ``initial_state``: (M, S, M̂), each a tuple with one [B, H, d_in, d_out] per memory
        layer (None: M = M̂ = M_init, S = 0); the final state is the same triple.

        Packed documents: ``inp["resets"]`` [B, ⌈T/C⌉] (chunk-aligned rows, backend "torch") restarts
        chunks inside the PyTorch scan; ``inp["cu_seqlens"]`` (int32 [N + 1] over the batch
        flattened to one row, backend "triton", linear memory) runs the kernel's variable-length
        path once for the whole batch (``_op_varlen``)."""
        if inp.get("cu_seqlens") is not None:
            return self._op_varlen(inp, initial_state, output_final_state, backend)
        q, k, v = inp["q"], inp["k"], inp["v"]
        theta, log_eta, log_keep, pos = inp["theta"], inp["log_eta"], inp["log_keep"], inp["offset"]
        if initial_state is None:
            M = [W.to(device=q.device, dtype=q.dtype).unsqueeze(0).expand(q.shape[0], *W.shape) for W in self.M_init]
            S, Mh = [torch.zeros_like(m) for m in M], list(M)
        else:
            M, S, Mh = (list(t) for t in initial_state)
        resets = inp.get("resets")
        if resets is not None and backend != Backend.TORCH:
            raise ValueError(f"Titans: chunk resets run in the PyTorch chunked form, not {backend!r}")
        if self.memory == "linear" and resets is not None:
            y, fin = titans_linear_chunk_torch(q, k, v, theta, log_eta, log_keep, (M[0], S[0], Mh[0]), True,
                                               inp["chunk_size"], pos, resets)
            M, S, Mh = [fin[0]], [fin[1]], [fin[2]]
        elif self.memory == "linear":
            y, fin = _tk.titans_linear(q, k, v, theta, log_eta, log_keep, (M[0], S[0], Mh[0]), True,
                                       backend=backend, chunk_size=inp["chunk_size"], offset=pos)
            M, S, Mh = [fin[0]], [fin[1]], [fin[2]]
        elif backend == "reference":
            y, M, S, Mh = self._mlp_reference(q, k, v, theta, log_eta, log_keep, M, S, Mh, pos)
        else:
            y, M, S, Mh = self._mlp_chunked(q, k, v, theta, log_eta, log_keep, M, S, Mh, pos, resets)
        return y, ((tuple(M), tuple(S), tuple(Mh)) if output_final_state else None)

    def _op_varlen(self, inp, initial_state, output_final_state: bool, backend) -> Tuple[torch.Tensor, None]:
        """The linear memory over packed documents in one call of the Triton kernel's
        variable-length path: q, k, v and the gates [B, H, T, ·] flattened to [1, H, B·T, ·]
        (the rows back to back, the order of ``inp["cu_seqlens"]``), every document from
        M = M_init, S = 0 with its chunks counted from its first token (the kernel's rows of the
        initial state, one per document, all M_init), as the document alone; y back to
        [B, H, T, d]. Documents always start from the initial memory, so neither an initial nor a
        final state is taken; the MLP memory and backends other than "triton" are refused."""
        if self.memory != "linear" or backend != Backend.TRITON:
            raise ValueError(f"Titans: packed documents through cu_seqlens run the linear memory's Triton kernel, "
                             f"not titans.memory={self.memory!r} on backend {str(backend)!r}")
        if initial_state is not None or output_final_state:
            raise ValueError("Titans: packed documents (cu_seqlens) start every document from the initial memory; "
                             "they take no initial state and return no final state")
        if inp["offset"] != 0:
            raise ValueError(f"Titans: packed documents (cu_seqlens) start at position 0, got offset {inp['offset']}")
        q, cu = inp["q"], inp["cu_seqlens"]
        B, N = q.shape[0], cu.shape[0] - 1
        M0 = self.M_init[0].to(device=q.device, dtype=q.dtype).unsqueeze(0).expand(N, *self.M_init[0].shape)
        flat = varlen_heads(q, inp["k"], inp["v"], inp["theta"], inp["log_eta"], inp["log_keep"])
        y, _ = _tk.titans_linear(*flat, (M0, torch.zeros_like(M0)), False, backend=backend,
                                 chunk_size=inp["chunk_size"], offset=0, cu_seqlens=cu)
        return unflatten_heads(y, B), None

    def output(self, y: torch.Tensor, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """o = W_O [RMSNorm(y) ⊙ SiLU(W_G x)], y [B, H, T, d] from the op (``gate``: SiLU(W_G x)
        when already computed)."""
        B, H, T, D = y.shape
        y = self.o_norm(y.to(x.dtype)).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(y * (F.silu(self.g_proj(x)) if gate is None else gate))

    def _run(self, x, state, output_state, backend: str):
        inp, carry = self.inputs(x, state, output_state)
        y, fin = self.op(inp, None if state is None else (state.M, state.S, state.Mh), output_state, backend)
        out = self.output(y, x)
        if not output_state:
            return out, None
        return out, dataclasses.replace(carry, M=fin[0], S=fin[1], Mh=fin[2],
                                        conv=carry.conv if self.conv is not None else None)

    # ---- MLP memory ----------------------------------------------------------------------------
    def _gain(self, ndim: int, dtype) -> torch.Tensor:
        """γ [H, d] shaped to broadcast against [..., H, d] (ndim 3) or [..., H, n, d] (ndim 4)."""
        g = self.mem_norm_weight.to(dtype)
        return g if ndim == 3 else g[:, None, :]

    def _rms(self, z: torch.Tensor) -> torch.Tensor:
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.mem_eps)

    def mlp_read(self, q: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
        """M(q) = q + γ ⊙ RMSNorm(GELU(q W₁) W₂) for q [B, H, n, d] (or [B, H, d]) and one memory
        (W₁, W₂) per sequence and head."""
        z = F.gelu(q @ W1.to(q.dtype)) @ W2.to(q.dtype) if q.dim() == 4 else \
            torch.einsum("bhj,bhjd->bhd", F.gelu(torch.einsum("bhi,bhij->bhj", q, W1.to(q.dtype))), W2.to(q.dtype))
        return q + self._gain(q.dim(), q.dtype) * self._rms(z)

    def _mlp_reference(self, q, k, v, theta, log_eta, log_keep, M: List, S: List, Mh: List, pos: int):
        """Token by token; ∇ℓ by torch.func.grad of ℓ(W₁, W₂; k, v) = mean_d (M(k) − v)²,
        M(k) = k + γ ⊙ RMSNorm(GELU(k W₁) W₂)."""
        eps = self.mem_eps

        def loss(W1, W2, k_t, v_t, g):
            z = F.gelu(k_t @ W1) @ W2
            out = k_t + g * z * torch.rsqrt(z.pow(2).mean() + eps)
            return (out - v_t).pow(2).mean()

        grad_fn = torch.func.vmap(torch.func.vmap(torch.func.grad(loss, argnums=(0, 1))))
        g = self._gain(3, q.dtype).expand(q.shape[0], -1, -1)
        C = self.chunk_size
        eta, keep = log_eta.exp(), log_keep.exp()
        outs = []
        for t in range(q.shape[2]):
            if (pos + t) % C == 0:
                Mh = list(M)
            G = grad_fn(Mh[0], Mh[1], k[:, :, t], v[:, :, t], g)
            e_t, th_t, kp_t = eta[:, :, t, None, None], theta[:, :, t, None, None], keep[:, :, t, None, None]
            S = [e_t * s - th_t * gr for s, gr in zip(S, G)]
            M = [kp_t * m + s for m, s in zip(M, S)]
            outs.append(self.mlp_read(q[:, :, t], M[0], M[1]))
        if (pos + q.shape[2]) % C == 0:
            Mh = list(M)
        y = torch.stack(outs, 2) if outs else v.new_zeros(v.shape)
        return y, M, S, Mh

    def _mlp_chunked(self, q, k, v, theta, log_eta, log_keep, M: List, S: List, Mh: List, pos: int,
                     resets: Optional[torch.Tensor] = None):
        """Chunk-parallel: per chunk, closed-form rank-one gradients at the anchor (the error
        backpropagated through the output's RMSNorm), then ``chunk_memory_step`` for W₁ (query
        side: q) and for W₂ (query side: GELU(q W₁,t)); the read adds q + γ ⊙ RMSNorm(·).
        ``resets`` [B, ⌈T/C⌉] bool (pos 0): chunk n of a row restarts from the initial (M, S)."""
        C = self.chunk_size
        g = self._gain(4, q.dtype)
        outs = []
        pieces = split_spans(_tk.chunk_spans(q.shape[2], C, pos), q, k, v, theta, log_eta, log_keep)
        M0, S0 = list(M), list(S)
        for i, (qc, kc, vc, thc, lec, lkc) in enumerate(pieces):
            if resets is not None and i > 0:
                r = resets[:, i, None, None, None]
                M = [torch.where(r, a, b) for a, b in zip(M0, M)]
                S = [torch.where(r, a, b) for a, b in zip(S0, S)]
            A1, A2 = Mh if (i == 0 and pos % C) else M
            h = kc @ A1
            a = F.gelu(h)
            z = a @ A2
            r = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.mem_eps)
            zh = z * r
            ge = g * (2.0 / z.shape[-1]) * (kc + g * zh - vc)            # γ ⊙ ∂ℓ/∂M(k)
            dz = r * (ge - zh * (zh * ge).mean(-1, keepdim=True))       # through RMSNorm: ∂ℓ/∂z
            delta1 = (dz @ A2.transpose(-1, -2)) * _gelu_grad(h)
            dec = _tk.chunk_decays(thc, lec, lkc)
            hq, M1, S1 = _tk.chunk_memory_step(M[0], S[0], kc, delta1, qc, dec)
            zq, M2, S2 = _tk.chunk_memory_step(M[1], S[1], a, dz, F.gelu(hq), dec)
            outs.append(qc + g * self._rms(zq))
            Mh = [A1, A2]
            M, S = [M1, M2], [S1, S2]
        if (pos + q.shape[2]) % C == 0:
            Mh = list(M)
        y = torch.cat(outs, 2) if outs else v.new_zeros(v.shape)
        return y, M, S, Mh

    def _run_docs(self, x: torch.Tensor, docs, backend=Backend.TORCH) -> torch.Tensor:
        """Packed documents, one op call for the batch. PyTorch form: the documents laid out at
        chunk boundaries, in rows about as long as the longest document (``DocLayout.balanced``:
        the chunk loop then takes about the longest document's steps, not a packed row's), the
        memory restarted from its initial state at each document's first chunk inside the scan,
        the conv masked. Triton form: on the packed rows themselves, the conv masked at document
        starts (``docs.offset``), then the kernel's ``cu_seqlens`` path over the batch flattened to
        one row (``_op_varlen``)."""
        if backend == Backend.TRITON:
            inp, _ = self.inputs(x, doc_offset=docs.offset)
            inp["cu_seqlens"] = docs.cu_seqlens
            y, _ = self.op(inp, backend=backend)
            return self.output(y, x)
        al = docs.balanced(self.chunk_size)
        xa = al.pad(x)
        inp, _ = self.inputs(xa, doc_offset=al.offset)
        inp["resets"] = al.resets
        y, _ = self.op(inp, backend=Backend.TORCH)
        return al.unpad(self.output(y, xa))

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents (``_run_docs``): the conv masked at document starts; the PyTorch chunked
    #: form on chunk-aligned documents in balanced rows with in-scan restarts, the Triton form
    #: (linear memory) the kernel's ``cu_seqlens`` path once for the batch flattened to one row;
    #: the reference form runs on the padded view
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, "reference")

    #: the Triton kernel (kernels/titans/chunk.py) covers the linear memory only
    op_contract = _tk.CONTRACT
    contract_labels = {"memory": "titans.memory"}

    def contract_args(self):
        return {"d_k": self.hd, "d_v": self.hd, "memory": self.memory}

    def chunked(self, x, state=None, output_state=False, docs=None):
        backend = self._resolve_backend(x)
        if docs is not None:
            if state is not None or output_state:
                raise ValueError("Titans: packed documents start every document from the initial memory; "
                                 "they take no state and return none")
            return self._run_docs(x, docs, backend), None
        return self._run(x, state, output_state, backend)

    def step(self, x, state):
        return self._run(x, state, True, "reference")

    def init_state(self, batch_size: int, device=None, dtype=None) -> TitansMemoryState:
        sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else (dtype or self.M_init[0].dtype)
        M = tuple(W.to(device=device, dtype=sd).unsqueeze(0).expand(batch_size, *W.shape) for W in self.M_init)
        cache = self.conv.init_cache(batch_size, device, dtype) if self.conv is not None else None
        return TitansMemoryState(M=M, S=tuple(torch.zeros_like(m) for m in M), Mh=M, conv=cache, pos=0)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Chunked form, per token and head. One memory layer (d_in × d_out) in
        ``chunk_memory_step``: z S₀ (2 d_in d_out), the chunk-end M and S (4 d_in d_out), z·x
        scores and their product with δ (2C d_in + 2C d_out); z M₀ is counted by
        ``ttt_lm.model.flops`` from the shape of M_init. Anchor gradients: the memory's forward at
        k (2 d_in d_out per layer) and, for the MLP, the error backpropagated through W₂ (2 d·ed).
        """
        c = cfg.titans
        d = cfg.hd
        C = min(c.chunk_size, max(seq_len, 1))

        def layer(di, do):
            return 8 * di * do + 2 * C * (di + do)

        if c.memory == "linear":
            per_head = layer(d, d)
        else:
            e = c.memory_expansion * d
            per_head = layer(d, e) + layer(e, d) + 2 * d * e
        return float(cfg.n_heads * per_head)


@register_mixer("titans_mag", config=TitansConfig, section="titans")
class TitansMAG(Mixer):
    r"""Memory as a gate (Titans §4.2, without persistent memory tokens):

        y = SW-Attn(x)          (sliding window of ``titans.window`` keys, ``LocalAttention``)
        m = LMM(x)              (``TitansMemory``)
        o = W_O [RMSNorm(y) ⊙ σ(RMSNorm(m))]

    the paper's y ⊗ M(x): both branches normalized with learnable weights, the memory branch
    through a sigmoid, so it gates the attention output per channel. The reference and chunked
    forms are written with the public stages: ``inputs`` (x), ``op`` (both branches, in the
    form's own forms) and ``output`` (the gate); ``step`` runs the branches' steps and the gate.

    Packed documents (``docs``): the chunked form runs each branch once on the packed rows with
    its own document handling (the attention's document mask; the LMM's chunk-aligned restarts
    on PyTorch, its Triton kernel's ``cu_seqlens`` path on Triton), then the gate per token. The
    reference form runs on the padded view."""

    #: attends over earlier tokens (an attention branch, a window): not a pure recurrence
    attends = True

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.d_model = cfg.d_model
        acfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=cfg.titans.window))
        self.attn = LocalAttention(acfg, layer_idx)
        self.memory = TitansMemory(cfg, layer_idx)
        # the branches feed the gate, not the residual stream: only W_O gets the depth-scaled init
        self.attn.o_proj._is_residual_out = False
        self.memory.o_proj._is_residual_out = False
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mem_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj._is_residual_out = True

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Each branch splits as its own mixer (their W_O row-parallel, so y and m are summed
        before the gate); the gate's norms and W_O then run replicated on the summed branches
        (with sequence parallelism on this rank's T/p tokens)."""
        acfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=cfg.titans.window))
        return LocalAttention.tp_plan(acfg).prefixed("attn").merged(
            TitansMemory.tp_plan(cfg).prefixed("memory"),
            TPPlan(sequence_region=("attn_norm", "mem_norm", "o_proj")))

    def reset_parameters(self) -> None:
        self.memory.reset_parameters()

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state: Optional[TitansMAGState] = None, output_state: bool = False):
        """The op's arguments: the block input x, which both branches read (each projects it in
        its own stages). The carry is the next position."""
        pos0 = 0 if state is None else int(state.pos)
        return {"x": x}, (TitansMAGState(pos=pos0 + x.shape[1]) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """Both branches over x: (y, m) = (SW-Attn(x), LMM(x)). Backend "reference": each
        branch's reference form; else the attention's chunked form (``attention.backend``) and the
        LMM with this ``kernels/`` backend. ``initial_state``: (attention state, LMM state) or
        None; the final state is the same pair."""
        x = inp["x"]
        sa, sm = (None, None) if initial_state is None else initial_state
        self.attn.kernel_backend = self.memory.kernel_backend = self.kernel_backend
        attn = self.attn.reference if backend == Backend.REFERENCE else self.attn.chunked
        y, sa = attn(x, sa, output_final_state)
        m, sm = self.memory._run(x, sm, output_final_state, backend)
        return (y, m), ((sa, sm) if output_final_state else None)

    def output(self, ym, x: torch.Tensor) -> torch.Tensor:
        """The gate: o = W_O [RMSNorm(y) ⊙ σ(RMSNorm(m))], (y, m) from the op."""
        y, m = ym
        return self.o_proj(self.attn_norm(y) * torch.sigmoid(self.mem_norm(m)))

    def _run(self, x, state, output_state, backend):
        inp, carry = self.inputs(x, state, output_state)
        ym, fin = self.op(inp, None if state is None else (state.attn, state.mem), output_state, backend)
        return self.output(ym, x), (dataclasses.replace(carry, attn=fin[0], mem=fin[1]) if output_state else None)

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the chunked form hands them to each branch (the attention's document
    #: mask; the LMM's chunk-aligned restarts in PyTorch, its kernel's ``cu_seqlens`` path once for
    #: the batch on Triton); the reference form runs on the padded view
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, Backend.REFERENCE)

    #: the LMM's op (the attention half uses no kernels/ op)
    op_contract, contract_labels = TitansMemory.op_contract, TitansMemory.contract_labels

    def contract_args(self):
        return self.memory.contract_args()

    def chunked(self, x, state=None, output_state=False, docs=None):
        self.memory.kernel_backend = self.kernel_backend
        backend = self.memory._resolve_backend(x)
        if docs is not None:
            self.attn.kernel_backend = self.kernel_backend
            y, _ = self.attn.chunked(x, docs=docs)
            m, _ = self.memory.chunked(x, docs=docs)
            return self.output((y, m), x), None
        return self._run(x, state, output_state, backend)

    def step(self, x, state):
        y, sa = self.attn.step(x, state.attn)
        m, sm = self.memory.step(x, state.mem)
        return self.output((y, m), x), TitansMAGState(attn=sa, mem=sm, pos=sm.pos)

    def init_state(self, batch_size: int, device=None, dtype=None) -> TitansMAGState:
        return TitansMAGState(attn=self.attn.init_state(batch_size, device, dtype),
                              mem=self.memory.init_state(batch_size, device, dtype), pos=0)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        acfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=cfg.titans.window))
        return LocalAttention.flops_per_token(acfg, seq_len) + TitansMemory.flops_per_token(cfg, seq_len)


@register_mixer("titans_mal", config=TitansConfig, section="titans")
class TitansMAL(Mixer):
    r"""Memory as a layer (Titans §4.3, Eqs. 29–31):

        x̃ = [p_1 … p_{N_p}] ‖ x          persistent memory: N_p = ``titans.persistent_tokens``
                                          learned tokens, prepended once, at the stream start
        y = M(x̃)                          the LMM (``TitansMemory``) as a layer
        o = SW-Attn(y)                    sliding window of ``titans.window`` keys

    The outputs at the persistent positions are dropped; the tokens act through the memory's
    state and through the attention's keys (while they are inside its window). Positions count
    from the first persistent token, so x_t sits at N_p + t. The persistent tokens start at
    N(0, 1), the scale of the RMS-normalized block input they stand beside (the paper gives no
    init). All three forms run both sub-layers in the matching form; ``init_state`` has read
    the persistent tokens already. The reference and chunked forms are written with the public
    stages: ``inputs`` (x̃), ``op`` (the LMM, then the attention) and ``output`` (x's positions).

    Packed documents (``docs``): a document alone reads [p_1 … p_{N_p}] ‖ document, so the chunked
    form inserts the persistent tokens before every document of the packed rows
    (``DocLayout.prefixed``) and runs both sub-layers once on that layout with their own document
    handling: the LMM chunk-aligned per document with in-scan restarts on PyTorch, through its
    Triton kernel's ``cu_seqlens`` path in one call on Triton (either way its chunks counted from
    each document's first persistent token, as alone), the attention with its document mask and
    RoPE at each token's position in [p ‖ document]. The reference form runs on the padded view."""

    #: attends over earlier tokens (an attention branch, a window): not a pure recurrence
    attends = True

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.d_model = cfg.d_model
        self.n_persist = cfg.titans.persistent_tokens
        acfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=cfg.titans.window))
        self.memory = TitansMemory(cfg, layer_idx)
        self.memory.o_proj._is_residual_out = False   # feeds the attention, not the residual stream
        self.attn = LocalAttention(acfg, layer_idx)    # its o_proj writes the residual stream
        self.persistent = nn.Parameter(torch.empty(self.n_persist, cfg.d_model))
        self.persistent._no_weight_decay = True
        self.persistent_shared = nn.Identity()  # the persistent tokens every head reads (tensor parallelism)
        self.out_split = nn.Identity()          # the output handed to the block's sequence region (same)
        self.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Each sub-layer splits as its own mixer, except that the memory's W_O sums its heads for
        every attention head to read (``row_to_heads``: all-reduced in forward and backward) and
        the persistent tokens are shared by all heads. The persistent positions are dropped after
        the attention's W_O, so its reduce-scatter over the sequence (sequence parallelism) would
        cut [persistent ‖ x] instead of x: that W_O is summed over the whole sequence instead
        (``row_full_sequence``), and this rank's T/p tokens of x are taken after the drop
        (``out_split``): one all-reduce of N_p + T tokens where Megatron has a reduce-scatter."""
        acfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=cfg.titans.window))
        mem = TitansMemory.tp_plan(cfg).prefixed("memory")
        mem = dataclasses.replace(mem, row=(), row_to_heads=mem.row)
        attn = LocalAttention.tp_plan(acfg).prefixed("attn")
        attn = dataclasses.replace(attn, row=(), row_full_sequence=attn.row)
        return mem.merged(attn, TPPlan(shared=("persistent_shared",), sequence_split=("out_split",)))

    def reset_parameters(self) -> None:
        self.memory.reset_parameters()
        nn.init.normal_(self.persistent, std=1.0)

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state: Optional[TitansMALState] = None, output_state: bool = False):
        """The op's arguments: x̃ = [p_1 … p_{N_p}] ‖ x at the stream start (no state), else x.
        The carry is the next position (the persistent tokens not counted)."""
        pos0 = 0 if state is None else int(state.pos)
        if state is None:
            x = torch.cat([self.persistent_shared(self.persistent).to(x.dtype).expand(x.shape[0], -1, -1), x], 1)
        return {"x": x}, (TitansMALState(pos=pos0 + x.shape[1] - (self.n_persist if state is None else 0))
                          if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """o = SW-Attn(M(x̃)): the LMM then the attention, in their reference forms for backend
        "reference", else the LMM with this ``kernels/`` backend and the attention's chunked form
        (``attention.backend``). ``initial_state``: (LMM state, attention state) or None; the
        final state is the same pair."""
        sm, sa = (None, None) if initial_state is None else initial_state
        self.attn.kernel_backend = self.memory.kernel_backend = self.kernel_backend
        y, sm = self.memory._run(inp["x"], sm, output_final_state, backend)
        attn = self.attn.reference if backend == Backend.REFERENCE else self.attn.chunked
        o, sa = attn(y, sa, output_final_state)
        return o, ((sm, sa) if output_final_state else None)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The op's outputs at x's positions (those at the persistent tokens dropped)."""
        return self.out_split(o[:, o.shape[1] - x.shape[1]:])

    def _run(self, x, state, output_state, backend):
        inp, carry = self.inputs(x, state, output_state)
        o, fin = self.op(inp, None if state is None else (state.mem, state.attn), output_state, backend)
        return self.output(o, x), (dataclasses.replace(carry, mem=fin[0], attn=fin[1]) if output_state else None)

    def _run_docs(self, x: torch.Tensor, docs) -> torch.Tensor:
        """Packed documents (chunked form), one pass for the batch: the rows laid out with the
        persistent tokens before every document (``DocLayout.prefixed``: [p ‖ document] is what
        the document alone reads, positions from its first persistent token), then the LMM with
        its own document restarts (chunk-aligned and in-scan on PyTorch, the kernel's
        ``cu_seqlens`` path on Triton) and the sliding-window attention with its document mask on
        that layout; x's slots are taken back."""
        pre = docs.prefixed(self.n_persist)
        xt = pre.pad(x, self.persistent_shared(self.persistent))
        self.attn.kernel_backend = self.memory.kernel_backend = self.kernel_backend
        y, _ = self.memory.chunked(xt, docs=pre.layout)
        o, _ = self.attn.chunked(y, docs=pre.layout)
        return self.out_split(pre.unpad(o))

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the chunked form runs once on the rows with the persistent tokens
    #: inserted before every document (``_run_docs``: the LMM's chunk-aligned restarts in PyTorch,
    #: its kernel's ``cu_seqlens`` path on Triton; the attention's document mask); the reference
    #: form runs on the padded view
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, Backend.REFERENCE)

    #: the LMM's op (the attention half uses no kernels/ op)
    op_contract, contract_labels = TitansMemory.op_contract, TitansMemory.contract_labels

    def contract_args(self):
        return self.memory.contract_args()

    def chunked(self, x, state=None, output_state=False, docs=None):
        self.memory.kernel_backend = self.kernel_backend
        if docs is not None:
            return self._run_docs(x, docs), None
        return self._run(x, state, output_state, self.memory._resolve_backend(x))

    def step(self, x, state):
        y, sm = self.memory.step(x, state.mem)
        o, sa = self.attn.step(y, state.attn)
        return o, TitansMALState(mem=sm, attn=sa, pos=sm.pos - self.n_persist)

    def init_state(self, batch_size: int, device=None, dtype=None) -> TitansMALState:
        """The state after the persistent tokens (run through the chunked forms)."""
        dtype = dtype or self.persistent.dtype
        x = torch.zeros(batch_size, 0, self.d_model, device=device, dtype=dtype)
        return self.chunked(x, None, True)[1]

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        acfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, window=cfg.titans.window))
        return LocalAttention.flops_per_token(acfg, seq_len) + TitansMemory.flops_per_token(cfg, seq_len)


@register_mixer("titans_mac", config=TitansConfig, section="titans")
class TitansMAC(Mixer):
    r"""Memory as a context (Titans §4.1, Eqs. 21–25), with causal masks for language modeling.

    The sequence is cut into segments S^{(i)} of C = ``titans.segment_len`` tokens (counted from
    the stream start). M^{(i)} is the long-term memory (``TitansMemory``, the LMM) after the
    segments before i; p_1 … p_{N_p} are ``titans.persistent_tokens`` learned tokens. For
    segment i:

        h_j = M*^{(i)}(q_j),  q_j = x_j W_Q                     (21) retrieval, no update
        S̃   = [p_1 … p_{N_p}] ‖ h ‖ S^{(i)}                     (22)
        y   = Attn(S̃)  at the positions of S^{(i)}              (23)
        M^{(i+1)} = M^{(i)} updated on y                         (24)
        o_j = RMSNorm(y_j) ⊙ σ(RMSNorm(M*_j(y_j)))               (25) o = y ⊗ M*(y)

    Causal reading (the paper states the segment form, not the masks): token j of the segment
    attends to every persistent token, to h_{j'} and x_{j'} for j' ≤ j (h_j depends on x_j and
    on earlier segments only); in (25) M*_j is the memory updated on y up to token j (the LMM
    run as a sequence layer over y, with its own chunk_size), so o_j never reads later tokens;
    the memory reaches the next segment as M^{(i+1)}, the state after the whole segment. The
    retrieval h_j = W_O^M [RMSNorm(M^{(i)}(q_j)) ⊙ SiLU(W_G^M x_j)] uses the LMM's own query,
    gate and output projections (q_j L2-normalized after SiLU as in the LMM, without its
    convolution, which belongs to the stream of y). ⊗ is the gate of MAG. Positions (RoPE):
    p_n at n, h_j and x_j both at N_p + j, restarting every segment. Attention is over
    N_p + 2C keys at most, so the cost is linear in the sequence length.

    Attn is multi-head attention with its own output projection W_O^attn, and (25) is the paper's
    o = y ⊗ M*(y) with the gate of MAG (both branches RMSNorm-ed with learned gains, the memory's
    through a sigmoid) and no projection after it: W_O^attn is the one projection between the
    heads and the residual stream. (MAG keeps a W_O after its gate.) With a second trained
    projection after the gate, W_O [RMSNorm(y) ⊙ σ(…)], MAC stayed at chance on the induction task
    where this form solves it (``docs/results/titans_mac.md``, from
    ``experiments/titans_ablations/titans_mac_ablations.py``). MAG learns with that projection, but
    only with its gate reading x: with σ(RMSNorm(M(y))), or with no gate, it stays at chance too
    (``experiments/titans_ablations/titans_mag_ablations.py``).

    Forms: ``reference`` (explicit softmax, the LMM's sequential form), ``chunked`` (the
    attention backend that the one resolver picks for ``attention.backend``, ``attention_backend``:
    SDPA with the mask above or the explicit softmax, "math"; flash-attn and flex_attention are
    refused, the mask being neither causal nor a window; the LMM's chunked form), ``step`` one
    token. All three are written with the public stages: ``inputs`` (x and the LMM's form), ``op``
    (the segments: retrieval, attention, the LMM over y) and ``output`` (the gate). The state carries the LMM's
    state, the memory at the current segment's start (R1, R2 …: M^{(i)} for retrieval), the
    current segment's inputs so far (``seg``; their keys and values are recomputed, exactly)
    and the position.

    Packed documents (``docs``): a document alone has its segments from its first token and the
    LMM's chunks from there, so the chunked form lays the documents out at multiples of the LMM's
    chunk size (``DocLayout.balanced``) and scans all rows at once in blocks of
    gcd(chunk_size, segment_len) tokens, each inside one chunk and one segment of one document:
    per row, the LMM restarts from its initial state at a document start, R = M at a segment
    start, and a block's queries attend to the persistent tokens and their own segment so far
    (the segment mask above, per row); ``_run_docs``. The LMM runs once per block in its own
    backend (on Triton: its kernel over the balanced rows, carrying the state, not the kernel's
    ``cu_seqlens`` path: a segment's memory input y depends on the attention over the memory's own
    retrieval, so the documents cannot go through the memory in one call). The reference form runs
    on the padded view."""

    #: attends over earlier tokens (an attention branch, a window): not a pure recurrence
    attends = True

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.titans
        self.d_model = cfg.d_model
        self.n_persist, self.segment_len = c.persistent_tokens, c.segment_len
        self.attn = Attention(cfg, layer_idx)
        self.memory = TitansMemory(cfg, layer_idx)
        # the branches feed the gate's norms, not the residual stream: no depth-scaled init
        self.attn.o_proj._is_residual_out = False
        self.memory.o_proj._is_residual_out = False
        self.persistent = nn.Parameter(torch.empty(self.n_persist, cfg.d_model))
        self.persistent._no_weight_decay = True
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mem_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # tensor-parallel hooks (identity here): [p ‖ h] every key/value head reads, y every memory
        # head reads, and the gate's inputs handed to the block's sequence region
        self.context_shared = nn.Identity()
        self.y_shared = nn.Identity()
        self.out_split = nn.Identity()
        self.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads split as in the sub-mixers: the attention's W_Q, W_K, W_V and the LMM's
        projections, conv and initial memory by heads. The attention's and the LMM's W_O are
        row-parallel and summed on every rank over the whole sequence (``row_full_sequence``),
        because later tokens read them: y feeds the LMM (every memory head reads it:
        ``y_shared``), the retrieval h = W_O^M[…] feeds every key/value head, with the persistent
        tokens (``context_shared``). The gate (its two norms) runs replicated, with sequence
        parallelism on this rank's T/p tokens of y and m (``out_split``)."""
        full = TPPlan.merged(*(dataclasses.replace(q, row=(), row_full_sequence=q.row) for q in (
            Attention.tp_plan(cfg).prefixed("attn"), TitansMemory.tp_plan(cfg).prefixed("memory"))))
        return full.merged(TPPlan(shared=("context_shared", "y_shared"), sequence_split=("out_split",),
                                  sequence_region=("attn_norm", "mem_norm")))

    def reset_parameters(self) -> None:
        self.memory.reset_parameters()
        nn.init.normal_(self.persistent, std=1.0)

    # ---- pieces ------------------------------------------------------------------------------
    def _retrieval_query(self, x: torch.Tensor) -> torch.Tensor:
        """The retrieval's query q = L2norm(SiLU(W_Q^M x)) [B, H, n, d]."""
        mem = self.memory
        B, n, _ = x.shape
        q = F.silu(mem.q_proj(x)).view(B, n, mem.n_heads, mem.hd).transpose(1, 2)
        return F.normalize(acc(q), p=2.0, dim=-1, eps=1e-6)

    def _retrieve(self, x: torch.Tensor, R, q: Optional[torch.Tensor] = None,
                  gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h = W_O^M [RMSNorm(M(q)) ⊙ SiLU(W_G^M x)] with the memory weights R, [B, n, D] (``q``,
        ``gate``: the query and SiLU(W_G^M x) when already computed)."""
        mem = self.memory
        q = self._retrieval_query(x) if q is None else q
        y = q @ R[0].to(q.dtype) if mem.memory == "linear" else mem.mlp_read(q, R[0], R[1])
        return mem.output(y, x, gate)

    #: the segment mask (every persistent token, then h and S causally) is neither causal nor a
    #: sliding window: the attention backends that take only those cannot run it
    ATTENTION_LIMITS = {
        Backend.FLASH: "titans_mac's segment mask (persistent tokens, retrieval h and segment causally) is "
                       "not a causal or sliding-window mask, the only ones flash_attn_func takes",
        Backend.FLEX: "titans_mac builds no flex_attention block mask for its segment mask; use sdpa or math",
    }

    #: the LMM's op (the segment attention uses no kernels/ op)
    op_contract, contract_labels = TitansMemory.op_contract, TitansMemory.contract_labels

    def contract_args(self):
        return self.memory.contract_args()

    def attention_backend(self, device, dtype=None) -> Backend:
        """The segment attention's backend for ``attention.backend``, by the one resolver (op
        "attention", with ``ATTENTION_LIMITS``): SDPA with the segment mask, or the explicit
        softmax ("math", "reference")."""
        return resolve("attention", self.attn.backend, device, dtype, self.ATTENTION_LIMITS)

    def op_backend(self, x: torch.Tensor) -> Backend:
        """The ``backend`` argument of ``op``: "reference" under ``impl="reference"``, else the
        segment attention's (``attention_backend``); the LMM resolves its own ``kernels/`` backend."""
        return Backend.REFERENCE if self.impl == "reference" else self.attention_backend(x.device, x.dtype)

    def _segment_attention(self, full: torch.Tensor, h: torch.Tensor, n_old: int, backend: Backend) -> torch.Tensor:
        """Attn(p ‖ h ‖ S) at the positions of S[n_old:] (the tokens of this call), [B, L − n_old, D]:
        the explicit softmax for backend "reference" or "math", SDPA for "sdpa"."""
        a = self.attn
        B, L, D = full.shape
        Np, Tq = self.n_persist, L - n_old
        ctx = self.context_shared(torch.cat([self.persistent.to(full.dtype).expand(B, -1, -1), h.to(full.dtype)], 1))
        ext = torch.cat([ctx, full], 1)
        q = a.q_proj(full[:, n_old:]).view(B, Tq, a.n_heads, a.hd).transpose(1, 2)
        k = a.k_proj(ext).view(B, -1, a.n_kv, a.hd).transpose(1, 2)
        v = a.v_proj(ext).view(B, -1, a.n_kv, a.hd).transpose(1, 2)
        seg_pos = Np + torch.arange(L, device=full.device)
        k_pos = torch.cat([torch.arange(Np, device=full.device), seg_pos, seg_pos])
        cq, sq = rope_cos_sin(seg_pos[n_old:], a.hd, a.rope_theta, dtype=acc_dtype(q.dtype))
        ck, sk = rope_cos_sin(k_pos, a.hd, a.rope_theta, dtype=acc_dtype(k.dtype))
        q, k = apply_rope(q, cq, sq), apply_rope(k, ck, sk)
        j = torch.arange(n_old, L, device=full.device)[:, None]
        jk = torch.arange(L, device=full.device)[None, :]
        mask = torch.cat([torch.ones(Tq, Np, dtype=torch.bool, device=full.device), jk <= j, jk <= j], 1)
        rep = a.n_heads // a.n_kv
        if backend in (Backend.REFERENCE, Backend.MATH):
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (acc(q) @ acc(kk).transpose(-1, -2)) / math.sqrt(a.hd)
            o = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ acc(vv)).to(q.dtype)
        elif backend == Backend.SDPA:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)
        else:
            raise ValueError(f"titans_mac: no segment attention on backend {str(backend)!r}: "
                             f"{self.ATTENTION_LIMITS.get(backend, 'not an attention backend')}")
        return a.o_proj(o.transpose(1, 2).reshape(B, Tq, a.n_heads * a.hd))

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state: Optional[TitansMACState] = None, output_state: bool = False,
               sequential: bool = False):
        """The op's arguments: x and the LMM's form (``sequential``: its reference form, else its
        chunked form). The carry is the next position."""
        pos0 = 0 if state is None else int(state.pos)
        return {"x": x, "memory_form": "reference" if sequential else "chunked"}, \
            (TitansMACState(pos=pos0 + x.shape[1]) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "sdpa"):
        """Segment by segment: retrieval h = M*^{(i)}(q), y = Attn(p ‖ h ‖ S) (backend: the
        attention's, from ``attention_backend`` or "reference"), the LMM over y giving m and
        M^{(i+1)}; returns (y, m) [B, T, D] each. ``initial_state``: (LMM state, R, seg) as in
        ``TitansMACState`` (None: ``init_state``'s); the final state is the same triple."""
        x = inp["x"]
        self.attn.kernel_backend = self.memory.kernel_backend = self.kernel_backend
        B, T, _ = x.shape
        if initial_state is None:
            st = self.init_state(B, x.device, x.dtype)
            initial_state = (st.mem, st.R, st.seg)
        mem_state, R, seg = initial_state
        R, seg = list(R), seg.to(x.dtype)
        form = getattr(self.memory, inp["memory_form"])
        ys, ms, t = [], [], 0
        while t < T:
            n_old = seg.shape[1]
            take = min(self.segment_len - n_old, T - t)
            full = torch.cat([seg, x[:, t:t + take]], 1)
            y = self._segment_attention(full, self._retrieve(full, R), n_old, backend)
            m, mem_state = form(self.y_shared(y), mem_state, True)
            ys.append(y)
            ms.append(m)
            seg, t = full, t + take
            if seg.shape[1] == self.segment_len:       # segment done: M^{(i+1)} for the next one
                R = list(mem_state.M)
                seg = seg[:, :0]
        ym = (torch.cat(ys, 1), torch.cat(ms, 1)) if ys else None
        return ym, ((mem_state, tuple(R), seg) if output_final_state else None)

    def output(self, ym, x: torch.Tensor) -> torch.Tensor:
        """The gate, per token, once over the whole call: o = RMSNorm(y) ⊙ σ(RMSNorm(m))."""
        if ym is None:
            return x.new_zeros(x.shape[0], 0, self.d_model)
        y, m = self.out_split(ym[0]), self.out_split(ym[1])
        return self.attn_norm(y) * torch.sigmoid(self.mem_norm(m))

    def _run(self, x, state, output_state, sequential: bool):
        inp, carry = self.inputs(x, state, output_state, sequential)
        backend = Backend.REFERENCE if sequential else self.attention_backend(x.device, x.dtype)
        ym, fin = self.op(inp, None if state is None else (state.mem, state.R, state.seg), output_state, backend)
        if not output_state:
            return self.output(ym, x), None
        return self.output(ym, x), dataclasses.replace(carry, mem=fin[0], R=fin[1], seg=fin[2])

    def _run_docs(self, x: torch.Tensor, docs) -> torch.Tensor:
        """Packed documents (chunked form), one pass over the batch. The documents are laid out at
        multiples of the LMM's chunk size C, in rows about as long as the longest document
        (``DocLayout.balanced``: the scan's steps are then about those of the longest document
        alone, not of a packed row), and scanned in blocks of g = gcd(C, segment_len) tokens: a
        block lies in one chunk and one segment of one document (documents start at multiples of
        C, segments at multiples of segment_len after them), and its position mod C is the same in
        every row, so the LMM runs on each block for all rows with one carried state. Per row, at
        a document start the LMM state (M, S, M̂) restarts from ``init_state``'s (its conv reads
        the w − 1 slots before the block, masked by the document offsets); at a segment start
        R = M (the memory after the segment before, M_init at a document start). A block's queries attend to every persistent token
        and to h, x of its own segment so far: the last segment_len keys of the row, masked to the
        segment and causally; each key's RoPE position, N_p + its index in its segment, is fixed
        per token. Padding after a document (zeros) runs on as garbage that the next document's
        restart discards; its outputs are dropped."""
        a, mem = self.attn, self.memory
        C, L, Np = mem.chunk_size, self.segment_len, self.n_persist
        g = math.gcd(C, L)
        al = docs.balanced(C)
        xa = al.pad(x)
        B, Tp, D = xa.shape
        dev, dt = x.device, x.dtype
        backend = self.attention_backend(dev, dt)
        mem.kernel_backend = a.kernel_backend = self.kernel_backend
        mem_backend = mem._resolve_backend(xa)
        # each slot's index in its document, padding continuing the document before it
        idx = torch.arange(Tp, device=dev)
        first = torch.zeros(B, Tp, dtype=torch.bool, device=dev)
        first[:, ::C] = al.resets
        off = idx - torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), 1).values   # [B, T′]
        j = off % L                                                 # index in its segment
        # what depends on x alone, for every slot at once, then cut into blocks (one split, whose
        # backward is one concatenation): x's queries and keys with RoPE at N_p + j, the
        # retrieval's query and gate; the persistent tokens' keys at 0 … N_p − 1
        cos, sin = rope_cos_sin(Np + j[:, None], a.hd, a.rope_theta, dtype=acc_dtype(xa.dtype))   # [B, 1, T′, hd]
        qx = apply_rope(a.q_proj(xa).view(B, Tp, a.n_heads, a.hd).transpose(1, 2), cos, sin).split(g, 2)
        kx = apply_rope(a.k_proj(xa).view(B, Tp, a.n_kv, a.hd).transpose(1, 2), cos, sin).split(g, 2)
        vx = a.v_proj(xa).view(B, Tp, a.n_kv, a.hd).transpose(1, 2).split(g, 2)
        rq = self._retrieval_query(xa).split(g, 2)
        rgate = F.silu(mem.g_proj(xa)).split(g, 1)
        xb = xa.split(g, 1)
        cj = (Np + j[:, None]).split(g, 2)
        p = self.context_shared(self.persistent.to(dt)[None]).expand(B, -1, -1)
        cp, sp = rope_cos_sin(torch.arange(Np, device=dev), a.hd, a.rope_theta, dtype=acc_dtype(p.dtype))
        kp = apply_rope(a.k_proj(p).view(B, Np, a.n_kv, a.hd).transpose(1, 2), cp, sp)
        vp = a.v_proj(p).view(B, Np, a.n_kv, a.hd).transpose(1, 2)
        nb = L // g                                                # blocks in a segment's key window
        zk = kp.new_zeros(B, a.n_kv, g, a.hd)
        keys = {n: [zk] * (nb - 1) for n in ("kh", "vh", "kx", "vx")}
        # the key window's mask: window key w is slot s + g − L + w, in the segment (w ≥ L − g − j0)
        # and causal (w ≤ L − g + i)
        w = torch.arange(L, device=dev)
        causal = w[None, None, :] <= L - g + torch.arange(g, device=dev)[None, :, None]     # [1, g, L]
        lo = (L - g - j[:, ::g]).T[:, :, None, None]                                    # [steps, B, 1, 1]
        ones = torch.ones(B, g, Np, dtype=torch.bool, device=dev)
        rep = a.n_heads // a.n_kv
        # the LMM over y: its inputs see the w − 1 slots before each block (the conv's history,
        # masked by the document offsets), its output stage runs once after the scan
        hist = mem.conv.conv.kernel_size[0] - 1 if mem.conv is not None else 0
        st0 = mem.init_state(B, dev, dt)
        M, S, Mh = st0.M, st0.S, st0.Mh
        R = st0.M
        ys, yshs, ym = [], [], []
        prev = xa.new_zeros(B, hist, D)
        off_h = F.pad(off, (hist, 0))                              # the offsets of [history ‖ slots]
        for n, s in enumerate(range(0, Tp, g)):
            if s % C == 0:     # documents start at chunk boundaries only: restart those rows
                r = al.resets[:, s // C, None, None, None]
                M, S, Mh = ([torch.where(r, a0, b0) for a0, b0 in zip(t0, t)] for t0, t in
                            ((st0.M, M), (st0.S, S), (st0.Mh, Mh)))
            new_seg = (j[:, s] == 0)[:, None, None, None]
            R = [torch.where(new_seg, m0, r0) for m0, r0 in zip(M, R)]
            h = self.context_shared(self._retrieve(xb[n], R, rq[n], rgate[n]).to(dt))
            ch, sh = rope_cos_sin(cj[n], a.hd, a.rope_theta, dtype=acc_dtype(h.dtype))
            keys["kh"].append(apply_rope(a.k_proj(h).view(B, g, a.n_kv, a.hd).transpose(1, 2), ch, sh))
            keys["vh"].append(a.v_proj(h).view(B, g, a.n_kv, a.hd).transpose(1, 2))
            keys["kx"].append(kx[n])
            keys["vx"].append(vx[n])
            for key in keys:
                keys[key] = keys[key][-nb:]
            k = torch.cat([kp, *keys["kh"], *keys["kx"]], 2)
            v = torch.cat([vp, *keys["vh"], *keys["vx"]], 2)
            seg_ok = causal & (w[None, None, :] >= lo[n])
            mask = torch.cat([ones, seg_ok, seg_ok], 2)[:, None]
            q = qx[n]
            if backend in (Backend.REFERENCE, Backend.MATH):
                kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                sc = (acc(q) @ acc(kk).transpose(-1, -2)) / math.sqrt(a.hd)
                o = (sc.masked_fill(~mask, float("-inf")).softmax(-1) @ acc(vv)).to(q.dtype)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)
            y = a.o_proj(o.transpose(1, 2).reshape(B, g, a.n_heads * a.hd))
            ysh = self.y_shared(y)                       # what the LMM reads (every memory head)
            yh = torch.cat([prev, ysh], 1)
            inp, _ = mem.inputs(yh, doc_offset=off_h[:, s:s + hist + g])
            inp = {k_: (t[:, :, hist:] if torch.is_tensor(t) else t) for k_, t in inp.items()}
            inp["offset"] = s
            ymem, (M, S, Mh) = mem.op(inp, (M, S, Mh), True, mem_backend)
            ys.append(y)
            yshs.append(ysh)
            ym.append(ymem)
            prev = yh[:, g:] if hist else prev
        y = torch.cat(ys, 1)
        m = mem.output(torch.cat(ym, 2), torch.cat(yshs, 1))
        return self.output((al.unpad(y), al.unpad(m)), x)    # the gate on the packed rows

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the chunked form scans the chunk-aligned documents in blocks with
    #: per-row restarts (``_run_docs``; the LMM once per block, in its backend); the reference form
    #: runs on the padded view
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, sequential=True)

    def chunked(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self._run_docs(x, docs), None
        return self._run(x, state, output_state, sequential=False)

    def step(self, x, state):
        return self._run(x, state, True, sequential=True)

    def init_state(self, batch_size: int, device=None, dtype=None) -> TitansMACState:
        dtype = dtype or self.persistent.dtype
        mem = self.memory.init_state(batch_size, device, dtype)
        return TitansMACState(mem=mem, R=mem.M, seg=torch.zeros(batch_size, 0, self.d_model, device=device, dtype=dtype),
                              pos=0)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Attention: each query scores N_p + 2·(j + 1) keys (j its index in the segment), on
        average N_p + C + 1 over a full segment of C; the key/value projections of the N_p + C
        extra keys per segment (p and h) add 4·D·(n_kv·hd)·(N_p + C)/C per token beyond the
        parameter-shape count. Retrieval: the memory read at q (2 d·d per head, or 4 d·ed for
        the MLP memory) and the LMM's W_Q, W_G, W_O applied once more (2·3·D·H·d). Plus the LMM
        over y (TitansMemory)."""
        c = cfg.titans
        C = max(1, min(c.segment_len, max(seq_len, 1)))
        H, d, D = cfg.n_heads, cfg.hd, cfg.d_model
        n_kv = cfg.attention.num_kv_heads or H
        attn = 4.0 * H * d * (c.persistent_tokens + C + 1) + 4.0 * D * n_kv * d * (c.persistent_tokens + C) / C
        read = H * (2 * d * d if c.memory == "linear" else 4 * d * c.memory_expansion * d) + 6.0 * D * H * d
        return attn + read + TitansMemory.flops_per_token(cfg, seq_len)
