import pytest
import torch

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer)

CASES = [
    ("attention", {}),
    ("attention", {"attention": {"num_kv_heads": 1}}),          # multi-query
    ("local_attention", {"attention": {"window": 4}}),
    ("local_attention", {"attention": {"window": 3, "num_kv_heads": 1}}),
]


@pytest.mark.parametrize("kind,kw", CASES)
@pytest.mark.parametrize("T", [1, 7, 16])
def test_chunked_matches_reference(kind, kw, T):
    m, _ = make_mixer(kind, **kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kind,kw", CASES)
def test_decode_and_segments(kind, kw):
    m, _ = make_mixer(kind, **kw)
    check_decode(m, 11)


@pytest.mark.parametrize("kind,kw", CASES)
def test_causal(kind, kw):
    m, _ = make_mixer(kind, **kw)
    check_causal(m, 12)


def test_gradcheck():
    m, _ = make_mixer("local_attention", attention={"window": 3})
    check_gradcheck(m)


def test_window_limits_context():
    """A token more than `window` back has no influence on a local layer."""
    m, _ = make_mixer("local_attention", attention={"window": 3})
    x = torch.randn(1, 10, m.d_model, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 2] += 1.0
    with torch.no_grad():
        y1, y2 = m(x)[0], m(x2)[0]
    assert (y1[:, 2:5] - y2[:, 2:5]).abs().max() > 1e-6   # positions 2,3,4 see token 2
    torch.testing.assert_close(y1[:, 5:], y2[:, 5:], atol=1e-12, rtol=0)


def test_local_cache_is_bounded():
    m, _ = make_mixer("local_attention", attention={"window": 4})
    st = m.init_state(1, dtype=torch.float64)
    for _ in range(10):
        _, st = m.step(torch.randn(1, 1, m.d_model, dtype=torch.float64), st)
    assert st.k.shape[2] == 3 and st.pos == 10


def test_decode_cache_is_preallocated_and_branch_safe():
    """Decoding writes each step's key into one growing buffer (no per-token concatenation of the
    whole cache), and two continuations of one state do not overwrite each other: each equals a
    full forward over its own tokens (float64, 1e-12)."""
    m, _ = make_mixer("attention")
    x = torch.randn(1, 6, m.d_model, dtype=torch.float64)
    a, b = (torch.randn(1, 1, m.d_model, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        _, st = m(x[:, :5], m.init_state(1, dtype=torch.float64), True)
        ya, st_a = m.step(a, st)
        yb, st_b = m.step(b, st)            # a second continuation of the same state
        _, st_a2 = m.step(x[:, 5:], st_a)   # and the first one goes on
        full_a = m(torch.cat([x[:, :5], a], 1))[0]
        full_b = m(torch.cat([x[:, :5], b], 1))[0]
    torch.testing.assert_close(ya[:, 0], full_a[:, -1], atol=1e-12, rtol=0)
    torch.testing.assert_close(yb[:, 0], full_b[:, -1], atol=1e-12, rtol=0)
    # the newest state appended in place: its keys are a view of the same buffer
    assert st_a2.kv_buf is st_a.kv_buf and st_a2.k.shape[2] == 7
    assert st_a2.k.data_ptr() == st_a.k.data_ptr()
    assert st_b.kv_buf is not st_a.kv_buf
    torch.testing.assert_close(st_a.k[:, :, -1:], st_a2.k[:, :, 5:6], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["sdpa", "math", "flex"])
def test_attention_mixer_runs_through_the_resolver(name):
    """Every attention.backend string gives the reference's outputs on CPU, and the mixer's
    resolver names its op; a bad string fails at the config."""
    m, _ = make_mixer("local_attention", attention={"window": 3, "backend": name})
    assert m.resolve_backend("cpu") == name
    x = torch.randn(2, 9, m.d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():   # flex_attention has no backward on CPU
        y, _ = m.chunked(x)
        y_ref, _ = m.reference(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-9)   # float64: summation order only
    m.backend = "flash"
    with pytest.raises(ValueError, match="local_attention: backend 'flash' was requested but is unavailable"):
        m.chunked(x)


def test_bad_attention_backend_fails_at_the_config():
    with pytest.raises(ValueError, match="model.attention.backend must be auto, sdpa, flex, flash or math, got 'cudnn'"):
        make_mixer("attention", attention={"backend": "cudnn"})
