r"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", ICLR 2025): the delta rule of DeltaNet with a data-dependent decay of the whole state,
as its official code (NVlabs/GatedDeltaNet, and flash-linear-attention's ``GatedDeltaNet`` layer)
builds the layer.

Per head h (H = ``gated_deltanet.num_heads``; key width d_k = expand_k·d_model / H, value width
d_v = expand_v·d_model / H), with state S ∈ R^{d_k×d_v} (the layout of ``kernels.gated_delta_rule``):

    q_t, k_t, v_t = SiLU(Conv(W_q x)_t), SiLU(Conv(W_k x)_t), SiLU(Conv(W_v x)_t)
    q_t ← d_k^{−1/2} · q_t / ‖q_t‖₂,     k_t ← k_t / ‖k_t‖₂
    α_t = exp(g_t),   g_t = −exp(A_log) · softplus(W_α x_t + dt_bias)        (one per head)
    β_t = σ(W_β x_t)                                                          (one per head)
    S_t = α_t S_{t−1} + β_t k_t (v_t − α_t S_{t−1}ᵀ k_t)ᵀ,     y_t = S_tᵀ q_t
    o_t = W_o [RMSNorm(y_t^{(h)}) ⊙ SiLU(W_g x_t)^{(h)}]_h

The decay α_t ∈ (0, 1] forgets the whole state at once (Mamba2's gate, parameterized as Mamba2's
Δ and A: A_log per head, Δ_t = softplus(W_α x_t + dt_bias)); the delta rule then replaces the
value stored under k_t. ``kernels.gated_delta_rule`` runs the recurrence: ``reference`` token
by token, ``chunked`` in the WY/UT chunkwise form with the decay folded in (``chunk_size`` tokens
per chunk), ``step`` one token from the decode cache (the state S and the three conv caches).

Init (official code): A = exp(A_log) ~ U(0, 16) per head; dt_bias = softplus⁻¹(Δ₀) with
log Δ₀ ~ U(log 0.001, log 0.1), Δ₀ ≥ 1e-4; the short convs keep PyTorch's default init; the
projections follow ``model.init`` (the presets use "mamba", the official code's ``mamba_init``).

Where the paper's text and the official code differ, this file follows the code:

* The paper writes the gate as α_t ∈ (0, 1) from a sigmoid-like map of x_t; the code uses Mamba2's
  α_t = exp(−exp(A_log)·softplus(W_α x_t + dt_bias)) (``use_mamba_gate=True``), as here.
* The paper's block diagram has no separate key/value widths; the code sets the key width to
  0.75·d_model and the value width to 1.5·d_model (``expand_k``, ``expand_v``), so the layer holds
  about 6·d_model² parameters (q, k: 0.75 each; v, gate, o: 1.5 each), as here.
* NVlabs' code gives W_β a bias and creates an unused D parameter; flash-linear-attention's layer
  has neither. We follow flash-linear-attention (no bias, no D): with zero-initialized biases the
  two start identical.
* The output gate is SiLU(W_g x) applied after a per-head RMSNorm with a learned gain (both codes'
  fused "RMSNorm swish gate"); the RMSNorm ε is ``model.norm_eps``.
* The official init rescales only modules named ``out_proj`` / ``fc2``; with ``model.init=mamba``
  W_o (a residual output here) is divided by √(2·n_layers) as every residual output of this LM.

Packed documents (``docs``): each document runs as if alone, from S = 0 and empty conv caches.
The convs' taps that would read the previous document are masked; the PyTorch chunked form then
resets S at each document start inside its scan, the Triton form flattens the batch to one row and
runs the kernel's variable-length path (``cu_seqlens``) in one call; the reference form runs on
the padded view (one document per row).

Context parallelism: the recurrence is affine in S (S_out = P S_in + S^loc with
P = Π_t α_t (I − β_t k_t k_tᵀ)), so ranks combine chunk summaries (``cp_form = "summary"``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels import gated_delta_rule as _gdr
from kernels.gated_delta_rule.torch_chunk import gated_delta_rule_chunk_torch
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import check_packed_triton, unflatten_heads, varlen_heads
from ttt_lm.model.layers import RMSNorm, acc
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.mixers.short_conv import QKVShortConvs
from ttt_lm.model.registry import option, register_mixer


@dataclass
class GatedDeltaNetConfig:
    """``model.gated_deltanet``: Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025); shapes as its
    official code builds them: key width expand_k·d_model, value width expand_v·d_model, split into
    num_heads heads."""
    num_heads: Optional[int] = None     # None = model.n_heads
    expand_k: float = option(0.75, gt=0)  # q/k width = expand_k · d_model (official: 0.75)
    expand_v: float = option(1.5, gt=0)   # v / gate / o_proj width = expand_v · d_model (official: 1.5)
    conv_width: int = option(4, ge=0)   # short causal conv on q/k/v (0 = none)
    chunk_size: int = option(64, ge=1)

    def short(self, n: int) -> "GatedDeltaNetConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return replace(self, chunk_size=n)

#: Δ₀ range and floor of the official init (the same as Mamba's dt init)
DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4
#: A = exp(A_log) ~ U(0, A_INIT_MAX) per head in the official init
A_INIT_MAX = 16.0
#: ε of the L2 normalization of q and k (flash-linear-attention's l2norm: x / √(Σx² + ε))
L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / √(Σ x² + ε) over the last dimension, computed in float32 for half inputs."""
    xf = acc(x)
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def head_dims(cfg):
    """(H, d_k, d_v) of ``cfg.gated_deltanet`` for ``cfg`` (the ModelConfig), checked: the key
    and value widths must be whole numbers that H divides."""
    c = cfg.gated_deltanet
    H = cfg.n_heads if c.num_heads is None else c.num_heads
    if not isinstance(H, int) or H < 1:
        raise ValueError(f"model.gated_deltanet.num_heads must be a positive int, got {H!r}")
    dims = []
    for name, e in (("expand_k", c.expand_k), ("expand_v", c.expand_v)):
        width = e * cfg.d_model
        if e <= 0 or abs(width - round(width)) > 1e-6 or round(width) % H:
            raise ValueError(f"model.gated_deltanet.{name}={e} gives width {width:g} = {name}·d_model "
                             f"({cfg.d_model}), which must be a whole multiple of the {H} heads")
        dims.append(round(width) // H)
    return H, dims[0], dims[1]


@dataclass
class GatedDeltaNetState(MixerState):
    """S [B, H, d_k, d_v]: the state (float32 for half inputs); conv_q, conv_k [B, H·d_k, w − 1]
    and conv_v [B, H·d_v, w − 1]: the short convs' caches (None without
    ``gated_deltanet.conv_width``); pos."""
    S: Optional[torch.Tensor] = None
    conv_q: Optional[torch.Tensor] = None
    conv_k: Optional[torch.Tensor] = None
    conv_v: Optional[torch.Tensor] = None


@register_mixer("gated_deltanet", config=GatedDeltaNetConfig)
class GatedDeltaNet(QKVShortConvs, Mixer):
    official_init = official_hybrid_init = "mamba"   # the official code and its hybrids init as mamba_ssm
    #: the gated delta rule is affine in its state: context parallelism combines chunk summaries
    cp_form = "summary"
    op_name = "gated_delta_rule"
    triton_custom_op = "kernels::gated_delta_rule_fwd"
    #: the state the short convs' stage (``QKVShortConvs``) builds
    conv_state = GatedDeltaNetState

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.gated_deltanet   # ranges checked by GatedDeltaNetConfig (ModelConfig.validate)
        self.d_model = cfg.d_model
        self.n_heads, self.dk, self.dv = head_dims(cfg)
        self.chunk_size = c.chunk_size
        key_dim, value_dim = self.n_heads * self.dk, self.n_heads * self.dv
        self.q_proj = nn.Linear(cfg.d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, value_dim, bias=False)
        self.a_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)    # W_α
        self.b_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)    # W_β
        self.g_proj = nn.Linear(cfg.d_model, value_dim, bias=False)       # W_g, the output gate
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.n_heads))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        w = c.conv_width
        self.build_convs(key_dim, value_dim, w, bias=False)
        self.o_norm = RMSNorm(self.dv, cfg.norm_eps)
        self.o_proj = nn.Linear(value_dim, cfg.d_model, bias=False)
        self.o_proj._is_residual_out = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_log and dt_bias as the official code draws them (module docstring); convs reset to
        PyTorch's default."""
        with torch.no_grad():
            A = torch.empty(self.n_heads, dtype=torch.float64).uniform_(0, A_INIT_MAX)
            self.A_log.copy_(torch.log(A))
            u = torch.rand(self.n_heads, dtype=torch.float64)
            dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_INIT_FLOOR)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))         # softplus⁻¹(Δ₀)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            if conv is not None:
                conv.conv.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads are independent: q, k, v, W_α, W_β and the output gate W_g split by heads
        (columns), the three short convs by channels (= heads), A_log and dt_bias by heads, W_o by
        rows; o_norm (over one head's features) is shared by all heads."""
        convs = ("q_conv.conv", "k_conv.conv", "v_conv.conv") if cfg.gated_deltanet.conv_width > 0 else ()
        return TPPlan(column=("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"), row=("o_proj",),
                      channel_convs=convs, head_params=("A_log", "dt_bias"), shared_modules=("o_norm",),
                      head_counts=("n_heads",))

    # ---- stages ------------------------------------------------------------------------------
    def inputs(self, x: torch.Tensor, state=None, output_state: bool = False, docs=None):
        """q (normalized, scaled by d_k^−1/2), k (normalized), v as [B, H, T, ·], g (log decay)
        and β [B, H, T]: ``gated_delta_rule``'s arguments; the carry is the conv caches. ``docs``
        (packed documents): the convs restart at each document start (the state's conv caches,
        given only by context parallelism's slices, masked as the rest); the op gets the
        documents as ``resets`` (the starts [B, T], for the PyTorch chunked form) and ``cu_seqlens``
        (int32 [N + 1] over the batch flattened to one row, for the Triton kernel)."""
        B, T, _ = x.shape
        st = state if state is not None else GatedDeltaNetState()
        (q, k, v), caches = self.conv_qkv(x, st, docs)
        heads = lambda t, d: t.view(B, T, self.n_heads, d).transpose(1, 2)
        q = l2norm(heads(q, self.dk)) * self.dk ** -0.5
        k = l2norm(heads(k, self.dk))
        v = heads(v, self.dv)
        g = -torch.exp(acc(self.A_log)) * F.softplus(acc(self.a_proj(x)) + acc(self.dt_bias))
        beta = torch.sigmoid(acc(self.b_proj(x)))
        pos0 = 0 if state is None else int(state.pos)
        carry = GatedDeltaNetState(**caches, pos=pos0 + T) if output_state else None
        inp = {"q": q, "k": k, "v": v, "g": g.transpose(1, 2), "beta": beta.transpose(1, 2),
               "chunk_size": self.chunk_size}
        if docs is not None:
            inp["resets"], inp["cu_seqlens"] = docs.starts, docs.cu_seqlens
        return inp, carry

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """The gated delta rule, ``kernels.gated_delta_rule`` (g ≤ 0 and β ∈ (0, 1) hold by
        construction, so their values are not re-checked). With packed documents (``inp["resets"]``
        and ``inp["cu_seqlens"]``): the PyTorch chunked form with the resets inside the scan, or
        the Triton kernel's variable-length path, one launch for the batch flattened to one row
        (``varlen_heads``); either from the zero state, so neither takes an initial state."""
        if inp.get("resets") is not None:
            check_packed_triton("Gated DeltaNet", backend, inp.get("cu_seqlens"), initial_state, output_final_state)
            if backend == Backend.TORCH:
                return gated_delta_rule_chunk_torch(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                                    initial_state, output_final_state, inp["chunk_size"],
                                                    inp["resets"])
            flat = varlen_heads(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
            o, _ = _gdr.gated_delta_rule_triton(*flat, chunk_size=inp["chunk_size"], cu_seqlens=inp["cu_seqlens"])
            return unflatten_heads(o, inp["q"].shape[0]), None
        return _gdr.gated_delta_rule_trusted(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                             initial_state=initial_state, output_final_state=output_final_state,
                                             backend=backend, chunk_size=inp["chunk_size"])

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, H, T, D = y.shape
        y = self.o_norm(y.transpose(1, 2).to(x.dtype)).reshape(B, T, H * D)
        return self.o_proj(y * F.silu(self.g_proj(x)))

    def _run(self, x, state, output_state, backend, docs=None):
        inp, carry = self.inputs(x, state, output_state, docs)
        y, S = self.op(inp, None if state is None else state.S, output_state, backend)
        return self.output(y, x), (replace(carry, S=S) if output_state else None)

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the convs are masked at document starts; the PyTorch chunked form resets
    #: inside its scan, the Triton form runs the kernel's ``cu_seqlens`` path once for the whole
    #: batch (flattened to one row); the reference form runs on the padded view
    handles_docs = True
    varlen_triton_op = "kernels.gated_delta_rule:gated_delta_rule_triton"

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, "reference")

    op_contract = _gdr.CONTRACT

    def contract_args(self):
        return {"d_k": self.dk, "d_v": self.dv}

    def chunked(self, x, state=None, output_state=False, docs=None):
        return self._run(x, state, output_state, self._resolve_backend(x), docs)

    def step(self, x, state):
        return self._run(x, state, True, "reference")

    def init_state(self, batch_size: int, device=None, dtype=None) -> GatedDeltaNetState:
        sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return GatedDeltaNetState(S=torch.zeros(batch_size, self.n_heads, self.dk, self.dv, device=device, dtype=sd),
                                  **self.init_conv_caches(batch_size, device, dtype))

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Chunked form, per token and head (d = d_k, e = d_v, C = chunk), as DeltaNet's: K Kᵀ and
        Q Kᵀ (2·2Cd), the two triangular solves (C(d+e)), W S, Q S and Kᵀ Ṽ (6de), the pseudo-value
        product (2Ce); the decay's elementwise products are left out."""
        H, d, e = head_dims(cfg)
        C = min(cfg.gated_deltanet.chunk_size, max(seq_len, 1))
        return float(H * (4 * C * d + C * (d + e) + 6 * d * e + 2 * C * e))
