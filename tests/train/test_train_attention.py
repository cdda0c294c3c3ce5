"""The trainer's FLOPs count (MFU logging, the scaling-law scripts) for global and local attention:
the projections, the head and the attention's own work, which grows with the context only for
global attention."""
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.flops import flops_per_token, matmul_params


def tiny_model_cfg(kind: str = "attention", **kw):
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_pattern=[kind], **kw)


def test_flops_per_token_counts_projections_head_and_attention():
    cfg = tiny_model_cfg()
    d, ff, V, T = 32, cfg.ff, 64, 16
    per_layer = 4 * d * d + 3 * d * ff          # q, k, v, o and the gated MLP's three matrices
    assert matmul_params(cfg) == 2 * per_layer + V * d  # + LM head (tied: counted anyway)
    attn = 4.0 * cfg.n_heads * cfg.hd * (T + 1) / 2.0   # q·k and p·v over (T+1)/2 keys on average
    f = flops_per_token(cfg, T)
    assert f["forward"] == 2.0 * (2 * per_layer + V * d) + 2 * attn
    assert f["train"] == 3 * f["forward"]
    # tying changes the parameter count, not the work
    assert flops_per_token(tiny_model_cfg(tie_embeddings=False), T) == f


def test_flops_grows_with_context_for_global_not_local_attention():
    g = tiny_model_cfg()
    loc = tiny_model_cfg("local_attention")
    loc.attention.window = 8
    assert flops_per_token(g, 64)["forward"] > flops_per_token(g, 32)["forward"]
    # beyond the window each query sees `window` keys: the per-token cost approaches a constant
    a, b = flops_per_token(loc, 4096)["forward"], flops_per_token(loc, 8192)["forward"]
    assert abs(a - b) / a < 1e-3
