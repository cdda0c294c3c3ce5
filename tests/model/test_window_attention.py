"""``ttt_lm.model.window_attention``: the one sliding-window path, against a dense reference.

The reference here is written from the definition (every query against every key, a T_q × T_k
mask of "causal, inside the window, same document"), not with the module's helpers. float64:
the blocked path reorders nothing inside a softmax row (the same keys, masked the same way), so
outputs and gradients agree to rounding, 1e-10 absolute on O(1) values; float32: 1e-5.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttt_lm.model import registry
from ttt_lm.model.backend import Backend
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.mixers import build_mixer
from ttt_lm.model.window_attention import default_block, sliding_window_attention


def dense_reference(q, k, v, window, seg=None):
    B, H, tq, d = q.shape
    tk, rep = k.shape[2], H // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(d)
    qpos = torch.arange(tq)[:, None] + (tk - tq)
    kpos = torch.arange(tk)[None, :]
    ok = (kpos <= qpos) & (kpos > qpos - window)
    if seg is not None:
        ok = ok & (seg[:, None, :, None] == seg[:, None, None, :])
    return s.masked_fill(~ok, float("-inf")).softmax(-1) @ vv


def qkv(B, H, Hk, tq, tk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, t: torch.randn(B, h, t, d, generator=g, dtype=dtype).requires_grad_()
    return mk(H, tq), mk(Hk, tk), mk(Hk, tk)


def layout(lengths_per_row):
    """A DocLayout of rows packed with documents of the given lengths (each row's sum equal)."""
    pos = torch.tensor([[i for n in row for i in range(n)] for row in lengths_per_row])
    return DocLayout.build(pos)


def compare(q, k, v, window, atol, docs=None, backend=Backend.SDPA, block=None):
    w = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(9))
    outs, grads = [], []
    for fn in (lambda: dense_reference(q, k, v, window, None if docs is None else docs.seg),
               lambda: sliding_window_attention(q, k, v, window, backend, docs=docs, block=block)):
        for t in (q, k, v):
            t.grad = None
        o = fn()
        (o * w).sum().backward()
        outs.append(o.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
    for name, g1, g0 in zip("qkv", grads[1], grads[0]):
        torch.testing.assert_close(g1, g0, atol=atol, rtol=0, msg=lambda s: f"grad of {name}: {s}")


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,window,block", [
    (100, 7, None),      # default block (16): 7 blocks, T not a multiple of the block
    (64, 17, 16),        # block = window − 1, the smallest allowed; T a multiple of it
    (71, 5, 9),          # block larger than the window
    (50, 1, None),       # window 1: each query sees itself only
    (40, 64, None),      # window larger than T: causal attention (the dense path)
    (37, 30, 29),        # T between block and 2 blocks (dense path) with an odd block
    (130, 30, 29),       # many blocks of an odd size
])
def test_equals_dense_reference(dtype, T, window, block):
    q, k, v = qkv(2, 4, 4, T, T, 8, dtype)
    compare(q, k, v, window, TOL[dtype], block=block)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gqa(dtype):
    q, k, v = qkv(1, 6, 2, 90, 90, 8, dtype, seed=1)
    compare(q, k, v, 11, TOL[dtype], block=12)


@pytest.mark.parametrize("tq,tk,window", [
    (40, 45, 8),     # a cache of 5 keys, fewer than w − 1
    (40, 100, 8),    # a cache longer than the window: keys no query sees are dropped
    (1, 30, 8),      # one decode step
    (70, 76, 7),     # the blocked path with queries padded on the left
])
def test_kv_cache(tq, tk, window):
    q, k, v = qkv(2, 4, 2, tq, tk, 8, torch.float64, seed=2)
    compare(q, k, v, window, TOL[torch.float64], block=window)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window,block", [(9, 8), (6, 16), (200, None)])
def test_packed_documents(dtype, window, block):
    # documents crossing block boundaries (block 8: 8, 16, 24, ...), a one-token document, one
    # longer than the window, and rows padded to a block multiple (T = 61)
    docs = layout([[13, 1, 30, 17], [61], [5, 5, 51]])
    q, k, v = qkv(3, 2, 2, 61, 61, 8, dtype, seed=3)
    compare(q, k, v, window, TOL[dtype], docs=docs, block=block)


def test_flex_backend_forward():
    """flex_attention (CUDA's path; eager on the CPU here) over the same mask, with documents."""
    docs = layout([[20, 44], [64]])
    q, k, v = (t.detach() for t in qkv(2, 2, 1, 64, 64, 8, torch.float32, seed=4))   # no flex backward on CPU
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for d in (None, docs):
            ref = dense_reference(q, k, v, 10, None if d is None else d.seg)
            o = sliding_window_attention(q, k, v, 10, Backend.FLEX, docs=d)
            torch.testing.assert_close(o, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_refuses_bad_window(window):
    q, k, v = qkv(1, 1, 1, 8, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        sliding_window_attention(q, k, v, window)


def test_refuses_bad_shapes_and_block():
    q, k, v = qkv(1, 2, 2, 40, 40, 4, torch.float32)
    with pytest.raises(ValueError, match=r"block must be an integer >= window - 1 = 9"):
        sliding_window_attention(q, k, v, 10, block=8)
    with pytest.raises(ValueError, match="12 keys for 40 queries"):
        sliding_window_attention(q, k[:, :, :12], v[:, :, :12], 10)
    with pytest.raises(ValueError, match="3 key heads must divide 2 query heads"):
        sliding_window_attention(q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3], 10)
    with pytest.raises(ValueError, match="packed documents take square"):
        sliding_window_attention(q[:, :, :20], k, v, 10, docs=layout([[40]]))


class MaxNumel(TorchDispatchMode):
    """The largest tensor any op makes (its numel), forward and backward."""

    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


def largest_tensor(fn) -> int:
    with MaxNumel() as m:
        fn()
    return m.max


def test_no_T_by_T_tensor():
    """At 2,048 tokens and window 64 the largest tensor of forward + backward is the blocked
    scores (H·T·2b), far below one T × T mask."""
    T, w = 2048, 64
    q, k, v = qkv(1, 2, 2, T, T, 8, torch.float32)

    def run():
        sliding_window_attention(q, k, v, w).sum().backward()

    n = largest_tensor(run)
    b = default_block(w)
    assert n <= 2 * (T + b) * 2 * b, n
    assert n < T * T // 8


def _short_windowed(kind: str, n: int) -> ModelConfig:
    """A one-layer model of ``kind`` at width 32 whose sections are short (``short(n)``) and whose
    windows (any section field named ``window``) are ``n`` tokens."""
    import dataclasses
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, layer_pattern=[kind])
    for name, section in cfg.sections().items():
        if callable(getattr(section, "short", None)):
            section = section.short(n)
        if any(f.name == "window" for f in dataclasses.fields(section)):
            section = dataclasses.replace(section, window=n)
        setattr(cfg, name, section)
    return cfg.validate()


@pytest.mark.parametrize("kind", registry.kinds_with(lambda c: not c.global_attention, registry.builtin_kinds()))
def test_mixer_memory_linear_in_length(kind):
    """Every kind but global attention: the largest tensor of the chunked form's forward + backward
    grows linearly with the sequence (twice the tokens, at most 2.5× the elements; a T × T mask or
    score matrix would give 4×)."""
    torch.manual_seed(0)
    cfg = _short_windowed(kind, 16)
    m = build_mixer(kind, cfg, 0)
    m.impl = "chunked"
    sizes = []
    for T in (256, 512):
        x = torch.randn(1, T, 32, requires_grad=True)
        sizes.append(largest_tensor(lambda: m(x)[0].sum().backward()))
    assert sizes[1] <= 2.5 * sizes[0], f"{kind}: largest tensor {sizes[0]} at 256 tokens, {sizes[1]} at 512"


def _has_window(kind: str) -> bool:
    """A module of the built mixer (itself or a part, e.g. Titans MAG's attention branch) has a
    window."""
    m = build_mixer(kind, _short_windowed(kind, 16), 0)
    return any(isinstance(getattr(mod, "window", None), int) for mod in m.modules())


#: the kinds with a window (read from the built mixers, not listed by name)
WINDOWED = tuple(k for k in registry.kinds_with(lambda c: not c.global_attention, registry.builtin_kinds())
                 if _has_window(k))


def test_windowed_kinds_found():
    """The window sections are found (the tests below would otherwise run over nothing)."""
    assert len(WINDOWED) >= 2, WINDOWED


def _windowed_mixer(kind: str):
    from ttt_lm.model.layers import init_weights
    torch.manual_seed(0)
    cfg = _short_windowed(kind, 16)
    m = build_mixer(kind, cfg, 0)
    init_weights(m, cfg.init_std * 10, 1)
    m.reset_parameters()
    return m.double()


@pytest.mark.parametrize("kind", WINDOWED)
def test_mixer_blocked_path_equals_reference(kind):
    """Windows of 16 over 100 tokens: the chunked form runs the blocked path (7 blocks of 16), and
    equals the reference form (explicit T × T softmax) in output and every gradient, float64 1e-9
    as the mixers' own reference tests; with packed documents crossing the blocks too."""
    from tests.model.mixer_checks import check_chunked_vs_reference
    m = _windowed_mixer(kind)
    check_chunked_vs_reference(m, 100, B=1)
    docs = layout([[23, 1, 40, 36]])
    x = torch.randn(1, 100, 32, dtype=torch.float64, requires_grad=True)
    outs = []
    for impl in ("reference", "chunked"):
        m.impl = impl
        x.grad = None
        y, _ = m(x, docs=docs)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-9, rtol=0)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-9, rtol=0)


@pytest.mark.parametrize("kind", WINDOWED)
def test_mixer_pieces_with_cache_equal_one_pass(kind):
    """Reading 100 tokens in pieces of 37 with the carried state (the KV cache before each piece's
    own keys: the blocked path with queries padded on the left) equals one pass, float64 1e-9."""
    m = _windowed_mixer(kind)
    x = torch.randn(1, 100, 32, dtype=torch.float64)
    with torch.no_grad():
        y, _ = m(x)
        st, ys = None, []
        for s in range(0, 100, 37):
            yp, st = m(x[:, s:s + 37], state=st, output_state=True)
            ys.append(yp)
    torch.testing.assert_close(torch.cat(ys, 1), y, atol=1e-9, rtol=0)
