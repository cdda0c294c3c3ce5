r"""Mamba block: a selective state-space model (Gu & Dao 2023, "Mamba: Linear-Time Sequence
Modeling with Selective State Spaces", §3 and Fig. 3).

With d_inner = expand·d_model, state size N = d_state and R = dt_rank:

    [x, z]        = W_in u_t                                  x, z ∈ R^{d_inner}
    x             = SiLU(Conv1D_{d_conv}(x))                  causal, depthwise
    [δ, B_t, C_t] = W_x x                                     δ ∈ R^R, B_t, C_t ∈ R^N
    Δ_t           = softplus(W_Δ δ + b_Δ)                     ∈ R^{d_inner}
    A             = −exp(A_log)                               ∈ R^{d_inner×N}
    h_t           = exp(Δ_t A) ⊙ h_{t−1} + (Δ_t ⊙ x_t) B_t^T   Ā = exp(ΔA), B̄x ≈ ΔBx
    y_t           = h_t C_t + D ⊙ x_t
    out_t         = W_out (y_t ⊙ SiLU(z_t))

Initialization as the paper's code: A_log = log(1..N) on every channel (S4D-real), D = 1,
b_Δ = softplus⁻¹(Δ₀) with Δ₀ ~ logU[dt_min, dt_max] (floored at 1e-4), W_Δ ~ U(±R^{−1/2}),
the convolution at PyTorch's default. W_in, W_x, W_out follow ``model.init``: with ``mamba``
(the Mamba presets) mamba_ssm's MambaLMHeadModel ``_init_weights``: PyTorch's kaiming-uniform
for W_in and W_x, and for W_out divided by √(n_residuals_per_layer · n_layers).

Forms: ``reference`` runs the scan token by token, ``chunked`` the chunked scan
(kernels.selective_scan; Triton on CUDA when present), ``step`` one token with the cache
{conv: last d_conv−1 inputs of the convolution, ssm: h_{t−1} ∈ R^{d_inner×N}}.

Packed documents (``docs``): each document runs as if alone, from h = 0 and an empty conv cache.
The conv's taps that would read the previous document are masked; the PyTorch chunked scan then
sets Ā_t = 0 at each document start, the Triton form flattens the batch to one row and runs the
kernel's variable-length path (``cu_seqlens``) in one call; the reference form runs on the padded
view (one document per row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import kernels.selective_scan as _ss
from kernels.selective_scan import selective_scan
from kernels.selective_scan.torch_chunk import selective_scan_chunk
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import check_packed_triton, doc_conv
from ttt_lm.model.layers import CausalConv1d, acc
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer


@dataclass
class MambaConfig:
    """``model.mamba``: Mamba selective SSM (Gu & Dao 2023)."""
    d_state: int = option(16, ge=1)
    d_conv: int = option(4, ge=1)
    expand: int = option(2, ge=1)
    dt_rank: Optional[int] = option(None, ge=1)  # None = ceil(d_model / 16)
    dt_min: float = 0.001
    dt_max: float = 0.1
    # tokens per chunk: the PyTorch form's vectorized unit, the Triton kernel's tile (at most 16)
    chunk_size: int = option(16, ge=1)

    def short(self, n: int) -> "MambaConfig":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``)."""
        return replace(self, chunk_size=n)

    def validate(self, model) -> None:
        if not 0.0 < self.dt_min <= self.dt_max:
            raise ValueError(f"model.mamba needs 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")

_DT_INIT_FLOOR = 1e-4


@dataclass
class MambaState(MixerState):
    """conv [B, d_inner, d_conv − 1]: the causal conv's cache; ssm [B, d_inner, d_state]: the
    scan's h (the accumulation dtype: float32 for half inputs); pos."""
    conv: Optional[torch.Tensor] = None
    ssm: Optional[torch.Tensor] = None


@register_mixer("mamba", config=MambaConfig)
class Mamba(Mixer):
    official_init = "mamba"        # mamba_ssm's _init_weights
    #: a diagonal linear recurrence: context parallelism combines the scan's chunk summaries
    cp_form = "summary"
    op_name = "selective_scan"
    triton_custom_op = "kernels::selective_scan_fwd"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        mc = cfg.mamba
        self.d_model = cfg.d_model
        self.d_inner = mc.expand * cfg.d_model
        self.d_state = mc.d_state
        self.dt_rank = mc.dt_rank or math.ceil(cfg.d_model / 16)
        self.dt_min, self.dt_max = mc.dt_min, mc.dt_max
        self.chunk_size = mc.chunk_size
        self.in_proj = nn.Linear(cfg.d_model, 2 * self.d_inner, bias=False)
        self.conv1d = CausalConv1d(self.d_inner, mc.d_conv)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * self.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, cfg.d_model, bias=False)
        self.out_proj._is_residual_out = True
        self.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Megatron's Mamba split: d_inner by channels. W_in by columns (its [x | z] outputs fused:
        each half split), the conv by channels, A_log and D by channels, W_out by rows. W_x reads
        the split x but produces δ, B, C for every channel: row-parallel with its sum all-reduced
        and kept in the TP region (``row_to_heads``); W_Δ then column-parallel (with b_Δ)."""
        return TPPlan(column=("in_proj", "dt_proj"), row=("out_proj",), row_to_heads=("x_proj",),
                      channel_convs=("conv1d.conv",), head_params=("A_log", "D"), fused=(("in_proj", 2),),
                      head_counts=("d_inner",))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.uniform_(self.dt_proj.weight, -self.dt_rank ** -0.5, self.dt_rank ** -0.5)
            u = torch.rand(self.d_inner, dtype=torch.float64)
            dt0 = torch.exp(u * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
            dt0 = dt0.clamp(min=_DT_INIT_FLOOR)
            self.dt_proj.bias.copy_(dt0 + torch.log(-torch.expm1(-dt0)))    # softplus⁻¹(Δ₀)
            n = torch.arange(1, self.d_state + 1, dtype=torch.float64)
            self.A_log.copy_(torch.log(n).expand(self.d_inner, -1))
            self.D.fill_(1.0)
        self.conv1d.conv.reset_parameters()

    def init_state(self, batch_size: int, device=None, dtype=None) -> MambaState:
        dt = acc(torch.empty(0, dtype=dtype or torch.get_default_dtype())).dtype
        return MambaState(conv=self.conv1d.init_cache(batch_size, device, dtype),
                          ssm=torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=dt))

    # ---- stages ------------------------------------------------------------------------------
    @property
    def cp_halo(self) -> int:
        return self.conv1d.width - 1

    def context_state(self, u_before, valid, start: int) -> MambaState:
        return MambaState(conv=self.conv1d.cache_from(self.in_proj(u_before)[..., :self.d_inner], valid), pos=start)

    def inputs(self, u: torch.Tensor, state=None, output_state: bool = False, docs=None):
        """u → ``selective_scan``'s arguments: x, z, δ = W_Δ·(W_x x)_δ without bias (b_Δ enters
        inside the scan, before softplus), B_t, C_t, A = −exp(A_log), D; the carry is the conv
        cache. ``docs`` (packed documents): the conv restarts at each document start (the state's
        conv cache, given only by context parallelism's slices, masked as the rest); the
        scan gets the documents as ``resets`` (the starts [B, T], for the PyTorch chunked form) and
        ``cu_seqlens`` (int32 [N + 1] over the batch flattened to one row, for the Triton kernel)."""
        x, z = self.in_proj(u).chunk(2, dim=-1)
        if docs is not None:
            x, conv_cache = doc_conv(self.conv1d, x, docs, None if state is None else state.conv), None
        else:
            x, conv_cache = self.conv1d(x, None if state is None else state.conv, output_state)
        x = F.silu(x)
        dbc = self.x_proj(x)
        delta, B_t, C_t = dbc.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.linear(delta, self.dt_proj.weight)
        A = -torch.exp(acc(self.A_log))
        inp = dict(x=x, delta=delta, A=A, B=B_t, C=C_t, D=self.D, z=z, delta_bias=self.dt_proj.bias,
                   delta_softplus=True, chunk_size=self.chunk_size)
        if docs is not None:
            inp["resets"], inp["cu_seqlens"] = docs.starts, docs.cu_seqlens
        pos0 = 0 if state is None else int(state.pos)
        return inp, (MambaState(conv=conv_cache, pos=pos0 + u.shape[1]) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """The selective scan, ``kernels.selective_scan``. With packed documents (``inp["resets"]``
        and ``inp["cu_seqlens"]``): the PyTorch chunked form with Ā_t = 0 at each start, or the
        Triton kernel's variable-length path, one launch for the batch flattened to one row
        ([B, T, ·] → [1, B·T, ·]); the latter from the zero state only (no initial or final state)."""
        if inp.get("resets") is not None:
            inp = dict(inp)
            cu = inp.pop("cu_seqlens", None)
            check_packed_triton("Mamba", backend, cu, initial_state, output_final_state)
            if backend == Backend.TORCH:
                return selective_scan_chunk(**inp, initial_state=initial_state, output_final_state=output_final_state)
            Bt, T = inp.pop("resets").shape
            for n in ("x", "delta", "B", "C", "z"):
                inp[n] = inp[n].reshape(1, Bt * T, inp[n].shape[-1])
            y, _ = selective_scan(**inp, backend=backend, cu_seqlens=cu)
            return y.view(Bt, T, y.shape[-1]), None
        return selective_scan(**inp, initial_state=initial_state, output_final_state=output_final_state,
                              backend=backend)

    def output(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y)

    def _scan(self, u, state, output_state, backend, docs=None):
        inp, carry = self.inputs(u, state, output_state, docs)
        y, hT = self.op(inp, None if state is None else state.ssm, output_state, backend)
        return self.output(y, u), (replace(carry, ssm=hT) if output_state else None)

    #: packed documents: the conv is masked at document starts; the PyTorch chunked scan resets
    #: inside (Ā_t = 0 at a start), the Triton form runs the kernel's ``cu_seqlens`` path once for
    #: the whole batch (flattened to one row); the reference form runs on the padded view
    handles_docs = True
    varlen_triton_op = "kernels.selective_scan.chunk:selective_scan_triton"

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._scan(x, state, output_state, "reference")

    op_contract = _ss.CONTRACT

    def contract_args(self):
        return {"d_inner": self.d_inner, "d_state": self.d_state}

    def chunked(self, x, state=None, output_state=False, docs=None):
        return self._scan(x, state, output_state, self._resolve_backend(x), docs)

    def step(self, u, state):
        inp, carry = self.inputs(u, state, True)
        x, z, delta, B_t, C_t = (acc(inp[n][:, 0]) for n in ("x", "z", "delta", "B", "C"))
        Delta = F.softplus(delta + acc(self.dt_proj.bias))                     # [B, d_inner]
        A = inp["A"]
        h = torch.exp(Delta[..., None] * A) * state.ssm + (Delta * x)[..., None] * B_t[:, None, :]
        y = torch.einsum("bdn,bn->bd", h, C_t) + acc(self.D) * x
        y = (y * F.silu(z)).to(u.dtype)
        return self.output(y[:, None], u), replace(carry, ssm=h)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        # The scan per (channel, state): Δ·A and exp(ΔA), (Δx)·B, Ā·h, + ΔBx, C·h multiply-add =
        # 7 per (d, n). ttt_lm.model.flops already counts the 2-D A_log [d_inner, N] as a matrix
        # (2 per (d, n)), which stands for Δ·A and exp(ΔA); the remaining 5 are counted here.
        # Per-channel elementwise work (softplus, D skip, SiLU gate) is left out by convention.
        d_inner = cfg.mamba.expand * cfg.d_model
        return 5.0 * d_inner * cfg.mamba.d_state
