r"""TTT-Linear / TTT-MLP in PyTorch: the dual form over each mini-batch (training, prefill) and the
primal form (decoding). Both take every inner gradient of a mini-batch at W_0, the inner weights
at the start of that mini-batch, with the analytic gradient of the LayerNorm-fused L2 loss.

Notation per head (row vectors; f(x; W) = x W + b for TTT-Linear). Over a mini-batch, tokens
i = 0..n−1 at positions p+i inside it (p > 0 when a previous call stopped inside a mini-batch),
with k_i, v_i, q_i, η_i and τ_{p+i} = token_idx[p+i]:

    g_i = ∂/∂Z ½‖LN(Z) − (v_i − k_i)‖² at Z = k_i W_0 + b_0        (ln_fused_l2_bwd)
    G_i = G_{−1} + Σ_{j≤i} η_j k_jᵀ g_j,   Gb_i = Gb_{−1} + Σ_{j≤i} η_j g_j
    W_i = W_0 − τ_{p+i} G_i,               b_i = b_0 − τ_{p+i} Gb_i
    z_i = q_i W_i + b_i,                   out_i = q_i + LN(z_i)

where G_{−1}, Gb_{−1} are the sums carried over from the tokens of this mini-batch seen before
(zero when p = 0). Dual form: with E_ij = τ_{p+i} η_j for j ≤ i (else 0) and A = tril(Q Kᵀ),

    Z̄ = Q W_0 + b_0 − τ ⊙ (Q G_{−1} + Gb_{−1}) − (E ⊙ A) Γ − E Γ,     Γ = [g_0; …; g_{n−1}]

because q_i k_jᵀ g_j = (q_i·k_j) g_j: no per-token W_i is ever formed, only n×n matrices. At the
end of a full mini-batch, W_0 ← W_0 − τ_{b−1} G_{n−1} and the carried sums restart at zero.

TTT-MLP (f(x) = GELU(x W1 + b1) W2 + b2, GELU with the tanh approximation): the same per layer,
with layer 1's inputs k, q and its gradient g1 = (g2 W2ᵀ) ⊙ GELU'(Z1) (at W_0), and layer 2's
inputs X2 = GELU(k W1_0 + b1_0) (gradient side) and X̄2 = GELU(Z̄1) (output side).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

LN_EPS = 1e-6
_GELU_C = math.sqrt(2.0 / math.pi)

TTTState = Dict[str, object]
LINEAR_KEYS = ("W1", "b1")
MLP_KEYS = ("W1", "b1", "W2", "b2")


# ---- inner-model pieces ---------------------------------------------------------------------
def ln_fwd(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float = LN_EPS) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return gamma * ((x - mu) / torch.sqrt(var + eps)) + beta


def ln_fused_l2_bwd(x: torch.Tensor, target: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                    eps: float = LN_EPS) -> torch.Tensor:
    """∂/∂x ½‖γ ⊙ x̂ + β − target‖², x̂ = (x − μ)/σ, row by row:
    (D·ĝ − Σĝ − x̂ Σ(ĝ ⊙ x̂)) / (D σ) with ĝ = γ ⊙ (y − target)."""
    D = x.shape[-1]
    mu = x.mean(-1, keepdim=True)
    std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + eps)
    x_hat = (x - mu) / std
    g_hat = (gamma * x_hat + beta - target) * gamma
    return (D * g_hat - g_hat.sum(-1, keepdim=True)
            - x_hat * (g_hat * x_hat).sum(-1, keepdim=True)) / (D * std)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * x ** 3)))


def gelu_tanh_bwd(x: torch.Tensor) -> torch.Tensor:
    """d/dx of the tanh-approximated GELU."""
    t = torch.tanh(_GELU_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * x * x)


# ---- state handling -------------------------------------------------------------------------
def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def make_state(weights: Dict[str, torch.Tensor], batch_size: int, dtype: torch.dtype,
               initial_state: Optional[TTTState]) -> TTTState:
    """The state a scan starts from: W_0 at the start of the current mini-batch (per sequence),
    the carried sums grad_* of the current partial mini-batch, and the position ``pos`` in it.
    Without ``initial_state``, W_0 is ``weights`` ([H, …] broadcast over the batch, or [B, H, …])
    and pos = 0."""
    if initial_state is not None:
        st = {k: initial_state[k].to(dtype) for k in weights}
        st.update({"grad_" + k: initial_state["grad_" + k].to(dtype) for k in weights})
        st["pos"] = int(initial_state["pos"])
        return st
    st = {}
    for k, w in weights.items():
        w = w.to(dtype)
        st[k] = w.expand(batch_size, *w.shape) if w.dim() == 3 else w
        st["grad_" + k] = torch.zeros(st[k].shape, dtype=dtype, device=w.device)
    st["pos"] = 0
    return st


def _close_mini_batch(st: TTTState, keys, tau_last: torch.Tensor, full: bool) -> TTTState:
    """After a segment: at a mini-batch boundary W_0 ← W_0 − τ_{b−1} G and the sums restart."""
    if not full:
        return st
    out = {}
    for k in keys:
        out[k] = st[k] - tau_last * st["grad_" + k]
        out["grad_" + k] = torch.zeros_like(st["grad_" + k])
    out["pos"] = 0
    return out


def scan_mini_batches(segment: Callable, st: TTTState, keys, xs: List[torch.Tensor],
                      token_idx: torch.Tensor, mini_batch_size: int,
                      resets: Optional[torch.Tensor] = None):
    """Split the time axis (dim 2 of every tensor in xs) at mini-batch boundaries, counting from
    st["pos"], and run ``segment(st, *xs_seg, tau_seg)`` on each piece in order.

    ``resets`` [B, ⌈T/b⌉] bool (only from pos 0): where True, mini-batch m of that row starts
    from the scan's initial W_0 instead of the carried one (a new sequence starts there; masked
    per row, the scan itself is one pass over the batch)."""
    T = xs[0].shape[2]
    W0 = None
    if resets is not None:
        if st["pos"] != 0:
            raise ValueError("scan_mini_batches: resets need a scan that starts at a mini-batch boundary (pos 0)")
        n_mb = -(-T // mini_batch_size)
        if tuple(resets.shape) != (xs[0].shape[0], n_mb) or resets.dtype != torch.bool:
            raise ValueError(f"scan_mini_batches: resets must be bool [B, ceil(T/b)] = "
                             f"{(xs[0].shape[0], n_mb)}, got {resets.dtype} {tuple(resets.shape)}")
        W0 = {k: st[k] for k in keys}
    # the pieces' lengths: the rest of the current mini-batch, then whole ones, then the tail.
    # Each input is split once (one autograd node whose backward concatenates the pieces'
    # gradients), not sliced per piece: a slice's backward writes a zero-filled gradient of the
    # whole sequence, which made forward+backward grow quadratically with T.
    sizes, p, t = [], st["pos"], 0
    while t < T:
        n = min(mini_batch_size - p, T - t)
        sizes.append(n)
        p, t = (p + n) % mini_batch_size, t + n
    pieces = [x.split(sizes, dim=2) for x in xs]
    outs = []
    for i, n in enumerate(sizes):
        p = st["pos"]
        if W0 is not None and i > 0:   # pos is 0 here: piece i is mini-batch i
            r = resets[:, i]
            st = dict(st)
            for k in keys:
                st[k] = torch.where(r.view(-1, *[1] * (st[k].dim() - 1)), W0[k], st[k])
        o, st = segment(st, *[xp[i] for xp in pieces], token_idx[p:p + n])
        full = p + n == mini_batch_size
        st["pos"] = p + n
        st = _close_mini_batch(st, keys, token_idx[mini_batch_size - 1], full)
        outs.append(o)
    return (torch.cat(outs, dim=2) if outs else xs[0][:, :, :0]), st


# ---- dual form ------------------------------------------------------------------------------
def _eta_matrix(eta: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """E_ij = τ_i η_j for j ≤ i: [B, H, n, n]."""
    return torch.tril(tau[:, None] * eta[..., None, :])


def _dual_layer(st, name, x_out, x_in, g, eta, tau, E):
    """One inner linear layer over a segment: Z̄ (the output-side pre-activations, dual form) and
    the carried sums updated with the segment's η-weighted gradients."""
    W0, b0 = st[name[0]], st[name[1]]
    Zb = x_out @ W0 + b0 - (E * torch.tril(x_out @ x_in.transpose(-1, -2))) @ g - E @ g
    if st["pos"] > 0:  # sums from earlier tokens of this mini-batch (zero at pos 0)
        Zb = Zb - tau[:, None] * (x_out @ st["grad_" + name[0]] + st["grad_" + name[1]])
    ek = eta[..., None] * x_in
    st["grad_" + name[0]] = st["grad_" + name[0]] + ek.transpose(-1, -2) @ g
    st["grad_" + name[1]] = st["grad_" + name[1]] + (eta[..., None] * g).sum(-2, keepdim=True)
    return Zb


def _linear_segment_dual(ln_w, ln_b):
    def seg(st, q, k, v, eta, tau):
        st = dict(st)
        g = ln_fused_l2_bwd(k @ st["W1"] + st["b1"], v - k, ln_w, ln_b)
        Zb = _dual_layer(st, ("W1", "b1"), q, k, g, eta, tau, _eta_matrix(eta, tau))
        return q + ln_fwd(Zb, ln_w, ln_b), st
    return seg


def _mlp_segment_dual(ln_w, ln_b):
    def seg(st, q, k, v, eta, tau):
        st = dict(st)
        Z1 = k @ st["W1"] + st["b1"]
        X2 = gelu_tanh(Z1)
        g2 = ln_fused_l2_bwd(X2 @ st["W2"] + st["b2"], v - k, ln_w, ln_b)
        g1 = (g2 @ st["W2"].transpose(-1, -2)) * gelu_tanh_bwd(Z1)
        E = _eta_matrix(eta, tau)
        Z1b = _dual_layer(st, ("W1", "b1"), q, k, g1, eta, tau, E)
        Z2b = _dual_layer(st, ("W2", "b2"), gelu_tanh(Z1b), X2, g2, eta, tau, E)
        return q + ln_fwd(Z2b, ln_w, ln_b), st
    return seg


# ---- primal form ----------------------------------------------------------------------------
def _linear_segment_primal(ln_w, ln_b):
    def seg(st, q, k, v, eta, tau):
        st, outs = dict(st), []
        for i in range(q.shape[2]):
            qi, ki, vi, ei = q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], eta[:, :, i, None, None]
            g = ln_fused_l2_bwd(ki @ st["W1"] + st["b1"], vi - ki, ln_w, ln_b)
            st["grad_W1"] = st["grad_W1"] + ei * ki.transpose(-1, -2) @ g
            st["grad_b1"] = st["grad_b1"] + ei * g
            W, b = st["W1"] - tau[i] * st["grad_W1"], st["b1"] - tau[i] * st["grad_b1"]
            outs.append(qi + ln_fwd(qi @ W + b, ln_w, ln_b))
        return torch.cat(outs, dim=2), st
    return seg


def _mlp_segment_primal(ln_w, ln_b):
    def seg(st, q, k, v, eta, tau):
        st, outs = dict(st), []
        for i in range(q.shape[2]):
            qi, ki, vi, ei = q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], eta[:, :, i, None, None]
            Z1 = ki @ st["W1"] + st["b1"]
            X2 = gelu_tanh(Z1)
            g2 = ln_fused_l2_bwd(X2 @ st["W2"] + st["b2"], vi - ki, ln_w, ln_b)
            g1 = (g2 @ st["W2"].transpose(-1, -2)) * gelu_tanh_bwd(Z1)
            st["grad_W1"] = st["grad_W1"] + ei * ki.transpose(-1, -2) @ g1
            st["grad_b1"] = st["grad_b1"] + ei * g1
            st["grad_W2"] = st["grad_W2"] + ei * X2.transpose(-1, -2) @ g2
            st["grad_b2"] = st["grad_b2"] + ei * g2
            W1, b1 = st["W1"] - tau[i] * st["grad_W1"], st["b1"] - tau[i] * st["grad_b1"]
            W2, b2 = st["W2"] - tau[i] * st["grad_W2"], st["b2"] - tau[i] * st["grad_b2"]
            outs.append(qi + ln_fwd(gelu_tanh(qi @ W1 + b1) @ W2 + b2, ln_w, ln_b))
        return torch.cat(outs, dim=2), st
    return seg


# ---- entry points ---------------------------------------------------------------------------
def _run(kind: str, form: str, XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, weights,
         mini_batch_size, initial_state, output_final_state, resets=None):
    dt = acc_dtype(XQ.dtype)
    B, H, T, d = XQ.shape
    keys = LINEAR_KEYS if kind == "linear" else MLP_KEYS
    st = make_state(weights, B, dt, initial_state)
    ln_w = ln_weight.to(dt).reshape(H, 1, d)
    ln_b = ln_bias.to(dt).reshape(H, 1, d)
    make = {("linear", "dual"): _linear_segment_dual, ("mlp", "dual"): _mlp_segment_dual,
            ("linear", "primal"): _linear_segment_primal, ("mlp", "primal"): _mlp_segment_primal}
    seg = make[(kind, form)](ln_w, ln_b)
    out, st = scan_mini_batches(seg, st, keys, [XQ.to(dt), XK.to(dt), XV.to(dt), eta.to(dt)],
                                token_idx.to(dt), mini_batch_size, resets)
    return out.to(XQ.dtype), (st if output_final_state else None)


def ttt_linear_chunk(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size=16,
                     initial_state=None, output_final_state=False, resets=None) -> Tuple[torch.Tensor, Optional[TTTState]]:
    return _run("linear", "dual", XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, {"W1": W1, "b1": b1},
                mini_batch_size, initial_state, output_final_state, resets)


def ttt_mlp_chunk(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size=16,
                  initial_state=None, output_final_state=False, resets=None) -> Tuple[torch.Tensor, Optional[TTTState]]:
    return _run("mlp", "dual", XQ, XK, XV, eta, token_idx, ln_weight, ln_bias,
                {"W1": W1, "b1": b1, "W2": W2, "b2": b2}, mini_batch_size, initial_state, output_final_state, resets)


def ttt_linear_primal(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, mini_batch_size=16,
                      initial_state=None, output_final_state=False) -> Tuple[torch.Tensor, Optional[TTTState]]:
    return _run("linear", "primal", XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, {"W1": W1, "b1": b1},
                mini_batch_size, initial_state, output_final_state)


def ttt_mlp_primal(XQ, XK, XV, eta, token_idx, ln_weight, ln_bias, W1, b1, W2, b2, mini_batch_size=16,
                   initial_state=None, output_final_state=False) -> Tuple[torch.Tensor, Optional[TTTState]]:
    return _run("mlp", "primal", XQ, XK, XV, eta, token_idx, ln_weight, ln_bias,
                {"W1": W1, "b1": b1, "W2": W2, "b2": b2}, mini_batch_size, initial_state, output_final_state)
