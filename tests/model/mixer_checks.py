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


def short_cases(n: int = 4, **kw):
    """(kind, variant name or None, ModelConfig) for every built-in kind at the tiny sizes of
    :func:`short_config`: one case per entry of the mixer class's ``variants`` (its section's
    settings changed by it), or one case for the kind as configured. ``kw``: ModelConfig fields."""
    out = []
    for kind in registry.builtin_kinds():
        cls = registry.mixer_class(kind)
        for name, sub in (cls.variants.items() if cls.variants else [(None, {})]):
            cfg = short_config(kind, n, **kw)
            for k, v in sub.items():
                setattr(getattr(cfg, cls.config_section), k, v)
            out.append((kind, name, cfg.validate()))
    return out


def make_mixer(kind: str, dtype=torch.float64, seed: int = 0, cfg: ModelConfig = None, **kw):
    """The mixer of ``kind`` built from ``cfg`` (default: :func:`tiny_cfg` of ``kw``), initialized
    with larger weights than training's; returns (mixer in ``dtype``, cfg)."""
    torch.manual_seed(seed)
    if cfg is None:
        cfg = tiny_cfg(kind, **kw)
    elif kw:
        raise ValueError(f"make_mixer: give cfg or section settings, not both (got {sorted(kw)})")
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


def close_states(a, b) -> None:
    """Two states of the same type, position and tensors (1e-12)."""
    assert type(a) is type(b) and a.pos == b.pos
    na, nb = a.named_tensors(), b.named_tensors()
    assert [n for n, _ in na] == [n for n, _ in nb]
    for (n, ta), (_, tb) in zip(na, nb):
        torch.testing.assert_close(ta, tb, atol=1e-12, rtol=0, msg=lambda s: f"{n}: {s}")


def check_reorder_then_step(m) -> None:
    """Reordering a batch's state (``index_select``) and then stepping equals stepping the
    reordered inputs from the start, as beam search needs; the original state is untouched by
    the reordered one's steps. float64: exact up to 1e-12 (a row's result does not depend on the
    other rows)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, m.d_model, generator=g, dtype=torch.float64)
    nxt = torch.randn(3, 2, m.d_model, generator=g, dtype=torch.float64)
    idx = torch.tensor([2, 0, 0])                      # reordered, one row twice, one dropped
    with torch.no_grad():
        _, st = m(x, output_state=True)
        st_idx = st.index_select(idx)
        _, want = m(x[idx], output_state=True)
        close_states(st_idx, want)
        for t in range(nxt.shape[1]):                  # then decode both ways
            y, st_idx = m.step(nxt[idx, t:t + 1], st_idx)
            y_want, want = m.step(nxt[idx, t:t + 1], want)
            torch.testing.assert_close(y, y_want, atol=1e-12, rtol=0)
        close_states(st_idx, want)
        # the original state is untouched by the reordered one's steps: it continues as before
        y0, _ = m.step(nxt[:, :1], st)
        y_full, _ = m(torch.cat([x, nxt[:, :1]], 1))
    torch.testing.assert_close(y0[:, 0], y_full[:, -1], atol=1e-12, rtol=0)


def check_map_to_detach(m) -> None:
    """``map`` / ``to`` / ``detach`` keep the state's type and fields; the position after 5
    tokens is the one 5 steps give; every tensor is batch first."""
    from ttt_lm.model.mixers.base import MixerState
    x = torch.randn(2, 5, m.d_model, dtype=torch.float64, requires_grad=True)
    _, st = m(x, output_state=True)
    assert isinstance(st, MixerState)
    with torch.no_grad():
        stepped = m.init_state(2, dtype=torch.float64)
        for t in range(5):
            _, stepped = m.step(x[:, t:t + 1], stepped)
    assert st.pos == stepped.pos   # (TTT keeps its position modulo the mini-batch size)
    names = [n for n, _ in st.named_tensors()]
    assert names and all(n for n in names)
    assert any(t.requires_grad for t in st.tensors())
    d = st.detach()
    assert type(d) is type(st) and d.pos == st.pos and not any(t.requires_grad for t in d.tensors())
    for a, b in zip(d.tensors(), st.tensors()):
        assert torch.equal(a, b)
    f32 = st.to(dtype=torch.float32)
    assert type(f32) is type(st) and [n for n, _ in f32.named_tensors()] == names
    for a, b in zip(f32.tensors(), st.tensors()):
        assert a.dtype == (torch.float32 if b.is_floating_point() else b.dtype)
    doubled = st.map(lambda t: t * 2)
    for a, b in zip(doubled.tensors(), st.tensors()):
        torch.testing.assert_close(a, b * 2, atol=0, rtol=0)
    # batch-first: every tensor's first dimension is the batch
    assert all(t.shape[0] == 2 for t in st.tensors())


def preset_config(name: str = "tiny", n: int = 4, **kw) -> ModelConfig:
    """The model of the preset ``configs/<name>.yaml`` (its layer pattern: a shared test that
    needs one concrete hybrid takes it from here rather than naming kinds) with the ModelConfig
    fields ``kw`` replaced and every section at its tiny sizes (:func:`short_sections`)."""
    import dataclasses
    import os
    from ttt_lm.config import load_config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "configs", f"{name}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"preset_config: no preset {name!r} ({path})")
    cfg = dataclasses.replace(load_config(path, []).model, **kw)
    return short_sections(cfg, n).validate()
