"""Checks every mixer must pass; each mixer's test module calls them with its own config."""
from __future__ import annotations

import torch

from ttt_lm.model import registry
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.mixers import build_mixer


def tiny_cfg(kind: str, **kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, layer_pattern=[kind])
    sub = {k: kw.pop(k) for k in list(kw) if k in registry.sections()}   # section name → its fields
    base.update(kw)
    cfg = ModelConfig(**base)
    for name, d in sub.items():
        for k, v in d.items():
            setattr(getattr(cfg, name), k, v)
    return cfg.validate()


def short_sections(cfg: ModelConfig, n: int) -> ModelConfig:
    """``cfg`` with every section that has ``tiny(n)`` (else ``short(n)``) replaced by it: the
    shared tests' sizes for every registered kind (chunks, mini-batches, windows and segments of
    a few tokens), declared by each section in its own file."""
    for name, section in cfg.sections().items():
        fn = getattr(section, "tiny", None) or getattr(section, "short", None)
        if callable(fn):
            setattr(cfg, name, fn(n))
    return cfg


def short_config(pattern, n: int = 4, **kw) -> ModelConfig:
    """A tiny ModelConfig of the layer kinds ``pattern`` (a kind or a sequence of kinds; None: the
    config's default pattern) with :func:`short_sections`; ``kw``: ModelConfig fields (d_model 16,
    2 heads, vocabulary 53, as many layers as the pattern has kinds unless given)."""
    base = dict(vocab_size=53, d_model=16, n_heads=2)
    if pattern is not None:
        pat = [pattern] if isinstance(pattern, str) else list(pattern)
        base.update(layer_pattern=pat, n_layers=len(pat))
    base.update(kw)
    return short_sections(ModelConfig(**base), n).validate()


def make_mixer(kind: str, dtype=torch.float64, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_cfg(kind, **kw)
    m = build_mixer(kind, cfg, 0)
    from ttt_lm.model.layers import init_weights
    init_weights(m, cfg.init_std * 10, 1)  # larger weights than training init: stronger signal
    m.reset_parameters()
    return m.to(dtype), cfg


def check_chunked_vs_reference(m, T: int, B: int = 2, atol: float = 1e-9, dtype=torch.float64):
    """chunked == reference in forward and in every parameter/input gradient (float64: differences
    are rounding only, so 1e-9 absolute on O(1) values)."""
    torch.manual_seed(1)
    x = torch.randn(B, T, m_dim(m), dtype=dtype, requires_grad=True)
    w = torch.randn(B, T, m_dim(m), dtype=dtype)
    outs, grads = [], []
    for impl in ("reference", "chunked"):
        m.impl = impl
        m.zero_grad()
        x.grad = None
        y, _ = m(x)
        (y * w).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                                         for p in m.parameters()])
    m.impl = "chunked"
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for n, g1, g0 in zip(names, grads[1], grads[0]):
        torch.testing.assert_close(g1, g0, atol=atol, rtol=1e-7, msg=lambda s: f"grad of {n}: {s}")


def check_decode(m, T: int, B: int = 2, atol: float = 1e-9, dtype=torch.float64):
    """Token-by-token step() and segment-by-segment forward with carried state equal one pass."""
    torch.manual_seed(2)
    x = torch.randn(B, T, m_dim(m), dtype=dtype)
    with torch.no_grad():
        y, _ = m(x)
        st = m.init_state(B, dtype=dtype)
        ys = []
        for t in range(T):
            yt, st = m.step(x[:, t:t + 1], st)
            ys.append(yt)
        torch.testing.assert_close(torch.cat(ys, 1), y, atol=atol, rtol=0)
        # two segments with a carried state
        cut = T // 2
        y1, s1 = m(x[:, :cut], output_state=True)
        y2, _ = m(x[:, cut:], state=s1)
        torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=atol, rtol=0)


def check_causal(m, T: int, dtype=torch.float64):
    """Changing token t+1.. never changes outputs ≤ t."""
    torch.manual_seed(3)
    x = torch.randn(1, T, m_dim(m), dtype=dtype)
    t = T // 2
    x2 = x.clone()
    x2[:, t + 1:] += torch.randn_like(x2[:, t + 1:])
    with torch.no_grad():
        y1, _ = m(x)
        y2, _ = m(x2)
    torch.testing.assert_close(y1[:, :t + 1], y2[:, :t + 1], atol=1e-12, rtol=0)
    assert (y1[:, t + 1:] - y2[:, t + 1:]).abs().max() > 1e-6, "later tokens have no effect at all"


def check_gradcheck(m, T: int = 5, B: int = 1):
    """torch.autograd.gradcheck of the chunked form w.r.t. its input, float64."""
    torch.manual_seed(4)
    x = torch.randn(B, T, m_dim(m), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp: m(inp)[0], (x,), eps=1e-6, atol=1e-5)


def m_dim(m) -> int:
    return m.d_model


def backend_results(m, x: torch.Tensor, w: torch.Tensor, state_key=None, backends=("torch", "triton")):
    """Per kernel backend: [y, (the carried state.<state_key>), ∂x, ∂ of every parameter] of the
    loss Σ y ⊙ w (+ Σ state.<state_key>), for holding two backends of one mixer equal."""
    res = []
    for backend in backends:
        m.kernel_backend = backend
        m.zero_grad()
        x.grad = None
        y, st = m(x, None, state_key is not None)
        loss = (y * w).sum() + (getattr(st, state_key).sum() if state_key is not None else 0)
        loss.backward()
        extra = [getattr(st, state_key).detach()] if state_key is not None else []
        res.append([y.detach(), *extra, x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    return res
