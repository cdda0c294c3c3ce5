r"""DeltaNet: a linear transformer whose fast weights are written with the delta rule
(Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers"; chunkwise
training after Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length"; layer layout as in flash-linear-attention's DeltaNet).

Per head, with fast weight W_t ∈ R^{d_v×d_φ}:

    q_t, k_t, v_t = SiLU(Conv(W_q x)_t), SiLU(Conv(W_k x)_t), SiLU(Conv(W_v x)_t)
    β_t = σ(W_β x_t)
    W_t = W_{t−1} + β_t (v_t − W_{t−1} φ(k_t)) φ(k_t)ᵀ
    y_t = W_t φ(q_t)
    o_t = W_o [RMSNorm(y_t^{(h)})]_h

W_{t−1} φ(k_t) is the value currently stored under the key; the write moves it a fraction β_t
of the way to v_t, so (with ‖φ(k)‖ ≤ 1 and β < 1) the fast weights stay bounded, unlike the
purely additive W_t = W_{t−1} + v_t φ(k_t)ᵀ of linear attention.

Feature map φ (``deltanet.feature_map``):

* ``identity``: φ(x) = x / ‖x‖₂, d_φ = d_h.
* ``dpfp``: deterministic parameter-free projection with ν = ``deltanet.dpfp_nu``
  (Schlag et al. 2021, §5.3). With r = ReLU([x, −x]) ∈ R^{2d_h},

      φ_{2d_h(i−1)+j}(x) = r_j · r_{j+i}     (i = 1..ν, j = 1..2d_h, index j+i taken mod 2d_h)
      φ(x) ← φ(x) / max(Σ_j φ_j(x), ε · max_j r_j²)

  so d_φ = 2 d_h ν and the features are non-negative and sum to one. The floor ε · max_j r_j²
  (ε = 1e-6) scales with the input like the sum does (both are quadratic in x), so φ(c x) = φ(x)
  for c > 0 and the features sum to one at any input scale; it only acts when nearly every
  product r_j r_{j+i} vanishes (e.g. ν = 1 with signs alternating along x), and keeps 0/0 out
  (an absolute ε would instead shrink the features of small inputs towards 0). DPFP's ReLU([x, −x]) is
  its own nonlinearity, so with it q and k skip the SiLU (v keeps it).

The short causal depthwise convolution (width ``deltanet.conv_width``, 0 = none) runs on q, k and
v. The state is S = Wᵀ ∈ R^{d_φ×d_v} per head (the layout of ``kernels.delta_rule``) plus the
convolution cache. ``reference`` runs the token-by-token delta rule, ``chunked`` the WY/UT
chunkwise form with ``deltanet.chunk_size`` tokens per chunk.

Packed documents (``docs``): each document runs as if alone, from S = 0 and an empty conv cache.
The conv's taps that would read the previous document are masked; the PyTorch chunked form then
resets S at each document start inside its scan, the Triton form flattens the batch to one row and
runs the kernel's variable-length path (``cu_seqlens``) in one call; the reference form runs on
the padded view (one document per row).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels import delta_rule as _dr
from kernels.delta_rule.torch_chunk import delta_rule_chunk_torch
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import check_packed_triton, doc_conv, unflatten_heads, varlen_heads
from ttt_lm.model.layers import CausalConv1d, RMSNorm
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer


@dataclass
class DeltaNetConfig:
    """``model.deltanet``: DeltaNet fast weights (Schlag et al. 2021; Yang et al. 2024)."""
    feature_map: str = option("identity", choices=("identity", "dpfp"))  # identity (L2-normalized) | dpfp
    dpfp_nu: int = 1
    chunk_size: int = option(64, ge=1)

    def short(self, n: int) -> "DeltaNetConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return replace(self, chunk_size=n)
    conv_width: int = option(4, ge=0)   # short causal conv on q/k/v (0 = none)


def dpfp(x: torch.Tensor, nu: int = 1, eps: float = 1e-6) -> torch.Tensor:
    """DPFP features of x [..., d] → [..., 2·d·ν], non-negative, summing to one; ``eps`` is
    relative to the largest r_j² (see module doc)."""
    r = F.relu(torch.cat([x, -x], dim=-1))
    # roll by +i puts r_{j−i} at position j; rolling by −i gives the r_{j+i} of the formula
    rolled = torch.cat([r.roll(shifts=-i, dims=-1) for i in range(1, nu + 1)], dim=-1)
    phi = torch.cat([r] * nu, dim=-1) * rolled
    floor = eps * r.square().amax(-1, keepdim=True)
    # the smallest normal number only matters for x = 0, where every term is 0
    denom = torch.maximum(phi.sum(-1, keepdim=True), floor).clamp_min(torch.finfo(phi.dtype).tiny)
    return phi / denom


@dataclass
class DeltaNetState(MixerState):
    """S [B, H, d_φ, d_h]: the fast weights (float32 for half inputs); conv [B, 3·H·d_h, w − 1]:
    the short conv's cache of [q | k | v] (None without ``deltanet.conv_width``); pos."""
    S: Optional[torch.Tensor] = None
    conv: Optional[torch.Tensor] = None


@register_mixer("deltanet", config=DeltaNetConfig)
class DeltaNet(Mixer):
    #: the delta rule is affine in its state: context parallelism combines chunk summaries
    cp_form = "summary"
    op_name = "delta_rule"
    triton_custom_op = "kernels::delta_rule_fwd"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.deltanet   # ranges checked by DeltaNetConfig (ModelConfig.validate)
        if c.feature_map == "dpfp" and not 1 <= c.dpfp_nu <= 2 * cfg.hd - 1:
            raise ValueError(f"model.deltanet.dpfp_nu must be in [1, 2·head_dim − 1], got {c.dpfp_nu}")
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.hd = cfg.hd
        self.feature_map = c.feature_map
        self.nu = c.dpfp_nu
        self.chunk_size = c.chunk_size
        self.d_phi = self.hd if c.feature_map == "identity" else 2 * self.hd * self.nu
        inner = self.n_heads * self.hd
        self.q_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.b_proj = nn.Linear(cfg.d_model, self.n_heads, bias=False)   # W_β
        # one depthwise conv over [q, k, v] channels is the same as three separate ones
        self.conv = CausalConv1d(3 * inner, c.conv_width, bias=False) if c.conv_width > 0 else None
        self.o_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)
        self.o_proj._is_residual_out = True

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Heads are independent (flash-linear-attention's DeltaNet splits like attention): q, k, v
        and W_β by heads (columns), the short conv per channel (its [q | k | v] channels fused:
        each part split by heads), o_proj by rows; o_norm (over one head's features) is shared
        by all heads."""
        conv = ("conv.conv",) if cfg.deltanet.conv_width > 0 else ()
        return TPPlan(column=("q_proj", "k_proj", "v_proj", "b_proj"), row=("o_proj",), channel_convs=conv,
                      shared_modules=("o_norm",), fused=tuple((n, 3) for n in conv), head_counts=("n_heads",))

    # ---- pieces ------------------------------------------------------------------------------
    def _phi(self, x: torch.Tensor) -> torch.Tensor:
        if self.feature_map == "identity":
            return F.normalize(F.silu(x), p=2.0, dim=-1, eps=1e-6)
        return dpfp(x, self.nu)

    # ---- stages ------------------------------------------------------------------------------
    @property
    def cp_halo(self) -> int:
        return 0 if self.conv is None else self.conv.width - 1

    def context_state(self, x_before, valid, start: int) -> DeltaNetState:
        if self.conv is None:
            return DeltaNetState(pos=start)
        qkv = torch.cat([self.q_proj(x_before), self.k_proj(x_before), self.v_proj(x_before)], -1)
        return DeltaNetState(conv=self.conv.cache_from(qkv, valid), pos=start)

    def inputs(self, x: torch.Tensor, state=None, output_state: bool = False, docs=None):
        """φ(q), φ(k), v as [B, H, T, ·] and β [B, H, T] (``delta_rule``'s arguments); the carry is
        the conv cache. ``docs`` (packed documents): the conv restarts at each document start (the
        state's conv cache, given only by context parallelism's slices, masked as the rest); the op gets the documents as ``resets`` (the starts [B, T], for the PyTorch chunked
        form) and ``cu_seqlens`` (int32 [N + 1] over the batch flattened to one row, for the Triton
        kernel)."""
        B, T, _ = x.shape
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        cache = None
        if self.conv is not None and docs is not None:
            qkv = doc_conv(self.conv, qkv, docs, None if state is None else state.conv)
        elif self.conv is not None:
            qkv, cache = self.conv(qkv, None if state is None else state.conv, output_cache=True)
        q, k, v = (t.view(B, T, self.n_heads, self.hd).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        beta = torch.sigmoid(self.b_proj(x)).transpose(1, 2)
        pos0 = 0 if state is None else int(state.pos)
        carry = DeltaNetState(conv=cache, pos=pos0 + T) if output_state else None
        inp = {"q": self._phi(q), "k": self._phi(k), "v": F.silu(v), "beta": beta, "chunk_size": self.chunk_size}
        if docs is not None:
            inp["resets"], inp["cu_seqlens"] = docs.starts, docs.cu_seqlens
        return inp, carry

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """The delta rule, ``kernels.delta_rule``. With packed documents (``inp["resets"]`` and
        ``inp["cu_seqlens"]``): the PyTorch chunked form with the resets inside the scan, or the
        Triton kernel's variable-length path, one launch for the batch flattened to one row
        (``varlen_heads``); either from the zero state, so neither takes an initial state."""
        if inp.get("resets") is not None:
            check_packed_triton("DeltaNet", backend, inp.get("cu_seqlens"), initial_state, output_final_state)
            if backend == Backend.TORCH:
                return delta_rule_chunk_torch(inp["q"], inp["k"], inp["v"], inp["beta"], initial_state,
                                              output_final_state, inp["chunk_size"], inp["resets"])
            flat = varlen_heads(inp["q"], inp["k"], inp["v"], inp["beta"])
            o, _ = _dr.delta_rule_triton(*flat, chunk_size=inp["chunk_size"], cu_seqlens=inp["cu_seqlens"])
            return unflatten_heads(o, inp["q"].shape[0]), None
        return _dr.delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], initial_state=initial_state,
                              output_final_state=output_final_state, backend=backend, chunk_size=inp["chunk_size"])

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, H, T, D = y.shape
        y = self.o_norm(y.to(x.dtype)).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(y)

    def _run(self, x, state, output_state, backend, docs=None):
        inp, carry = self.inputs(x, state, output_state, docs)
        y, S = self.op(inp, None if state is None else state.S, output_state, backend)
        return self.output(y, x), (replace(carry, S=S) if output_state else None)

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the conv is masked at document starts; the PyTorch chunked form resets
    #: inside its scan (``reset_masks``), the Triton form runs the kernel's ``cu_seqlens`` path once
    #: for the whole batch (flattened to one row); the reference form runs on the padded view
    handles_docs = True
    varlen_triton_op = "kernels.delta_rule:delta_rule_triton"

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, "reference")

    op_contract = _dr.CONTRACT

    def contract_args(self):
        return {"d_k": self.d_phi, "d_v": self.hd}

    def chunked(self, x, state=None, output_state=False, docs=None):
        return self._run(x, state, output_state, self._resolve_backend(x), docs)

    def step(self, x, state):
        return self._run(x, state, True, "reference")

    def init_state(self, batch_size: int, device=None, dtype=None) -> DeltaNetState:
        sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return DeltaNetState(S=torch.zeros(batch_size, self.n_heads, self.d_phi, self.hd, device=device, dtype=sd),
                             conv=None if self.conv is None else self.conv.init_cache(batch_size, device, dtype))

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """Chunked form, per token and head (d = d_φ, e = d_v, C = chunk): K Kᵀ and Q Kᵀ (2·2Cd),
        the two triangular solves (C(d+e)), W S (2de), Q S (2de), the pseudo-value product
        (2Ce) and the state update Kᵀ Ṽ (2de)."""
        c = cfg.deltanet
        e = cfg.hd
        d = e if c.feature_map == "identity" else 2 * e * c.dpfp_nu
        C = min(c.chunk_size, max(seq_len, 1))
        return float(cfg.n_heads * (4 * C * d + C * (d + e) + 6 * d * e + 2 * C * e))
