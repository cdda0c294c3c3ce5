r"""TTT-Linear and TTT-MLP: sequence modeling layers whose hidden state is the weights of an inner
model trained by gradient descent on a self-supervised loss as the sequence is read (Sun et al.
2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden States"), in the formulation
of the official ttt-lm-pytorch / ttt-lm-jax code.

Per head (H heads of width d; row vectors), for the layer input x_t ∈ R^{d_model}:

    k_t = θ_K x_t,  v_t = θ_V x_t,  q_t = θ_Q x_t       (RoPE on q, k at position t mod b)
    f(k; W) = k W1 + b1                                  TTT-Linear, W = (W1 ∈ R^{d×d}, b1)
    f(k; W) = GELU_tanh(k W1 + b1) W2 + b2               TTT-MLP, W1 ∈ R^{d×4d}, W2 ∈ R^{4d×d}
    ℓ(W; x_t) = ½ ‖LN(f(k_t; W)) + k_t − v_t‖²           LN: per-head LayerNorm (γ, β learnable)

The official gradient is that of ½‖·‖² (LN's Jacobian applied to LN(f(k)) − (v − k)), computed
in closed form (``ln_fused_l2_bwd`` in kernels/ttt/torch_chunk.py); the specification
(kernels/ttt/reference.py) takes it with autograd instead.

Mini-batch TTT with mini-batch size b. Token t is at position p = t mod b inside mini-batch
i = ⌊t/b⌋; W_0^{(i)} is the state at the start of that mini-batch:

    η_t = η_base · σ(θ_η · x_t + b_η) / d                  per head and token (official ttt_lr_eta)
    τ_p = max(0, 1/(p+1) + learnable_token_idx[p])         official token_idx
    W_t = W_0^{(i)} − τ_p · Σ_{s = ib}^{t} η_s ∇ℓ(W_0^{(i)}; x_s)
    z_t = q_t + LN(f(q_t; W_t))                            output rule
    W_0^{(i+1)} = W_{ib+b−1}

η_base is 1.0 for TTT-Linear and 0.1 for TTT-MLP unless ``ttt.base_lr`` is set. ttt-lm-jax's
TTT-MLP runs warm η_base up in training (``ttt_base_lr_init`` 0.01 → ``ttt_base_lr`` 0.1 over
``ttt_base_lr_warmup`` steps, the optimizer's warmup): at optimizer step s (1-based)

    η_base(s) = η_init + min(1, (s − 1)/n_warmup) · (η_base − η_init)

(``ttt.base_lr_init``, ``ttt.base_lr_warmup``; the trainer calls ``LM.set_train_step``). As
there, only training uses it: evaluation and decoding use η_base. With τ_p = 1/(p+1)
(learnable_token_idx = 0) W_t takes one step with the η-weighted mean of the mini-batch's
gradients so far.

Which W does the output use? Every gradient inside mini-batch i is taken at W_0^{(i)}, the state
at the start of the mini-batch, never at a partly updated one; but token t's output uses W_t, the
state after the cumulative update through t itself (its own gradient included), not W_0^{(i)}
and not the state at the end of the mini-batch. In the paper's notation (Sec. 2.7, App. A),
"W_0" in the dual form is the initial state of an arbitrary mini-batch and W_1 … W_b the states
after each of its tokens; W^k with a layer index names the k-th layer of the inner MLP.

Dual form (training; ``chunked``). Within a mini-batch stack the rows: K, Q ∈ R^{n×d}, the
gradients w.r.t. the inner pre-activations Γ = [g_s] at W_0 (∇_{W1}ℓ_s = k_sᵀ g_s), and
E_ts = τ_t η_s for s ≤ t (else 0). Then, since q_t k_sᵀ g_s = (q_t · k_s) g_s,

    Z̄ = Q W1_0 + b1_0 − (E ⊙ tril(Q Kᵀ)) Γ − E Γ,           z = Q + LN(Z̄)
    W1_0' = W1_0 − τ_{b−1} Kᵀ diag(η) Γ,    b1_0' = b1_0 − τ_{b−1} ηᵀ Γ

so no per-token W_t is formed: the cost per mini-batch is matrix products of b×d, b×b and d×d
blocks. TTT-MLP applies this to each layer (layer 2's inputs are GELU(K W1_0 + b1_0) on the
gradient side and GELU(Z̄1) on the output side). The mini-batches themselves run in sequence.
The primal form (``step``, decoding) materializes W_t per token from the same quantities.

A partial mini-batch (a length that is not a multiple of b, or a segment boundary inside one) is
handled exactly: the state carries W_0 of the current mini-batch, the running sums
Σ η_s ∇ℓ_s of its tokens seen so far (``grad_W1`` …), the position ``pos`` in it, and the
causal-conv caches; the next segment continues the same mini-batch.

Layer output: o = o_proj(gate(post_norm(concat_heads(z)))), post_norm a LayerNorm(eps 1e-6) over
all heads; gate (``use_gate``, "Mamba backbone") multiplies by GELU_tanh(g_proj x).
``share_qk``: one projection q_proj, then separate causal depthwise convs of width
``conv_width`` for Q and K (no k_proj). The block's optional ``pre_conv`` lives in lm.Block.

Parameters map one-to-one onto ttt-lm-pytorch's ``TTTLinear`` / ``TTTMLP`` (under
``model.layers.{i}.seq_modeling_block.``), same names and shapes (W = H·d):

    q_proj.weight [W, D]     k_proj.weight [W, D] (not with share_qk)    v_proj.weight [W, D]
    o_proj.weight [D, W]     g_proj.weight [W, D] (use_gate)             post_norm.weight/bias [W]
    conv_q.weight, conv_k.weight [W, 1, conv_width], .bias [W] (share_qk)
    learnable_ttt_lr_weight [H, 1, D]   learnable_ttt_lr_bias [H, 1]   learnable_token_idx [b]
    ttt_norm_weight, ttt_norm_bias [H, d]
    W1 [H, d, d] b1 [H, 1, d] (Linear);  W1 [H, d, 4d] b1 [H, 1, 4d] W2 [H, 4d, d] b2 [H, 1, d] (MLP)

``token_idx`` (1/(p+1)) is a non-persistent buffer there and here. RoPE is the official one:
q, k are permuted (pairs (2i, 2i+1) → halves) before the half-split rotation and permuted back,
i.e. the interleaved rotation, so released weights need no reordering.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

import kernels.ttt as _ttt
from kernels.ttt import triton_packed_limit, ttt_linear, ttt_mlp
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import masked_conv, unflatten_heads, varlen_heads
from ttt_lm.model.layers import acc, apply_rope, rope_cos_sin
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer


@dataclass
class TTTConfig:
    """``model.ttt``: TTT-Linear and TTT-MLP (Sun et al. 2024), one section for both kinds."""
    mini_batch_size: int = option(16, ge=1)       # b: tokens per TTT mini-batch
    base_lr: Optional[float] = option(None, gt=0)  # η_base; None: 1.0 for TTT-Linear, 0.1 for TTT-MLP
    mlp_expansion: int = option(4, ge=1)          # TTT-MLP inner hidden = expansion × head_dim
    use_gate: bool = False             # GELU output gate (the "Mamba backbone" variant)
    share_qk: bool = False             # one Q/K projection, separate causal convs for Q and K
    pre_conv: bool = False             # causal conv before the mixer in the block
    conv_width: int = option(4, ge=1)
    rope_theta: float = 10000.0
    # Warmup of η_base in training, as ttt-lm-jax's TTT-MLP runs: from base_lr_init to base_lr
    # linearly over base_lr_warmup optimizer steps (None / 0: no warmup)
    base_lr_init: Optional[float] = None
    base_lr_warmup: int = 0

    def short(self, n: int) -> "TTTConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return replace(self, mini_batch_size=n)

    def validate(self, model) -> None:
        if (self.base_lr_init is None) != (self.base_lr_warmup == 0):
            raise ValueError("model.ttt.base_lr_init and model.ttt.base_lr_warmup go together: set both "
                             f"(a warmup from base_lr_init over base_lr_warmup > 0 steps) or neither; got "
                             f"{self.base_lr_init} and {self.base_lr_warmup}")
        if self.base_lr_init is not None and (self.base_lr_init <= 0 or self.base_lr_warmup < 0):
            raise ValueError(f"model.ttt.base_lr_init must be > 0 and base_lr_warmup > 0, got "
                             f"{self.base_lr_init} and {self.base_lr_warmup}")

#: N(0, 0.02) for W1, W2 and θ_η, as in the official code (independent of model.init_std)
INNER_INIT_STD = 0.02


def _causal_conv(conv: nn.Conv1d, x: torch.Tensor, cache: Optional[torch.Tensor]):
    """Depthwise causal conv of x [B, T, C] with the last w−1 inputs in ``cache`` [B, C, w−1];
    returns y [B, T, C] and the new cache."""
    xt = x.transpose(1, 2)
    w = conv.kernel_size[0]
    if cache is None:
        cache = xt.new_zeros(xt.shape[0], xt.shape[1], w - 1)
    xt = torch.cat([cache.to(xt.dtype), xt], dim=-1)
    return conv(xt).transpose(1, 2), xt[..., xt.shape[-1] - (w - 1):]


def _permute(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, …) → (x0, x2, …, x1, x3, …): the official permute_qk."""
    *s, d = x.shape
    return x.reshape(*s, d // 2, 2).transpose(-1, -2).reshape(*s, d)


def _unpermute(x: torch.Tensor) -> torch.Tensor:
    *s, d = x.shape
    return x.reshape(*s, 2, d // 2).transpose(-1, -2).reshape(*s, d)


@dataclass
class TTTState(MixerState):
    """The inner model's weights per sequence and head: W1 [B, H, d, d₁], b1 [B, H, 1, d₁] and for
    TTT-MLP W2 [B, H, d₁, d], b2 [B, H, 1, d] (None for TTT-Linear), with grad_W1 … grad_b2 of
    the same shapes (the gradient accumulated over the current mini-batch); float32 for half
    inputs, as the ops keep them. conv_q, conv_k [B, H·d, w − 1]: the share_qk convs' caches (None
    without share_qk). pos: tokens read mod b (the position inside the current mini-batch, as the
    kernels keep it)."""
    W1: Optional[torch.Tensor] = None
    b1: Optional[torch.Tensor] = None
    W2: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    grad_W1: Optional[torch.Tensor] = None
    grad_b1: Optional[torch.Tensor] = None
    grad_W2: Optional[torch.Tensor] = None
    grad_b2: Optional[torch.Tensor] = None
    conv_q: Optional[torch.Tensor] = None
    conv_k: Optional[torch.Tensor] = None

    #: the fields the ``kernels.ttt`` ops read and return (their state dict's keys, with pos)
    OP_FIELDS = ("W1", "b1", "W2", "b2", "grad_W1", "grad_b1", "grad_W2", "grad_b2")

    def op_state(self) -> Dict[str, object]:
        """The state as ``kernels.ttt``'s ops take it: a dict of the inner weights, their
        accumulated gradients and pos."""
        d = {n: getattr(self, n) for n in self.OP_FIELDS if getattr(self, n) is not None}
        d["pos"] = self.pos
        return d

    @classmethod
    def from_op(cls, d: Dict[str, object], **rest) -> "TTTState":
        """The state from an op's final-state dict (and ``rest``: the conv caches)."""
        unknown = set(d) - set(cls.OP_FIELDS) - {"pos"}
        if unknown:
            raise ValueError(f"TTTState.from_op: the op returned unexpected state entries {sorted(unknown)}")
        return cls(**{n: d.get(n) for n in cls.OP_FIELDS}, pos=d["pos"], **rest)


class HeadsLayerNorm(nn.LayerNorm):
    """LayerNorm over the features of all heads, its gain and bias cast to the input's dtype (the
    input is float32 for half-precision models). Tensor parallelism swaps it for one whose
    statistics span the ranks (``TPPlan.group_norms``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class _TTTBase(Mixer):
    official_init = "ttt"          # ttt-lm-pytorch / ttt-lm-jax: N(0, 0.02)
    #: "linear" (TTTLinear) or "mlp" (TTTMLP)
    kind: str = "linear"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        t = cfg.ttt
        self.layer_idx = layer_idx
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.hd = cfg.hd
        self.width = self.n_heads * self.hd
        self.mini_batch_size = t.mini_batch_size
        self.base_lr = t.base_lr if t.base_lr is not None else (1.0 if self.kind == "linear" else 0.1)
        self.base_lr_init, self.base_lr_warmup = t.base_lr_init, t.base_lr_warmup
        #: η_base(s) / η_base in training (set_train_step); 1 until a step is set
        self.lr_mult = 1.0
        self.share_qk = t.share_qk
        self.use_gate = t.use_gate
        self.conv_width = t.conv_width
        self.rope_theta = t.rope_theta
        if self.hd % 2:
            raise ValueError(f"TTT layers need an even head_dim for RoPE, got {self.hd}")
        H, D, W = self.n_heads, self.d_model, self.width

        self.q_proj = nn.Linear(D, W, bias=False)
        if not self.share_qk:
            self.k_proj = nn.Linear(D, W, bias=False)
        self.v_proj = nn.Linear(D, W, bias=False)
        self.o_proj = nn.Linear(W, D, bias=False)
        self.o_proj._is_residual_out = True
        if self.share_qk:
            self.conv_q = nn.Conv1d(W, W, self.conv_width, groups=W, bias=True)
            self.conv_k = nn.Conv1d(W, W, self.conv_width, groups=W, bias=True)

        self.register_buffer("token_idx", torch.empty(self.mini_batch_size), persistent=False)
        self.reset_buffers()
        self.learnable_token_idx = nn.Parameter(torch.zeros(self.mini_batch_size))
        self.learnable_ttt_lr_weight = nn.Parameter(torch.empty(H, 1, D))   # θ_η
        self.learnable_ttt_lr_bias = nn.Parameter(torch.zeros(H, 1))
        self.ttt_norm_weight = nn.Parameter(torch.ones(H, self.hd))         # γ of the inner LN
        self.ttt_norm_bias = nn.Parameter(torch.zeros(H, self.hd))          # β
        if self.use_gate:
            self.g_proj = nn.Linear(D, W, bias=False)
        self.post_norm = HeadsLayerNorm(W, eps=1e-6)
        #: τ passes through here: it is shared by all heads (tensor parallelism sums its gradient)
        self.tau_shared = nn.Identity()
        d = self.hd
        if self.kind == "linear":
            self.inner_keys = ("W1", "b1")
            self.W1 = nn.Parameter(torch.empty(H, d, d))
            self.b1 = nn.Parameter(torch.zeros(H, 1, d))
        else:
            self.inner_keys = ("W1", "b1", "W2", "b2")
            m = self.hidden = d * t.mlp_expansion
            self.W1 = nn.Parameter(torch.empty(H, d, m))
            self.b1 = nn.Parameter(torch.zeros(H, 1, m))
            self.W2 = nn.Parameter(torch.empty(H, m, d))
            self.b2 = nn.Parameter(torch.zeros(H, 1, d))
        self.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads are independent, so they split like attention: q, k, v and g (use_gate) by
        columns, the share_qk convs by channels, the per-head θ_η, b_η, inner LayerNorm γ, β and
        inner weights by heads, o_proj by rows; post_norm spans all heads (statistics across
        ranks) and τ is shared by all heads."""
        t = cfg.ttt
        inner = ("W1", "b1") if cls.kind == "linear" else ("W1", "b1", "W2", "b2")
        return TPPlan(column=("q_proj", "v_proj") + (() if t.share_qk else ("k_proj",)) + (("g_proj",) if t.use_gate else ()),
                      row=("o_proj",), channel_convs=("conv_q", "conv_k") if t.share_qk else (),
                      head_params=("learnable_ttt_lr_weight", "learnable_ttt_lr_bias", "ttt_norm_weight",
                                   "ttt_norm_bias") + inner,
                      group_norms=("post_norm",), shared=("tau_shared",), head_counts=("n_heads", "width"))

    @classmethod
    def block_pre_conv(cls, cfg) -> Optional[int]:
        """The "Mamba backbone" residual conv (``ttt.pre_conv``), run by the block."""
        return cfg.ttt.conv_width if cfg.ttt.pre_conv else None

    # ---- parameters --------------------------------------------------------------------------
    def reset_buffers(self) -> None:
        """Recompute the buffers that are not saved: token_idx = 1/i for i = 1..b (transformers'
        from_pretrained calls this, since it leaves unsaved buffers empty)."""
        with torch.no_grad():
            self.token_idx.copy_(1.0 / torch.arange(1, self.mini_batch_size + 1, device=self.token_idx.device,
                                                    dtype=self.token_idx.dtype))

    def reset_parameters(self) -> None:
        """Official init of the TTT-specific parameters: W ~ N(0, 0.02), inner biases 0, θ_η ~
        N(0, 0.02) with bias 0, learnable_token_idx 0, LayerNorms γ = 1 and β = 0, and PyTorch's
        default for the Q/K convs. The dense projections are left to the model's init."""
        with torch.no_grad():
            for n in self.inner_keys:
                p = getattr(self, n)
                if n.startswith("W"):
                    p.normal_(0.0, INNER_INIT_STD)
                else:
                    p.zero_()
            self.learnable_ttt_lr_weight.normal_(0.0, INNER_INIT_STD)
            self.learnable_ttt_lr_bias.zero_()
            self.learnable_token_idx.zero_()
            self.ttt_norm_weight.fill_(1.0)
            self.ttt_norm_bias.zero_()
        self.post_norm.reset_parameters()
        if self.share_qk:
            self.conv_q.reset_parameters()
            self.conv_k.reset_parameters()

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state: Optional[TTTState] = None, output_state: bool = False,
               doc_offset: Optional[torch.Tensor] = None):
        """The op's arguments: XQ, XK, XV [B, H, T, d] (RoPE at positions mod b), η, τ, the inner
        LayerNorm's γ, β, the inner weights (the initial state when none is carried) and b; the
        carry is the conv caches (share_qk). ``doc_offset`` [B, T] (each token's index in its
        document, no state): the convolutions restart at document starts (``masked_conv``) and
        RoPE takes each token's position in its document's mini-batches (offset mod b)."""
        B, T, _ = x.shape
        if doc_offset is not None and state is not None:
            raise ValueError("TTT inputs: doc_offset (document restarts) takes no carried state")
        conv_q = conv_k = None
        if self.share_qk and doc_offset is not None:
            xq = self.q_proj(x)
            XQ, XK = masked_conv(self.conv_q, xq, doc_offset), masked_conv(self.conv_k, xq, doc_offset)
        elif self.share_qk:
            xq = self.q_proj(x)
            XQ, conv_q = _causal_conv(self.conv_q, xq, None if state is None else state.conv_q)
            XK, conv_k = _causal_conv(self.conv_k, xq, None if state is None else state.conv_k)
        else:
            XQ, XK = self.q_proj(x), self.k_proj(x)
        XV = self.v_proj(x)
        XQ, XK, XV = (y.view(B, T, self.n_heads, self.hd).transpose(1, 2) for y in (XQ, XK, XV))
        pos0 = 0 if state is None else int(state.pos)
        if doc_offset is not None:
            # [B, 1, T, d]: every document's mini-batches counted from its own start
            cos, sin = (c[:, None] for c in rope_cos_sin(doc_offset % self.mini_batch_size, self.hd,
                                                          self.rope_theta, dtype=acc(XQ).dtype))
        else:
            positions = (pos0 + torch.arange(T, device=x.device)) % self.mini_batch_size
            cos, sin = rope_cos_sin(positions, self.hd, self.rope_theta, dtype=acc(XQ).dtype)
        XQ = _unpermute(apply_rope(_permute(XQ), cos, sin))
        XK = _unpermute(apply_rope(_permute(XK), cos, sin))
        inp = {"q": XQ, "k": XK, "v": XV, "eta": self._eta(x), "tau": self._tau(),
               "ln_weight": self.ttt_norm_weight, "ln_bias": self.ttt_norm_bias, "inner": self._inner_weights(),
               "mini_batch_size": self.mini_batch_size}
        return inp, (TTTState(conv_q=conv_q, conv_k=conv_k, pos=pos0 + T) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """Mini-batch TTT: ``kernels.ttt.ttt_linear`` / ``ttt_mlp`` (``inp["resets"]``: the
        mini-batches that start a document, restarted from the initial weights in the scan;
        ``inp["cu_seqlens"]``: the documents packed back to back in one row, B = 1, each from the
        initial weights)."""
        op = ttt_linear if self.kind == "linear" else ttt_mlp
        kw = {"mini_batch_resets": inp["resets"]} if inp.get("resets") is not None else {}
        if inp.get("cu_seqlens") is not None:
            kw["cu_seqlens"] = inp["cu_seqlens"]
        return op(inp["q"], inp["k"], inp["v"], inp["eta"], inp["tau"], inp["ln_weight"], inp["ln_bias"],
                  *inp["inner"], mini_batch_size=inp["mini_batch_size"], initial_state=initial_state,
                  output_final_state=output_final_state, backend=backend, **kw)

    def output(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o = o_proj(gate(post_norm(concat_heads(z))))."""
        B, H, T, d = z.shape
        y = self.post_norm(acc(z.transpose(1, 2).reshape(B, T, H * d)))
        if self.use_gate:
            y = F.gelu(acc(self.g_proj(x)), approximate="tanh") * y
        return self.o_proj(y.to(x.dtype))

    def set_train_step(self, step: int) -> None:
        """η_base's warmup at optimizer step ``step`` (1-based), as ttt-lm-jax's get_ttt_lr_mult."""
        if self.base_lr_init is None:
            return
        frac = min(1.0, (step - 1) / self.base_lr_warmup)
        self.lr_mult = (self.base_lr_init + frac * (self.base_lr - self.base_lr_init)) / self.base_lr

    def _eta(self, x: torch.Tensor) -> torch.Tensor:
        """η_t = η_base σ(θ_η·x_t + b_η) / d, [B, H, T] (η_base warmed up in training)."""
        xf = acc(x)
        a = torch.einsum("btc,hc->bht", xf, self.learnable_ttt_lr_weight[:, 0].to(xf.dtype))
        a = a + self.learnable_ttt_lr_bias.to(xf.dtype)[None, :, :]
        base = self.base_lr * (self.lr_mult if self.training else 1.0)
        return base * torch.sigmoid(a) / self.hd

    def _tau(self) -> torch.Tensor:
        """τ_p = max(0, 1/(p+1) + learnable_token_idx[p]), [b]."""
        return self.tau_shared(torch.clamp_min(self.token_idx.to(self.learnable_token_idx.dtype)
                                               + self.learnable_token_idx, 0.0))

    def _inner_weights(self):
        return [getattr(self, n) for n in self.inner_keys]

    def _run(self, x: torch.Tensor, state: Optional[TTTState], output_state: bool, backend: str):
        inp, carry = self.inputs(x, state, output_state)
        z, new = self.op(inp, None if state is None else state.op_state(), output_state, backend)
        out = self.output(z, x)
        if not output_state:
            return out, None
        return out, TTTState.from_op(new, conv_q=carry.conv_q, conv_k=carry.conv_k)

    # ---- forms -------------------------------------------------------------------------------
    def contract_args(self):
        return {"d": self.hd}

    #: packed documents (``docs``): the PyTorch dual form lays the documents out at mini-batch
    #: boundaries in rows about as long as the longest document (``DocLayout.balanced``: fewer
    #: steps of the mini-batch loop than the packed rows' own) and restarts W at each document's
    #: first mini-batch inside its scan; the Triton form flattens the packed rows to one row and
    #: runs every document in one call of the op's packed kernels (``cu_seqlens``), falling back
    #: to the padded view, with a warning, only where that launch would pass the kernels' int32
    #: offsets (``_run_packed``); the reference form runs on the padded view (``Mixer.run_padded``)
    handles_docs = True

    def _run_packed(self, x: torch.Tensor, docs):
        """The Triton form over packed documents: the inputs of the packed rows [B, T] (convs and
        RoPE restarted at document starts, ``inputs``' ``doc_offset``), flattened row-major to
        [1, H, B·T, …] (the order of ``docs.cu_seqlens``), one call of the op with ``cu_seqlens``
        (each document's mini-batches from its first token, from the initial weights, τ_p by its
        own positions), the output put back in [B, T]. Where one packed launch would pass the
        kernels' int32 offsets (``kernels.ttt.triton_packed_limit``) the batch runs on the padded
        view instead (``Mixer.run_padded``: one document per row, launched in groups of rows),
        with a warning naming the reason."""
        B, T = docs.shape
        H, d = self.n_heads, self.hd
        inner = self.W1.shape[-1]
        why = triton_packed_limit(self.kind, H, B * T, d, docs.n_docs, self.mini_batch_size, inner)
        if why is not None:
            warnings.warn(f"{type(self).__name__}: packed documents run on the padded view (one document "
                          f"per row), not in one packed launch: {why}", stacklevel=2)
            return self.run_padded(self.chunked, x, docs)
        inp, _ = self.inputs(x, doc_offset=docs.offset)
        inp["q"], inp["k"], inp["v"], inp["eta"] = varlen_heads(inp["q"], inp["k"], inp["v"], inp["eta"])
        inp["cu_seqlens"] = docs.cu_seqlens
        z, _ = self.op(inp, backend=Backend.TRITON)
        return self.output(unflatten_heads(z, B), x), None

    def _run_docs(self, x: torch.Tensor, docs, backend: str):
        al = docs.balanced(self.mini_batch_size)
        xa = al.pad(x)
        inp, _ = self.inputs(xa, doc_offset=al.offset)
        inp["resets"] = al.resets
        z, _ = self.op(inp, backend=backend)
        return al.unpad(self.output(z, xa)), None

    def chunked(self, x, state=None, output_state=False, docs=None):
        backend = self._resolve_backend(x)
        if docs is not None:
            if backend == Backend.TORCH:
                return self._run_docs(x, docs, backend)
            if backend == Backend.TRITON:
                return self._run_packed(x, docs)
            return self.run_padded(self.chunked, x, docs)
        return self._run(x, state, output_state, backend)

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, "reference")

    def step(self, x, state):
        return self._run(x, state, True, "primal")

    def init_state(self, batch_size: int, device=None, dtype=None) -> TTTState:
        st = {}
        dtype = dtype if dtype is not None else self.q_proj.weight.dtype
        sdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # as the ops keep it
        for n, w in zip(self.inner_keys, self._inner_weights()):
            w = w.to(device=device, dtype=sdt)
            st[n] = w.expand(batch_size, *w.shape).clone()
            st["grad_" + n] = torch.zeros_like(st[n])
        if self.share_qk:
            for n in ("conv_q", "conv_k"):
                st[n] = torch.zeros(batch_size, self.width, self.conv_width - 1, device=device, dtype=dtype)
        return TTTState(**st, pos=0)

    @staticmethod
    def _inner_flops(cfg, hidden: Optional[int]) -> float:
        """Forward FLOPs per token of the dual form beyond what ttt_lm.model.flops counts from
        parameter shapes, summed over heads (multiply-add = 2). Per inner linear layer
        d_in → d_out and mini-batch b the dual form costs k W_0, Q W_0 and the state update
        Kᵀ diag(η) Γ (2 d_in d_out each), tril(Q Kᵀ) (2 b d_in), (E ⊙ A) Γ and E Γ (4 b d_out);
        TTT-MLP adds the backward through W2 to reach layer 1 (2 d m). The k W_0 product
        (2 FLOPs per entry of W1, W2) is already in the parameter-shape count, as is θ_η·x, so
        both are left out here; LayerNorms and GELU are O(d)."""
        d, b = cfg.hd, cfg.ttt.mini_batch_size
        if hidden is None:
            per_head = 4 * d * d + 2 * b * d + 4 * b * d
        else:
            m = hidden
            per_head = (4 * d * m + 2 * b * d + 4 * b * m) + (4 * m * d + 2 * b * m + 4 * b * d) + 2 * d * m
        return float(cfg.n_heads * per_head)


@register_mixer("ttt_linear", config=TTTConfig, section="ttt")
class TTTLinear(_TTTBase):
    """TTT-Linear: inner model f(k) = k W1 + b1 per head; η_base = 1.0 by default."""
    kind = "linear"
    triton_custom_op = "kernels::ttt_linear_fwd"
    op_contract = _ttt.TTT_LINEAR

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        return _TTTBase._inner_flops(cfg, None)


@register_mixer("ttt_mlp", config=TTTConfig, section="ttt")
class TTTMLP(_TTTBase):
    """TTT-MLP: inner model f(k) = GELU_tanh(k W1 + b1) W2 + b2 per head, hidden width
    ``ttt.mlp_expansion`` × head_dim (4 in the paper); η_base = 0.1 by default."""
    kind = "mlp"
    triton_custom_op = "kernels::ttt_mlp_fwd"
    op_contract = _ttt.TTT_MLP

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        return _TTTBase._inner_flops(cfg, cfg.hd * cfg.ttt.mlp_expansion)
