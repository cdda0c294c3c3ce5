"""The chunked LM head + cross-entropy (ttt_lm.model.loss) against the plain loss: F.cross_entropy
of the float32 copy of the full logits, forward and both gradients."""
import pytest
import torch
import torch.nn.functional as F

from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.loss import linear_cross_entropy, plain_cross_entropy
from tests.model.mixer_checks import preset_config

V, D = 97, 24


def data(N, dtype, n_ignored=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.randperm(N, generator=g)[:n_ignored]] = -100
    return h, w, y


def both(h, w, y, chunk, reduction="mean"):
    """(loss, ∂h, ∂w) of the chunked loss and of the plain one, from the same leaves."""
    out = []
    for fn in (lambda: linear_cross_entropy(h, w, y, chunk_size=chunk, reduction=reduction),
               lambda: F.cross_entropy((h @ w.t()).float() if h.dtype != torch.float64 else h @ w.t(), y,
                                       ignore_index=-100, reduction=reduction)):
        h.grad = w.grad = None
        loss = fn()
        (loss * 3.0).backward()   # a non-unit upstream gradient reaches both inputs
        out.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    return out


# float64: the same sums in another order (rounding-level 1e-12); float32: 1e-5 relative (a sum of
# N·V exponentials in another order; the chunks' matrix products are blocked differently)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("N,chunk", [(77, 16), (77, 77), (5, 64), (64, 16)])
def test_equals_the_plain_loss_and_gradients(dtype, tol, N, chunk):
    """Token counts that are not a multiple of the chunk (77 = 4·16 + 13), one chunk, a chunk
    larger than the tokens, an exact multiple; ignored labels scattered among them."""
    (l1, gh1, gw1), (l2, gh2, gw2) = both(*data(N, dtype, n_ignored=min(5, N - 1)), chunk)
    assert l1.dtype == l2.dtype
    torch.testing.assert_close(l1, l2, rtol=tol, atol=tol)
    torch.testing.assert_close(gh1, gh2, rtol=tol, atol=tol)
    torch.testing.assert_close(gw1, gw2, rtol=tol, atol=tol)
    assert gh1.abs().max() > 0 and gw1.abs().max() > 0


def test_bfloat16_matches_the_plain_loss():
    """bf16 h and W: the logits' products in bf16 with float32 accumulation in both, the loss in
    float32. Loss to 1e-5 relative; gradients to bf16's resolution (2⁻⁸ relative, 2e-3 absolute
    here): the plain path rounds ∂L/∂z to bf16 after the 1/N scale, this one before, and
    accumulates ∂L/∂W over chunks in float32."""
    (l1, gh1, gw1), (l2, gh2, gw2) = both(*data(203, torch.bfloat16), 64)
    assert l1.dtype == torch.float32 and gh1.dtype == gw1.dtype == torch.bfloat16
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh1.float(), gh2.float(), rtol=2 ** -7, atol=2e-3)
    torch.testing.assert_close(gw1.float(), gw2.float(), rtol=2 ** -7, atol=2e-3)


def test_autocast_runs_the_products_in_bf16_like_nn_linear():
    """float32 leaves under CPU autocast(bf16): the chunked loss equals the plain head's under the
    same autocast (whose Linear casts h and W to bf16), not the float32 loss."""
    h, w, y = data(90, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = linear_cross_entropy(h, w, y, chunk_size=32)
        b = plain_cross_entropy(F.linear(h, w), y)
    full32 = plain_cross_entropy(h @ w.t(), y)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (a - full32).abs() > 1e-4   # bf16 products really ran
    a.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32


def test_sum_reduction_no_grad_and_nothing_to_predict():
    h, w, y = data(50, torch.float64)
    want = F.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk_size=7, reduction="sum"), want,
                               rtol=1e-12, atol=1e-12)
    with torch.no_grad():   # evaluation: no gradient buffers, same loss
        torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk_size=7), want / (y != -100).sum(),
                                   rtol=1e-12, atol=1e-12)
    # every label ignored: nan, as F.cross_entropy, and zero gradients
    y_none = torch.full_like(y, -100)
    loss = linear_cross_entropy(h, w, y_none, chunk_size=7)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(h @ w.t(), y_none, ignore_index=-100))
    linear_cross_entropy(h, w, y_none, chunk_size=7, reduction="sum").backward()
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_batched_shapes_and_bad_input():
    h, w, y = data(24, torch.float64)
    torch.testing.assert_close(linear_cross_entropy(h.view(2, 12, D), w, y.view(2, 12), chunk_size=5),
                               linear_cross_entropy(h, w, y, chunk_size=5), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match=r"weight must be \[V, D\]"):
        linear_cross_entropy(h, w[:, :-1], y)
    with pytest.raises(ValueError, match="labels must be integer"):
        linear_cross_entropy(h, w, y.float())
    with pytest.raises(ValueError, match="labels must be integer"):
        linear_cross_entropy(h, w, y[:-1])


def lm(chunk, tie=True, dtype=torch.float64):
    torch.manual_seed(0)
    # the default preset's hybrid at tiny sizes
    cfg = preset_config("tiny", 4, vocab_size=61, d_model=32, n_heads=2, n_layers=2, tie_embeddings=tie,
                        loss_chunk_size=chunk)
    return LM(cfg).to(dtype)


@pytest.mark.parametrize("tie", [True, False])
def test_lm_loss_and_every_gradient_equal_the_full_logits_path(tie):
    """LM.forward with labels (chunks of 8 over 2 × 19 = 38 tokens) against loss_chunk_size=0 (the
    full logits and F.cross_entropy), with tied and untied embeddings; float64, 1e-10."""
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, :3] = -100
    grads = []
    for chunk in (8, 0):
        m = lm(chunk, tie)
        assert (m.lm_head.weight is m.embed.weight) == tie
        out = m(x, labels=y)
        if chunk:
            assert out.logits is None   # no [B, T, V] logits in training
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l1, g1), (l2, g2) = grads
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-10)
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-10, atol=1e-10, msg=n)
    assert g1["embed.weight"].abs().max() > 0


def test_loss_chunk_size_is_checked():
    with pytest.raises(ValueError, match="model.loss_chunk_size"):
        ModelConfig(loss_chunk_size=-1).validate()
