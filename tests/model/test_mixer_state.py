"""The typed decode states (``MixerState`` and each mixer's subclass): map / to / detach /
index_select on every mixer kind. Reordering a batch's state and then stepping equals stepping
the reordered inputs from the start, as beam search needs. float64 throughout: a row's result
does not depend on the other rows, so the comparisons are exact up to 1e-12."""
import dataclasses

import pytest
import torch

from tests.model.mixer_checks import make_mixer, tiny_cfg
from ttt_lm.model import LM, registry
from ttt_lm.model.mixers.base import MixerState

#: per kind, the settings of its cases (small chunks and windows, so that 6 tokens cross them);
#: a kind not named here runs once with its section's defaults
SETTINGS = {
    "local_attention": [{"attention": {"window": 3}}],
    "ttt_linear": [{"ttt": {"mini_batch_size": 4}}],
    "ttt_mlp": [{"ttt": {"mini_batch_size": 4, "share_qk": True}}],
    "titans": [{"titans": {"chunk_size": 4}}, {"titans": {"chunk_size": 4, "memory": "linear"}}],
    "titans_mag": [{"titans": {"chunk_size": 4, "window": 3}}],
    "titans_mal": [{"titans": {"chunk_size": 4, "window": 3, "persistent_tokens": 2}}],
    "titans_mac": [{"titans": {"chunk_size": 4, "segment_len": 4, "persistent_tokens": 2}}],
    "rglru": [{"rglru": {"chunk_size": 4}}],
    "mamba": [{"mamba": {"d_state": 4}}],
    "lact": [{"lact": {"chunk_size": 2, "window": 3, "num_heads": 2, "low_rank": 2, "use_muon": True,
                       "muon_dtype": "state"}}],
}
#: every built-in kind, from the registry
KINDS = [(k, kw) for k in registry.builtin_kinds() for kw in SETTINGS.get(k, [{}])]
IDS = [f"{k}-{i}" for i, (k, _) in enumerate(KINDS)]


def _close_states(a: MixerState, b: MixerState):
    assert type(a) is type(b) and a.pos == b.pos
    na, nb = a.named_tensors(), b.named_tensors()
    assert [n for n, _ in na] == [n for n, _ in nb]
    for (n, ta), (_, tb) in zip(na, nb):
        torch.testing.assert_close(ta, tb, atol=1e-12, rtol=0, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("kind,kw", KINDS, ids=IDS)
def test_reorder_then_step_equals_stepping_reordered_inputs(kind, kw):
    m, _ = make_mixer(kind, **kw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, m.d_model, generator=g, dtype=torch.float64)
    nxt = torch.randn(3, 2, m.d_model, generator=g, dtype=torch.float64)
    idx = torch.tensor([2, 0, 0])                      # reordered, one row twice, one dropped
    with torch.no_grad():
        _, st = m(x, output_state=True)
        st_idx = st.index_select(idx)
        _, want = m(x[idx], output_state=True)
        _close_states(st_idx, want)
        for t in range(nxt.shape[1]):                  # then decode both ways
            y, st_idx = m.step(nxt[idx, t:t + 1], st_idx)
            y_want, want = m.step(nxt[idx, t:t + 1], want)
            torch.testing.assert_close(y, y_want, atol=1e-12, rtol=0)
        _close_states(st_idx, want)
        # the original state is untouched by the reordered one's steps: it continues as before
        y0, _ = m.step(nxt[:, :1], st)
        y_full, _ = m(torch.cat([x, nxt[:, :1]], 1))
    torch.testing.assert_close(y0[:, 0], y_full[:, -1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind,kw", KINDS, ids=IDS)
def test_map_to_and_detach_keep_the_type_and_the_fields(kind, kw):
    m, _ = make_mixer(kind, **kw)
    x = torch.randn(2, 5, m.d_model, dtype=torch.float64, requires_grad=True)
    _, st = m(x, output_state=True)
    assert isinstance(st, MixerState)
    if not kind.startswith("ttt"):   # TTT keeps its position modulo the mini-batch size
        assert st.pos == m.init_state(2, dtype=torch.float64).pos + 5
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


def test_index_select_refuses_a_non_vector_index():
    m, _ = make_mixer("deltanet")
    st = m.init_state(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="1-D index of batch rows"):
        st.index_select(torch.tensor([[0, 1]]))


def test_lm_states_reorder_with_the_pre_conv():
    """A whole model's states (block states with TTT's pre-conv cache, and an attention layer)."""
    cfg = dataclasses.replace(tiny_cfg("ttt_linear"), layer_pattern=["ttt_linear", "attention"], n_layers=2)
    cfg.ttt.pre_conv = True
    torch.manual_seed(0)
    lm = LM(cfg.validate()).double().eval()
    ids = torch.randint(0, 64, (3, 7))
    idx = torch.tensor([1, 2, 1])
    with torch.no_grad():
        states = lm(ids, output_states=True).states
        assert states[0].pre_conv is not None
        moved = [s.index_select(idx) for s in states]
        y, _ = lm.step(ids[idx, -1], moved)
        want = lm(torch.cat([ids[idx], ids[idx, -1:]], 1)).logits[:, -1]
    torch.testing.assert_close(y, want, atol=1e-10, rtol=0)
