r"""Griffin's recurrent block with the Real-Gated Linear Recurrent Unit (RG-LRU)
(De et al. 2024, "Griffin: Mixing Gated Linear Recurrences with Local Attention", §2.4).

RG-LRU, per channel of the recurrence width W, for the block's input x_t to the layer:

    r_t = σ(W_a x_t + b_a)                      recurrence gate
    i_t = σ(W_x x_t + b_x)                      input gate
    a_t = a^{c·r_t},   a = σ(Λ),   c = 8        log a_t = −c·r_t·softplus(−Λ)
    h_t = a_t ⊙ h_{t−1} + √(1 − a_t²) ⊙ (i_t ⊙ x_t)

W_a, W_x are block-diagonal with ``num_heads`` blocks. a_t is formed in log space: a^{c·r_t} as a
power of a number near 1 would lose its digits, and √(1 − a_t²) = √(−expm1(2 log a_t)) keeps
them. The derivative of the square root is bounded (at 1000, as in the official recurrentgemma
code) so that a_t → 1 cannot blow up gradients in low precision. At the first token of a stream
(no carried state, or a state at position 0) the normalization is skipped, h_0 = i_0 ⊙ x_0, as
recurrentgemma does at a document start.

Λ is initialized so that a^c ~ U[a_min, a_max] = U[0.9, 0.999], as the paper states:
a = u^{1/c}, Λ = logit(a). (recurrentgemma's code instead draws a itself with a² uniform on
[0.9², 0.999²]; a linspace over Λ is neither.)

The recurrent block (Griffin Fig. 2):

    y = W_out( GeLU(W_y x) ⊙ RG-LRU(Conv1D_4(W_x' x)) )

with a causal depthwise convolution of width ``conv_width``. Forms: ``reference`` runs the
recurrence token by token (kernels.linear_scan reference), ``chunked`` the chunked scan
(kernels.linear_scan, Triton on CUDA when present), ``step`` one token with the cache
{conv: last conv_width−1 inputs, h: h_{t−1}, pos}.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear_scan import has_triton_backend, linear_scan
from ttt_lm.model.layers import CausalConv1d, acc
from ttt_lm.model.mixers.base import Mixer, State

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


def lambda_init(width: int, c: float, a_min: float, a_max: float, generator=None) -> torch.Tensor:
    """Λ with a^c ~ U[a_min, a_max] for a = σ(Λ) (float64)."""
    u = torch.empty(width, dtype=torch.float64).uniform_(a_min, a_max, generator=generator)
    log_a = torch.log(u) / c
    return log_a - torch.log(-torch.expm1(log_a))          # logit(a) = log a − log(1 − a)


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


class RGLRUBlock(Mixer):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        rc = cfg.rglru
        self.d_model = cfg.d_model
        self.width = rc.lru_width or cfg.d_model
        self.num_heads = rc.num_heads or cfg.n_heads
        self.c, self.a_min, self.a_max = rc.c, rc.a_min, rc.a_max
        self.chunk_size = rc.chunk_size
        if not 0.0 < rc.a_min < rc.a_max < 1.0:
            raise ValueError(f"model.rglru needs 0 < a_min < a_max < 1, got {rc.a_min}, {rc.a_max}")
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

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.Lambda.copy_(lambda_init(self.width, self.c, self.a_min, self.a_max))
        self.gate_a.reset_parameters()
        self.gate_x.reset_parameters()
        # recurrentgemma's Conv1D: N(0, 0.01 / width), zero bias
        nn.init.normal_(self.conv1d.conv.weight, std=math.sqrt(0.01 / self.conv1d.width))
        nn.init.zeros_(self.conv1d.conv.bias)

    def init_state(self, batch_size: int, device=None, dtype=None) -> State:
        dt = acc(torch.empty(0, dtype=dtype or torch.get_default_dtype())).dtype
        return {"conv": self.conv1d.init_cache(batch_size, device, dtype),
                "h": torch.zeros(batch_size, self.width, device=device, dtype=dt), "pos": 0}

    # ---- shared pieces -----------------------------------------------------------------------
    def _gates(self, x: torch.Tensor, state, output_state: bool):
        """Branches up to the scan: GeLU branch, log a_t and b_t = √(1 − a_t²) ⊙ i_t ⊙ x_t."""
        pos0 = 0 if state is None else int(state["pos"])
        gelu_y = F.gelu(self.linear_y(x), approximate="tanh")
        xb, conv_cache = self.conv1d(self.linear_x(x), None if state is None else state["conv"], output_state)
        r_t = torch.sigmoid(acc(self.gate_a(xb)))
        i_t = torch.sigmoid(acc(self.gate_x(xb)))
        log_a_t = -self.c * r_t * F.softplus(-acc(self.Lambda))
        norm = _SqrtBoundDerivative.apply(-torch.expm1(2.0 * log_a_t))
        if pos0 == 0 and x.shape[1] > 0:
            # stream start: h_0 = i_0 ⊙ x_0, unnormalized (recurrentgemma's reset)
            first = torch.zeros_like(norm[:1, :, :1], dtype=torch.bool)
            first[:, 0] = True
            norm = torch.where(first, torch.ones_like(norm), norm)
        b_t = norm * i_t * acc(xb)
        h0 = None if state is None else state["h"]
        return gelu_y, log_a_t, b_t, h0, conv_cache, pos0

    def _finish(self, h, gelu_y, x, hT, conv_cache, pos0, output_state):
        y = self.linear_out(h.to(x.dtype) * gelu_y)
        st = {"conv": conv_cache, "h": hT, "pos": pos0 + x.shape[1]} if output_state else None
        return y, st

    def _scan(self, x, state, output_state, backend):
        gelu_y, log_a_t, b_t, h0, conv_cache, pos0 = self._gates(x, state, output_state)
        h, hT = linear_scan(log_a_t, b_t, h0, output_state, backend=backend, chunk_size=self.chunk_size)
        return self._finish(h, gelu_y, x, hT, conv_cache, pos0, output_state)

    # ---- forms -------------------------------------------------------------------------------
    def reference(self, x, state=None, output_state=False):
        return self._scan(x, state, output_state, "reference")

    def triton_unavailable(self):
        return None if has_triton_backend() else "kernels/linear_scan has no Triton kernel"

    def chunked(self, x, state=None, output_state=False):
        return self._scan(x, state, output_state, self._resolve_backend(x))

    def step(self, x, state):
        gelu_y, log_a_t, b_t, h0, conv_cache, pos0 = self._gates(x, state, True)
        h = torch.exp(log_a_t[:, 0]) * h0.to(b_t.dtype) + b_t[:, 0]
        return self._finish(h[:, None], gelu_y, x, h, conv_cache, pos0, True)

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        # the scan a_t ⊙ h_{t−1} + b_t: a multiply and an add per channel. The gates' elementwise
        # work is left out by convention (ttt_lm.model.flops); the block-diagonal W_a, W_x, the
        # conv and the projections are counted there from their parameter shapes.
        return 2.0 * (cfg.rglru.lru_width or cfg.d_model)
