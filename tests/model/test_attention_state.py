"""Attention's decode state beyond the shared checks of ``test_mixer_state.py``: its KV buffer."""
import torch

from tests.model.mixer_checks import make_mixer


def test_attention_map_drops_the_shared_buffer():
    """A mapped state must not append into the buffer its source's keys are views of."""
    m, _ = make_mixer("attention")
    x = torch.randn(2, 4, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        _, st = m(x, output_state=True)
        _, st = m.step(x[:, :1], st)
        assert st.kv_buf is not None
        r = st.index_select(torch.tensor([1, 0]))
        assert r.kv_buf is None and r.kv_end is None
        _, r2 = m.step(x[[1, 0], 1:2], r)
        _, s2 = m.step(x[:, 1:2], st)
    torch.testing.assert_close(r2.k, s2.k[[1, 0]], atol=1e-12, rtol=0)
