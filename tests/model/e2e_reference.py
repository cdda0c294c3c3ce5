r"""An independent reference of TTT-E2E's training forward, written from the official code's
semantics (github test-time-training/e2e: ``ttt/model/transformer.py``, ``attention.py``,
``loss.py``), sharing no code with ``ttt_lm.model.e2e``.

It differs in form on purpose: one sequence at a time (each with its own fast weights), attention
of chunk i over the k, v of every earlier token of that layer kept in a list (RoPE at absolute
positions, keys t − w < j ≤ t) instead of a w-token cache at local positions (equal: RoPE's scores
depend on the position difference only), RMSNorm and SwiGLU written out, weights applied as
``x @ W.T`` of the model's parameters (read by name), the clip as the optax ``select``.

Mutations (``Mutations``) produce the wrong variants the tests must tell apart: a first-order inner
step, rotate-half RoPE, parallel prime and static MLPs, a token-weighted mean, a detached cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch


@dataclass
class Mutations:
    first_order: bool = False          # g_i without its graph (no second order)
    rotate_half: bool = False          # RoPE on halves (x_i, x_{i+d/2}) instead of pairs (x_{2i}, x_{2i+1})
    parallel_mlps: bool = False        # prime and static MLP read the same input, outputs summed
    token_mean: bool = False           # sequence loss = mean over tokens instead of over chunks
    detach_cache: bool = False         # earlier chunks' k, v without their graph


@dataclass
class RefOut:
    loss: torch.Tensor                 # batch loss
    losses: torch.Tensor               # [n_chunks, B] ℓ_i
    grad_norms: torch.Tensor           # [n_chunks − 1, B] ‖g_i‖ before the clip
    fast: List[List[List[torch.Tensor]]]   # [B][i] = flat W^{(i)} (S·3 tensors: w1, w3, w2 per block)
    logits: torch.Tensor               # [B, T, V]


def rms(x, g, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def rope(x, pos, theta, rotate_half):
    """x [H, n, d] at integer positions pos [n]."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        a = pos.to(torch.float64) * f
        c, s = torch.cos(a).to(x.dtype), torch.sin(a).to(x.dtype)
        j0, j1 = (i, i + d // 2) if rotate_half else (2 * i, 2 * i + 1)
        out[..., j0] = x[..., j0] * c - x[..., j1] * s
        out[..., j1] = x[..., j0] * s + x[..., j1] * c
    return out


def mlp(x, w1, w3, w2):
    a = x @ w1.T
    return ((a * torch.sigmoid(a)) * (x @ w3.T)) @ w2.T


def reference(P: Dict[str, torch.Tensor], cfg, input_ids: torch.Tensor, labels: torch.Tensor, rho: float = 1.0,
              mut: Optional[Mutations] = None) -> RefOut:
    """The batch loss and what the inner loop did. ``P``: parameter name → tensor (the model's
    names); ``cfg``: its ModelConfig."""
    mut = mut or Mutations()
    e = cfg.ttt_e2e
    L, S, b, w, eps = cfg.n_layers, e.suffix_len, e.inner_batch, e.window, cfg.norm_eps
    H, d = cfg.n_heads, cfg.d_model // cfg.n_heads
    B, T = input_ids.shape
    E = P["embed.weight"]

    def attn_qkv(l, x):
        p = f"layers.{l}.attn."
        q = (x @ P[p + "wq.weight"].T).view(-1, H, d).transpose(0, 1)
        k = (x @ P[p + "wk.weight"].T).view(-1, H, d).transpose(0, 1)
        v = (x @ P[p + "wv.weight"].T).view(-1, H, d).transpose(0, 1)
        return rms(q, P[p + "q_norm.weight"], eps), rms(k, P[p + "k_norm.weight"], eps), v

    def attend(l, q, qpos, k, v, kpos):
        p = f"layers.{l}.attn."
        q = rope(q, qpos, e.rope_theta, mut.rotate_half)
        k = rope(k, kpos, e.rope_theta, mut.rotate_half)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        ok = (qpos[:, None] >= kpos[None, :]) & (qpos[:, None] - kpos[None, :] < w)
        s = torch.where(ok, s, torch.full_like(s, float("-inf")))
        o = torch.softmax(s, -1) @ v                     # [H, n, d]
        return o.transpose(0, 1).reshape(-1, H * d) @ P[p + "wo.weight"].T

    def static_mlp(l, x):
        p = f"layers.{l}.mlp."
        return mlp(x, P[p + "gate_proj.weight"], P[p + "up_proj.weight"], P[p + "down_proj.weight"])

    def norm(l, name, x):
        return rms(x, P[f"layers.{l}.{name}.weight"], eps)

    all_losses, all_norms, all_fast, all_logits, seq_losses = [], [], [], [], []
    for bi in range(B):
        x = E[input_ids[bi]]                              # [T, D]
        pos = torch.arange(T)
        for l in range(L - S):                            # prefix: all tokens at once
            q, k, v = attn_qkv(l, norm(l, "seq_norm", x))
            x = x + norm(l, "seq_post_norm", attend(l, q, pos, k, v, pos))
            x = x + norm(l, "ffn_post_norm", static_mlp(l, norm(l, "ffn_norm", x)))
        h0 = x
        W = []
        for j in range(S):
            p = f"layers.{L - S + j}.prime."
            W += [P[p + "w1"], P[p + "w3"], P[p + "w2"]]
        kv_hist = [([], []) for _ in range(S)]           # per TTT block: k (pre-RoPE), v of earlier chunks
        losses, norms, fast, logits_all, tok_ce, tok_n = [], [], [], [], [], []
        starts = list(range(0, T, b))
        for i, s0 in enumerate(starts):
            s1 = min(s0 + b, T)
            qpos = torch.arange(s0, s1)
            fast.append([t.detach().clone() for t in W])
            Wi = W
            if not torch.is_grad_enabled():
                raise RuntimeError("reference needs grad mode")
            x = h0[s0:s1]
            new_kv = []
            for j in range(S):
                l = L - S + j
                q, k, v = attn_qkv(l, norm(l, "seq_norm", x))
                ks, vs = kv_hist[j]
                past_k = [t.detach() if mut.detach_cache else t for t in ks]
                past_v = [t.detach() if mut.detach_cache else t for t in vs]
                kk, vv = torch.cat(past_k + [k], 1), torch.cat(past_v + [v], 1)
                x = x + norm(l, "seq_post_norm", attend(l, q, qpos, kk, vv, torch.arange(0, s1)))
                new_kv.append((k, v))
                w1, w3, w2 = Wi[3 * j:3 * j + 3]
                if mut.parallel_mlps:
                    x = x + norm(l, "prime_post_norm", mlp(norm(l, "prime_norm", x), w1, w3, w2)) \
                        + norm(l, "ffn_post_norm", static_mlp(l, norm(l, "ffn_norm", x)))
                else:
                    x = x + norm(l, "prime_post_norm", mlp(norm(l, "prime_norm", x), w1, w3, w2))
                    x = x + norm(l, "ffn_post_norm", static_mlp(l, norm(l, "ffn_norm", x)))
            for j in range(S):
                kv_hist[j][0].append(new_kv[j][0])
                kv_hist[j][1].append(new_kv[j][1])
            logits = rms(x, P["norm.weight"], eps) @ E.T   # tied head
            logits_all.append(logits)
            y = labels[bi, s0:s1]
            m = (y != -100)
            lp = torch.log_softmax(logits, -1)
            ce = -lp.gather(-1, y.clamp_min(0)[:, None])[:, 0]
            ce = torch.where(m, ce, torch.zeros_like(ce))
            ell = ce.sum() / max(float(m.sum()), 1e-10)
            losses.append(ell)
            tok_ce.append(ce.sum())
            tok_n.append(m.sum())
            if i + 1 < len(starts):
                g = torch.autograd.grad(ell, Wi, create_graph=not mut.first_order, retain_graph=True)
                if mut.first_order:
                    g = [t.detach() for t in g]
                gn = torch.sqrt(sum((t * t).sum() for t in g))
                c = e.inner_clip
                g = [t if bool(gn < c) else t / gn * c for t in g]
                norms.append(gn)
                W = [wt - e.inner_lr * rho * gt for wt, gt in zip(Wi, g)]
        wts = torch.tensor([(min(s + b, T) - s) / b for s in starts], dtype=h0.dtype)
        if mut.token_mean:
            seq_losses.append(torch.stack(tok_ce).sum() / torch.stack(tok_n).sum().clamp_min(1))
        else:
            seq_losses.append((torch.stack(losses) * wts).sum() / wts.sum())
        all_losses.append(torch.stack(losses))
        all_norms.append(torch.stack(norms) if norms else torch.zeros(0, dtype=h0.dtype))
        all_fast.append(fast)
        all_logits.append(torch.cat(logits_all, 0))
    return RefOut(loss=torch.stack(seq_losses).mean(), losses=torch.stack(all_losses, 1),
                  grad_norms=torch.stack(all_norms, 1), fast=all_fast, logits=torch.stack(all_logits))
