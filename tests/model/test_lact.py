"""The ``lact`` mixer: its three forms, streaming, packed documents, config checks, FLOPs."""
import dataclasses

import pytest
import torch

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.flops import flops_per_token, matmul_params
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers import build_mixer
from ttt_lm.model.mixers.lact import LaCT

BASE = {"chunk_size": 4, "window": 3, "num_heads": 2, "muon_dtype": "state"}
CASES = [
    dict(BASE),                                                   # momentum, full-rank initial weights
    dict(BASE, low_rank=3, use_muon=True),                        # the preset's low rank, Muon
    dict(BASE, use_momentum=False, prenorm=True, inter_multi=1.5),  # d_h ≠ head width
    dict(BASE, chunk_size=64, window=64, num_heads=1),            # one chunk: no write at all
]
IDS = ["momentum", "lowrank_muon", "prenorm_wide", "one_chunk"]


@pytest.mark.parametrize("kw", CASES, ids=IDS)
@pytest.mark.parametrize("T", [1, 9, 12])
def test_chunked_matches_reference(kw, T):
    m, _ = make_mixer("lact", lact=kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_decode_and_segments(kw):
    """step() token by token, the chunk written when the token after it arrives, and two segments
    with the state passed, equal one pass (float64)."""
    m, _ = make_mixer("lact", lact=kw)
    check_decode(m, 13)


@pytest.mark.parametrize("kw", CASES[:2], ids=IDS[:2])
def test_causal(kw):
    m, _ = make_mixer("lact", lact=kw)
    check_causal(m, 12)


def test_gradcheck():
    m, _ = make_mixer("lact", d_model=16, lact=dict(BASE, chunk_size=3, low_rank=2))
    check_gradcheck(m, T=7)


def test_fast_path_matters_and_chunks_write():
    """Both paths reach the output, and a write changes what later chunks read: with the
    learning-rate projection pushed to ~0 the later tokens' outputs change, the first chunk's not."""
    m, _ = make_mixer("lact", lact=dict(BASE, chunk_size=4))
    x = torch.randn(1, 12, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        y, _ = m(x)
        m.lr_proj.bias.fill_(-60.0)      # softplus(−60 + …) ≈ 0: no update
        y0, _ = m(x)
    torch.testing.assert_close(y[:, :4], y0[:, :4], atol=1e-12, rtol=0)
    assert (y[:, 4:] - y0[:, 4:]).abs().max() > 1e-4


def test_state_holds_the_open_chunk_and_window():
    m, _ = make_mixer("lact", lact=dict(BASE, chunk_size=4, window=3))
    x = torch.randn(2, 10, m.d_model, dtype=torch.float64)
    _, st = m(x, output_state=True)
    assert st.pos == 10 and st.fk.shape[2] == 2 and st.k.shape[2] == 2   # 10 = 2·4 + 2; w − 1 = 2
    _, st = m(x[:, :8], output_state=True)
    assert st.fk.shape[2] == 4            # a full chunk stays open until the next token


def test_packed_documents_start_from_the_initial_weights():
    """With reset_at_doc_boundaries, a packed row equals its documents run one by one."""
    cfg = dataclasses.replace(tiny_cfg("lact", lact=dict(BASE)), n_layers=2, reset_at_doc_boundaries=True)
    torch.manual_seed(0)
    lm = LM(cfg).double().eval()
    ids = torch.randint(0, 64, (1, 15))
    pos = torch.tensor([list(range(9)) + list(range(6))])
    with torch.no_grad():
        packed = lm(ids, position_ids=pos).logits
        a = lm(ids[:, :9]).logits
        b = lm(ids[:, 9:]).logits
    torch.testing.assert_close(packed, torch.cat([a, b], 1), atol=1e-10, rtol=0)


def test_bad_config_names_the_key():
    for kw, key in [(dict(num_heads=3), "model.lact.num_heads"), (dict(chunk_size=0), "model.lact.chunk_size"),
                    (dict(window=-1), "model.lact.window"), (dict(muon_dtype="fp8"), "model.lact.muon_dtype"),
                    (dict(low_rank=-2), "model.lact.low_rank"), (dict(base_lr=0.0), "model.lact.base_lr")]:
        cfg = tiny_cfg("lact", lact=dict(BASE, **kw))
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            build_mixer("lact", cfg, 0)


def test_init_follows_the_official_code():
    cfg = tiny_cfg("lact", d_model=64, lact=dict(BASE, low_rank=4, num_heads=2))
    torch.manual_seed(0)
    m = LaCT(cfg, 0)
    w0, w1, w2 = m.fast_weights()
    e = 32
    eye = torch.eye(e)
    # W_left W_right + 0.5·I: the identity part is there, the rest is small
    assert ((w0 - 0.5 * eye).abs().max()) < 0.5
    torch.testing.assert_close(m.w0.left.std().item(), 0.5 / 4 ** 0.5, rtol=0.15, atol=0)
    torch.testing.assert_close(m.w0.right.std().item(), 0.5 / e ** 0.5, rtol=0.15, atol=0)
    torch.testing.assert_close(w1.std().item(), 1 / e ** 0.5, rtol=0.1, atol=0)
    assert torch.equal(m.qk_scale, torch.ones(64, 2)) and torch.equal(m.qk_offset, torch.zeros(64, 2))


def test_flops_count_the_fast_weight_products():
    """FLOPs per token: the fast-weight products (query apply for every token, the write for the
    tokens of written chunks), Muon, the window's attention; the initial fast weights are not
    counted again from their shapes."""
    cfg = tiny_cfg("lact", d_model=64, n_heads=4, lact=dict(BASE, chunk_size=16, window=8, num_heads=2,
                                                              low_rank=4))
    f = LaCT.flops_per_token(cfg, 64)
    e = dh = 32
    seen = (8 * 9 / 2 + (64 - 8) * 8) / 64
    want = 4 * 4 * 16 * seen + 2 * e * dh * (6 + 12 * 48 / 64)
    assert f == pytest.approx(want)
    cfg.lact.use_muon = True
    fm = LaCT.flops_per_token(cfg, 64)
    assert fm - f == pytest.approx(2 * 3 * 5 * (4 * 32 ** 3 + 2 * 32 ** 3) * 3 / 64)
    assert LaCT.flops_per_token(cfg, 16) == pytest.approx(4 * 4 * 16 * (8 * 9 / 2 + 8 * 8) / 16 + 2 * e * dh * 6)
    # N_matmul: the low-rank factors, w1 and the per-channel scales are left out
    m = LM(cfg)
    lact = m.layers[0].mixer
    dense = sum(p.numel() for n, p in m.named_parameters() if p.ndim >= 2 and n != "embed.weight"
                and not any(s in n for s in ("w0.", "w2.", "w1", "qk_scale", "qk_offset")))
    assert matmul_params(cfg) == dense + (m.lm_head.weight.numel() if cfg.tie_embeddings else 0)
    assert flops_per_token(cfg, 64)["forward"] == pytest.approx(2 * matmul_params(cfg) + fm)
    assert lact.w1._flops_not_per_token
