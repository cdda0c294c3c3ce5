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
    assert st["k"].shape[2] == 3 and st["pos"] == 10
