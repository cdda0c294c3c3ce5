import pytest
import torch

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers.ttt import TTTLinear, TTTMLP

# b = 4 so that T = 11 spans two full mini-batches and a partial one
CASES = [
    ("ttt_linear", {"ttt": {"mini_batch_size": 4}}),
    ("ttt_linear", {"ttt": {"mini_batch_size": 4, "use_gate": True, "share_qk": True}}),
    ("ttt_mlp", {"ttt": {"mini_batch_size": 4}}),
    ("ttt_mlp", {"ttt": {"mini_batch_size": 4, "use_gate": True, "share_qk": True}}),
]


def _perturb(m, seed=5):
    """Move the parameters that init leaves at a symmetric point (learnable_token_idx = 0,
    LN γ = 1, β = 0, zero biases) so that every gradient path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n in ("learnable_token_idx", "ttt_norm_weight", "ttt_norm_bias", "b1", "b2",
                     "learnable_ttt_lr_bias", "post_norm.weight", "post_norm.bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            if n in ("W1", "W2"):  # official 0.02 init makes f(k) tiny; a larger W tests more
                p.mul_(10.0)
    return m


@pytest.mark.parametrize("kind,kw", CASES)
@pytest.mark.parametrize("T", [1, 11])
def test_chunked_matches_reference(kind, kw, T):
    m, _ = make_mixer(kind, **kw)
    check_chunked_vs_reference(_perturb(m), T)


@pytest.mark.parametrize("kind,kw", CASES)
def test_decode_and_segments(kind, kw):
    m, _ = make_mixer(kind, **kw)
    check_decode(_perturb(m), 11)   # cut at 5: the second segment starts inside a mini-batch


@pytest.mark.parametrize("kind,kw", CASES)
def test_segments_at_every_cut(kind, kw):
    """forward(x2, state=forward(x1).state) == forward(x1 ++ x2) for every split point, including
    cuts on and off mini-batch boundaries, and a three-way split."""
    m, _ = make_mixer(kind, **kw)
    _perturb(m)
    torch.manual_seed(6)
    x = torch.randn(2, 10, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        y, _ = m(x)
        for cut in range(1, 10):
            y1, s1 = m(x[:, :cut], output_state=True)
            y2, _ = m(x[:, cut:], state=s1)
            # float64 rounding only
            torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-10, rtol=0)
        y1, s = m(x[:, :3], output_state=True)
        y2, s = m(x[:, 3:6], state=s, output_state=True)
        y3, s = m(x[:, 6:], state=s, output_state=True)
        torch.testing.assert_close(torch.cat([y1, y2, y3], 1), y, atol=1e-10, rtol=0)
        assert s.pos == 10 % 4


@pytest.mark.parametrize("kind,kw", CASES)
def test_causal(kind, kw):
    m, _ = make_mixer(kind, **kw)
    check_causal(_perturb(m), 12)


@pytest.mark.parametrize("kind", ["ttt_linear", "ttt_mlp"])
def test_gradcheck(kind):
    m, _ = make_mixer(kind, d_model=8, n_heads=2, ttt={"mini_batch_size": 2, "use_gate": True, "share_qk": True})
    check_gradcheck(_perturb(m), T=5)


@pytest.mark.parametrize("kind,kw", CASES)
def test_outer_loss_trains_projections_and_lr(kind, kw):
    """The inner update stays in the autograd graph: K, V, Q, θ_η and token_idx all get gradients."""
    m, _ = make_mixer(kind, **kw)
    x = torch.randn(2, 11, m.d_model, dtype=torch.float64)
    y, _ = m(x)
    (y * torch.randn_like(y)).sum().backward()
    names = ["q_proj.weight", "v_proj.weight", "learnable_ttt_lr_weight", "learnable_ttt_lr_bias",
             "learnable_token_idx", "W1", "b1", "ttt_norm_weight", "ttt_norm_bias"]
    names += ["conv_q.weight", "conv_k.weight", "g_proj.weight"] if kw["ttt"].get("share_qk") else ["k_proj.weight"]
    params = dict(m.named_parameters())
    for n in names:
        assert params[n].grad is not None and params[n].grad.abs().max() > 1e-8, n


def test_parameter_names_and_shapes_match_official():
    """The names and shapes of ttt-lm-pytorch's TTTLinear / TTTMLP (hidden 32, 2 heads, b = 4)."""
    H, d, D, b = 2, 16, 32, 4
    common = {"q_proj.weight": (D, D), "k_proj.weight": (D, D), "v_proj.weight": (D, D),
              "o_proj.weight": (D, D), "learnable_token_idx": (b,), "learnable_ttt_lr_weight": (H, 1, D),
              "learnable_ttt_lr_bias": (H, 1), "ttt_norm_weight": (H, d), "ttt_norm_bias": (H, d),
              "post_norm.weight": (D,), "post_norm.bias": (D,)}
    lin = {**common, "W1": (H, d, d), "b1": (H, 1, d)}
    mlp = {**common, "W1": (H, d, 4 * d), "b1": (H, 1, 4 * d), "W2": (H, 4 * d, d), "b2": (H, 1, d)}
    for cls, kind, want in ((TTTLinear, "ttt_linear", lin), (TTTMLP, "ttt_mlp", mlp)):
        m = cls(tiny_cfg(kind, ttt={"mini_batch_size": b}), 0)
        assert {n: tuple(p.shape) for n, p in m.state_dict().items()} == want
        gated = cls(tiny_cfg(kind, ttt={"mini_batch_size": b, "share_qk": True, "use_gate": True}), 0)
        got = {n: tuple(p.shape) for n, p in gated.state_dict().items()}
        want_g = {k: v for k, v in want.items() if k != "k_proj.weight"}
        want_g.update({"g_proj.weight": (D, D), "conv_q.weight": (D, 1, 4), "conv_q.bias": (D,),
                       "conv_k.weight": (D, 1, 4), "conv_k.bias": (D,)})
        assert got == want_g


def test_reset_parameters_is_official_init():
    torch.manual_seed(0)
    m = TTTMLP(tiny_cfg("ttt_mlp", d_model=64, n_heads=2), 0)
    m.reset_parameters()
    assert abs(m.W1.std().item() - 0.02) < 0.002 and abs(m.W2.std().item() - 0.02) < 0.002
    assert abs(m.learnable_ttt_lr_weight.std().item() - 0.02) < 0.006
    for n in ("b1", "b2", "learnable_ttt_lr_bias", "learnable_token_idx", "ttt_norm_bias", "post_norm.bias"):
        assert dict(m.named_parameters())[n].abs().max() == 0, n
    assert (m.ttt_norm_weight == 1).all() and (m.post_norm.weight == 1).all()
    assert m.base_lr == 0.1 and TTTLinear(tiny_cfg("ttt_linear"), 0).base_lr == 1.0
    assert TTTLinear(tiny_cfg("ttt_linear", ttt={"base_lr": 0.5}), 0).base_lr == 0.5


def test_rope_positions_restart_every_mini_batch():
    """RoPE at t mod b: the same token at positions 1 and 1 + b (2 and 2 + b) gets the same rotated
    q (k), and a different one at positions 1 and 2."""
    m, _ = make_mixer("ttt_linear", ttt={"mini_batch_size": 4})
    x = torch.randn(1, 1, m.d_model, dtype=torch.float64).expand(1, 9, m.d_model)
    inp, _ = m.inputs(x)
    XQ, XK = inp["q"], inp["k"]
    torch.testing.assert_close(XQ[:, :, 1], XQ[:, :, 5], atol=1e-12, rtol=0)
    torch.testing.assert_close(XK[:, :, 2], XK[:, :, 6], atol=1e-12, rtol=0)
    assert (XQ[:, :, 1] - XQ[:, :, 2]).abs().max() > 1e-6


def test_rope_is_interleaved_pairs():
    """The official permute → half-split RoPE → unpermute rotates pairs (2i, 2i+1) by angle p·θ^(−2i/d)."""
    m, _ = make_mixer("ttt_linear", ttt={"mini_batch_size": 4})
    x = torch.randn(1, 4, m.d_model, dtype=torch.float64)
    XQ = m.inputs(x)[0]["q"]
    raw = m.q_proj(x).view(1, 4, m.n_heads, m.hd).transpose(1, 2)
    d, p = m.hd, 3
    ang = p * m.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, bb = raw[:, :, p, 0::2], raw[:, :, p, 1::2]
    torch.testing.assert_close(XQ[:, :, p, 0::2], a * ang.cos() - bb * ang.sin(), atol=1e-12, rtol=0)
    torch.testing.assert_close(XQ[:, :, p, 1::2], bb * ang.cos() + a * ang.sin(), atol=1e-12, rtol=0)


def test_flops_per_token():
    """Dual-form work per token minus the k·W_0 product that the parameter-shape count of
    ttt_lm.model.flops already holds (2 FLOPs per entry of W1, W2)."""
    cfg = tiny_cfg("ttt_linear", ttt={"mini_batch_size": 16})
    d, b, H = cfg.hd, 16, cfg.n_heads
    assert TTTLinear.flops_per_token(cfg, 2048) == H * (6 * d * d + 6 * b * d) - 2 * H * d * d
    m = 4 * d
    assert TTTMLP.flops_per_token(cfg, 2048) == H * (14 * d * m + 6 * b * d + 6 * b * m) - 2 * H * 2 * d * m


def test_in_language_model_with_pre_conv():
    """A full LM of TTT-Linear/TTT-MLP blocks with pre_conv: chunked == reference, and
    generation state carries through prefill + decode."""
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, layer_pattern=["ttt_linear", "ttt_mlp"])
    cfg.ttt.mini_batch_size = 4
    cfg.ttt.pre_conv = True
    torch.manual_seed(0)
    lm = LM(cfg).double()
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        a = lm(ids).logits
        b = lm.set_impl("reference")(ids).logits
        lm.set_impl("chunked")
        out = lm(ids[:, :5], output_states=True)
        logits, st = lm.step(ids[:, 5], out.states)
        logits2, _ = lm.step(ids[:, 6], st)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)  # float64 rounding
    torch.testing.assert_close(logits, a[:, 5], atol=1e-9, rtol=0)
    torch.testing.assert_close(logits2, a[:, 6], atol=1e-9, rtol=0)


@pytest.mark.parametrize("kind", ["ttt_linear", "ttt_mlp"])
def test_both_ttt_kinds_run_their_triton_kernel_on_cuda(kind):
    """kernels/ttt has a Triton kernel for each inner model: auto and triton pick it on CUDA."""
    from tests.model.mixer_checks import short_config
    cfg = short_config(kind)
    for backend in ("auto", "triton"):
        cfg.kernel_backend = backend
        assert LM(cfg).kernel_backends("cuda") == {kind: "triton"}
