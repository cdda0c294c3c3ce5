import dataclasses

import pytest
import torch
from scipy import stats

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer)
from ttt_lm.model.mixers.rglru import RGLRUBlock, RGLRUState, lambda_init

CASES = [
    {"rglru": {"chunk_size": 4}},
    {"rglru": {"chunk_size": 3, "lru_width": 48, "num_heads": 4, "conv_width": 2}},
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("T", [1, 7, 16])
def test_chunked_matches_reference(kw, T):
    m, _ = make_mixer("rglru", **kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kw", CASES)
def test_decode_and_segments(kw):
    m, _ = make_mixer("rglru", **kw)
    check_decode(m, 11)   # 11 and the cut at 5 are not multiples of the chunk sizes 4 and 3


@pytest.mark.parametrize("kw", CASES)
def test_causal(kw):
    m, _ = make_mixer("rglru", **kw)
    check_causal(m, 12)


def test_gradcheck():
    m, _ = make_mixer("rglru", d_model=8, n_heads=2, rglru={"chunk_size": 2})
    check_gradcheck(m, T=5)


def _a_pow_c(Lambda: torch.Tensor, c: float) -> torch.Tensor:
    return torch.sigmoid(Lambda.double()) ** c


def test_lambda_init_paper_gives_uniform_a_pow_c():
    """a_init=paper: a^c over 4096 channels must look like U[0.9, 0.999] (KS test, p > 0.01); the
    linspace over Λ used by some reimplementations must be rejected by the same test, so the
    test has power."""
    torch.manual_seed(0)
    n, c, lo, hi = 4096, 8.0, 0.9, 0.999
    ac = _a_pow_c(lambda_init(n, c, lo, hi, "paper"), c).numpy()
    assert ac.min() >= lo - 1e-12 and ac.max() <= hi + 1e-12
    assert stats.kstest(ac, stats.uniform(loc=lo, scale=hi - lo).cdf).pvalue > 0.01
    linspace = torch.linspace(-4.323, -9.0, n)  # σ(−Λ)-style decays, exponentially biased to 1
    a_lin = torch.exp(-c * torch.nn.functional.softplus(linspace.double()))
    assert stats.kstest(a_lin.numpy(), stats.uniform(loc=lo, scale=hi - lo).cdf).pvalue < 1e-6
    even = torch.linspace(lo, hi, n, dtype=torch.float64) ** (1 / c)  # even a^c grid mapped through Λ
    lam_lin = torch.linspace(float(torch.logit(even[0])), float(torch.logit(even[-1])), n)
    assert stats.kstest(_a_pow_c(lam_lin, c).numpy(), stats.uniform(loc=lo, scale=hi - lo).cdf).pvalue < 1e-6


def test_lambda_init_official_gives_uniform_a_squared():
    """a_init=official (recurrentgemma's rnn_param_init): a ∈ [0.9, 0.999] with a² ~ U[0.81,
    0.998] (KS p > 0.01), so the decay at r = 1, a^8, spans [0.43, 0.992]. The same KS test
    rejects the paper-text init, and the two inits' a differ by a KS distance of ≈ 0.87."""
    torch.manual_seed(0)
    n, c, lo, hi = 4096, 8.0, 0.9, 0.999
    a = torch.sigmoid(lambda_init(n, c, lo, hi, "official"))
    assert a.min() >= lo - 1e-9 and a.max() <= hi + 1e-9
    a2_dist = stats.uniform(loc=lo ** 2, scale=hi ** 2 - lo ** 2).cdf
    assert stats.kstest((a ** 2).numpy(), a2_dist).pvalue > 0.01
    ac = (a ** c).numpy()
    assert ac.min() < 0.45 and ac.max() > 0.99            # [0.43, 0.992], not [0.9, 0.999]
    a_paper = torch.sigmoid(lambda_init(n, c, lo, hi, "paper"))
    assert stats.kstest((a_paper ** 2).numpy(), a2_dist).pvalue < 1e-6
    d = stats.ks_2samp(a.numpy(), a_paper.numpy()).statistic
    assert 0.8 < d < 0.95, d


def test_lambda_init_official_matches_rnn_param_init_steps():
    """Λ is −a_param of recurrentgemma's recipe, step for step on the same uniform draws:
    u ~ U[min² + 1e-8, max² + 1e-8], log a = ½ log u, a_param = log(exp(−log a) − 1)."""
    g = torch.Generator().manual_seed(7)
    lam = lambda_init(512, 8.0, 0.9, 0.999, "official", generator=g)
    g = torch.Generator().manual_seed(7)
    u = torch.empty(512, dtype=torch.float64).uniform_(0.9 ** 2 + 1e-8, 0.999 ** 2 + 1e-8, generator=g)
    a_param = torch.log(torch.exp(-0.5 * torch.log(u)) - 1.0)
    torch.testing.assert_close(lam, -a_param, atol=1e-10, rtol=0)
    # a = exp(−softplus(a_param)) there, σ(Λ) here
    torch.testing.assert_close(torch.sigmoid(lam), torch.exp(-torch.nn.functional.softplus(a_param)),
                               atol=1e-12, rtol=0)


def test_lambda_init_rejects_unknown_mode():
    with pytest.raises(ValueError, match="a_init must be one of"):
        lambda_init(8, 8.0, 0.9, 0.999, "linspace")
    with pytest.raises(ValueError, match="model.rglru.a_init"):
        make_mixer("rglru", rglru={"a_init": "uniform"})


@pytest.mark.parametrize("a_init", ["official", "paper"])
def test_module_init_follows_a_init(a_init):
    """After the model's generic init, the block's own Λ still follows model.rglru.a_init."""
    m, cfg = make_mixer("rglru", d_model=64, n_heads=4, rglru={"lru_width": 2048, "num_heads": 8, "a_init": a_init})
    a = torch.sigmoid(m.Lambda.detach().double())
    if a_init == "official":
        sample, dist = (a ** 2).numpy(), stats.uniform(loc=0.81, scale=0.999 ** 2 - 0.81).cdf
    else:
        sample, dist = (a ** cfg.rglru.c).numpy(), stats.uniform(loc=0.9, scale=0.099).cdf
    assert stats.kstest(sample, dist).pvalue > 0.01
    # block-diagonal gates: N(0, 1/block) inside the blocks
    assert abs(m.gate_a.weight.std().item() - (1 / 256) ** 0.5) < 0.01


def _by_hand(m, c, x, seg, h0=None):
    """The RG-LRU block's h from the equations, one channel vector at a time (float64): reset
    (h = i ⊙ x, no √(1 − a²)) where seg = 0, and the conv reading only seg_t + 1 inputs back."""
    w = m.conv1d.width
    u = m.linear_x(x)
    W, bias = m.conv1d.conv.weight[:, 0, :], m.conv1d.conv.bias
    T = x.shape[1]
    xb = torch.stack([bias + sum(W[:, w - 1 - j] * u[:, t - j] for j in range(w) if j <= t and j <= seg[t])
                      for t in range(T)], 1)
    r = torch.sigmoid(m.gate_a(xb))
    i = torch.sigmoid(m.gate_x(xb))
    a = torch.sigmoid(m.Lambda) ** (c * r)
    h = torch.zeros_like(xb[:, 0]) if h0 is None else h0
    hs = []
    for t in range(T):
        if seg[t] == 0:
            h = i[:, t] * xb[:, t]
        else:
            h = a[:, t] * h + torch.sqrt(1 - a[:, t] ** 2) * (i[:, t] * xb[:, t])
        hs.append(h)
    return torch.stack(hs, 1)


PACKED = [5, 6, 7, 0, 1, 2, 3, 4, 5, 0, 0, 1, 2]      # starts inside a document; resets at 3, 9, 10


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_segment_pos_resets_as_recurrentgemma(impl):
    """Packed rows with segment positions: a row that starts inside a document normalizes its
    first token by √(1 − a²) (no reset there), the state and the conv restart where
    segment_pos = 0 (one-token documents included), compared with the equations by hand."""
    m, cfg = make_mixer("rglru", rglru={"chunk_size": 4})
    m.impl = impl
    torch.manual_seed(5)
    T = len(PACKED)
    x = torch.randn(2, T, m.d_model, dtype=torch.float64)
    seg = torch.tensor([PACKED, list(range(T))])
    with torch.no_grad():
        _, st = m(x, segment_pos=seg, output_state=True)
        hs = [_by_hand(m, cfg.rglru.c, x[b:b + 1], seg[b].tolist()) for b in range(2)]
        torch.testing.assert_close(st.h, torch.cat([h[:, -1] for h in hs]), atol=1e-12, rtol=0)
        # the outputs: W_out(h ⊙ GeLU branch)
        y, _ = m(x, segment_pos=seg)
        gelu_y = torch.nn.functional.gelu(m.linear_y(x), approximate="tanh")
        torch.testing.assert_close(y, m.linear_out(torch.cat(hs) * gelu_y), atol=1e-12, rtol=0)
        # without segment positions the first token is a stream start: unnormalized, so different
        y0, _ = m(x[:1])
        assert (y0[:, 0] - y[:1, 0]).abs().max() > 1e-3


def test_segment_pos_chunked_matches_reference_with_gradients():
    """The chunked form with resets inside rows (packed sequences) equals the reference in
    outputs and every gradient (float64)."""
    m, _ = make_mixer("rglru", rglru={"chunk_size": 3})
    torch.manual_seed(6)
    T = len(PACKED)
    x = torch.randn(2, T, m.d_model, dtype=torch.float64, requires_grad=True)
    h0 = RGLRUState(conv=torch.randn(2, m.width, 3, dtype=torch.float64), h=torch.randn(2, m.width, dtype=torch.float64),
                    pos=5)
    seg = torch.tensor([PACKED, list(range(5, 5 + T))])
    wts = torch.randn(2, T, m.d_model, dtype=torch.float64)
    res = []
    for impl in ("reference", "chunked"):
        m.impl = impl
        m.zero_grad()
        x.grad = None
        y, st = m(x, state=h0, output_state=True, segment_pos=seg)
        ((y * wts).sum() + st.h.sum()).backward()
        res.append([y.detach(), st.h.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(res[1], res[0]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_segment_pos_triton_equals_torch():
    """Resets inside rows with kernel_backend="triton" (the linear-scan kernel's cu_seqlens,
    under the interpreter) against "torch": outputs, final state and every gradient (float64)."""
    m, _ = make_mixer("rglru", d_model=16, n_heads=2, rglru={"chunk_size": 4})
    torch.manual_seed(9)
    T = len(PACKED)
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, T, 16, dtype=torch.float64)
    seg = torch.tensor([PACKED, list(range(2, 2 + T))])
    res = []
    for backend in ("torch", "triton"):
        m.kernel_backend = backend
        m.zero_grad()
        x.grad = None
        y, st = m(x, None, True, segment_pos=seg)
        ((y * w).sum() + st.h.sum()).backward()
        res.append([y.detach(), st.h.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, r in zip(res[1], res[0]):
        torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9)


def test_documents_triton_take_the_layout_offsets(monkeypatch):
    """With the LM's ``DocLayout`` (packed documents) the Triton form scans with the layout's
    ``cu_seqlens`` (one call, no host read of the resets: ``linear_scan_reset`` is not called)
    and equals the PyTorch form with the same documents (resets inside its scan): outputs and
    every gradient (float64, as above)."""
    import ttt_lm.model.mixers.rglru as rg
    from ttt_lm.model.docs import DocLayout
    m, _ = make_mixer("rglru", d_model=16, n_heads=2, rglru={"chunk_size": 4})
    torch.manual_seed(9)
    T = len(PACKED)
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, T, 16, dtype=torch.float64)
    seg = torch.tensor([PACKED, list(range(2, 2 + T))])
    docs = DocLayout.build(seg)
    calls = []
    real_scan, real_reset = rg.linear_scan, rg.linear_scan_reset

    def scan(*a, **k):
        calls.append(k.get("cu_seqlens"))
        return real_scan(*a, **k)

    def reset(*a, **k):
        assert a[5] == "torch", "the Triton form read the resets instead of the layout's offsets"
        return real_reset(*a, **k)
    monkeypatch.setattr(rg, "linear_scan", scan)
    monkeypatch.setattr(rg, "linear_scan_reset", reset)
    res = []
    for backend in ("torch", "triton"):
        m.kernel_backend = backend
        m.zero_grad()
        x.grad = None
        y, st = m(x, docs=docs, segment_pos=seg)
        assert st is None
        (y * w).sum().backward()
        res.append([y.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    assert len(calls) == 1 and torch.equal(calls[0], docs.cu_seqlens)
    for a, r in zip(res[1], res[0]):
        torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9)
    # the documents matter: without the resets the later pieces read the earlier ones
    monkeypatch.undo()
    with torch.no_grad():
        assert (m(x)[0] - res[1][0]).abs().max() > 1e-3


def test_segment_pos_decode_and_segments_match_one_pass():
    """step() token by token and two segments with a carried state, both given the segment
    positions, equal one pass over the packed rows (a reset right after the cut included)."""
    m, _ = make_mixer("rglru", rglru={"chunk_size": 4})
    torch.manual_seed(7)
    T = len(PACKED)
    x = torch.randn(2, T, m.d_model, dtype=torch.float64)
    seg = torch.tensor([PACKED, [4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3]])
    with torch.no_grad():
        y, _ = m(x, segment_pos=seg)
        st = m.init_state(2, dtype=torch.float64)
        ys = []
        for t in range(T):
            yt, st = m.step(x[:, t:t + 1], st, segment_pos=seg[:, t:t + 1])
            ys.append(yt)
        torch.testing.assert_close(torch.cat(ys, 1), y, atol=1e-10, rtol=0)
        for cut in (3, 9):    # the second segment starts with a reset
            y1, s1 = m(x[:, :cut], output_state=True, segment_pos=seg[:, :cut])
            y2, _ = m(x[:, cut:], state=s1, segment_pos=seg[:, cut:])
            torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-10, rtol=0)


def test_decode_state_at_position_zero_is_dropped():
    """A state whose pos is 0 but whose h and conv cache are not zero (a reused cache): the
    official RG-LRU drops h at segment_pos = 0, so the step equals one from a fresh state."""
    m, _ = make_mixer("rglru")
    torch.manual_seed(8)
    x = torch.randn(2, 1, m.d_model, dtype=torch.float64)
    fresh = m.init_state(2, dtype=torch.float64)
    stale = dataclasses.replace(fresh, conv=torch.randn_like(fresh.conv), h=torch.randn_like(fresh.h), pos=0)
    with torch.no_grad():
        y0, s0 = m.step(x, fresh)
        y1, s1 = m.step(x, stale)
        ys, _ = m(x, state=stale)
    torch.testing.assert_close(y1, y0, atol=0, rtol=0)
    torch.testing.assert_close(s1.h, s0.h, atol=0, rtol=0)
    torch.testing.assert_close(ys, y0, atol=1e-12, rtol=0)


def test_segment_pos_shape_is_checked():
    m, _ = make_mixer("rglru")
    x = torch.randn(2, 5, m.d_model, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"segment_pos must be \[B, T\]"):
        m(x, segment_pos=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer positions"):
        m(x, segment_pos=torch.zeros(2, 5))


def test_recurrence_matches_equations():
    """One channel worked by hand from the paper's equations, including the unnormalized first
    token and √(1 − a_t²) afterwards (float64, rounding-level tolerance)."""
    m, cfg = make_mixer("rglru")
    x = torch.randn(1, 3, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        _, st = m(x, output_state=True)
        xb, _ = m.conv1d(m.linear_x(x))
        r = torch.sigmoid(m.gate_a(xb))
        i = torch.sigmoid(m.gate_x(xb))
        a = torch.sigmoid(m.Lambda) ** (cfg.rglru.c * r)
        h = i[:, 0] * xb[:, 0]
        for t in (1, 2):
            h = a[:, t] * h + torch.sqrt(1 - a[:, t] ** 2) * (i[:, t] * xb[:, t])
    torch.testing.assert_close(st.h, h, atol=1e-12, rtol=0)
    assert st.pos == 3


def test_sqrt_gradient_is_bounded():
    """With Λ = 200, softplus(−Λ) underflows in float32, a_t = 1 and √(1 − a_t²) = √0, whose true
    derivative is infinite (NaN gradients through it); the bounded one keeps gradients finite."""
    m, _ = make_mixer("rglru", dtype=torch.float32)
    with torch.no_grad():
        m.Lambda.fill_(200.0)
    x = torch.randn(1, 6, m.d_model, requires_grad=True)
    m(x)[0].sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.Lambda.grad).all()


def test_flops_per_token():
    _, cfg = make_mixer("rglru", rglru={"lru_width": 48, "num_heads": 4})
    assert RGLRUBlock.flops_per_token(cfg, 128) == 2.0 * 48


def test_griffin_lm_decode_matches_forward():
    """Griffin's (R, R, A) pattern as a whole model: token-by-token LM.step equals one forward
    pass, and the reference forms equal the chunked ones (float64, rounding-level tolerance)."""
    from ttt_lm.model.lm import LM
    from tests.model.mixer_checks import tiny_cfg
    cfg = tiny_cfg("rglru", n_layers=3, layer_pattern=["rglru", "rglru", "local_attention"],
                   rglru={"chunk_size": 4}, attention={"window": 4})
    torch.manual_seed(0)
    lm = LM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        logits = lm(ids).logits
        st = lm.init_states(2, dtype=torch.float64)
        steps = []
        for t in range(ids.shape[1]):
            lt, st = lm.step(ids[:, t], st)
            steps.append(lt)
        ref = lm.set_impl("reference")(ids).logits
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(ref, logits, atol=1e-10, rtol=0)


def test_griffin_lm_position_ids_reach_the_rglru():
    """LM.forward hands the loader's position_ids to the RG-LRU (not to attention): packed rows
    reset the recurrent layers where a document starts, and LM.step with the same positions
    equals the forward pass (float64)."""
    from ttt_lm.model.lm import LM
    from tests.model.mixer_checks import tiny_cfg
    cfg = tiny_cfg("rglru", n_layers=3, layer_pattern=["rglru", "rglru", "local_attention"],
                   rglru={"chunk_size": 4}, attention={"window": 4})
    torch.manual_seed(0)
    lm = LM(cfg).double()
    T = len(PACKED)
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    pos = torch.tensor([PACKED, list(range(T))])
    with torch.no_grad():
        logits = lm(ids, position_ids=pos).logits
        plain = lm(ids).logits
        st = lm.init_states(2, dtype=torch.float64)
        steps = []
        for t in range(T):
            lt, st = lm.step(ids[:, t], st, position_ids=pos[:, t])
            steps.append(lt)
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(logits[1], plain[1], atol=1e-12, rtol=0)     # positions 0..T−1: no change
    assert (logits[0] - plain[0]).abs().max() > 1e-4                        # packed row: resets


def test_rglru_runs_the_linear_scan_triton_kernel_on_cuda():
    """kernels/linear_scan has a Triton kernel: auto and triton pick it on CUDA, CPU runs torch."""
    from tests.model.mixer_checks import short_config
    from ttt_lm.model.lm import LM
    for backend in ("auto", "triton"):
        m = LM(dataclasses.replace(short_config("rglru"), kernel_backend=backend))
        assert m.kernel_backends("cuda") == {"rglru": "triton"}
    assert LM(short_config("rglru")).kernel_backends("cpu") == {"rglru": "torch"}
