import json
import time

import pytest
import torch

from ttt_lm.eval.__main__ import main
from ttt_lm.eval.synthetic import (build_tiny_lm, evaluate_task, induction_heads, make_task, mqar,
                                   selective_copying, train_task)


def g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_induction_heads_answer_is_the_token_after_the_first_special():
    x, y = induction_heads(64, 40, vocab_size=8, generator=g())
    S = 7
    assert x.shape == y.shape == (64, 40) and int(x.max()) <= S
    for xi, yi in zip(x, y):
        where = (xi == S).nonzero().flatten().tolist()
        assert len(where) == 2 and where[1] == 39 and where[0] <= 37
        assert yi[-1] == xi[where[0] + 1] != S
        assert (yi[:-1] == -100).all()
    p = torch.stack([(xi == S).nonzero()[0, 0] for xi in x])
    assert p.min() < 5 and p.max() > 30  # positions spread over the sequence


def test_mqar_queries_ask_for_the_value_stored_with_their_key():
    V, N, T = 64, 6, 48
    x, y = mqar(32, T, vocab_size=V, num_kv_pairs=N, generator=g())
    for xi, yi in zip(x, y):
        keys, vals = xi[0:2 * N:2].tolist(), xi[1:2 * N:2].tolist()
        assert len(set(keys)) == N and all(1 <= k < V // 2 for k in keys) and all(V // 2 <= v < V for v in vals)
        q = (yi != -100).nonzero().flatten().tolist()
        assert len(q) == N and all(t >= 2 * N and (t - 2 * N) % 2 == 0 for t in q)
        assert sorted(xi[q].tolist()) == sorted(keys)
        for t in q:
            assert yi[t] == vals[keys.index(int(xi[t]))]
        rest = [t for t in range(2 * N, T) if t not in q]
        assert (xi[rest] == 0).all()
    with pytest.raises(ValueError, match="too short"):
        mqar(1, 20, vocab_size=V, num_kv_pairs=6)


def test_mqar_gaps_follow_a_power_law():
    x, y = mqar(400, 256, vocab_size=128, num_kv_pairs=4, generator=g())
    gaps = ((y != -100).nonzero()[:, 1] - 8) // 2
    # P(g) ∝ g^(a−1) with a = 0.01: the first quarter of the gaps takes most of the mass
    assert (gaps < 30).float().mean() > 0.6


def test_selective_copying_targets_are_the_data_tokens_in_order():
    x, y = selective_copying(32, 30, vocab_size=10, num_tokens=5, generator=g())
    for xi, yi in zip(x, y):
        region = xi[:25]
        data = region[region >= 2]
        assert len(data) == 5 and ((region == 0) | (region >= 2)).all()
        assert (xi[25:] == 1).all()
        assert yi[25:].tolist() == data.tolist() and (yi[:25] == -100).all()


def test_generators_are_reproducible():
    for t in ("induction", "mqar", "selective_copying"):
        task = make_task(t)
        a, b = task.batch(4, 64, g(3)), task.batch(4, 64, g(3))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_two_layer_attention_learns_induction_heads():
    """Budget: at most 800 AdamW steps of 32 sequences of length 16 (vocabulary 8) for a 2-layer
    d_model=64 attention model, about 15 s on one CPU core; solved means >= 95% accuracy on 64
    held-out sequences (chance is 1/7)."""
    task = make_task("induction", vocab_size=8)
    m = build_tiny_lm(["attention"], 8, n_layers=2, d_model=64, max_seq_len=64, seed=0)
    t0 = time.time()
    _, solved_at = train_task(m, task, 16, 800, batch_size=32, lr=3e-3, warmup=20, stop_at=0.95, check_every=25)
    assert solved_at is not None, "no induction head within 800 steps"
    assert evaluate_task(m, task, 16, num_examples=128, seed=5) >= 0.9
    assert time.time() - t0 < 60


def test_cli_table(tmp_path):
    rc = main(["synthetic", "--task", "mqar", "--mixers", "attention,deltanet+attention", "--train-len", "32",
               "--test-lens", "32,64", "--steps", "3", "--vocab-size", "32", "--num-kv-pairs", "4",
               "--d-model", "32", "--num-eval", "8", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    md = (tmp_path / "mqar.md").read_text()
    assert "| attention |" in md and "| deltanet+attention | deltanet,attention |" in md and "32*" in md
    res = json.loads((tmp_path / "mqar.json").read_text())["results"]
    assert [r["mixer"] for r in res] == ["attention", "deltanet+attention"]
    assert all(0 <= a <= 1 for r in res for a in r["accuracy"].values())
    assert (tmp_path / "mqar.png").exists()
