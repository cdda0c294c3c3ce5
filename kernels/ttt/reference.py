r"""The specification of TTT-Linear / TTT-MLP (Sun et al. 2024): one token at a time, with the
inner gradient taken by ``torch.autograd`` of the inner loss itself, so that nothing here depends
on the hand-derived LayerNorm gradient or the dual form of ``torch_chunk.py``.

Per head, with θ = (W1, b1) (TTT-Linear: f(x; θ) = x W1 + b1) or (W1, b1, W2, b2) (TTT-MLP:
f(x; θ) = GELU_tanh(x W1 + b1) W2 + b2), row vectors, and mini-batch size b:

    ℓ(θ; k, v) = ½ ‖LN_γβ(f(k; θ)) − (v − k)‖²          (= ½‖LN(f(θ_K x)) + θ_K x − θ_V x‖²)

    for token t at position p = t mod b inside its mini-batch (counted from the state's pos):
        p = 0:       θ_0 ← current θ (the state at the start of the mini-batch), G ← 0
        G ← G + η_t ∇_θ ℓ(θ_0; k_t, v_t)          every gradient of the mini-batch is taken at θ_0
        θ_t = θ_0 − token_idx[p] · G
        out_t = q_t + LN_γβ(f(q_t; θ_t))
        p = b − 1:   the state becomes θ_t

The ½ is the official convention (its gradient is LN's Jacobian times LN(Z) − (v − k)).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

LN_EPS = 1e-6


def _ln(x, gamma, beta):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return gamma * (x - mu) / torch.sqrt(var + LN_EPS) + beta


def _f(x, th: Dict[str, torch.Tensor]):
    z = x @ th["W1"] + th["b1"]
    if "W2" in th:
        z = F.gelu(z, approximate="tanh") @ th["W2"] + th["b2"]
    return z


def _ttt_ref(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, weights: Dict[str, torch.Tensor],
             mini_batch_size: int, initial_state, output_final_state):
    dt = torch.float32 if XQ.dtype in (torch.float16, torch.bfloat16) else XQ.dtype
    B, H, T, d = XQ.shape
    keys = list(weights)
    outer_grad = torch.is_grad_enabled()
    gamma, beta = ln_weight.to(dt).reshape(H, 1, d), ln_bias.to(dt).reshape(H, 1, d)
    with torch.enable_grad():  # the inner gradient needs autograd even when decoding under no_grad
        if initial_state is None:
            th0 = {k: (w.to(dt).expand(B, *w.shape) if w.dim() == 3 else w.to(dt)).clone() for k, w in weights.items()}
            G = {k: torch.zeros_like(v) for k, v in th0.items()}
            pos = 0
        else:
            th0 = {k: initial_state[k].to(dt) for k in keys}
            G = {k: initial_state["grad_" + k].to(dt) for k in keys}
            pos = int(initial_state["pos"])
        # autograd.grad needs θ_0 in a graph; a leaf copy where it is not (no_grad callers)
        th0 = {k: (v if v.requires_grad else v.detach().requires_grad_()) for k, v in th0.items()}
        outs = []
        for t in range(T):
            q, k, v = (X[:, :, t:t + 1].to(dt) for X in (XQ, XK, XV))
            e = eta[:, :, t].to(dt)[:, :, None, None]
            loss = 0.5 * ((_ln(_f(k, th0), gamma, beta) - (v - k)) ** 2).sum()
            grads = torch.autograd.grad(loss, [th0[n] for n in keys], create_graph=outer_grad)
            G = {n: G[n] + e * g for n, g in zip(keys, grads)}
            th_t = {n: th0[n] - token_idx[pos].to(dt) * G[n] for n in keys}
            outs.append(q + _ln(_f(q, th_t), gamma, beta))
            pos += 1
            if pos == mini_batch_size:
                th0, G, pos = th_t, {n: torch.zeros_like(g) for n, g in G.items()}, 0
                th0 = {n: (w if w.requires_grad else w.detach().requires_grad_()) for n, w in th0.items()}
        out = torch.cat(outs, dim=2)
    final = None
    if output_final_state:
        final = {**{n: th0[n] for n in keys}, **{"grad_" + n: G[n] for n in keys}, "pos": pos}
    if not outer_grad:
        out = out.detach()
        if final is not None:
            final = {n: (x.detach() if torch.is_tensor(x) else x) for n, x in final.items()}
    return out.to(XQ.dtype), final


def ttt_linear_ref(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size=16,
                   initial_state: Optional[dict] = None, output_final_state: bool = False
                   ) -> Tuple[torch.Tensor, Optional[dict]]:
    return _ttt_ref(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, {"W1": W1, "b1": b1},
                    mini_batch_size, initial_state, output_final_state)


def ttt_mlp_ref(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size=16,
                initial_state: Optional[dict] = None, output_final_state: bool = False
                ) -> Tuple[torch.Tensor, Optional[dict]]:
    return _ttt_ref(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, {"W1": W1, "b1": b1, "W2": W2, "b2": b2},
                    mini_batch_size, initial_state, output_final_state)
