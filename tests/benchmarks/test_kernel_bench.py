"""The FLOP counts ``benchmarks/kernels.py`` reports for LaCT, against the matrix products the op
actually runs (torch's FLOP counter, on the CPU), and the rate strings built from them."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels.lact import block_causal_lact_swiglu

_spec = importlib.util.spec_from_file_location(
    "kernels_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py")
kb = importlib.util.module_from_spec(_spec)
sys.modules["kernels_bench"] = kb            # its dataclasses look their module up
_spec.loader.exec_module(kb)


@pytest.mark.parametrize("T,chunk", [(20, 8), (24, 8), (8, 8), (5, 8), (17, 4)])
def test_lact_flops_count_the_ops_matrix_products(T, chunk):
    """Forward: every bmm the op runs, with the last chunk (full or partial) read and not written;
    forward+backward: 3 × that, each product's backward being two products of its size."""
    B, H, D = 2, 3, 8
    torch.manual_seed(0)
    q, k, v = (torch.nn.functional.normalize(torch.randn(B, H, T, D), dim=-1).requires_grad_() for _ in range(3))
    lrs = [(1e-3 * torch.rand(B, H, T)).requires_grad_() for _ in range(3)]
    mom = torch.rand(B, H, T, requires_grad=True)
    ws = [(torch.randn(H, D, D) / D ** 0.5).requires_grad_() for _ in range(3)]
    fwd, fwd_bwd = kb.lact_flops(B, T, H, D, chunk)
    with FlopCounterMode(display=False) as fc:
        o, _ = block_causal_lact_swiglu(q, k, v, *lrs, *ws, chunk_size=chunk, momentum=mom)
    assert fc.get_total_flops() == fwd
    with FlopCounterMode(display=False) as fc:
        o, _ = block_causal_lact_swiglu(q, k, v, *lrs, *ws, chunk_size=chunk, momentum=mom)
        o.sum().backward()
    assert fc.get_total_flops() == fwd_bwd


def test_rates_in_tflops_with_the_share_of_peak():
    assert kb._rate(2.0, flops=989e9, peak_flops=989e12) == "494 TFLOP/s (50%)"
    assert kb._rate(2.0, flops=989e9) == "494 TFLOP/s"
    assert kb._rate("OOM", flops=1e9) == "-"
