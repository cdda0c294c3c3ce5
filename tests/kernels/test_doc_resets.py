"""State resets inside the PyTorch chunked scans (masks, not slices): a row holding several
sequences, with ``resets`` True at each one's first token, gives each sequence's own outputs and
gradients, as if it ran alone from a zero state. float64, so that 1e-10 checks exactness (the
masks change only which terms are summed)."""
import pytest
import torch

from kernels.delta_rule.torch_chunk import delta_rule_chunk_torch
from kernels.gated_delta_rule.torch_chunk import gated_delta_rule_chunk_torch

B, H, T, DK, DV = 2, 2, 23, 4, 3
CUTS = [[0, 3, 4, 11, 20], [0, 1, 9, 10]]   # sequences of 1 token, shorter than a chunk, across chunks


def _inputs(channel_beta=False):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q = r(B, H, T, DK)
    k = torch.nn.functional.normalize(r(B, H, T, DK), dim=-1)
    v = r(B, H, T, DV)
    beta = torch.rand(B, H, T, *((DV,) if channel_beta else ()), generator=g, dtype=torch.float64)
    gate = -torch.rand(B, H, T, generator=g, dtype=torch.float64)
    resets = torch.zeros(B, T, dtype=torch.bool)
    for b, c in enumerate(CUTS):
        resets[b, c] = True
    return [t.requires_grad_() for t in (q, k, v, beta, gate)], resets


def _pieces():
    for b, c in enumerate(CUTS):
        for a, e in zip(c, c[1:] + [T]):
            yield b, a, e


def _check(run, tensors, resets):
    w = torch.randn(B, H, T, DV, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = run(*tensors, resets=resets)
    grads = torch.autograd.grad((out * w).sum(), tensors)
    ref = torch.zeros_like(out)
    ref_grads = [torch.zeros_like(t) for t in tensors]
    for b, a, e in _pieces():
        piece = [t[b:b + 1, :, a:e].detach().requires_grad_() for t in tensors]
        o = run(*piece, resets=None)
        ref[b:b + 1, :, a:e] = o.detach()
        for rg, gp in zip(ref_grads, torch.autograd.grad((o * w[b:b + 1, :, a:e]).sum(), piece)):
            rg[b:b + 1, :, a:e] = gp
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk", [4, 5, 64])
@pytest.mark.parametrize("channel_beta", [False, True])
def test_delta_rule_resets(chunk, channel_beta):
    (q, k, v, beta, _), resets = _inputs(channel_beta)
    _check(lambda q, k, v, beta, resets: delta_rule_chunk_torch(q, k, v, beta, chunk_size=chunk, resets=resets)[0],
           [q, k, v, beta], resets)


@pytest.mark.parametrize("chunk", [4, 5, 64])
def test_gated_delta_rule_resets(chunk):
    (q, k, v, beta, gate), resets = _inputs()
    _check(lambda q, k, v, g, beta, resets: gated_delta_rule_chunk_torch(q, k, v, g, beta, chunk_size=chunk,
                                                                        resets=resets)[0],
           [q, k, v, gate, beta], resets)


def test_ttt_mini_batch_resets_restart_the_weights():
    """TTT's in-scan restarts: rows of [doc a | doc b] aligned at mini-batch boundaries give each
    document's own outputs from W_0."""
    from kernels.ttt import ttt_linear
    torch.manual_seed(0)
    B, H, d, b = 2, 2, 4, 4
    T = 12
    q, k, v = (torch.randn(B, H, T, d) for _ in range(3))
    eta = torch.rand(B, H, T) * 0.1
    tau = 1.0 / torch.arange(1, b + 1)
    lw, lb = torch.ones(H, d), torch.zeros(H, d)
    W1, b1 = torch.randn(H, d, d) * 0.1, torch.zeros(H, 1, d)
    resets = torch.tensor([[True, False, True], [True, True, False]])
    out, _ = ttt_linear(q, k, v, eta, tau, lw, lb, W1, b1, b, mini_batch_resets=resets)
    for r, cut in ((0, 8), (1, 4)):
        for a, e in ((0, cut), (cut, T)):
            ref, _ = ttt_linear(q[r:r + 1, :, a:e], k[r:r + 1, :, a:e], v[r:r + 1, :, a:e], eta[r:r + 1, :, a:e],
                                tau, lw, lb, W1, b1, b)
            torch.testing.assert_close(out[r:r + 1, :, a:e], ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="backend='torch'"):
        ttt_linear(q, k, v, eta, tau, lw, lb, W1, b1, b, backend="reference", mini_batch_resets=resets)
    with pytest.raises(ValueError, match=r"bool \[B, ceil\(T/b\)\]"):
        ttt_linear(q, k, v, eta, tau, lw, lb, W1, b1, b, mini_batch_resets=resets[:, :2])


@pytest.mark.parametrize("chunk", [4, 64])
def test_selective_scan_resets(chunk):
    """Mamba's scan with Ā_t = 0 at each start (its hand-written backward included)."""
    from kernels.selective_scan.torch_chunk import selective_scan_chunk
    g = torch.Generator().manual_seed(0)
    Di, N = 3, 4
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x, delta, Bm, Cm, z = r(B, T, Di), r(B, T, Di), r(B, T, N), r(B, T, N), r(B, T, Di)
    A, D = -torch.rand(Di, N, generator=g, dtype=torch.float64), r(Di)
    tensors = [t.requires_grad_() for t in (x, delta, Bm, Cm, z)]
    resets = torch.zeros(B, T, dtype=torch.bool)
    for b, c in enumerate(CUTS):
        resets[b, c] = True
    w = r(B, T, Di)

    def run(x, delta, Bm, Cm, z, resets):
        return selective_scan_chunk(x, delta, A, Bm, Cm, D, z, delta_softplus=True, chunk_size=chunk,
                                    resets=resets)[0]

    out = run(*tensors, resets)
    grads = torch.autograd.grad((out * w).sum(), tensors)
    for b, a, e in _pieces():
        piece = [t[b:b + 1, a:e].detach().requires_grad_() for t in tensors]
        o = run(*piece, None)
        torch.testing.assert_close(out[b:b + 1, a:e], o, atol=1e-10, rtol=0)
        for gr, gp in zip(grads, torch.autograd.grad((o * w[b:b + 1, a:e]).sum(), piece)):
            torch.testing.assert_close(gr[b:b + 1, a:e], gp, atol=1e-10, rtol=0)


def test_titans_linear_chunk_resets():
    """Titans' linear memory restarted from the initial (M, S) at chunks flagged in chunk_resets."""
    from kernels.titans.torch_chunk import titans_linear_chunk_torch
    g = torch.Generator().manual_seed(0)
    C, T = 4, 12
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q, k, v = r(B, H, T, DK), torch.nn.functional.normalize(r(B, H, T, DK), dim=-1), r(B, H, T, DK)
    theta = torch.rand(B, H, T, generator=g, dtype=torch.float64) * 0.1
    log_eta, log_keep = -torch.rand(B, H, T, generator=g, dtype=torch.float64), -torch.rand(B, H, T, generator=g,
                                                                                           dtype=torch.float64) * 0.1
    M0 = r(B, H, DK, DK)
    init = (M0, torch.zeros_like(M0), M0)
    resets = torch.tensor([[True, False, True], [True, True, False]])
    out, _ = titans_linear_chunk_torch(q, k, v, theta, log_eta, log_keep, init, chunk_size=C, chunk_resets=resets)
    for row, cut in ((0, 8), (1, 4)):
        for a, e in ((0, cut), (cut, T)):
            sl = lambda t: t[row:row + 1, :, a:e]
            ref, _ = titans_linear_chunk_torch(sl(q), sl(k), sl(v), sl(theta), sl(log_eta), sl(log_keep),
                                               tuple(t[row:row + 1] for t in init), chunk_size=C)
            torch.testing.assert_close(out[row:row + 1, :, a:e], ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="chunk_resets must be bool"):
        titans_linear_chunk_torch(q, k, v, theta, log_eta, log_keep, init, chunk_size=C, chunk_resets=resets[:, :2])


def test_linear_scan_resets():
    """The RG-LRU's scan with a_t = 0 at each start (its hand-written backward included), against
    each piece run alone; a reset on a row's first token drops the initial state."""
    from kernels.linear_scan.torch_chunk import linear_scan_chunk
    g = torch.Generator().manual_seed(0)
    log_a = -torch.rand(B, T, 5, generator=g, dtype=torch.float64)
    b = torch.randn(B, T, 5, generator=g, dtype=torch.float64)
    h0 = torch.randn(B, 5, generator=g, dtype=torch.float64)
    tensors = [t.clone().requires_grad_() for t in (log_a, b)]
    resets = torch.zeros(B, T, dtype=torch.bool)
    for row, c in enumerate(CUTS):
        resets[row, c] = True
    w = torch.randn(B, T, 5, generator=g, dtype=torch.float64)
    h, _ = linear_scan_chunk(*tensors, h0, resets=resets)
    grads = torch.autograd.grad((h * w).sum(), tensors)
    for row, a, e in _pieces():
        piece = [t[row:row + 1, a:e].detach().requires_grad_() for t in tensors]
        ref, _ = linear_scan_chunk(*piece)
        torch.testing.assert_close(h[row:row + 1, a:e], ref, atol=1e-12, rtol=0)
        for gr, gp in zip(grads, torch.autograd.grad((ref * w[row:row + 1, a:e]).sum(), piece)):
            torch.testing.assert_close(gr[row:row + 1, a:e], gp, atol=1e-12, rtol=0)


LACT_DOCS = [[5, 3, 9], [12, 1, 8]]   # C = 4: rows of 8 + 4 + 12 and 12 + 4 + 8 aligned tokens


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("opts", [dict(momentum=True), dict(momentum=True, use_muon=True, prenorm=True),
                                  dict(momentum=False, prenorm=False)], ids=["momentum", "muon_prenorm", "plain"])
def test_lact_chunk_resets(backend, opts):
    """LaCT's schedule restarted from w0, w1, w2 (zero momentum) at chunks flagged in ``resets``:
    rows of documents laid out at chunk boundaries (zeros after each document's end), against each
    document alone; outputs and the gradients of every input and of w0, w1, w2 (padding's are 0:
    a document's last chunk is written only into a state the next reset discards)."""
    from kernels.lact import block_causal_lact_swiglu
    C, Hh, dk, dv, dh = 4, 2, 3, 3, 5
    T = 24
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q, k, v = r(2, Hh, T, dk), r(2, Hh, T, dk), r(2, Hh, T, dv)
    lr0, lr1, lr2 = (torch.rand(2, Hh, T, generator=g, dtype=torch.float64) * 0.5 for _ in range(3))
    mom = torch.rand(2, Hh, T, generator=g, dtype=torch.float64) if opts["momentum"] else None
    w0, w2, w1 = r(Hh, dh, dk), r(Hh, dh, dk), r(Hh, dv, dh)
    real = torch.zeros(2, T, dtype=torch.bool)
    resets = torch.zeros(2, T // C, dtype=torch.bool)
    spans = []
    for row, lens in enumerate(LACT_DOCS):
        a = 0
        for n in lens:
            real[row, a:a + n] = True
            resets[row, a // C] = True
            spans.append((row, a, a + n))
            a += -(-n // C) * C
    mask = real[:, None, :].to(torch.float64)
    q, k, v = (t * mask[..., None] for t in (q, k, v))
    lr0, lr1, lr2 = (t * mask for t in (lr0, lr1, lr2))
    tensors = [q, k, v, lr0, lr1, lr2] + ([mom * mask] if mom is not None else []) + [w0, w1, w2]
    tensors = [t.clone().requires_grad_() for t in tensors]
    kw = dict(chunk_size=C, use_muon=opts.get("use_muon", False), prenorm=opts.get("prenorm", False),
              muon_dtype=None, backend=backend)

    def run(ts, resets):
        q, k, v, l0, l1, l2 = ts[:6]
        m = ts[6] if mom is not None else None
        return block_causal_lact_swiglu(q, k, v, l0, l1, l2, *ts[-3:], momentum=m, resets=resets, **kw)[0]

    w = r(2, Hh, T, dv)
    out = run(tensors, resets)
    grads = torch.autograd.grad((out * w).sum(), tensors)
    ref_w = [torch.zeros_like(t) for t in tensors[-3:]]
    n_tok = len(tensors) - 3
    ref_tok = [torch.zeros_like(t) for t in tensors[:n_tok]]
    for row, a, e in spans:
        piece = [t[row:row + 1, :, a:e].detach().requires_grad_() for t in tensors[:n_tok]]
        piece += [t.detach().requires_grad_() for t in tensors[n_tok:]]
        o = run(piece, None)
        torch.testing.assert_close(out[row:row + 1, :, a:e], o, atol=1e-10, rtol=0)
        gs = torch.autograd.grad((o * w[row:row + 1, :, a:e]).sum(), piece, materialize_grads=True)
        for rg, gp in zip(ref_tok, gs[:n_tok]):
            rg[row:row + 1, :, a:e] = gp
        for rg, gp in zip(ref_w, gs[n_tok:]):
            rg += gp
    for gr, rg in zip(grads, ref_tok + ref_w):
        torch.testing.assert_close(gr, rg, atol=1e-10, rtol=0)
    # resets change the result, and bad ones are refused
    assert (run(tensors, None) - out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="resets must be a bool tensor"):
        run(tensors, resets[:, :-1])
