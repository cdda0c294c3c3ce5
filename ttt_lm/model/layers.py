"""Building blocks shared by the mixers and the block: RMSNorm, rotary embeddings, the gated MLP,
and a causal depthwise convolution with a decode cache."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ttt_lm.model.config import INIT_SCHEMES


def acc(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype: float32 for half types, else unchanged (float64 stays)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of ``dtype`` (what :func:`acc` converts to), without a tensor."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x²) + ε) · g, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = acc(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * acc(self.weight)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float = 10000.0, dtype=torch.float32):
    """Rotary embedding tables (Su et al. 2021) for integer `positions` (any shape), half-split
    layout: cos/sin have shape positions.shape + (dim,), frequencies θ^(-2i/dim) for i < dim/2.
    Computed in float64 and returned in ``dtype``: pass the accumulation dtype of the tensors they
    rotate (``acc(x).dtype``: float32 for bf16/fp16, float64 in a float64 run), which
    :func:`apply_rope` computes in."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin; cos/sin broadcast against x (e.g. [T, D] against [B, H, T, D])."""
    xf = acc(x)
    return (xf * cos.to(xf.dtype) + rotate_half(xf) * sin.to(xf.dtype)).to(x.dtype)


class GatedMLP(nn.Module):
    """Gated MLP (Shazeer 2020): y = W_down(act(W_gate x) ⊙ W_up x). act = SiLU gives SwiGLU
    (Llama), GELU gives GeGLU (Griffin). Names follow Llama: gate_proj, up_proj, down_proj."""

    def __init__(self, d_model: int, d_ff: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        self.down_proj._is_residual_out = True
        if act == "silu":
            self.act = F.silu
        elif act == "gelu":
            self.act = lambda t: F.gelu(t, approximate="tanh")
        else:
            raise ValueError(f"model.mlp_act must be 'silu' or 'gelu', got {act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time: y_t = b + Σ_{j<w} W[:, j] ⊙ x_{t-w+1+j}.

    forward takes [B, T, C] and an optional cache ([B, C, w-1], the last w-1 inputs) and can
    return the new cache, so a long sequence can be processed segment by segment or one token at
    a time with the same result as one pass."""

    def __init__(self, channels: int, width: int = 4, bias: bool = True):
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(channels, channels, width, groups=channels, bias=bias, padding=0)

    def init_cache(self, batch_size: int, device=None, dtype=None) -> torch.Tensor:
        return torch.zeros(batch_size, self.conv.in_channels, self.width - 1, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, output_cache: bool = False):
        xt = x.transpose(1, 2)  # [B, C, T]
        if cache is None:
            cache = xt.new_zeros(xt.shape[0], xt.shape[1], self.width - 1)
        xt = torch.cat([cache.to(xt.dtype), xt], dim=-1)
        y = self.conv(xt).transpose(1, 2)
        new_cache = xt[..., xt.shape[-1] - (self.width - 1):] if output_cache else None
        return y, new_cache

    def cache_from(self, x_before: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The cache [B, C, w − 1] after reading ``x_before`` [B, w − 1, C], the inputs just
        before a slice; ``valid`` [w − 1] (bool) is False before the sequence start, where the
        cache holds zeros as a fresh one does."""
        return (x_before * valid[None, :, None].to(x_before.dtype)).transpose(1, 2)




def init_weights(module: nn.Module, std: float, n_layers: int, scheme: str = "gpt2",
                 n_residuals_per_layer: int = 2) -> None:
    """Initialize every nn.Linear and nn.Embedding of ``module`` by ``scheme`` (``model.init``),
    then run the mixers' own ``reset_parameters`` (decays, gates, inner-model weights, convs),
    which every scheme shares. "Residual outs" are the projections that write into the residual
    stream (marked ``_is_residual_out``: o_proj, out_proj, linear_out, the MLP's down_proj);
    biases start at zero.

    * ``gpt2`` (GPT-2, Megatron-LM): N(0, std), residual outs N(0, std / √(2·n_layers)), so the
      residual stream's variance does not grow with depth.
    * ``ttt`` (ttt-lm-pytorch ``TTTPreTrainedModel._init_weights``, ttt-lm-jax): N(0, std) for
      every linear and embedding (std = initializer_range = 0.02), residual outs included.
    * ``griffin`` (recurrentgemma ``reset_parameters``, ``final_w_init_variance_scale = 2 /
      n_layers``): N(0, 1/fan_in) for linears, residual outs N(0, (2/n_layers)/fan_in):
      linear_x, linear_y N(0, 1/width), linear_out N(0, (2/L)/lru_width), q/k/v N(0, 1/width),
      the MLP's up N(0, 1/width), down N(0, (2/L)/d_ff). Embeddings keep N(0, std): recurrentgemma
      draws N(0, 1/width) and multiplies by √width in the forward pass, which this LM does not.
    * ``mamba`` (mamba_ssm ``MambaLMHeadModel`` ``_init_weights``): linears keep PyTorch's
      default (kaiming-uniform, a = √5), residual outs that divided by √(n_residuals_per_layer ·
      n_layers) (1 residual per layer without an MLP, 2 with one), embeddings N(0, std)."""
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"model.init must be one of {INIT_SCHEMES}, got {scheme!r}")
    for m in module.modules():
        if isinstance(m, nn.Linear):
            out = getattr(m, "_is_residual_out", False)
            if scheme == "gpt2":
                nn.init.normal_(m.weight, mean=0.0, std=std / math.sqrt(2 * n_layers) if out else std)
            elif scheme == "ttt":
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif scheme == "griffin":
                nn.init.normal_(m.weight, mean=0.0, std=math.sqrt((2.0 / n_layers if out else 1.0) / m.in_features))
            else:  # mamba
                m.reset_parameters()
                if out:
                    with torch.no_grad():
                        m.weight.div_(math.sqrt(n_residuals_per_layer * n_layers))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
    for m in module.modules():
        if m is not module and hasattr(m, "reset_parameters") and getattr(m, "_mixer_init", False):
            m.reset_parameters()
