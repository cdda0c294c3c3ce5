"""Speed and memory of the sequence-mixing ops in ``kernels/``: each op's Triton kernel against its
chunked PyTorch form and against causal flash attention (``scaled_dot_product_attention`` with the
flash backend) on q, k, v of the same [B, H, T, D].

Sizes: T ∈ {2k, 8k, 32k} with B·T = 64k tokens, H = 12 heads, D = 64, bfloat16, on CUDA. For each
form: forward time, forward+backward time (median of up to ``--reps`` CUDA-event timings; a slow
form is timed fewer times, at least 3), the peak memory each allocates beyond its inputs, and a
rate: for every form but the PyTorch one, the bandwidth implied by the bytes the op must move at
least (reads of its inputs, writes of its outputs), with its share of the device's DRAM peak; for
causal SDPA, TFLOP/s (4·B·H·T²·D/2 forward, 3.5 × that forward+backward); for an op whose work is
large matrix products (LaCT), TFLOP/s of those products and their share of the device's dense bf16
peak, for every form.

    python benchmarks/kernels.py                    # sdpa and every registered op, CUDA
    python benchmarks/kernels.py --ops sdpa linear_scan --seq-lens 2048 8192 --json rows.jsonl
    python benchmarks/kernels.py --smoke            # tiny size; on CPU through the Triton interpreter
    python benchmarks/kernels.py --list             # registered ops, kernels/ folders without a benchmark

The forms of an op are the backends its module lists in ``BACKENDS`` (but the sequential
reference), plus flash-linear-attention's kernel where that package imports (CUDA only). An op is
added by registering a function that builds its inputs and forms, named after the op's public
function with ``_bench`` after it; the kernels/ folder it measures is the one of that name, else the
one whose ``__init__.py`` defines that function (``kernels/ttt`` for ``ttt_mlp``); ``needs`` is a
module without which it is not registered:

    @register(needs="kernels.my_op")
    def my_op_bench(B, T, H, D, dtype, device) -> Bench: ...

``--record-pass`` runs each non-PyTorch form once, forward and backward, untimed: the GPU
campaign runs it with ``TTT_LM_RECORD_LAUNCHES`` to learn which Triton kernels to compile first.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if not torch.cuda.is_available():
    # Triton kernels can only run through the interpreter here; it must be on before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from ttt_lm.train.metrics import peak_flops_for  # noqa: E402


@dataclass
class Bench:
    """One op at one size. ``forms`` map a name ("triton", "torch") to a closure running the
    forward on ``inputs`` and returning the tensors to backpropagate from; ``min_bytes`` gives the
    least traffic of the forward and of forward+backward, for the bandwidth figure."""
    inputs: List[torch.Tensor]
    forms: Dict[str, Callable[[], Sequence[torch.Tensor]]]
    min_bytes_fwd: int = 0
    min_bytes_fwd_bwd: int = 0
    #: FLOPs of the matrix products, for ops whose work is large products (rate in TFLOP/s and % of
    #: the device's dense bf16 peak instead of GB/s)
    flops_fwd: float = 0.0
    flops_fwd_bwd: float = 0.0
    notes: Dict[str, str] = field(default_factory=dict)


REGISTRY: Dict[str, Callable[..., Bench]] = {}
#: op name → the kernels/ folder it measures
FOLDERS: Dict[str, str] = {}
KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"


def register(needs: Optional[str] = None):
    """Register the decorated ``<op>_bench`` as the benchmark of the op ``<op>``, measuring the
    kernels/ folder :func:`op_folder` finds for it. ``needs``: a module the benchmark imports;
    where it does not exist (an op not in this checkout) the benchmark is not registered."""
    def deco(fn):
        if needs is not None and not _exists(needs):
            return fn
        if not fn.__name__.endswith("_bench"):
            raise ValueError(f"benchmarks/kernels.py: a benchmark is named <op>_bench, got {fn.__name__!r}")
        name = fn.__name__[: -len("_bench")]
        REGISTRY[name] = fn
        FOLDERS[name] = op_folder(name)
        return fn
    return deco


def op_folder(op: str) -> str:
    """The kernels/ folder of the op ``op``: ``kernels/<op>`` where it exists, else the one folder
    whose ``__init__.py`` defines the public function ``op`` (``ttt_mlp`` in ``kernels/ttt``)."""
    if (KERNELS_DIR / op / "__init__.py").exists():
        return op
    pat = re.compile(rf"^def {re.escape(op)}\(", re.M)
    found = sorted(p.parent.name for p in KERNELS_DIR.glob("*/__init__.py")
                   if pat.search(p.read_text(encoding="utf-8")))
    if len(found) != 1:
        raise ValueError(f"benchmarks/kernels.py: op {op!r} is defined by {len(found)} kernels/ folders "
                         f"({found}); a benchmark measures one")
    return found[0]


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def folders_without_bench() -> List[str]:
    """The op folders under kernels/ that no registered benchmark measures."""
    have = set(FOLDERS.values())
    return sorted(p.name for p in KERNELS_DIR.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists() and p.name not in have)


def backend_forms(module) -> List[str]:
    """The forms to time of an op module: its ``BACKENDS`` except the sequential reference."""
    return [b for b in getattr(module, "BACKENDS", ("triton", "torch")) if b != "reference"]


# ---- ops ---------------------------------------------------------------------------------------

@register()
def linear_scan_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """h_t = exp(log_a_t) ⊙ h_{t−1} + b_t over C = H·D channels (RG-LRU's recurrence width)."""
    from kernels.linear_scan import linear_scan

    C = H * D
    log_a = (-torch.rand(B, T, C, device=device).mul(3).add(0.01)).to(dtype).requires_grad_()
    b = torch.randn(B, T, C, device=device, dtype=dtype, requires_grad=True)
    n = B * T * C * torch.finfo(dtype).bits // 8
    return Bench(
        inputs=[log_a, b],
        forms={
            "triton": lambda: linear_scan(log_a, b, backend="triton")[:1],
            "torch": lambda: linear_scan(log_a, b, backend="torch")[:1],
        },
        min_bytes_fwd=3 * n,            # read log_a, b; write h
        min_bytes_fwd_bwd=8 * n,        # + read log_a, b, dh; write dlog_a, db
    )


def _qkv(B, H, T, D, dtype, device, normalize_k=False):
    q, k, v = (torch.randn(B, H, T, D, device=device) for _ in range(3))
    if normalize_k:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _fla_op(module: str, name: str, device: str):
    """flash-linear-attention's op ``fla.ops.<module>.<name>`` for the side-by-side, or None where the
    package is not installed or there is no GPU (its kernels need CUDA)."""
    if device != "cuda":
        return None
    try:
        mod = __import__(f"fla.ops.{module}", fromlist=[name])
    except Exception:  # not installed, or it does not import with this torch/triton
        return None
    return getattr(mod, name, None)


def _bthd_leaves(*ts):
    """Copies of [B, H, T, D] (or [B, H, T]) inputs in flash-linear-attention's [B, T, H, ...] layout, as
    leaves of their own so the layout change is not timed."""
    return [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in ts]


@register()
def delta_rule_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """DeltaNet's S_t = S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t; L2-normalized q, k."""
    from kernels.delta_rule import delta_rule

    q, k, v = _qkv(B, H, T, D, dtype, device, normalize_k=True)
    beta = torch.rand(B, H, T, device=device).to(dtype).requires_grad_()
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    forms = {f: (lambda f=f: delta_rule(q, k, v, beta, backend=f, chunk_size=64)[:1]) for f in ("triton", "torch")}
    inputs = [q, k, v, beta]
    fla = _fla_op("delta_rule", "chunk_delta_rule", device)
    if fla is not None:
        fq, fk, fv, fbeta = _bthd_leaves(q, k, v, beta)
        forms["fla chunk_delta_rule"] = lambda: fla(fq, fk, fv, fbeta)[:1]
        inputs += [fq, fk, fv, fbeta]
    return Bench(inputs=inputs, forms=forms, min_bytes_fwd=4 * n, min_bytes_fwd_bwd=11 * n)


@register()
def gated_delta_rule_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """Gated DeltaNet's S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t,
    α_t = exp(g_t); L2-normalized q, k; d_v = d_k = D here (flash-linear-attention's
    ``chunk_gated_delta_rule`` beside it, with its query scale set to 1 so both compute the same)."""
    from kernels.gated_delta_rule import gated_delta_rule

    q, k, v = _qkv(B, H, T, D, dtype, device, normalize_k=True)
    g = (-0.1 * torch.rand(B, H, T, device=device)).requires_grad_()
    beta = torch.rand(B, H, T, device=device).to(dtype).requires_grad_()
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    forms = {f: (lambda f=f: gated_delta_rule(q, k, v, g, beta, backend=f, chunk_size=64)[:1])
             for f in ("triton", "torch")}
    inputs = [q, k, v, g, beta]
    fla = _fla_op("gated_delta_rule", "chunk_gated_delta_rule", device)
    if fla is not None:
        fq, fk, fv, fg, fbeta = _bthd_leaves(q, k, v, g, beta)
        forms["fla chunk_gated_delta_rule"] = lambda: fla(fq, fk, fv, fg, fbeta, scale=1.0)[:1]
        inputs += [fq, fk, fv, fg, fbeta]
    return Bench(inputs=inputs, forms=forms, min_bytes_fwd=4 * n, min_bytes_fwd_bwd=11 * n)


@register()
def titans_linear_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """Titans' linear memory with momentum and forgetting, chunks of 64 tokens."""
    from kernels.titans import titans_linear

    q, k, v = _qkv(B, H, T, D, dtype, device, normalize_k=True)
    theta = (0.5 * torch.rand(B, H, T, device=device)).to(dtype).requires_grad_()
    log_eta = F.logsigmoid(torch.randn(B, H, T, device=device) + 2).to(dtype).requires_grad_()
    log_keep = F.logsigmoid(torch.randn(B, H, T, device=device) + 3).to(dtype).requires_grad_()
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    return Bench(
        inputs=[q, k, v, theta, log_eta, log_keep],
        forms={f: (lambda f=f: titans_linear(q, k, v, theta, log_eta, log_keep, backend=f, chunk_size=64)[:1])
               for f in ("triton", "torch")},
        min_bytes_fwd=4 * n, min_bytes_fwd_bwd=11 * n,
    )


def _ttt_inputs(B, H, T, D, dtype, device, mlp: bool):
    q, k, v = _qkv(B, H, T, D, dtype, device)
    eta = (0.01 * torch.sigmoid(torch.randn(B, H, T, device=device))).to(dtype).requires_grad_()
    b = 16
    token_idx = (1.0 / torch.arange(1, b + 1, device=device, dtype=torch.float32)).requires_grad_()
    ln_w = torch.ones(H, D, device=device, requires_grad=True)
    ln_b = torch.zeros(H, D, device=device, requires_grad=True)
    inner = [(0.02 * torch.randn(H, D, 4 * D if mlp else D, device=device)).requires_grad_(),
             torch.zeros(H, 1, 4 * D if mlp else D, device=device, requires_grad=True)]
    if mlp:
        inner += [(0.02 * torch.randn(H, 4 * D, D, device=device)).requires_grad_(),
                  torch.zeros(H, 1, D, device=device, requires_grad=True)]
    return [q, k, v, eta, token_idx, ln_w, ln_b, *inner], b


@register()
def ttt_linear_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """TTT-Linear's dual form over mini-batches of 16, inner LayerNorm fused, per-head per-token η."""
    from kernels.ttt import ttt_linear

    ins, b = _ttt_inputs(B, H, T, D, dtype, device, mlp=False)
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    forms = {f: (lambda f=f: ttt_linear(*ins, mini_batch_size=b, backend=f)[:1]) for f in ("triton", "torch")}
    inputs = list(ins)
    fla = _fla_op("ttt", "chunk_ttt_linear", device)
    if fla is not None:
        # the same recurrence in flash-linear-attention's form: one η per token ([B, T, H, 1]), inner
        # LayerNorm weight and bias per head, mini-batches (chunks) of 16, zero initial state
        fq, fk, fv, feta = _bthd_leaves(*ins[:4])
        fw, fb = ins[5].detach().clone().requires_grad_(), ins[6].detach().clone().requires_grad_()
        forms["fla chunk_ttt_linear"] = lambda: fla(fq, fk, fv, fw, fb, feta.unsqueeze(-1), chunk_size=b)[:1]
        inputs += [fq, fk, fv, feta, fw, fb]
    return Bench(inputs=inputs, forms=forms, min_bytes_fwd=4 * n, min_bytes_fwd_bwd=11 * n)


@register()
def ttt_mlp_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """TTT-MLP's dual form (inner MLP D → 4D → D), mini-batches of 16."""
    from kernels.ttt import has_triton_backend, ttt_mlp

    ins, b = _ttt_inputs(B, H, T, D, dtype, device, mlp=True)
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    forms = ("triton", "torch") if has_triton_backend("mlp") else ("torch",)
    return Bench(inputs=ins, forms={f: (lambda f=f: ttt_mlp(*ins, mini_batch_size=b, backend=f)[:1]) for f in forms},
                 min_bytes_fwd=4 * n, min_bytes_fwd_bwd=11 * n)


@register()
def selective_scan_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """Mamba's selective scan at the width of a model with d_model = H·D: d_inner = 2·H·D channels,
    state size N = 16, Δ = softplus(δ + b_Δ), D skip and SiLU(z) gate, tiles of 16 steps."""
    from kernels.selective_scan import selective_scan

    Di, N = 2 * H * D, 16
    x, delta, z = (torch.randn(B, T, Di, device=device).to(dtype).requires_grad_() for _ in range(3))
    Bm, Cm = (torch.randn(B, T, N, device=device).to(dtype).requires_grad_() for _ in range(2))
    A = (-torch.arange(1, N + 1, device=device, dtype=torch.float32).expand(Di, N).contiguous()).requires_grad_()
    Dp = torch.ones(Di, device=device, requires_grad=True)
    bias = torch.full((Di,), -4.0, device=device, requires_grad=True)     # Δ ≈ softplus(−4) ≈ 0.018
    n = B * T * Di * torch.finfo(dtype).bits // 8
    return Bench(
        inputs=[x, delta, z, Bm, Cm, A, Dp, bias],
        forms={f: (lambda f=f: selective_scan(x, delta, A, Bm, Cm, D=Dp, z=z, delta_bias=bias, delta_softplus=True,
                                              backend=f, chunk_size=16)[:1]) for f in ("triton", "torch")},
        min_bytes_fwd=4 * n,            # read x, δ, z; write out (B, C are N/Di of that)
        min_bytes_fwd_bwd=11 * n,       # + read x, δ, z, d_out; write dx, dδ, dz
    )


@register(needs="kernels.gated_delta_rule")
def gated_delta_rule_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """Gated DeltaNet's S_t = α_t S_{t−1} + β_t k_t (v_t − α_t S_{t−1}ᵀ k_t)ᵀ, α_t = exp(g_t), L2-normalized
    q, k; every backend the op module lists, and flash-linear-attention's chunk_gated_delta_rule."""
    import kernels.gated_delta_rule as mod

    q, k, v = _qkv(B, H, T, D, dtype, device, normalize_k=True)
    g = F.logsigmoid(torch.randn(B, H, T, device=device) + 4).to(dtype).requires_grad_()
    beta = torch.rand(B, H, T, device=device).to(dtype).requires_grad_()
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    forms = {f: (lambda f=f: mod.gated_delta_rule_trusted(q, k, v, g, beta, backend=f)[:1])
             for f in backend_forms(mod)}
    inputs = [q, k, v, g, beta]
    fla = _fla_op("gated_delta_rule", "chunk_gated_delta_rule", device)
    if fla is not None:
        fq, fk, fv, fg, fbeta = _bthd_leaves(q, k, v, g, beta)
        forms["fla chunk_gated_delta_rule"] = lambda: fla(fq, fk, fv, fg, fbeta)[:1]
        inputs += [fq, fk, fv, fg, fbeta]
    return Bench(inputs=inputs, forms=forms, min_bytes_fwd=4 * n, min_bytes_fwd_bwd=11 * n)


@register(needs="kernels.kda")
def kda_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """KDA's S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ with a per-channel log
    decay g [B, H, T, D] (a gate near Kimi Linear's initial range); L2-normalized q, k; every
    backend the op module lists, and flash-linear-attention's chunk_kda (query scale 1)."""
    import kernels.kda as mod

    q, k, v = _qkv(B, H, T, D, dtype, device, normalize_k=True)
    g = F.logsigmoid(torch.randn(B, H, T, D, device=device) + 4).to(dtype).requires_grad_()
    beta = torch.rand(B, H, T, device=device).to(dtype).requires_grad_()
    n = B * H * T * D * torch.finfo(dtype).bits // 8
    forms = {f: (lambda f=f: mod.kda(q, k, v, g, beta, backend=f)[:1]) for f in backend_forms(mod)}
    inputs = [q, k, v, g, beta]
    fla = _fla_op(mod.__name__.rsplit(".", 1)[1], "chunk_kda", device)   # fla.ops.kda, as our folder
    if fla is not None:
        fq, fk, fv, fg, fbeta = _bthd_leaves(q, k, v, g, beta)
        forms["fla chunk_kda"] = lambda: fla(fq, fk, fv, fg, fbeta, scale=1.0)[:1]
        inputs += [fq, fk, fv, fg, fbeta]
    return Bench(inputs=inputs, forms=forms, min_bytes_fwd=5 * n, min_bytes_fwd_bwd=13 * n)


@register(needs="kernels.ssd")
def ssd_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """Mamba-2's SSD, S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ, y_t = S_t C_t, as Mamba-2 runs it: H heads
    of p = D channels, one group of B, C with state size n = 128, Δ = softplus(dt + dt_bias), A in
    [−16, −1], chunks of 256; every backend the op module lists, and mamba_ssm's
    mamba_chunk_scan_combined (same layout) where it imports on a GPU."""
    import kernels.ssd as mod

    n = 128
    x = torch.randn(B, T, H, D, device=device).to(dtype).requires_grad_()
    dt = torch.randn(B, T, H, device=device).to(dtype).requires_grad_()
    Bm, Cm = (torch.randn(B, T, 1, n, device=device).to(dtype).requires_grad_() for _ in range(2))
    A = (-torch.linspace(1.0, 16.0, H, device=device)).requires_grad_()
    bias = torch.full((H,), -3.0, device=device, requires_grad=True)      # Δ ≈ softplus(dt − 3)
    forms = {f: (lambda f=f: mod.ssd(x, dt, A, Bm, Cm, dt_bias=bias, dt_softplus=True, backend=f,
                                     chunk_size=256)[:1]) for f in backend_forms(mod)}
    fn = _mamba_chunk_scan(device)
    if fn is not None:
        forms["mamba_ssm mamba_chunk_scan_combined"] = lambda: (fn(x, dt, A, Bm, Cm, 256, dt_bias=bias,
                                                                   dt_softplus=True),)
    bits = torch.finfo(dtype).bits // 8
    nx, nbc, ndt = B * T * H * D * bits, 2 * B * T * n * bits, B * T * H * bits
    # forward: read x, dt, B, C, write y; backward: read x, dt, B, C, dy, write dx, ddt, dB, dC
    return Bench(inputs=[x, dt, Bm, Cm, A, bias], forms=forms, min_bytes_fwd=2 * nx + nbc + ndt,
                 min_bytes_fwd_bwd=5 * nx + 3 * nbc + 3 * ndt)


def _mamba_chunk_scan(device: str):
    """mamba_ssm's ``mamba_chunk_scan_combined`` for the side-by-side, or None where the package is
    not installed or there is no GPU (its kernels need CUDA)."""
    if device != "cuda":
        return None
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or it does not import with this torch/triton
        return None
    return mamba_chunk_scan_combined


def lact_flops(B: int, T: int, H: int, D: int, chunk: int) -> Tuple[float, float]:
    """FLOPs (2 per multiply-add) of the LaCT op's matrix products with d_k = d_v = d_h = D: forward,
    and forward+backward as 3 × forward. Per head and token, reading the weights costs 6·D² (q W₀₂ᵀ
    4·D², then ·w1ᵀ 2·D²); a token of a written chunk (every chunk but the last) adds 12·D² (k W₀₂ᵀ
    4·D², v w1 2·D², dw1 2·D², [dw0; dw2] 4·D²). The weight normalisation and the momentum are
    O(D²) per chunk, not counted."""
    written = T - ((T - 1) % chunk + 1)     # the last chunk, full or partial, is read and never written
    fwd = 2 * B * H * D * D * (3 * T + 6 * written)
    return fwd, 3 * fwd


@register(needs="kernels.lact")
def lact_bench(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: str) -> Bench:
    """LaCT's block-causal SwiGLU fast weights as its presets run them: d_h = d_k = d_v = D, chunks
    of 2048 tokens (of T where T is shorter: then nothing is written), momentum on, no Muon,
    L2-normalised q, k, per-token lr ≈ 0.001 per matrix, float32 fast weights; every backend the op
    module lists. Its rate is TFLOP/s of its matrix products (``lact_flops``) and their share of the
    device's dense bf16 peak."""
    import kernels.lact as mod

    C = min(2048, T)
    q, k, v = _qkv(B, H, T, D, dtype, device, normalize_k=True)
    lrs = [(1e-3 * torch.rand(B, H, T, device=device)).to(dtype).requires_grad_() for _ in range(3)]
    mom = torch.sigmoid(torch.randn(B, H, T, device=device)).to(dtype).requires_grad_()
    ws = [(torch.randn(H, D, D, device=device) / D ** 0.5).requires_grad_() for _ in range(3)]
    forms = {f: (lambda f=f: mod.block_causal_lact_swiglu(q, k, v, *lrs, *ws, chunk_size=C, momentum=mom,
                                                          backend=f)[:1]) for f in backend_forms(mod)}
    fl = lact_flops(B, T, H, D, C)
    return Bench(inputs=[q, k, v, *lrs, mom, *ws], forms=forms, flops_fwd=fl[0], flops_fwd_bwd=fl[1])


# ---- timing ------------------------------------------------------------------------------------

def _sdpa_form(B, T, H, D, dtype, device):
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)
    else:
        def run():
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)
    return [q, k, v], run


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps, warmup, max_ms: float = 3000.0):
    """Median of ``reps`` timings after ``warmup`` calls; a slow form (the PyTorch ones) is timed
    fewer times, so that its timings take about ``max_ms`` (at least 3)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for i in range(reps):
        if i >= 3 and sum(out) > max_ms:
            break
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _peak(fn, device):
    """MiB allocated at the peak of one call, beyond what was allocated before it."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _measure(run, inputs, device, reps, warmup):
    def fwd():
        return run()

    def fwd_bwd():
        outs = run()
        grads = [torch.ones_like(o) for o in outs]
        torch.autograd.backward(list(outs), grads)
        for x in inputs:
            x.grad = None

    r = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        try:
            r[name + "_ms"] = _time(fn, device, reps, warmup)
            r[name + "_mib"] = _peak(fn, device)
        except torch.OutOfMemoryError:
            r[name + "_ms"] = r[name + "_mib"] = "OOM"
            torch.cuda.empty_cache()
        except Exception as e:  # a kernel that cannot launch here (e.g. Triton's OutOfResources)
            r[name + "_ms"] = r[name + "_mib"] = f"error: {type(e).__name__}"
            print(f"# {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
            if device == "cuda":
                torch.cuda.empty_cache()
    return r


def peak_bandwidth_gbps(device: str) -> Optional[float]:
    """Nominal DRAM bandwidth of known devices (GB/s); None when unknown."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    table = [("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
             ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0)]
    for key, bw in table:
        if key in name:
            return bw
    return None


def _fmt(x, spec=".3f"):
    return x if isinstance(x, str) else ("-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec))


def sdpa_flops(B: int, T: int, H: int, D: int) -> Tuple[float, float]:
    """FLOPs of causal attention (forward; forward+backward = 3.5 × forward, flash's count with the
    recomputation in its backward): 2 products of T × T × D per head, half of them masked."""
    fwd = 4 * B * H * T * T * D / 2
    return fwd, 3.5 * fwd


def _rate(ms, nbytes=0, flops=0.0, peak_bw=None, peak_flops=None) -> str:
    if not isinstance(ms, float) or not (nbytes or flops):
        return "-"
    if flops:
        tf = flops / (ms * 1e-3) / 1e12
        return f"{tf:.0f} TFLOP/s" + (f" ({100 * tf * 1e12 / peak_flops:.0f}%)" if peak_flops else "")
    gbps = nbytes / (ms * 1e-3) / 1e9
    return f"{gbps:.0f} GB/s" + (f" ({100 * gbps / peak_bw:.0f}%)" if peak_bw else "")


def _record_pass(bench: Bench) -> None:
    """Each non-PyTorch form once, forward and backward, untimed: under TTT_LM_RECORD_LAUNCHES this
    records every Triton launch the timed run makes (kernels/_launch_cache.py)."""
    for form, run in bench.forms.items():
        if form == "torch":
            continue
        outs = run()
        torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
        for x in bench.inputs:
            x.grad = None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="*", default=None,
                   help=f"registered ops, and 'sdpa' for causal attention (default: sdpa and every op: "
                        f"{', '.join(REGISTRY)})")
    p.add_argument("--seq-lens", nargs="*", type=int, default=[2048, 8192, 32768])
    p.add_argument("--tokens", type=int, default=65536, help="B·T")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="also append one JSON line per row to this file")
    p.add_argument("--record-pass", action="store_true",
                   help="run each non-PyTorch form once, untimed (the GPU campaign's launch record)")
    p.add_argument("--list", action="store_true", help="print the registered ops and uncovered kernels/ folders")
    p.add_argument("--smoke", action="store_true",
                   help="tiny size (T=64, B=2, H=2, D=16, float32) that runs anywhere, the CPU included")
    a = p.parse_args(argv)
    if a.list:
        print(json.dumps({"ops": list(REGISTRY), "folders": FOLDERS, "without_bench": folders_without_bench()}))
        return

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.smoke:
        a.seq_lens, a.tokens, a.heads, a.head_dim, a.dtype, a.reps, a.warmup = [64], 128, 2, 16, "float32", 1, 1
    elif device != "cuda" and not a.record_pass:
        sys.exit("benchmarks/kernels.py: no CUDA device; the benchmark sizes need a GPU "
                 "(use --smoke for a tiny run through the Triton interpreter)")
    dtype = getattr(torch, a.dtype)
    ops = a.ops if a.ops is not None else ["sdpa"] + list(REGISTRY)
    unknown = [o for o in ops if o not in REGISTRY and o != "sdpa"]
    if unknown:
        sys.exit(f"benchmarks/kernels.py: unknown ops {unknown}; registered: {['sdpa'] + list(REGISTRY)}")
    if a.record_pass:
        for T in a.seq_lens:
            for op in ops:
                if op != "sdpa":
                    _record_pass(REGISTRY[op](max(1, a.tokens // T), T, a.heads, a.head_dim, dtype, device))
        return

    peak = peak_bandwidth_gbps(device)
    peak_fl = peak_flops_for(torch.cuda.get_device_name()) if device == "cuda" else None
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"# device: {dev_name}; dtype {a.dtype}; H={a.heads}, D={a.head_dim}, B·T={a.tokens}; "
          f"median of up to {a.reps}" + (f"; peak DRAM bandwidth {peak:.0f} GB/s" if peak else ""))
    print("| op | T | B | form | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd rate | fwd+bwd rate |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def emit(op, T, B, form, r, rates):
        row = {"op": op, "T": T, "B": B, "form": form, "fwd_ms": _fmt(r["fwd_ms"]), "fwd_bwd_ms": _fmt(r["fwd_bwd_ms"]),
               "fwd_mib": _fmt(r["fwd_mib"], ".0f"), "fwd_bwd_mib": _fmt(r["fwd_bwd_mib"], ".0f"),
               "fwd_rate": rates[0], "fwd_bwd_rate": rates[1]}
        print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    for T in a.seq_lens:
        B = max(1, a.tokens // T)
        for op in ops:
            if op == "sdpa":
                qkv, sdpa_run = _sdpa_form(B, T, a.heads, a.head_dim, dtype, device)
                r = _measure(sdpa_run, qkv, device, a.reps, a.warmup)
                fl = sdpa_flops(B, T, a.heads, a.head_dim)
                label = "sdpa (flash, causal)" if device == "cuda" else "sdpa (causal)"
                emit(label, T, B, "sdpa", r, [_rate(r["fwd_ms"], flops=fl[0]), _rate(r["fwd_bwd_ms"], flops=fl[1])])
                del qkv, sdpa_run
                continue
            bench = REGISTRY[op](B, T, a.heads, a.head_dim, dtype, device)
            for form, run in bench.forms.items():
                r = _measure(run, bench.inputs, device, a.reps, a.warmup)
                if bench.flops_fwd:
                    rates = [_rate(r["fwd_ms"], flops=bench.flops_fwd, peak_flops=peak_fl),
                             _rate(r["fwd_bwd_ms"], flops=bench.flops_fwd_bwd, peak_flops=peak_fl)]
                else:
                    rates = ["-", "-"] if form == "torch" else [
                        _rate(r["fwd_ms"], bench.min_bytes_fwd, peak_bw=peak),
                        _rate(r["fwd_bwd_ms"], bench.min_bytes_fwd_bwd, peak_bw=peak)]
                emit(op, T, B, form, r, rates)
            del bench
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
