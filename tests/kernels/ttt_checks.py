"""Shared by the TTT kernel tests (test_ttt_triton.py, test_ttt_mlp_triton.py)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def run_chained(op: Callable, args: Sequence[torch.Tensor], b: int, w_out: torch.Tensor, cuts: Sequence[int]):
    """``op`` (``ttt_linear`` or ``ttt_mlp``, backend "triton") over a sequence cut at ``cuts``, each
    piece continued from the previous piece's final state (decode-style chaining), with the loss
    of the tests' ``_run`` (Σ out ⊙ w + Σ‖final state‖², through .float() so that the gradients
    round alike). ``args``: XQ, XK, XV, η [B, H, T, …] first, then the rest of the op's inputs.
    Returns (output, final state, the gradient of every input), as ``_run`` does; asserts each
    piece ends at pos = its end mod b."""
    for t in args:
        t.grad = None
    T = args[0].shape[2]
    outs, st = [], None
    bounds = (0, *cuts, T)
    for t0, t1 in zip(bounds[:-1], bounds[1:]):
        xs = [x[:, :, t0:t1] for x in args[:4]]
        o, st = op(*xs, *args[4:], mini_batch_size=b, initial_state=st, output_final_state=True,
                   backend="triton")
        assert st["pos"] == t1 % b
        outs.append(o)
    out = torch.cat(outs, dim=2)
    loss = (out.float() * w_out).sum() + sum((v.float() ** 2).sum() for v in st.values() if torch.is_tensor(v))
    loss.backward()
    return (out.detach(), {k: (v.detach() if torch.is_tensor(v) else v) for k, v in st.items()},
            [t.grad.clone() for t in args])
