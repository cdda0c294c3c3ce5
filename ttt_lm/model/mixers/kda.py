r"""Kimi Delta Attention (KDA; Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", arXiv 2510.26692): Gated DeltaNet's delta rule with the scalar decay per head replaced
by one per key channel, as flash-linear-attention's ``KimiDeltaAttention`` layer
(``fla/layers/kda.py``, the layer Kimi Linear's release runs) builds it.

Per head h (H = ``kda.num_heads``, key width d_k = ``kda.head_dim``, value width
d_v = expand_v·d_k), with state S ∈ R^{d_k×d_v} (the layout of ``kernels.kda``):

    q_t, k_t, v_t = SiLU(Conv(W_q x)_t), SiLU(Conv(W_k x)_t), SiLU(Conv(W_v x)_t)
    q_t ← d_k^{−1/2} · q_t / ‖q_t‖₂,     k_t ← k_t / ‖k_t‖₂
    g_t = −exp(A_log) · softplus(W_f^↑ W_f^↓ x_t + dt_bias) ∈ R^{d_k}    (A_log one per head, dt_bias one per channel)
    β_t = σ(W_β x_t)  (2·σ(W_β x_t) with ``allow_neg_eigval``)            (one per head)
    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,       y_t = S_tᵀ q_t
    o_t = W_o [RMSNorm(y_t^{(h)}) ⊙ σ(W_g^↑ W_g^↓ x_t + b_g)^{(h)}]_h

Row c of the state (key channel c) decays by α_{t,c} = exp(g_{t,c}) ∈ (0, 1], then the delta rule
moves the value stored under k_t a fraction β_t of the way to v_t. The forget gate and the output
gate are low-rank: W_f^↓, W_g^↓ map d_model to ``gate_rank`` features (d_v by default, as
flash-linear-attention; Kimi Linear's release uses d_k, the same width at expand_v = 1), W_f^↑ to
the H·d_k decays, W_g^↑ to the H·d_v gate logits. Without ``use_short_conv`` q, k, v are
SiLU(W x). ``kernels.kda`` runs the recurrence: ``reference`` token by token, ``chunked`` in the
chunkwise WY/UT form with the per-channel decay (``chunk_size`` tokens per chunk, finite under any
decay: ``kernels/kda/torch_chunk.py``), ``step`` one token from the decode cache (S and the three
conv caches).

Init (flash-linear-attention, ``KimiDeltaAttention.__init__`` and ``KDAPreTrainedModel._init_weights``):
A = exp(A_log) ~ U(1, 16) per head; dt_bias = softplus⁻¹(Δ₀) per channel (H·d_k of them) with
log Δ₀ ~ U(log 0.001, log 0.1), Δ₀ ≥ 1e-4; every linear and the short convs N(0, 0.02) (the
presets' ``model.init=ttt`` draws the linears, residual outs included, and ``reset_parameters``
the convs from ``model.init_std``), biases (b_g) zero; the norm's gain one.

Where the paper's text and the code differ, this file follows flash-linear-attention's code:

* The paper writes the forget gate as α_t = f(W_α^↑ W_α^↓ x_t) without fixing f here; the code's f
  is Mamba2's parameterization per channel, g = −exp(A_log)·softplus(· + dt_bias) (its ``kda_gate``),
  as here. (Its ``lower_bound`` / ``safe_gate`` form, g = lower_bound·σ(exp(A_log)(· + dt_bias)),
  a later option of the kernels that Kimi Linear's configs do not set, is not offered.)
* The paper's output gate is σ(W_g^↑ W_g^↓ x_t); flash-linear-attention's W_g^↑ has a bias b_g
  (``nn.Linear(..., bias=True)``), Kimi Linear's released checkpoints have none. Ours has it
  (``output_gate_bias``; zero at init, so the two start identical).
* The output gate follows a per-head RMSNorm with a learned gain, its activation the sigmoid
  (``FusedRMSNormGated(activation="sigmoid")``; Gated DeltaNet's is SiLU). The RMSNorm ε is
  ``model.norm_eps``.
* The low-rank width is d_v (flash-linear-attention) rather than d_k (Kimi Linear's modeling code):
  ``gate_rank`` sets it.
* Grouped value heads (flash-linear-attention's ``num_v_heads``), which Kimi Linear does not use,
  are not offered.

Packed documents (``docs``): each document runs as if alone, from S = 0 and empty conv caches. The
convs' taps that would read the previous document are masked; the PyTorch chunked form then resets
S at each document start inside its scan (``kernels/kda/torch_chunk.py``'s ``resets``), one call
for the batch; a Triton backend, once ``kernels.kda`` has one, runs the op's ``cu_seqlens`` path on
the batch flattened to one row; the reference form runs on the padded view (one document per row).

Context parallelism: the recurrence is affine in S, S_out = P S_in + S^loc with
P = Π_t (I − β_t k_t k_tᵀ) Diag(α_t) ∈ R^{d_k×d_k}, a chunk's transition matrix: the per-channel decay
keeps the combination linear, so the ranks combine chunk summaries (``cp_form = "summary"``) as
for the delta rules (``ttt_lm.parallel.cp.summary.cp_kda``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels import kda as _kda
from kernels.kda.reference import kda_reference
from kernels.kda.torch_chunk import kda_chunk_torch
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import unflatten_heads, varlen_heads
from ttt_lm.model.layers import RMSNorm, acc
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.mixers.gated_deltanet import DT_INIT_FLOOR, DT_MAX, DT_MIN, l2norm
from ttt_lm.model.mixers.short_conv import QKVShortConvs
from ttt_lm.model.registry import option, register_mixer


@dataclass
class KDAConfig:
    """``model.kda``: Kimi Delta Attention (Kimi Team 2025); the options of flash-linear-attention's
    ``KDAConfig`` that Kimi Linear's configs use. Heads: ``num_heads`` of ``head_dim`` key channels
    (either may be left None: num_heads = d_model / head_dim, head_dim = d_model / num_heads; both
    None: model.n_heads heads splitting d_model)."""
    num_heads: Optional[int] = option(None, ge=1)   # H (Kimi Linear 48B: 32; flash-linear-attention's default 16)
    head_dim: Optional[int] = option(None, ge=1)    # d_k per head (Kimi Linear and flash-linear-attention: 128)
    expand_v: float = option(1.0, gt=0)             # d_v = expand_v · d_k (both codes: 1)
    use_short_conv: bool = True                     # short causal convs on q, k, v (both codes: on)
    conv_size: int = option(4, ge=1)                # their width (Kimi Linear's short_conv_kernel_size: 4)
    conv_bias: bool = False                         # a bias in the short convs (both codes: none)
    allow_neg_eigval: bool = False                  # β = 2σ(W_β x) ∈ (0, 2): I − β k kᵀ may have a negative eigenvalue
    gate_rank: Optional[int] = option(None, ge=1)   # width of the low-rank gate projections; None: d_v
    output_gate_bias: bool = True                   # the bias b_g of W_g^↑ (flash-linear-attention: yes; Kimi's checkpoints: no)
    chunk_size: int = option(64, ge=1)              # tokens per chunk of the chunked form (flash-linear-attention: 64)

    def short(self, n: int) -> "KDAConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks'
        tiny models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return replace(self, chunk_size=n)

    def scaled(self, family, model) -> "KDAConfig":
        """This section for ``model``, the family's model ``family`` at another width
        (``ttt_lm.scaling.ladder``): the head size kept and the heads following the width (a key
        width of d_model stays d_model, an explicit one grows in proportion); a head size that does
        not divide the new width gives way to the model's heads."""
        H, dk = self.num_heads, self.head_dim
        if H is None and dk is None:
            return self
        if dk is None:                       # H heads splitting d_model: keep their size
            H, dk = None, family.d_model // H
        if H is not None:
            H = max(1, round(H * model.d_model / family.d_model))
        elif model.d_model % dk:
            return replace(self, num_heads=None, head_dim=None)
        return replace(self, num_heads=H, head_dim=dk)

    def validate(self, model) -> None:
        if "kda" in model.layer_pattern:
            head_dims(model)


#: A = exp(A_log) ~ U(A_INIT_MIN, A_INIT_MAX) per head in flash-linear-attention's init
A_INIT_MIN, A_INIT_MAX = 1.0, 16.0


def head_dims(cfg):
    """(H, d_k, d_v, gate rank) of ``cfg.kda`` for ``cfg`` (the ModelConfig), checked: the widths
    must be whole numbers (the error names the key)."""
    c = cfg.kda
    H, dk = c.num_heads, c.head_dim
    for name, v in (("num_heads", H), ("head_dim", dk)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"model.kda.{name} must be a positive int, got {v!r}")
    if H is None and dk is None:
        H = cfg.n_heads
    if dk is None:
        if cfg.d_model % H:
            raise ValueError(f"model.kda.num_heads={H} must divide model.d_model={cfg.d_model} "
                             "(head_dim is unset: d_k = d_model / num_heads)")
        dk = cfg.d_model // H
    elif H is None:
        if cfg.d_model % dk:
            raise ValueError(f"model.kda.head_dim={dk} must divide model.d_model={cfg.d_model} "
                             "(num_heads is unset: H = d_model / head_dim)")
        H = cfg.d_model // dk
    dv = c.expand_v * dk
    if c.expand_v <= 0 or abs(dv - round(dv)) > 1e-6:
        raise ValueError(f"model.kda.expand_v={c.expand_v} gives d_v = expand_v·head_dim = {dv:g}, "
                         "which must be a whole number")
    dv = round(dv)
    rank = dv if c.gate_rank is None else c.gate_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"model.kda.gate_rank must be a positive int, got {c.gate_rank!r}")
    if not isinstance(c.conv_size, int) or c.conv_size < 1:
        raise ValueError(f"model.kda.conv_size must be a positive int, got {c.conv_size!r}")
    return H, dk, dv, rank


@dataclass
class KDAState(MixerState):
    """S [B, H, d_k, d_v]: the state (float32 for half inputs); conv_q, conv_k [B, H·d_k, w − 1]
    and conv_v [B, H·d_v, w − 1]: the short convs' caches (None without ``kda.use_short_conv``); pos."""
    S: Optional[torch.Tensor] = None
    conv_q: Optional[torch.Tensor] = None
    conv_k: Optional[torch.Tensor] = None
    conv_v: Optional[torch.Tensor] = None


@register_mixer("kda", config=KDAConfig)
class KimiDeltaAttention(QKVShortConvs, Mixer):
    official_init = official_hybrid_init = "ttt"   # FLA's KDA model and its 3:1 hybrids: N(0, 0.02)
    #: KDA is affine in its state (a chunk's transition is a [d_k, d_k] matrix per head): context
    #: parallelism combines chunk summaries
    cp_form = "summary"
    op_name = "kda"
    #: the state the short convs' stage (``QKVShortConvs``) builds
    conv_state = KDAState

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.kda
        self.d_model = cfg.d_model
        self.n_heads, self.dk, self.dv, self.gate_rank = head_dims(cfg)
        self.chunk_size = c.chunk_size
        self.allow_neg_eigval = bool(c.allow_neg_eigval)
        self.init_std = cfg.init_std
        key_dim, value_dim = self.n_heads * self.dk, self.n_heads * self.dv
        self.q_proj = nn.Linear(cfg.d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, value_dim, bias=False)
        self.f_a_proj = nn.Linear(cfg.d_model, self.gate_rank, bias=False)    # W_f^↓
        self.f_b_proj = nn.Linear(self.gate_rank, key_dim, bias=False)        # W_f^↑: one decay per channel
        self.b_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)        # W_β
        self.g_a_proj = nn.Linear(cfg.d_model, self.gate_rank, bias=False)    # W_g^↓
        self.g_b_proj = nn.Linear(self.gate_rank, value_dim, bias=c.output_gate_bias)   # W_g^↑, b_g
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.dt_bias = nn.Parameter(torch.zeros(key_dim))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        w = c.conv_size if c.use_short_conv else 0
        self.build_convs(key_dim, value_dim, w, bias=c.conv_bias)
        self.o_norm = RMSNorm(self.dv, cfg.norm_eps)
        self.o_proj = nn.Linear(value_dim, cfg.d_model, bias=False)
        self.o_proj._is_residual_out = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_log, dt_bias and the short convs as flash-linear-attention draws them (module
        docstring); the linears follow ``model.init``."""
        with torch.no_grad():
            A = torch.empty(self.n_heads, dtype=torch.float64).uniform_(A_INIT_MIN, A_INIT_MAX)
            self.A_log.copy_(torch.log(A))
            u = torch.rand(self.dt_bias.shape[0], dtype=torch.float64)
            dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_INIT_FLOOR)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))         # softplus⁻¹(Δ₀)
            for conv in (self.q_conv, self.k_conv, self.v_conv):
                if conv is not None:
                    nn.init.normal_(conv.conv.weight, mean=0.0, std=self.init_std)
                    if conv.conv.bias is not None:
                        nn.init.zeros_(conv.conv.bias)

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads are independent: q, k, v, W_β and the up factors W_f^↑ (decays) and W_g^↑ (output
        gate, with its bias) split by heads (columns), the three short convs by channels (= heads),
        A_log (per head) and dt_bias (per channel, head-major) by heads, W_o by rows. The down
        factors W_f^↓, W_g^↓ (d_model → gate rank, read by every head's up factor) are replicated,
        their gradients summed across ranks, as is o_norm (over one head's features): exact, since
        each rank's heads see the whole low-rank activation."""
        convs = ("q_conv.conv", "k_conv.conv", "v_conv.conv") if cfg.kda.use_short_conv else ()
        return TPPlan(column=("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj"), row=("o_proj",),
                      channel_convs=convs, head_params=("A_log", "dt_bias"),
                      shared_modules=("f_a_proj", "g_a_proj", "o_norm"), head_counts=("n_heads",))

    # ---- stages ------------------------------------------------------------------------------
    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """g = −exp(A_log)·softplus(W_f^↑ W_f^↓ x + dt_bias) [B, T, H, d_k] (accumulation dtype)."""
        B, T, _ = x.shape
        f = acc(self.f_b_proj(self.f_a_proj(x))) + acc(self.dt_bias)
        return -torch.exp(acc(self.A_log))[:, None] * F.softplus(f.view(B, T, self.n_heads, self.dk))

    def inputs(self, x: torch.Tensor, state=None, output_state: bool = False, docs=None):
        """q (normalized, scaled by d_k^−1/2), k (normalized), v, g (the per-channel log decay) as
        [B, H, T, ·] and β [B, H, T]: ``kernels.kda``'s arguments; the carry is the conv caches.
        ``docs`` (packed documents): the convs restart at each document start (the state's conv
        caches, given only by context parallelism's slices, masked as the rest); the op gets the
        documents as ``resets`` (the starts [B, T], for the PyTorch chunked form) and
        ``cu_seqlens`` (int32 [N + 1] over the batch flattened to one row)."""
        B, T, _ = x.shape
        st = state if state is not None else KDAState()
        (q, k, v), caches = self.conv_qkv(x, st, docs)
        heads = lambda t, d: t.view(B, T, self.n_heads, d).transpose(1, 2)
        q = l2norm(heads(q, self.dk)) * self.dk ** -0.5
        k = l2norm(heads(k, self.dk))
        v = heads(v, self.dv)
        beta = torch.sigmoid(acc(self.b_proj(x)))
        if self.allow_neg_eigval:
            beta = 2 * beta
        pos0 = 0 if state is None else int(state.pos)
        carry = KDAState(**caches, pos=pos0 + T) if output_state else None
        inp = {"q": q, "k": k, "v": v, "g": self.gate(x).transpose(1, 2), "beta": beta.transpose(1, 2),
               "chunk_size": self.chunk_size}
        if docs is not None:
            inp["resets"], inp["cu_seqlens"] = docs.starts, docs.cu_seqlens
        return inp, carry

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """KDA, ``kernels.kda``: the reference and PyTorch chunked forms called directly (g ≤ 0
        and β ∈ (0, 1), or (0, 2) with ``allow_neg_eigval``, hold by construction, so the public
        entry's value check and its read-back are skipped), any other backend through
        ``kernels.kda.kda_trusted`` (the entry without that check). With packed documents
        (``inp["resets"]``, no state in or out):
        the PyTorch chunked form with the resets inside the scan, or the public entry's
        ``cu_seqlens`` path on the batch flattened to one row (``varlen_heads``)."""
        q, k, v, g, beta, C = (inp[n] for n in ("q", "k", "v", "g", "beta", "chunk_size"))
        if inp.get("resets") is not None:
            if initial_state is not None or output_final_state:
                raise ValueError("KDA: packed documents start from the zero state; they take no initial state "
                                 "and return no final state")
            if backend in (Backend.TORCH, Backend.REFERENCE):
                return kda_chunk_torch(q, k, v, g, beta, None, False, C, inp["resets"])
            o, _ = _kda.kda_trusted(*(t.contiguous() for t in varlen_heads(q, k, v, g, beta)),
                                    backend=str(backend), chunk_size=C, cu_seqlens=inp["cu_seqlens"])
            return unflatten_heads(o, q.shape[0]), None
        if backend == Backend.REFERENCE:
            return kda_reference(q, k, v, g, beta, initial_state, output_final_state)
        if backend == Backend.TORCH:
            return kda_chunk_torch(q, k, v, g, beta, initial_state, output_final_state, C)
        # the Triton kernels read rows of contiguous [B, H, T, ...] tensors (the head split above is a view)
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        return _kda.kda_trusted(q, k, v, g, beta, initial_state, output_final_state, backend=str(backend),
                                chunk_size=C)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, H, T, D = y.shape
        y = self.o_norm(y.transpose(1, 2).to(x.dtype))
        gate = torch.sigmoid(self.g_b_proj(self.g_a_proj(x))).view(B, T, H, D)
        return self.o_proj((y * gate).reshape(B, T, H * D))

    def _run(self, x, state, output_state, backend, docs=None):
        inp, carry = self.inputs(x, state, output_state, docs)
        y, S = self.op(inp, None if state is None else state.S, output_state, backend)
        return self.output(y, x), (replace(carry, S=S) if output_state else None)

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the convs are masked at document starts and the PyTorch chunked form
    #: resets inside its scan (one call for the batch); the reference form runs on the padded view
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, "reference")

    op_contract = _kda.CONTRACT
    contract_labels = {"beta_max": "kda.allow_neg_eigval"}

    def contract_args(self):
        return {"d_k": self.dk, "d_v": self.dv, "beta_max": 2.0 if self.allow_neg_eigval else 1.0}

    def chunked(self, x, state=None, output_state=False, docs=None):
        return self._run(x, state, output_state, self._resolve_backend(x), docs)

    def step(self, x, state):
        return self._run(x, state, True, "reference")

    def init_state(self, batch_size: int, device=None, dtype=None) -> KDAState:
        sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return KDAState(S=torch.zeros(batch_size, self.n_heads, self.dk, self.dv, device=device, dtype=sd),
                        **self.init_conv_caches(batch_size, device, dtype))

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Chunked form, per token and head (d = d_k, e = d_v, C = chunk), as Gated DeltaNet's: the
        decayed scores P(K) and P(Q) (2·2Cd), the two triangular solves (C(d+e)), W S, Q S and Kᵀ Ṽ
        (6de), the pseudo-value product (2Ce); the per-channel decay's elementwise factors and the
        gate are left out."""
        H, d, e, _ = head_dims(cfg)
        C = min(cfg.kda.chunk_size, max(seq_len, 1))
        return float(H * (4 * C * d + C * (d + e) + 6 * d * e + 2 * C * e))
