import pytest
import torch
import torch.nn.functional as F

from kernels.ttt import ttt_linear, ttt_mlp
from kernels.ttt.torch_chunk import gelu_tanh, gelu_tanh_bwd, ln_fused_l2_bwd, ln_fwd

B, H, D = 2, 2, 8


def _inputs(kind, T, b, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    q, k, v = r(B, H, T, D), r(B, H, T, D), r(B, H, T, D)
    eta = (0.5 * torch.rand(B, H, T, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    tau = (1.0 / torch.arange(1, b + 1, dtype=torch.float64) + 0.1 * torch.randn(b, generator=g, dtype=torch.float64)
           ).to(dtype).requires_grad_()
    lw, lb = (1 + r(H, D, scale=0.1)).detach().requires_grad_(), r(H, D, scale=0.1)
    if kind == "linear":
        weights = [r(H, D, D, scale=0.3), r(H, 1, D, scale=0.1)]
    else:
        weights = [r(H, D, 4 * D, scale=0.3), r(H, 1, 4 * D, scale=0.1), r(H, 4 * D, D, scale=0.3), r(H, 1, D, scale=0.1)]
    return [q, k, v, eta, tau, lw, lb], weights


def _op(kind):
    return ttt_linear if kind == "linear" else ttt_mlp


def _run_and_grads(kind, backend, args, weights, b, w_out, initial_state=None):
    leaves = [t for t in args + weights if t is not None]
    leaves += [] if initial_state is None else [t for t in initial_state.values() if torch.is_tensor(t)]
    for t in leaves:
        t.grad = None
    out, st = _op(kind)(*args, *weights, mini_batch_size=b, initial_state=initial_state,
                        output_final_state=True, backend=backend)
    loss = (out * w_out).sum() + sum((v * v).sum() for v in st.values() if torch.is_tensor(v))
    loss.backward()
    return out.detach(), {k: v.detach() if torch.is_tensor(v) else v for k, v in st.items()}, \
        [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in leaves]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("T", [1, 4, 11])
@pytest.mark.parametrize("backend", ["torch", "primal"])
def test_matches_reference_forward_state_and_grads(kind, T, backend):
    """Dual (torch) and primal forms == the autograd-based sequential spec: output, final state
    (θ_0, carried sums, pos), and the gradient of every input. float64: rounding only, 1e-10."""
    b = 4
    args, weights = _inputs(kind, T, b)
    w_out = torch.randn(B, H, T, D, dtype=torch.float64)
    ref = _run_and_grads(kind, "reference", args, weights, b, w_out)
    got = _run_and_grads(kind, backend, args, weights, b, w_out)
    torch.testing.assert_close(got[0], ref[0], atol=1e-10, rtol=0)
    assert got[1]["pos"] == ref[1]["pos"] == T % b
    for k in ref[1]:
        if k != "pos":
            torch.testing.assert_close(got[1][k], ref[1][k], atol=1e-10, rtol=0, msg=lambda s: f"state {k}: {s}")
    for i, (g1, g0) in enumerate(zip(got[2], ref[2])):
        torch.testing.assert_close(g1, g0, atol=1e-10, rtol=1e-8, msg=lambda s: f"grad of input {i}: {s}")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("backend", ["torch", "primal"])
def test_initial_state_mid_mini_batch(kind, backend):
    """A state that stops inside a mini-batch (pos = 3 of b = 4, nonzero carried sums) continued by
    every form gives the one-pass result, and gradients reach the state's tensors."""
    b, T1, T2 = 4, 7, 6
    args, weights = _inputs(kind, T1 + T2, b)
    with torch.no_grad():
        full, _ = _op(kind)(*args, *weights, mini_batch_size=b, backend="reference")
        first = [a[:, :, :T1] if a.dim() >= 3 and a.shape[2] == T1 + T2 else a for a in args]
        _, st = _op(kind)(*first, *weights, mini_batch_size=b, output_final_state=True, backend="reference")
    assert st["pos"] == 3 and st["grad_W1"].abs().max() > 0
    second = [a[:, :, T1:].detach() if a.dim() >= 3 and a.shape[2] == T1 + T2 else a for a in args]
    st = {k: (v.clone().requires_grad_() if torch.is_tensor(v) else v) for k, v in st.items()}
    w_out = torch.randn(B, H, T2, D, dtype=torch.float64)
    none = [None] * len(weights)  # the state replaces the weights
    ref = _run_and_grads(kind, "reference", second, none, b, w_out, initial_state=st)
    got = _run_and_grads(kind, backend, second, none, b, w_out, initial_state=st)
    torch.testing.assert_close(ref[0], full[:, :, T1:], atol=1e-10, rtol=0)
    torch.testing.assert_close(got[0], ref[0], atol=1e-10, rtol=0)
    for i, (g1, g0) in enumerate(zip(got[2], ref[2])):
        torch.testing.assert_close(g1, g0, atol=1e-10, rtol=1e-8, msg=lambda s: f"grad {i}: {s}")
    assert st["grad_W1"].grad.abs().max() > 0 and st["W1"].grad.abs().max() > 0


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_float32_close_to_float64(kind):
    """The dual form in float32 stays within 1e-4 of the float64 spec at O(1) outputs (float32
    rounding through LayerNorms and a few mini-batches of updates)."""
    b, T = 4, 11
    args, weights = _inputs(kind, T, b)
    with torch.no_grad():
        ref, _ = _op(kind)(*args, *weights, mini_batch_size=b, backend="reference")
        got, _ = _op(kind)(*[a.float() for a in args], *[w.float() for w in weights], mini_batch_size=b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)


def test_mini_batch_one_is_online_gradient_descent():
    """b = 1 and token_idx = 1: W_t = W_{t−1} − η_t ∇_W ℓ(W_{t−1}; x_t) with the gradient of
    ℓ = ½‖LN(k W + b) + k − v‖² taken by torch.autograd here, independently of the closed-form
    LayerNorm gradient of the dual form; out_t = q_t + LN(q_t W_t + b_t). float64, 1e-10."""
    T = 6
    args, (W1, b1) = _inputs("linear", T, 1)
    q, k, v, eta, _, lw, lb = [a.detach() for a in args]
    W1, b1 = W1.detach(), b1.detach()
    one = torch.ones(1, dtype=torch.float64)
    got, st = ttt_linear(q, k, v, eta, one, lw, lb, W1, b1, mini_batch_size=1, output_final_state=True)

    gamma, beta = lw[:, None], lb[:, None]
    W = W1.expand(B, H, D, D).clone()
    bb = b1.expand(B, H, 1, D).clone()
    outs = []
    for t in range(T):
        kt, vt, qt = k[:, :, t:t + 1], v[:, :, t:t + 1], q[:, :, t:t + 1]
        Wg, bg = W.clone().requires_grad_(), bb.clone().requires_grad_()
        z = kt @ Wg + bg
        ln = F.layer_norm(z, (D,), eps=1e-6) * gamma + beta
        loss = 0.5 * ((ln + kt - vt) ** 2).sum()
        gW, gb = torch.autograd.grad(loss, [Wg, bg])
        e = eta[:, :, t, None, None]
        W, bb = W - e * gW, bb - e * gb
        outs.append(qt + F.layer_norm(qt @ W + bb, (D,), eps=1e-6) * gamma + beta)
    torch.testing.assert_close(got, torch.cat(outs, 2), atol=1e-10, rtol=0)
    torch.testing.assert_close(st["W1"], W, atol=1e-10, rtol=0)
    torch.testing.assert_close(st["b1"], bb, atol=1e-10, rtol=0)
    assert st["pos"] == 0 and st["grad_W1"].abs().max() == 0


def test_ln_fused_l2_bwd_is_the_gradient():
    """The closed form equals autograd of ½‖LN_γβ(x) − target‖² (float64, rounding only)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    tgt, gamma, beta = (torch.randn(3, 5, 16, generator=g, dtype=torch.float64),
                        1 + 0.2 * torch.randn(16, generator=g, dtype=torch.float64),
                        0.2 * torch.randn(16, generator=g, dtype=torch.float64))
    y = ln_fwd(x, gamma, beta)
    torch.testing.assert_close(y, F.layer_norm(x, (16,), gamma, beta, eps=1e-6), atol=1e-12, rtol=0)
    (auto,) = torch.autograd.grad(0.5 * ((y - tgt) ** 2).sum(), x)
    torch.testing.assert_close(ln_fused_l2_bwd(x, tgt, gamma, beta), auto, atol=1e-12, rtol=0)


def test_gelu_tanh_and_derivative():
    x = torch.linspace(-6, 6, 101, dtype=torch.float64, requires_grad=True)
    y = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(gelu_tanh(x), y, atol=1e-14, rtol=0)
    (auto,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gelu_tanh_bwd(x), auto, atol=1e-13, rtol=0)


def test_gradient_taken_at_mini_batch_start():
    """Seed 000: inside a mini-batch every gradient uses θ_0, yet token t's output uses θ_t. With
    b = T = 2 the second output must use W_0 − τ_1(η_0 ∇ℓ_0(W_0) + η_1 ∇ℓ_1(W_0)), which differs
    from sequential online GD (∇ℓ_1 at the already updated W)."""
    args, weights = _inputs("linear", 2, 2)
    q, k, v, eta, _, lw, lb = [a.detach() for a in args]
    W1, b1 = [w.detach() for w in weights]
    ones = torch.ones(2, dtype=torch.float64)
    mb, _ = ttt_linear(q, k, v, eta, ones, lw, lb, W1, b1, mini_batch_size=2)
    ogd, _ = ttt_linear(q, k, v, eta, ones[:1], lw, lb, W1, b1, mini_batch_size=1)
    torch.testing.assert_close(mb[:, :, 0], ogd[:, :, 0], atol=1e-12, rtol=0)  # first token: same
    assert (mb[:, :, 1] - ogd[:, :, 1]).abs().max() > 1e-6


def test_bad_shapes_are_refused():
    args, weights = _inputs("linear", 5, 4)
    with pytest.raises(ValueError, match="token_idx"):
        ttt_linear(*args[:4], args[4][:3], *args[5:], *weights, mini_batch_size=4)
    with pytest.raises(ValueError, match="eta"):
        ttt_linear(*args[:3], args[3][:, :, :4], *args[4:], *weights, mini_batch_size=4)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_bfloat16_computes_in_float32(kind):
    """bf16 inputs: the op works in float32 (state too) and rounds only its output to bf16, so
    against the float64 spec on the same (bf16-rounded) inputs the error is bf16 output rounding
    (relative 2^-8) plus float32 noise (1e-4 absolute)."""
    b, T = 4, 11
    args, weights = _inputs(kind, T, b)
    a16, w16 = [a.detach().bfloat16() for a in args], [w.detach().bfloat16() for w in weights]
    with torch.no_grad():
        ref, _ = _op(kind)(*[a.double() for a in a16], *[w.double() for w in w16], mini_batch_size=b,
                           backend="reference")
        got, st = _op(kind)(*a16, *w16, mini_batch_size=b, output_final_state=True)
    assert got.dtype == torch.bfloat16 and st["W1"].dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=2 ** -8)
