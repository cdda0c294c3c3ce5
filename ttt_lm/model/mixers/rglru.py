r"""Griffin's recurrent block with the Real-Gated Linear Recurrent Unit (RG-LRU)
(De et al. 2024, "Griffin: Mixing Gated Linear Recurrences with Local Attention", §2.4), checked
against the official recurrentgemma code (its PyTorch port, ``recurrentgemma/torch/layers.py``).

RG-LRU, per channel of the recurrence width W, for the block's input x_t to the layer:

    r_t = σ(W_a x_t + b_a)                      recurrence gate
    i_t = σ(W_x x_t + b_x)                      input gate
    a_t = a^{c·r_t},   a = σ(Λ),   c = 8        log a_t = −c·r_t·softplus(−Λ)
    h_t = a_t ⊙ h_{t−1} + √(1 − a_t²) ⊙ (i_t ⊙ x_t)

W_a, W_x are block-diagonal with ``num_heads`` blocks. a_t is formed in log space: a^{c·r_t} as a
power of a number near 1 would lose its digits, and √(1 − a_t²) = √(−expm1(2 log a_t)) keeps
them. The derivative of the square root is bounded (at 1000, as in the official recurrentgemma
code) so that a_t → 1 cannot blow up gradients in low precision. (recurrentgemma's ``a_param``
is −Λ: its a = exp(−softplus(a_param)) = σ(−a_param).)

Document resets follow recurrentgemma's ``segment_pos`` (the position of each token in its
document, 0 at a document's first token; the data loader's ``position_ids``). Where
segment_pos_t = 0 the state is dropped and the input is not normalized:

    h_t = i_t ⊙ x_t                             (segment_pos_t = 0: a_t is replaced by 0)
    h_t = a_t ⊙ h_{t−1} + √(1 − a_t²) ⊙ (i_t ⊙ x_t)   (every other token, the first token of a
                                                  row that starts inside a document included)

and the convolution only reads inputs of the token's own document: Conv1D(x)_t = b + Σ_{j<w,
j ≤ segment_pos_t} W_j ⊙ x_{t−j}. Without ``segment_pos`` the positions are the stream's own
(state.pos + t): a reset only at the stream's first token. A decode state at pos = 0 drops
its h and its conv cache, as the official RG-LRU drops h there. (recurrentgemma masks the
convolution only when it has no cache and then by the document boundaries it sees; for the
consecutive positions of a document the rule above is the same, and it also holds across a
carried cache and context-parallel slices.)

Λ initialization, ``rglru.a_init``:

* ``official`` (default): recurrentgemma's ``rnn_param_init(min_rad=0.9, max_rad=0.999)``,
  which produced the paper's results: a² ~ U[a_min² + 10⁻⁸, a_max² + 10⁻⁸], a = √(a²),
  Λ = logit(a). So a ∈ [0.9, 0.999] and the decay at r_t = 1, a^c, spans [0.43, 0.992].
* ``paper``: the paper's sentence (§2.4, "a^c is uniformly distributed between 0.9 and 0.999"):
  a^c ~ U[a_min, a_max], a = u^{1/c}, Λ = logit(a); a ∈ [0.987, 0.9999]. This decays far more
  slowly than the official init (two-sample KS distance between the two a's: 0.87).

A linspace over Λ is neither. The gates W_a, W_x start at N(0, 1/block width) and the conv at
N(0, 0.01/conv_width), zero biases (recurrentgemma); the dense projections W_x', W_y, W_out
follow ``model.init`` (``griffin`` in the Griffin and Hawk presets: N(0, 1/width), and W_out
N(0, (2/n_layers)/lru_width)).

The recurrent block (Griffin Fig. 2):

    y = W_out( GeLU(W_y x) ⊙ RG-LRU(Conv1D_4(W_x' x)) )

with a causal depthwise convolution of width ``conv_width``. Forms: ``reference`` runs the
recurrence token by token (kernels.linear_scan reference), ``chunked`` the chunked scan
(kernels.linear_scan, Triton on CUDA when present), ``step`` one token with the cache
{conv: last conv_width−1 inputs, h: h_{t−1}, pos}. Resets inside a row run the scan as packed
sequences (``cu_seqlens``), one per document piece (on the Triton backend with the LM's
``DocLayout``, the layout's ``cu_seqlens``: no host read).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import kernels.linear_scan as _ls
from kernels.linear_scan import linear_scan, linear_scan_reset
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.layers import CausalConv1d, acc
from ttt_lm.model.mixers.base import Mixer, MixerState, TPPlan
from ttt_lm.model.registry import option, register_mixer

#: model.rglru.a_init: how Λ is drawn (see the module docstring)
A_INITS = ("official", "paper")


@dataclass
class RGLRUConfig:
    """``model.rglru``: Griffin's recurrent block (De et al. 2024)."""
    lru_width: Optional[int] = option(None, ge=1)  # width of the recurrence; None = d_model
    num_heads: Optional[int] = option(None, ge=1)  # blocks of the block-diagonal gate weights; None = n_heads
    c: float = 8.0
    # Λ init: official (recurrentgemma: a ∈ [a_min, a_max] with a² uniform) | paper (the paper's
    # text: a^c uniform on [a_min, a_max]); see the module docstring
    a_init: str = option("official", choices=A_INITS)
    a_min: float = 0.9
    a_max: float = 0.999
    conv_width: int = option(4, ge=1)
    chunk_size: int = option(64, ge=1)  # tokens per chunk of the chunked linear scan

    def tiny(self, n: int) -> "RGLRUConfig":
        """This section for the tests' tiny models (``tests/model/mixer_checks.short_config``): the
        scan in chunks of ``n``. (It has no ``short``: the chunk size changes no value of the
        recurrence, and the synthetic tasks keep it.)"""
        return replace(self, chunk_size=n)

    def scaled(self, family, model) -> "RGLRUConfig":
        """This section for ``model``, the family's model ``family`` at another width
        (``ttt_lm.scaling.ladder``): an explicit lru_width grows with d_model (rounded up to a
        multiple of the head width), explicit gate blocks follow the head count."""
        out = self
        if self.lru_width is not None:
            hd = model.hd
            out = replace(out, lru_width=int(hd * math.ceil(self.lru_width * model.d_model / family.d_model / hd)))
        if self.num_heads is not None:
            out = replace(out, num_heads=model.n_heads)
        return out

    def validate(self, model) -> None:
        if not 0.0 < self.a_min < self.a_max < 1.0:
            raise ValueError(f"model.rglru needs 0 < a_min < a_max < 1, got {self.a_min}, {self.a_max}")


#: bound on d√x/dx, as recurrentgemma's RG-LRU
_MAX_SQRT_GRAD = 1000.0


class _SqrtBoundDerivative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / torch.sqrt(torch.clamp(4.0 * x, min=1.0 / _MAX_SQRT_GRAD ** 2))


#: recurrentgemma's rnn_param_init adds this to both ends of the a² range
_RNN_INIT_EPS = 1e-8


def lambda_init(width: int, c: float, a_min: float, a_max: float, mode: str = "official",
                generator=None) -> torch.Tensor:
    """Λ (float64) such that a = σ(Λ) follows ``mode``: "official" (recurrentgemma): a² ~
    U[a_min² + 1e-8, a_max² + 1e-8]; "paper": a^c ~ U[a_min, a_max]. See the module docstring."""
    if mode == "official":
        u = torch.empty(width, dtype=torch.float64).uniform_(a_min ** 2 + _RNN_INIT_EPS, a_max ** 2 + _RNN_INIT_EPS,
                                                             generator=generator)
        log_a = 0.5 * torch.log(u)
    elif mode == "paper":
        u = torch.empty(width, dtype=torch.float64).uniform_(a_min, a_max, generator=generator)
        log_a = torch.log(u) / c
    else:
        raise ValueError(f"model.rglru.a_init must be one of {A_INITS}, got {mode!r}")
    return log_a - torch.log(-torch.expm1(log_a))          # logit(a) = log a − log(1 − a)


def segment_positions(segment_pos: Optional[torch.Tensor], x: torch.Tensor, pos0: int) -> torch.Tensor:
    """The [B, T] segment positions of x's tokens: ``segment_pos`` checked, or the stream's own
    positions pos0 + t."""
    B, T = x.shape[:2]
    if segment_pos is None:
        return (pos0 + torch.arange(T, device=x.device)).expand(B, T)
    if segment_pos.shape != (B, T):
        raise ValueError(f"RG-LRU: segment_pos must be [B, T] = {(B, T)} like the input, got {tuple(segment_pos.shape)}")
    if segment_pos.dtype.is_floating_point or segment_pos.dtype == torch.bool:
        raise ValueError(f"RG-LRU: segment_pos must hold integer positions, got {segment_pos.dtype}")
    return segment_pos.to(x.device)


class BlockDiagonalLinear(nn.Module):
    """y = x W + b with W block-diagonal: heads h = 1..H each map their W/H channels."""

    def __init__(self, width: int, num_blocks: int):
        super().__init__()
        if width % num_blocks:
            raise ValueError(f"model.rglru.lru_width={width} is not divisible by model.rglru.num_heads={num_blocks}")
        self.num_blocks, self.block = num_blocks, width // num_blocks
        self.weight = nn.Parameter(torch.empty(num_blocks, self.block, self.block))
        self.bias = nn.Parameter(torch.empty(num_blocks, self.block))

    def reset_parameters(self) -> None:
        # recurrentgemma: N(0, 1/block_width), zero bias
        nn.init.normal_(self.weight, std=math.sqrt(1.0 / self.block))
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.unflatten(-1, (self.num_blocks, self.block))
        return (torch.einsum("...hi,hij->...hj", xs, self.weight) + self.bias).flatten(-2)


@dataclass
class RGLRUState(MixerState):
    """conv [B, D_rnn, w − 1]: the Conv1D's cache; h [B, D_rnn]: the recurrence (accumulation
    dtype); pos: the stream position (a reset at pos 0)."""
    conv: Optional[torch.Tensor] = None
    h: Optional[torch.Tensor] = None


@register_mixer("rglru", config=RGLRUConfig)
class RGLRUBlock(Mixer):
    official_init = official_hybrid_init = "griffin"   # Hawk alone, Griffin with local attention
    takes_segment_pos = True
    #: a diagonal linear recurrence: context parallelism combines the scan's chunk summaries
    cp_form = "summary"
    op_name = "linear_scan"
    triton_custom_op = "kernels::linear_scan_fwd"
    #: document resets (segment_pos) are read on the host
    compile_graph_breaks = "aten.nonzero"

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        rc = cfg.rglru
        self.d_model = cfg.d_model
        self.width = rc.lru_width or cfg.d_model
        self.num_heads = rc.num_heads or cfg.n_heads
        self.c, self.a_min, self.a_max = rc.c, rc.a_min, rc.a_max
        self.a_init = rc.a_init
        self.chunk_size = rc.chunk_size
        self.linear_y = nn.Linear(cfg.d_model, self.width)          # GeLU branch
        self.linear_x = nn.Linear(cfg.d_model, self.width)          # recurrence branch
        self.conv1d = CausalConv1d(self.width, rc.conv_width)
        self.gate_a = BlockDiagonalLinear(self.width, self.num_heads)   # W_a, b_a → r_t
        self.gate_x = BlockDiagonalLinear(self.width, self.num_heads)   # W_x, b_x → i_t
        self.Lambda = nn.Parameter(torch.empty(self.width))
        self.Lambda._no_weight_decay = True
        self.linear_out = nn.Linear(self.width, cfg.d_model)
        self.linear_out._is_residual_out = True
        self.reset_parameters()

    @classmethod
    def tp_plan(cls, cfg) -> TPPlan:
        """Channels are independent and the gates W_a, W_x block-diagonal, so the recurrence width
        splits by head blocks (rank r keeps blocks r·H/p …): W_x' and W_y by columns, the conv by
        channels, the gates' blocks and Λ by heads, W_out by rows."""
        return TPPlan(column=("linear_y", "linear_x"), row=("linear_out",), channel_convs=("conv1d.conv",),
                      head_params=("gate_a.weight", "gate_a.bias", "gate_x.weight", "gate_x.bias", "Lambda"),
                      head_counts=("width", "num_heads", "gate_a.num_blocks", "gate_x.num_blocks"))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.Lambda.copy_(lambda_init(self.width, self.c, self.a_min, self.a_max, self.a_init))
        self.gate_a.reset_parameters()
        self.gate_x.reset_parameters()
        # recurrentgemma's Conv1D: N(0, 0.01 / width), zero bias
        nn.init.normal_(self.conv1d.conv.weight, std=math.sqrt(0.01 / self.conv1d.width))
        nn.init.zeros_(self.conv1d.conv.bias)

    def init_state(self, batch_size: int, device=None, dtype=None) -> RGLRUState:
        dt = acc(torch.empty(0, dtype=dtype or torch.get_default_dtype())).dtype
        return RGLRUState(conv=self.conv1d.init_cache(batch_size, device, dtype),
                          h=torch.zeros(batch_size, self.width, device=device, dtype=dt), pos=0)

    # ---- stages ------------------------------------------------------------------------------
    @property
    def cp_halo(self) -> int:
        return self.conv1d.width - 1

    def context_state(self, x_before, valid, start: int) -> RGLRUState:
        return RGLRUState(conv=self.conv1d.cache_from(self.linear_x(x_before), valid), h=None, pos=start)

    def _conv(self, u: torch.Tensor, cache, output_state: bool, seg: torch.Tensor, pos0_known: Optional[int],
              starts_inside: bool = False):
        """Conv1D_w within each document: y_t = b + Σ_{j<w, j ≤ seg_t} W_j ⊙ u_{t−j} (u before
        the call from ``cache``). The masked sum runs only where a mask can drop a non-zero input;
        ``pos0_known`` is the stream position when ``seg`` is the stream's own, ``starts_inside``
        says that documents start inside the rows (the LM's ``DocLayout``, known on the host): no
        host sync in either case; else one read of whether any tap is masked."""
        w = self.conv1d.width
        y, new_cache = self.conv1d(u, cache, output_state)
        T = u.shape[1]
        if starts_inside:
            need = w > 1            # a start at t >= 1 has seg_t = 0 < min(t, w − 1)
        elif pos0_known is not None:
            need = cache is not None and pos0_known < w - 1
        else:
            reach = torch.arange(T, device=u.device).clamp(max=w - 1) if cache is None else torch.full(
                (T,), w - 1, device=u.device)
            need = bool((seg < reach).any())
        if not need or T == 0:
            return y, new_cache
        B, _, C = u.shape
        prev = u.new_zeros(B, w - 1, C) if cache is None else cache.to(u.dtype).transpose(1, 2)
        ut = torch.cat([prev, u], 1)                                   # [B, w − 1 + T, C]
        weight = self.conv1d.conv.weight[:, 0, :]                      # [C, w]; W_j = weight[:, w − 1 − j]
        y = self.conv1d.conv.bias.to(u.dtype).expand(B, T, C)
        for j in range(w):
            keep = (seg >= j)[..., None].to(u.dtype)
            y = y + keep * ut[:, w - 1 - j:w - 1 - j + T] * weight[:, w - 1 - j]
        return y, new_cache

    def inputs(self, x: torch.Tensor, state=None, output_state: bool = False, segment_pos=None, docs=None):
        """The recurrence branch up to the scan: log a_t, b_t = √(1 − a_t²) ⊙ i_t ⊙ x_t (1 in place
        of the root where segment_pos_t = 0) and the resets, as ``linear_scan_reset``'s
        arguments; the carry is the conv cache and the next position. ``docs`` (packed documents,
        a ``DocLayout`` or context parallelism's ``SliceDocs``) adds nothing: the documents reach
        the RG-LRU through ``segment_pos`` (resets where it is 0, the conv's taps masked by it,
        the state's conv cache included), which the one-process run reads as well; the LM's
        ``DocLayout`` only tells the conv, on the host, that its masks are needed."""
        pos0 = 0 if state is None else int(state.pos)
        seg = segment_positions(segment_pos, x, pos0)
        reset = seg == 0
        xb, conv_cache = self._conv(self.linear_x(x), None if state is None else state.conv, output_state, seg,
                                    pos0 if segment_pos is None else None,
                                    isinstance(docs, DocLayout) and docs.inner_starts)
        r_t = torch.sigmoid(acc(self.gate_a(xb)))
        i_t = torch.sigmoid(acc(self.gate_x(xb)))
        log_a_t = -self.c * r_t * F.softplus(-acc(self.Lambda))
        norm = _SqrtBoundDerivative.apply(-torch.expm1(2.0 * log_a_t))
        norm = torch.where(reset[..., None], torch.ones_like(norm), norm)   # recurrentgemma's reset
        b_t = norm * i_t * acc(xb)
        carry = RGLRUState(conv=conv_cache, pos=pos0 + x.shape[1]) if output_state else None
        # resets inside the rows come only from segment positions, and the LM's document layout
        # says on the host whether its rows have any: then the scan need not read them back
        inner = segment_pos is not None and not (isinstance(docs, DocLayout) and not docs.inner_starts)
        out = {"log_a": log_a_t, "b": b_t, "reset": reset, "chunk_size": self.chunk_size, "inner_resets": inner}
        if isinstance(docs, DocLayout) and docs.inner_starts:
            out["cu_seqlens"] = docs.cu_seqlens     # the same pieces as the resets, with no host read
        return out, carry

    def op(self, inp, initial_state=None, output_final_state: bool = False, backend: str = "torch"):
        """h_t = a_t ⊙ h_{t−1} + b_t (h_t = b_t at a reset): ``kernels.linear_scan``. With the LM's
        document layout (``inp["cu_seqlens"]``) the Triton form scans the rows flattened to one,
        each document piece from the zero state (h_t = b_t at its first token, as a reset
        gives), with the layout's offsets: no host read of the resets (``linear_scan_reset``
        reads them for the other cases)."""
        cu = inp.get("cu_seqlens")
        if cu is not None and backend == "triton":
            if initial_state is not None or output_final_state:
                raise ValueError("RG-LRU: packed documents (cu_seqlens) start from the zero state; they take no "
                                 "initial state and return no final state")
            B, T, D = inp["b"].shape
            h, _ = linear_scan(inp["log_a"].reshape(1, B * T, D), inp["b"].reshape(1, B * T, D), None, False,
                               backend=backend, chunk_size=inp["chunk_size"], cu_seqlens=cu)
            return h.reshape(B, T, D), None
        return linear_scan_reset(inp["log_a"], inp["b"], initial_state, inp["reset"], output_final_state, backend,
                                 inp["chunk_size"], inp.get("inner_resets", True))

    def output(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y = W_out(GeLU(W_y x) ⊙ h)."""
        return self.linear_out(h.to(x.dtype) * F.gelu(self.linear_y(x), approximate="tanh"))

    def _scan(self, x, state, output_state, backend, segment_pos=None, docs=None):
        inp, carry = self.inputs(x, state, output_state, segment_pos, docs)
        h, hT = self.op(inp, None if state is None else state.h, output_state, backend)
        return self.output(h, x), (replace(carry, h=hT) if output_state else None)

    op_contract = _ls.CONTRACT

    def contract_args(self):
        return {"d": self.width}

    # ---- forms -------------------------------------------------------------------------------
    # documents restart inside packed rows through segment_pos (the LM passes position_ids with
    # its DocLayout): the scan's resets and the conv's masks, one call for the batch
    handles_docs = True

    def reference(self, x, state=None, output_state=False, segment_pos=None, docs=None):
        return self._scan(x, state, output_state, "reference", segment_pos, docs)

    def chunked(self, x, state=None, output_state=False, segment_pos=None, docs=None):
        return self._scan(x, state, output_state, self._resolve_backend(x), segment_pos, docs)

    def step(self, x, state, segment_pos=None):
        inp, carry = self.inputs(x, state, True, segment_pos)
        log_a_t, b_t, reset = inp["log_a"], inp["b"], inp["reset"]
        h_prev = torch.where(reset[:, 0, None], torch.zeros_like(b_t[:, 0]), state.h.to(b_t.dtype))
        h = torch.exp(log_a_t[:, 0]) * h_prev + b_t[:, 0]
        return self.output(h[:, None], x), replace(carry, h=h)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        # the scan a_t ⊙ h_{t−1} + b_t: a multiply and an add per channel. The gates' elementwise
        # work is left out by convention (ttt_lm.model.flops); the block-diagonal W_a, W_x, the
        # conv and the projections are counted there from their parameter shapes.
        return 2.0 * (cfg.rglru.lru_width or cfg.d_model)
