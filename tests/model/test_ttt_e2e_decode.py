"""TTT-E2E inference (ttt_lm.model.e2e, the decode section): token-by-token decode, chunked prefill
and a forward that carries states give the logits of the training-mode forward of the whole
sequence (in eval, ρ = 1), and the fast weights after a prefill are the forward's W^{(i)} of the
last chunk; greedy generation continues with the argmax of the forward; the state stays the same
size whatever the context; bad states are refused.

Cases: prompts whose length is not a multiple of the inner batch b, prefill pieces that are not
multiples of b (smaller and larger than b), windows that are not multiples of b (w = 6 > b = 4
and w = 3 < b), one and two TTT blocks, and the model without them (S = 0).

Tolerance: float64 runs the same math in another order (attention over a cache whose keys are
rotated at absolute positions instead of the forward's local ones, the prefix blocks by SDPA with a mask instead of the sliding-window kernel), so it
agrees to rounding (measured ~1e-14); the bound is 1e-10. float32: 2e-5 of max(1, the largest
|logit|), as the model's reference tests.
"""
from __future__ import annotations

import pytest
import torch

from tests.model.test_ttt_e2e import e2e_config
from ttt_lm.model.e2e import E2EState
from ttt_lm.model.lm import LM

TOL64 = 1e-10
CASES = {                            # name: (S, L, b, w)
    "two_ttt_w6_b4": (2, 3, 4, 6),
    "one_ttt_w3_b4": (1, 3, 4, 3),
    "one_ttt_w9_b4": (1, 2, 4, 9),
    "no_ttt_w5": (0, 2, 4, 5),
}


def model(case: str, dtype=torch.float64, clip=1.0) -> LM:
    S, L, b, w = CASES[case]
    torch.manual_seed(0)
    return LM(e2e_config(S=S, L=L, b=b, w=w, clip=clip)).to(dtype).eval()


def tokens(m, T: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, m.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def forward_logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


def close(got, want, tol=TOL64):
    err = float((got - want).abs().max())
    assert err <= tol, f"max |decode − forward| = {err:.3g} > {tol}"


@pytest.mark.parametrize("case", list(CASES))
def test_token_by_token_decode_equals_the_forward(case):
    m = model(case)
    ids = tokens(m, 23)
    full = forward_logits(m, ids)
    st = m.init_states(2)
    for t in range(ids.shape[1]):
        lg, st = m.step(ids[:, t], st)
        close(lg, full[:, t])
        assert all(s.pos == t + 1 for s in st)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("T", [21, 23])
def test_chunked_prefill_equals_the_forward(case, T):
    m = model(case)
    ids = tokens(m, T)
    full = forward_logits(m, ids)
    b = m.e2e.inner_batch
    for n in (1, 3, 5, 7, None):
        assert n is None or n % b
        lg, st = m.prefill(ids, n)
        close(lg, full[:, -1])
        assert all(s.pos == T for s in st)
        if m.e2e.suffix_len:
            assert st[-1].steps == (T - 1) // b                 # every chunk but the open one updated
            assert st[m.n_prefix].chunk_ids.shape == (2, T - b * ((T - 1) // b))


@pytest.mark.parametrize("case", ["two_ttt_w6_b4", "one_ttt_w3_b4"])
def test_fast_weights_after_prefill_are_those_of_the_forward(case):
    """After T tokens the state holds W^{(⌈T/b⌉−1)}, the weights the forward's last chunk ran with;
    at a chunk boundary (T = 5b) the last whole chunk's step waits for the next token, and the
    step that reads it takes it: W^{(5)} of the forward of T + 1 tokens."""
    m = model(case)
    b, P, S = m.e2e.inner_batch, m.n_prefix, m.e2e.suffix_len
    ids = tokens(m, 5 * b + 3)
    for T in (5 * b - 1, 5 * b, 5 * b + 1, 5 * b + 3):
        with torch.no_grad():
            tr = m.run(ids[:, :T], keep_fast=True)
        for n in (3, None):
            _, st = m.prefill(ids[:, :T], n)
            assert st[-1].steps == len(tr.fast) - 1
            for j in range(S):
                for got, want in zip(st[P + j].fast, tr.fast[-1][j]):
                    close(got, want)
    _, st = m.prefill(ids[:, :5 * b], 3)
    with torch.no_grad():
        tr = m.run(ids[:, :5 * b + 1], keep_fast=True)
    assert st[-1].steps == 4 and len(tr.fast) == 6
    _, st = m.step(ids[:, 5 * b], st)
    assert st[-1].steps == 5
    for j in range(S):
        for got, want in zip(st[P + j].fast, tr.fast[5][j]):
            close(got, want)
        for got, before in zip(st[P + j].fast, tr.fast[4][j]):
            assert float((got - before).abs().max()) > 1e-6     # the step did change them


def test_inner_steps_are_clipped_as_in_the_forward():
    """A small clip threshold (every inner step clipped) and a large one (none) both agree."""
    for clip in (1e-3, 1e3):
        m = model("two_ttt_w6_b4", clip=clip)
        ids = tokens(m, 19)
        lg, _ = m.prefill(ids, 5)
        close(lg, forward_logits(m, ids)[:, -1])


def test_forward_with_carried_states_equals_one_forward():
    m = model("two_ttt_w6_b4")
    ids = tokens(m, 26)
    full = forward_logits(m, ids)
    with torch.no_grad():
        a = m(ids[:, :9], output_states=True)
        b_ = m(ids[:, 9:14], states=a.states, output_states=True)
        c = m(ids[:, 14:], states=b_.states)
    assert c.states is None
    close(torch.cat([a.logits, b_.logits, c.logits], 1), full)


@pytest.mark.parametrize("case", ["two_ttt_w6_b4", "one_ttt_w3_b4", "no_ttt_w5"])
def test_hidden_gives_the_forward_logits_through_the_head_and_carries_states(case):
    """hidden (the LM.hidden contract: final-normed, then lm_head) = forward's logits within 1e-12;
    chunked calls with carried states = one call; in training mode (ρ and the graph) too."""
    m = model(case)
    ids = tokens(m, 26)
    full = forward_logits(m, ids)
    with torch.no_grad():
        h, st = m.hidden(ids)
        assert st is None and h.shape == (2, 26, m.cfg.d_model)
        close(m.lm_head(h), full, 1e-12)
        a, sa = m.hidden(ids[:, :9], output_states=True)
        b_, sb = m.hidden(ids[:, 9:14], sa, output_states=True)
        c, sc = m.hidden(ids[:, 14:], sb)
        assert sc is None
        close(torch.cat([a, b_, c], 1), h, 1e-12)
        close(m.lm_head(torch.cat([a, b_, c], 1)), full, 1e-12)
        whole, s_whole = m.hidden(ids, output_states=True)
        close(whole, h, 1e-12)
        assert [x.pos for x in s_whole] == [x.pos for x in m(ids, output_states=True).states] == [26] * m.cfg.n_layers
    m.train().set_train_step(2)
    ht, _ = m.hidden(ids)
    assert ht.requires_grad
    with torch.no_grad():
        close(m.lm_head(ht), m(ids).logits, 1e-12)


@pytest.mark.parametrize("case", ["two_ttt_w6_b4", "no_ttt_w5"])
def test_greedy_generate_is_the_argmax_of_the_forward(case):
    m = model(case)
    ids = tokens(m, 10)
    out = m.generate(ids, 9, temperature=0, prefill_chunk=3)
    assert out.shape == (2, 19) and torch.equal(out[:, :10], ids)
    want = forward_logits(m, out)[:, 9:-1].argmax(-1)
    assert torch.equal(out[:, 10:], want)
    assert torch.equal(m.generate(ids, 9, temperature=0, prefill_chunk=None), out)


def test_float32_decode_agrees_with_the_float32_forward():
    m = model("two_ttt_w6_b4", torch.float32)
    ids = tokens(m, 22)
    full = forward_logits(m, ids)
    tol = 2e-5 * max(1.0, float(full.abs().max()))
    st = m.init_states(2)
    for t in range(ids.shape[1]):
        lg, st = m.step(ids[:, t], st)
        close(lg, full[:, t], tol)
    assert st[-1].fast[0].dtype == torch.float32


def test_decode_uses_rho_one_in_training_mode_too():
    """ρ (the inner-lr warm-up) is a training schedule: decode takes full inner steps."""
    m = model("two_ttt_w6_b4")
    ids = tokens(m, 15)
    want = forward_logits(m, ids)[:, -1]
    m.train().set_train_step(1)
    assert m.rho() < 1
    lg, _ = m.prefill(ids, 4)
    close(lg, want)


def test_state_size_is_constant_in_the_context():
    """After any number of tokens past the window and a chunk, every state tensor has the same
    shape at the same offset in the chunk: the window caches, the open chunk and W."""
    m = model("two_ttt_w6_b4")
    b = m.e2e.inner_batch
    ids = tokens(m, 12 * b + 2, B=1)

    def shapes(T):
        _, st = m.prefill(ids[:, :T], 5)
        return [tuple(t.shape) for s in st for t in s.tensors()]
    assert shapes(3 * b + 2) == shapes(12 * b + 2)
    assert shapes(3 * b) == shapes(11 * b)
    k = shapes(12 * b + 2)
    assert max(s[2] for s in k if len(s) == 4) <= m.e2e.window + b


def test_states_reorder_rows_like_separate_runs():
    """index_select on every state (beam search's reordering) continues each row as alone."""
    m = model("two_ttt_w6_b4")
    ids = tokens(m, 13)
    _, st = m.prefill(ids, 5)
    idx = torch.tensor([1, 1, 0])
    moved = [s.index_select(idx) for s in st]
    nxt = tokens(m, 6, B=3, seed=2)
    for t in range(nxt.shape[1]):
        lg, moved = m.step(nxt[:, t], moved)
    full = forward_logits(m, torch.cat([ids[idx], nxt], 1))[:, -1]
    close(lg, full)


def test_decode_appends_in_place_and_two_continuations_do_not_overwrite_each_other():
    """Decode steps write each key into the caches' buffer (the state's k is a view of it, not a
    copy per token), while every state stays at most 1.5x its keys plus 16; stepping twice from
    one state (two continuations of a prompt) gives each the logits of its own forward."""
    m = model("two_ttt_w6_b4")
    b = m.e2e.inner_batch
    ids = tokens(m, 3 * b + 1)
    _, st = m.prefill(ids, 5)
    a, c = tokens(m, 2 * b + 3, seed=3), tokens(m, 2 * b + 3, seed=4)
    sa, sc = st, st
    for t in range(a.shape[1]):
        before = [s.k.untyped_storage().data_ptr() for s in sa]
        la, sa = m.step(a[:, t], sa)        # a first, then c from the same states: c must not see a's keys
        lc, sc = m.step(c[:, t], sc)
        if t:
            same = [s.k.untyped_storage().data_ptr() == p for s, p in zip(sa, before)]
            assert sum(same) >= len(sa) - 2, same    # a buffer is rebuilt now and then, not every step
        for s in sa + sc:
            assert s.kv_buf is not None and s.k.untyped_storage().nbytes() <= \
                (1.5 * s.k.shape[2] + 16 + 1) * s.k[:, :, :1].numel() * s.k.element_size()
    close(la, forward_logits(m, torch.cat([ids, a], 1))[:, -1])
    close(lc, forward_logits(m, torch.cat([ids, c], 1))[:, -1])


def test_bad_states_and_labels_with_states_are_refused():
    m = model("two_ttt_w6_b4")
    ids = tokens(m, 6)
    _, st = m.prefill(ids, None)
    with pytest.raises(ValueError, match="the states hold \\[2\\] rows, the tokens 3"):
        m.step(torch.zeros(3, dtype=torch.long), st)
    with pytest.raises(ValueError, match="states must be the list of 3 E2EState"):
        m.step(ids[:, 0], st[:2])
    with pytest.raises(ValueError, match="labels with carried states"):
        m(ids, labels=ids, output_states=True)
    with pytest.raises(ValueError, match="token_ids must be \\[B\\]"):
        m.step(ids, st)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        m.init_states(0)
    with pytest.raises(ValueError, match="prefill_chunk .* must be an integer >= 1.*got 0"):
        m.prefill(ids, 0)
    with pytest.raises(ValueError, match="logits must be 'all', 'last', 'hidden' or None, got 'first'"):
        m.advance(ids, st, "first")
    assert all(isinstance(s, E2EState) for s in st)


# ---- the evals and the Hugging Face export run it -----------------------------------------------
def tiny_preset():
    from ttt_lm.config import load_config
    cfg = load_config("configs/tiny_ttt_e2e.yaml")
    torch.manual_seed(0)
    return LM(cfg.model).eval(), cfg.data.seq_len


def test_long_context_eval_runs_the_decode_form_up_to_four_times_the_training_length():
    """loss_by_position reads each document in pieces with the states carried (the decode form:
    memory flat in the length), here 1,024 = 4 × data.seq_len positions in pieces of 300 tokens
    (not a multiple of b = 32): the per-position losses equal those of one forward over the
    document (float32: 2e-4 absolute on losses ~8.3), and every position is counted."""
    import numpy as np
    import torch.nn.functional as F

    from ttt_lm.eval import loss_by_position
    m, T = tiny_preset()
    n = 4 * T
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, m.cfg.vocab_size, (n + 1,), generator=g) for _ in range(2)]
    calls = []
    hook = m.embed.register_forward_hook(lambda mod, a, o: calls.append(a[0].shape[1]))
    st = loss_by_position(m, docs, max_len=n, chunk_len=300, batch_size=2, show_progress=False)
    hook.remove()
    assert calls == [300, 300, 300, n - 900]          # pieces, states carried
    with torch.no_grad():
        want = sum(F.cross_entropy(m(d[None, :n]).logits[0], d[1:], reduction="none").double() for d in docs)
    assert st["sum"].shape == (n,) and (st["count"] == 2).all()
    np.testing.assert_allclose(st["sum"], want.numpy(), atol=2e-4, rtol=0)


def test_evals_hold_only_the_full_attention_variant_to_max_seq_len():
    """The windowed model reads any context; without a window (the full-attention baseline) a
    context beyond model.max_seq_len is refused as for global attention layers."""
    from ttt_lm.eval import EvalError, loss_by_position
    docs = [torch.randint(0, 37, (41,), generator=torch.Generator().manual_seed(3))]
    for S, w in ((1, 6), (0, 6), (0, None)):
        cfg = e2e_config(S=S, L=2, b=4, w=w)
        cfg.max_seq_len = 16
        torch.manual_seed(0)
        m = LM(cfg).eval()
        if w is None:
            with pytest.raises(EvalError, match="context length 40 exceeds model.max_seq_len=16 .*2 of 2: E2ELM"):
                loss_by_position(m, docs, max_len=40, chunk_len=7, show_progress=False)
        else:
            st = loss_by_position(m, docs, max_len=40, chunk_len=7, show_progress=False)
            assert (st["count"] == 1).all()


def test_perplexity_eval_runs_the_forward():
    from ttt_lm.eval.perplexity import evaluate_perplexity, text_batches
    m, T = tiny_preset()
    ids = torch.randint(3, m.cfg.vocab_size, (2 * T + 1,), generator=torch.Generator().manual_seed(2))
    got = evaluate_perplexity(m, text_batches(ids, T, 2), show_progress=False)
    with torch.no_grad():
        x = torch.stack([ids[:T], ids[T:2 * T]])
        y = torch.stack([ids[1:T + 1], ids[T + 1:]])
        want = float(m(x, labels=y).loss)         # every chunk whole: the chunk mean is the token mean
    assert got["tokens"] == 2 * T and abs(got["loss"] - want) < 1e-5


def test_hf_export_reloads_with_the_same_logits_and_generation(tmp_path):
    """save_hf and AutoModelForCausalLM: the reloaded model is an E2ELM with the same weights; a
    forward without the cache gives the plain forward's logits bit for bit, one with the cache
    (transformers' default) the decode form's bit for bit (and the forward's within float32
    rounding); greedy generate (prompt in one pass, then one LM.step per token) gives
    LM.generate's tokens; load_hf gives the model back."""
    from transformers import AutoModelForCausalLM

    from ttt_lm.hf import load_hf, save_hf
    from ttt_lm.model.e2e import E2ELM
    m = model("two_ttt_w6_b4", torch.float32)
    out = save_hf(m, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(hf.model, E2ELM)
    ids = tokens(m, 13)
    with torch.no_grad():
        plain = m(ids).logits
        assert torch.equal(hf(ids, use_cache=False).logits, plain)
        assert torch.equal(hf(ids).logits, m(ids, output_states=True).logits)
        close(hf(ids).logits, plain, 2e-5 * max(1.0, float(plain.abs().max())))
    ours = m.generate(ids, 10, temperature=0)
    gen = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=None)
    assert torch.equal(gen, ours)
    beams = hf.generate(ids, max_new_tokens=4, num_beams=3, do_sample=False, eos_token_id=None, pad_token_id=None)
    assert beams.shape == (2, 17) and torch.equal(beams[:, :13], ids)
    back = load_hf(out)
    assert isinstance(back, E2ELM)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, plain)


def test_generate_cli_decodes_an_e2e_export(tmp_path, capsys):
    """python -m ttt_lm.generate on an export of the model: greedy text through LM.generate with
    the E2E states, the same tokens as the model's own generate, at any --prefill-chunk."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ttt_lm.artifacts import save_export
    from ttt_lm.config import ExperimentConfig
    from ttt_lm.generate import main
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    tk.save(str(tmp_path / "tokenizer.json"))
    cfg = e2e_config(S=1, L=2, b=4, w=6)
    cfg.vocab_size = 300
    torch.manual_seed(0)
    m = LM(cfg).eval()
    out = save_export(m, ExperimentConfig(model=cfg), str(tmp_path / "export"), str(tmp_path / "tokenizer.json"))
    prompt = "the quick brown fox jumps over the lazy dog " * 2
    got = []
    for n in ("3", "100"):
        rc = main(["--checkpoint", out, "--prompt", prompt, "--max-new-tokens", "7", "--temperature", "0",
                   "--device", "cpu", "--json", "--prefill-chunk", n])
        res = capsys.readouterr()
        assert rc == 0, res.err
        got.append(json.loads(res.out))
    ids = [0] + tk.encode(prompt).ids                       # after the end-of-document id, as the CLI does
    want = m.generate(torch.tensor([ids]), 7, temperature=0, vocab_size=300, eos_id=0)[0, len(ids):].tolist()
    want = want[:want.index(0)] if 0 in want else want
    assert len(want) == 7 and got[0] == got[1] and got[0]["ids"] == want
