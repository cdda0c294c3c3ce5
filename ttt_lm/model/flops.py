"""FLOPs per token of a model, from its config: the one function MFU logging and the scaling-law
scripts both call.

    forward = 2 · N_matmul + Σ_layers mixer_class(kind).flops_per_token(cfg, seq_len)
    train   = 3 · forward            (backward ≈ 2 × forward)

N_matmul counts every parameter with two or more dimensions except the input embedding, plus the
LM head even when it is tied to the embedding (the head's matmul runs either way). A weight
matrix W applied to one token costs 2·|W| FLOPs (a multiply and an add per entry); depthwise
convolutions ([C, 1, K]) and a fast-weight mixer's initial state W_0 applied to the token cost the
same 2·|W|. What a mixer does beyond that (attention scores, inner-model gradient steps, scans) is
its own ``flops_per_token``; a parameter whose per-token cost the mixer counts there itself (LaCT's
initial fast weights, low-rank factors and per-channel scales) carries ``_flops_not_per_token``
and is left out of N_matmul. Norms, biases and elementwise gates are left out, as in Kaplan et al.
(2020) and the PaLM MFU convention.
"""
from __future__ import annotations

from typing import Dict

import torch

from ttt_lm.model.config import ModelConfig
from ttt_lm.model.mixers import mixer_class


def matmul_params(cfg: ModelConfig) -> int:
    """N_matmul of the model, counted on a meta-device copy (no memory, no init cost)."""
    from ttt_lm.model.lm import LM

    try:
        with torch.device("meta"):
            model = LM(cfg)
    except Exception:  # a mixer init that cannot run on meta tensors: count on CPU instead
        model = LM(cfg)
    n = 0
    for name, p in model.named_parameters():  # tied weights are listed once, under embed
        if p.ndim >= 2 and p is not model.embed.weight and not getattr(p, "_flops_not_per_token", False):
            n += p.numel()
    n += model.lm_head.weight.numel() if cfg.tie_embeddings else 0
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> Dict[str, float]:
    """{"forward": F, "train": 3F} FLOPs per token for sequences of seq_len tokens (a model variant
    with blocks of its own, ``reads_layer_pattern`` False, counts its own: TTT-E2E's)."""
    from ttt_lm.model.lm import model_class
    cls = model_class(cfg)
    if not cls.reads_layer_pattern:
        return cls.flops_per_token(cfg, seq_len)
    fwd = 2.0 * matmul_params(cfg)
    for kind in cfg.layer_kinds():
        fwd += float(mixer_class(kind).flops_per_token(cfg, seq_len))
    return {"forward": fwd, "train": 3.0 * fwd}
