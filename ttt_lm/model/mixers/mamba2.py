r"""Mamba-2 block: the state-space dual (SSD) layer (Dao & Gu 2024, "Transformers are SSMs:
Generalized Models and Efficient Algorithms Through Structured State Space Duality", arXiv
2405.21060, §7 and Fig. 6), laid out as mamba_ssm's ``Mamba2`` module so that its checkpoints'
tensors map onto this one name for name and shape for shape.

With d_inner = expand·d_model, d_ssm ≤ d_inner channels of SSM (the rest, d_mlp = d_inner − d_ssm,
a gated MLP branch; d_ssm = d_inner by default), h = d_ssm / headdim heads of p = headdim channels,
g = ngroups groups of B and C (head i reads group i // (h / g)) and state size n = d_state:

    [z₀, x₀, z, xBC, dt] = W_in u_t                     one in_proj: [d_mlp | d_mlp | d_ssm | conv_dim | h]
    [x, B, C]            = SiLU(Conv1D_{d_conv}(xBC))    causal, depthwise over conv_dim = d_ssm + 2gn
    Δ_t                  = softplus(dt_t + dt_bias)      ∈ R^h (clamped to dt_limit when set)
    A                    = −exp(A_log)                   ∈ R^h: one scalar decay rate per head
    S_t                  = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ      S ∈ R^{p×n} per head
    y_t                  = S_t C_t + D ∘ x_t             D per head (or per channel, D_has_hdim)
    y_t                  ← RMSNorm_g(y_t ∘ SiLU(z_t)) ∘ w   gated RMSNorm over groups of d_ssm / g, ε 1e-5
    out_t                = W_out [SiLU(z₀) ∘ x₀ | y_t]

``kernels.ssd`` runs the scan (mamba_ssm's ``mamba_chunk_scan_combined`` layout). Forms:
``reference`` the op's token-by-token reference, ``chunked`` its chunked (SSD) form (the
resolver picks the backend: the op's Triton kernels, ``kernels::ssd_fwd``, on CUDA; PyTorch
elsewhere), ``step`` one token from the cache {conv [B, conv_dim, d_conv]: the last d_conv
inputs of the conv, as mamba_ssm's ``conv_state``; ssm [B, h, p, n]: S}.

Init (mamba_ssm's ``Mamba2.__init__``): A ~ U(A_init_range) = U(1, 16) per head, A_log = log A;
Δ₀ log-uniform in [dt_min, dt_max] = [1e-3, 1e-1] floored at dt_init_floor = 1e-4, dt_bias =
softplus⁻¹(Δ₀); D = 1; the norm's gain 1; the conv at PyTorch's default. in_proj and out_proj
follow ``model.init`` (``mamba``: mamba_ssm's ``_init_weights``, out_proj divided by
√(n_residuals · n_layers)).

Where mamba_ssm's code and the paper's text differ, this file follows the code:

* Discretization: the paper writes A_t = exp(Δ_t A) and B̄ by zero-order hold in its Mamba-1
  background; the code's input term is Δ_t x_t B_tᵀ (B not discretized), as here.
* The gate: the paper's block normalizes y and multiplies by SiLU(z); the code's default
  (``rmsnorm=True, norm_before_gate=False``) gates first and normalizes the product, per group of
  d_ssm / ngroups channels, as here. ``rmsnorm=False`` gates after D inside the op, y ∘ SiLU(z),
  with no norm; ``norm_before_gate=True`` normalizes first, RMSNorm(y) ∘ SiLU(z).
* D is one scalar per head in the paper; the code allows one per channel (``D_has_hdim``).
* ``dt_limit``: mamba_ssm clamps Δ in its chunked kernels but not in ``step``; here every form
  clamps, so that decoding equals the forward.
* The paper's block has no MLP branch; the code's ``d_ssm`` < d_inner splits one off in_proj
  ([z₀ | x₀], SiLU(z₀) ∘ x₀ concatenated before out_proj), as here (tensor parallelism then refuses
  the layer: out_proj's input is not split by heads).

Packed documents (``docs``): each document runs as if alone, from S = 0 and an empty conv cache.
The conv's taps that would read the previous document are masked (``masked_conv``), and the op runs
on the batch flattened to one row with the documents' ``cu_seqlens`` (its backends restart the scan
inside, one call per layer). The op's PyTorch form plans the sequences on the host (``cu_seqlens``
from the layout's host lengths) but sizes a per-token index from lengths on the device, a read
back off the CPU; there the chunked form runs on the padded view instead (one document per row,
one call), as the reference form does everywhere.

Context parallelism: S is affine in its initial state (a scalar transition exp(Σ_t Δ_t A) per head
on each rank's slice), so the ranks combine chunk summaries (``cp_form = "summary"``, op ``ssd``);
the conv's halo is d_conv − 1 tokens. Tensor parallelism splits heads and groups (ngroups must be
divisible by the TP size): in_proj by columns part by part, the conv by channels part by part,
A_log, dt_bias, D and the norm's gain by heads, out_proj by rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import kernels.ssd as _ssd
from kernels.ssd.reference import ssd_reference
from kernels.ssd.torch_chunk import ssd_chunk_torch
from ttt_lm.model.backend import Backend
from ttt_lm.model.docs import masked_conv
from ttt_lm.model.layers import acc
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer


@dataclass
class Mamba2Config:
    """``model.mamba2``: Mamba-2 (Dao & Gu 2024); fields and defaults of mamba_ssm's ``Mamba2``."""
    d_state: int = option(128, ge=1)
    d_conv: int = option(4, ge=1)
    expand: int = option(2, ge=1)
    # channels per head; None: mamba_ssm's 64, or d_ssm where that is narrower (the tests' tiny models)
    headdim: Optional[int] = option(None, ge=1)
    ngroups: int = option(1, ge=1)
    d_ssm: Optional[int] = option(None, ge=1)   # channels of SSM (None = d_inner); the rest a gated MLP
    # tokens per chunk of the chunked (SSD) form: a power of two (the op's kernels tile by it)
    chunk_size: int = option(256, ge=1)
    A_init_range: List[float] = field(default_factory=lambda: [1.0, 16.0])
    dt_min: float = option(0.001, gt=0)
    dt_max: float = option(0.1, gt=0)
    dt_init_floor: float = option(1e-4, ge=0)
    dt_limit: List[float] = field(default_factory=lambda: [0.0, math.inf])   # Δ clamped to it
    D_has_hdim: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    bias: bool = False        # in_proj and out_proj biases
    conv_bias: bool = True

    def short(self, n: int) -> "Mamba2Config":
        """This section for short sequences of a few chunks of ``n`` tokens (the synthetic tasks' tiny
        models, ``ttt_lm.eval.synthetic.build_tiny_lm``): chunks of the power of two at or above n."""
        return replace(self, chunk_size=1 << max(int(n) - 1, 0).bit_length())

    def tiny(self, n: int) -> "Mamba2Config":
        """This section for the tests' tiny models (d_model 16): ``short(n)`` with heads of 8
        channels, a state of 8 and 2 groups (so that a 2-way tensor-parallel split has a group
        per rank)."""
        return replace(self.short(n), headdim=8, d_state=8, ngroups=2)

    def validate(self, model) -> None:
        if "mamba2" in model.layer_pattern:   # the widths are checked where the kind is used
            self._validate_widths(model)
        c = self.chunk_size
        if c & (c - 1):
            raise ValueError(f"model.mamba2.chunk_size={c} must be a power of two (the SSD kernels tile by it)")
        r = list(self.A_init_range)
        if len(r) != 2 or not 0 < r[0] <= r[1]:
            raise ValueError(f"model.mamba2.A_init_range={r} must be [lo, hi] with 0 < lo <= hi")
        if not self.dt_min <= self.dt_max:
            raise ValueError(f"model.mamba2.dt_min={self.dt_min} must be <= model.mamba2.dt_max={self.dt_max}")
        lim = list(self.dt_limit)
        if len(lim) != 2 or not 0 <= lim[0] < lim[1]:
            raise ValueError(f"model.mamba2.dt_limit={lim} must be [lo, hi] with 0 <= lo < hi")

    def _validate_widths(self, model) -> None:
        d_inner = self.expand * model.d_model
        d_ssm = d_inner if self.d_ssm is None else self.d_ssm
        if d_ssm > d_inner:
            raise ValueError(f"model.mamba2.d_ssm={self.d_ssm} is more than d_inner = expand·d_model = {d_inner}")
        p = head_width(self, d_ssm)
        if d_ssm % p:
            raise ValueError(f"model.mamba2.headdim={self.headdim} must divide the SSM width d_ssm = {d_ssm} "
                             f"({'expand·d_model' if self.d_ssm is None else 'model.mamba2.d_ssm'})")
        nheads = d_ssm // p
        if nheads % self.ngroups:
            raise ValueError(f"model.mamba2.ngroups={self.ngroups} must divide the number of heads "
                             f"d_ssm / headdim = {nheads}")


#: mamba_ssm's ``headdim``
DEFAULT_HEADDIM = 64


def head_width(c: Mamba2Config, d_ssm: int) -> int:
    """The channels per head p: ``headdim``, or when unset mamba_ssm's 64 (d_ssm if narrower)."""
    return min(DEFAULT_HEADDIM, d_ssm) if c.headdim is None else c.headdim


def dims(cfg):
    """(d_inner, d_ssm, nheads, conv_dim, headdim) of ``cfg.mamba2`` for the ModelConfig ``cfg``."""
    c = cfg.mamba2
    d_inner = c.expand * cfg.d_model
    d_ssm = d_inner if c.d_ssm is None else c.d_ssm
    p = head_width(c, d_ssm)
    return d_inner, d_ssm, d_ssm // p, d_ssm + 2 * c.ngroups * c.d_state, p


class GatedRMSNorm(nn.Module):
    """mamba_ssm's ``RMSNormGated`` (``layernorm_gated.rms_norm_ref``): with z, y ∘ SiLU(z) then an
    RMSNorm over each group of ``group_size`` channels (``norm_before_gate=False``), or the norm
    first and the gate after (``True``); gain ``weight`` [d]; computed in float32 for half inputs."""

    def __init__(self, d: int, group_size: int, eps: float = 1e-5, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = y.dtype
        yf = acc(y)
        if z is not None and not self.norm_before_gate:
            yf = yf * F.silu(acc(z))
        grp = yf.unflatten(-1, (-1, self.group_size))
        out = (grp * torch.rsqrt(grp.square().mean(-1, keepdim=True) + self.eps)).flatten(-2) * acc(self.weight)
        if z is not None and self.norm_before_gate:
            out = out * F.silu(acc(z))
        return out.to(dtype)


@dataclass
class Mamba2State(MixerState):
    """conv [B, conv_dim, d_conv]: the last d_conv inputs of the conv over [x | B | C] (mamba_ssm's
    ``conv_state``; the oldest column is the one the next token's conv no longer reads); ssm
    [B, h, headdim, d_state]: S (mamba_ssm's ``ssm_state``; the accumulation dtype: float32 for
    half inputs); pos."""
    conv: Optional[torch.Tensor] = None
    ssm: Optional[torch.Tensor] = None


#: the keyword arguments of ``kernels.ssd.ssd`` that ``inputs`` puts into the op's inputs
_SSD_ARGS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "chunk_size")


@register_mixer("mamba2", config=Mamba2Config)
class Mamba2(Mixer):
    official_init = official_hybrid_init = "mamba"   # mamba_ssm's _init_weights, its hybrids too
    #: the state is affine in its initial value (a scalar decay per head): chunk summaries combine
    cp_form = "summary"
    op_name = "ssd"
    triton_custom_op = "kernels::ssd_fwd"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        c = cfg.mamba2
        self.d_model = cfg.d_model
        self.d_inner, self.d_ssm, self.nheads, self.conv_dim, self.headdim = dims(cfg)
        self.d_mlp = self.d_inner - self.d_ssm
        self.d_state, self.ngroups, self.d_conv = c.d_state, c.ngroups, c.d_conv
        self.chunk_size = c.chunk_size
        self.A_init_range, self.dt_limit = tuple(c.A_init_range), tuple(float(v) for v in c.dt_limit)
        self.dt_min, self.dt_max, self.dt_init_floor = c.dt_min, c.dt_max, c.dt_init_floor
        self.D_has_hdim, self.rmsnorm = c.D_has_hdim, c.rmsnorm
        # order [z0 | x0 | z | x | B | C | dt], as mamba_ssm's in_proj
        self.in_proj = nn.Linear(cfg.d_model, 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads,
                                 bias=c.bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.d_conv, groups=self.conv_dim, bias=c.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.d_ssm if self.D_has_hdim else self.nheads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.norm = (GatedRMSNorm(self.d_ssm, self.d_ssm // self.ngroups, 1e-5, c.norm_before_gate)
                     if self.rmsnorm else None)
        self.out_proj = nn.Linear(self.d_inner, cfg.d_model, bias=c.bias)
        self.out_proj._is_residual_out = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_log, dt_bias, D, the norm's gain and the conv as mamba_ssm's ``Mamba2.__init__``."""
        with torch.no_grad():
            A = torch.empty(self.nheads, dtype=torch.float64).uniform_(*self.A_init_range)
            self.A_log.copy_(torch.log(A))
            u = torch.rand(self.nheads, dtype=torch.float64)
            dt = torch.exp(u * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
            dt = dt.clamp(min=self.dt_init_floor)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))            # softplus⁻¹(Δ₀)
            self.D.fill_(1.0)
            if self.norm is not None:
                self.norm.weight.fill_(1.0)
        self.conv1d.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> Optional[TPPlan]:
        """Megatron's and mamba_ssm's split: heads and groups by ranks. in_proj by columns, each of
        its parts [z | x | B | C | dt] split by ranks (``fused`` with the parts' sizes); the conv by
        channels, each of [x | B | C] split; A_log, dt_bias, D and the norm's gain by heads (a norm
        group lies within one rank's heads when the TP size divides ngroups); out_proj by rows.
        None (no tensor parallelism) with an MLP branch (d_ssm < d_inner): out_proj's input
        [SiLU(z₀) x₀ | y] would need a split part by part on a row-parallel layer."""
        d_inner, d_ssm, h, _, _ = dims(cfg)
        if d_ssm != d_inner:
            return None
        gn = cfg.mamba2.ngroups * cfg.mamba2.d_state
        params = ("A_log", "dt_bias", "D") + (("norm.weight",) if cfg.mamba2.rmsnorm else ())
        return TPPlan(column=("in_proj",), row=("out_proj",), channel_convs=("conv1d",), head_params=params,
                      fused=(("in_proj", (d_ssm, d_ssm, gn, gn, h)), ("conv1d", (d_ssm, gn, gn))),
                      head_counts=("d_inner", "d_ssm", "nheads", "ngroups", "conv_dim"))

    def init_state(self, batch_size: int, device=None, dtype=None) -> Mamba2State:
        sd = acc(torch.empty(0, dtype=dtype or torch.get_default_dtype())).dtype
        return Mamba2State(
            conv=torch.zeros(batch_size, self.conv_dim, self.d_conv, device=device, dtype=dtype),
            ssm=torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=sd))

    # ---- stages ------------------------------------------------------------------------------
    @property
    def cp_halo(self) -> int:
        return self.d_conv - 1

    def _split(self, zxbcdt: torch.Tensor):
        return zxbcdt.split([self.d_mlp, self.d_mlp, self.d_ssm, self.conv_dim, self.nheads], dim=-1)

    def context_state(self, u_before, valid, start: int) -> Mamba2State:
        xBC = self._split(self.in_proj(u_before))[3] * valid[None, :, None].to(u_before.dtype)
        conv = torch.cat([xBC.new_zeros(xBC.shape[0], 1, xBC.shape[2]), xBC], 1).transpose(1, 2)
        return Mamba2State(conv=conv, pos=start)

    def _conv(self, xBC: torch.Tensor, cache: Optional[torch.Tensor], output_state: bool, docs=None):
        """The causal depthwise conv over xBC [B, T, conv_dim] from the cache [B, conv_dim, d_conv]
        (its last d_conv − 1 columns are the history; None: zeros). Returns (conv output, the new
        cache or None). ``docs``: the taps into an earlier document masked (``masked_conv``)."""
        w = self.d_conv
        hist = None if cache is None else cache[..., 1:]
        if docs is not None:
            return masked_conv(self.conv1d, xBC, docs.offset, hist), None
        xt = xBC.transpose(1, 2)
        full = torch.cat([xt.new_zeros(xt.shape[0], xt.shape[1], w) if cache is None else cache.to(xt.dtype), xt], -1)
        y = F.conv1d(full[..., 1:], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim).transpose(1, 2)
        return y, (full[..., full.shape[-1] - w:] if output_state else None)

    def _delta_args(self, dt: torch.Tensor) -> dict:
        """Δ as the op takes it: softplus(dt + dt_bias) inside the op, or here with dt_limit's clamp."""
        if self.dt_limit == (0.0, math.inf):
            return {"dt": dt, "dt_bias": self.dt_bias, "dt_softplus": True}
        delta = F.softplus(acc(dt) + acc(self.dt_bias)).clamp(*self.dt_limit)
        return {"dt": delta, "dt_bias": None, "dt_softplus": False}

    def inputs(self, u: torch.Tensor, state=None, output_state: bool = False, docs=None):
        """u → ``kernels.ssd.ssd``'s arguments (x [B, T, h, p], dt [B, T, h], A = −exp(A_log), B, C
        [B, T, g, n], D, z for the op's gate when there is no norm, dt_bias, softplus, chunk_size)
        and what ``op`` applies after the scan (``norm_z``: the norm's gate z; ``mlp``: [z₀, x₀]);
        the carry is the conv cache. ``docs`` (packed documents): the conv restarts at each
        document start (the state's cache, given only by context parallelism's slices, masked as
        the rest) and ``cu_seqlens`` (over the batch flattened to one row) goes to the op."""
        Bt, T, _ = u.shape
        z0, x0, z, xBC, dt = self._split(self.in_proj(u))
        xBC, conv_cache = self._conv(xBC, None if state is None else state.conv, output_state, docs)
        xBC = F.silu(xBC)
        x, B, C = xBC.split([self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        heads = lambda t: t.unflatten(-1, (self.nheads, self.headdim))
        inp = dict(x=heads(x), A=-torch.exp(acc(self.A_log)),
                   B=B.unflatten(-1, (self.ngroups, self.d_state)), C=C.unflatten(-1, (self.ngroups, self.d_state)),
                   D=self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D,
                   z=None if self.rmsnorm else heads(z), chunk_size=self.chunk_size, **self._delta_args(dt),
                   norm_z=z if self.rmsnorm else None, mlp=(z0, x0) if self.d_mlp else None)
        if docs is not None:
            # on the device for a kernel; on the host for the PyTorch forms, which plan the pieces
            # there (built from the layout's host lengths: no read back from the device)
            inp["cu_seqlens"], inp["host_cu_seqlens"] = docs.cu_seqlens, docs.host_cu_seqlens
        pos0 = 0 if state is None else int(state.pos)
        return inp, (Mamba2State(conv=conv_cache, pos=pos0 + T) if output_state else None)

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """The SSD scan (``kernels.ssd``) and the per-token work after it that stays within a
        head's group (the gated norm, the MLP branch): returns (y [B, T, d_inner], the final state).
        With ``inp["cu_seqlens"]`` (packed documents) the op runs once on the batch flattened to one
        row ([B, T, ·] → [1, B·T, ·]), and ``initial_state`` / the final state are then per
        document of ``cu_seqlens`` ([N, h, p, n], N documents; context parallelism routes its rows'
        states to them). The PyTorch, reference and Triton backends are called directly (A < 0 and
        Δ > 0 hold by construction: no value check, no read back); any other goes through
        ``kernels.ssd.ssd``."""
        args = {k: inp[k] for k in _SSD_ARGS}
        cu = inp.get("cu_seqlens")
        Bt, T = args["x"].shape[:2]
        if cu is not None:
            for k in ("x", "dt", "B", "C", "z"):
                if args[k] is not None:
                    args[k] = args[k].reshape(1, Bt * T, *args[k].shape[2:])
        if backend in (Backend.TORCH, Backend.REFERENCE):
            cu = inp.get("host_cu_seqlens", cu)
        if backend == Backend.TORCH:
            y, fin = ssd_chunk_torch(**args, initial_state=initial_state, output_final_state=output_final_state,
                                     cu_seqlens=cu)
        elif backend == Backend.REFERENCE:
            args.pop("chunk_size")
            y, fin = ssd_reference(**args, initial_state=initial_state, output_final_state=output_final_state,
                                   cu_seqlens=cu)
        elif backend == Backend.TRITON:
            y, fin = _ssd.ssd_triton(**args, initial_state=initial_state, output_final_state=output_final_state,
                                     cu_seqlens=cu)
        else:
            y, fin = _ssd.ssd(**args, initial_state=initial_state, output_final_state=output_final_state,
                              backend=str(backend), cu_seqlens=cu)
        y = y.reshape(Bt, T, self.d_ssm)
        if self.norm is not None:
            y = self.norm(y, inp["norm_z"])
        if inp.get("mlp") is not None:
            z0, x0 = inp["mlp"]
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return y, fin

    def output(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y)

    def _run(self, u, state, output_state, backend, docs=None):
        inp, carry = self.inputs(u, state, output_state, docs)
        y, S = self.op(inp, None if state is None else state.ssm, output_state, backend)
        return self.output(y, u), (replace(carry, ssm=S) if output_state else None)

    # ---- forms -------------------------------------------------------------------------------
    #: packed documents: the conv masked at document starts, the op once on the flattened batch
    #: with the documents' ``cu_seqlens``; the reference form runs on the padded view
    handles_docs = True

    def reference(self, x, state=None, output_state=False, docs=None):
        if docs is not None:
            return self.run_padded(self.reference, x, docs)
        return self._run(x, state, output_state, Backend.REFERENCE)

    def chunked(self, x, state=None, output_state=False, docs=None):
        backend = self._resolve_backend(x)
        if docs is not None and backend == Backend.TORCH and x.device.type != "cpu":
            # the op's PyTorch form sizes its per-token sequence index from the lengths on the
            # device (a read back to the host): off the CPU the padded view, which reads nothing
            return self.run_padded(self.chunked, x, docs)
        return self._run(x, state, output_state, backend, docs)

    op_contract = _ssd.CONTRACT

    def contract_args(self):
        """kernels.ssd's sizes (``shapes.py``: x [b, T, h, p], B [b, T, g, n])."""
        return {"h": self.nheads, "p": self.headdim, "n": self.d_state, "g": self.ngroups}

    def step(self, u: torch.Tensor, state: Mamba2State):
        """One token, as mamba_ssm's ``Mamba2.step``: the conv cache rolled by one and the conv read
        off it, then S ← exp(Δ A) S + Δ x Bᵀ, y = S C + D x."""
        dtype = u.dtype
        z0, x0, z, xBC, dt = self._split(self.in_proj(u[:, 0]))
        conv = torch.cat([state.conv[..., 1:].to(xBC.dtype), xBC[..., None]], -1)      # [B, conv_dim, d_conv]
        xBC = (conv * self.conv1d.weight[:, 0, :]).sum(-1)
        if self.conv1d.bias is not None:
            xBC = xBC + self.conv1d.bias
        xBC = F.silu(xBC)
        x, B, C = xBC.split([self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        rep = self.nheads // self.ngroups
        x = acc(x).view(-1, self.nheads, self.headdim)
        B = acc(B).view(-1, self.ngroups, self.d_state).repeat_interleave(rep, 1)    # [B, h, n]
        C = acc(C).view(-1, self.ngroups, self.d_state).repeat_interleave(rep, 1)
        delta = F.softplus(acc(dt) + acc(self.dt_bias))
        if self.dt_limit != (0.0, math.inf):
            delta = delta.clamp(*self.dt_limit)
        A = -torch.exp(acc(self.A_log))
        S = state.ssm * torch.exp(delta * A)[..., None, None] + \
            torch.einsum("bh,bhn,bhp->bhpn", delta, B, x)
        y = torch.einsum("bhpn,bhn->bhp", S, C)
        D = acc(self.D).view(self.nheads, self.headdim) if self.D_has_hdim else acc(self.D)[:, None]
        y = y + D * x
        if not self.rmsnorm:
            y = y * F.silu(acc(z).view(-1, self.nheads, self.headdim))
        y = y.reshape(-1, self.d_ssm).to(dtype)
        if self.norm is not None:
            y = self.norm(y, z)
        if self.d_mlp:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        out = self.output(y[:, None], u)
        return out, Mamba2State(conv=conv, ssm=S, pos=int(state.pos) + 1)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        """The chunked (SSD) form per token, Q = the chunk (at most the sequence): the scores C Bᵀ of
        each group (2Qn per group), the masked scores times Δx per head (2Qp), what the token adds
        to its chunk's state and the entering state it reads (2pn each, per head). The decays'
        elementwise work, the conv, the norm and the gates are left out by convention."""
        c = cfg.mamba2
        _, _, h, _, p = dims(cfg)
        Q = min(c.chunk_size, max(seq_len, 1))
        return float(c.ngroups * 2 * Q * c.d_state + h * (2 * Q * p + 4 * p * c.d_state))
