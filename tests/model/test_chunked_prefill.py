"""Chunked prefill (``LM.prefill`` / ``LM.generate(..., prefill_chunk=n)``): a prompt read n tokens
per forward pass, every layer's state carried from piece to piece, gives the logits and the greedy
continuation of one pass over it, for every registered layer kind and every tiny preset; only the
last position's logits are formed; bad input is refused at entry; ``python -m ttt_lm.generate``
takes ``--prefill-chunk``.

Cases. Per registered kind (``registry.builtin_kinds()``): a 2-layer model of that kind with each
mixer section's ``short(8)`` settings (chunks / mini-batches of 8 tokens), a 77-token prompt read
in pieces of 3 (smaller than every chunk, not a divisor of 77) and of 16 (larger than a chunk, not
a divisor of 77 nor a multiple of 8). Per preset (every ``configs/tiny*.yaml``): the preset as it
is (its own chunk, mini-batch, segment and window sizes: 16, 64, 128), a 151-token prompt in
pieces of 3 and 64.

Tolerance (float32): chunking changes only where the chunked forms cut the sequence (the scans'
chunk boundaries, attention over a KV cache instead of one causal block), so the results differ by
summation order alone. Measured: at most 1.7e-6 of the largest |logit| (float64: 1e-14). The test
allows 2e-5 of it (about ten times the measured difference, ~100 float32 ulps of the largest
logit). Greedy tokens must be equal; the one-pass logits' top-2 margins are 5e-4 or more, far above
that difference.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ttt_lm.config import load_config
from ttt_lm.model import LM, ModelConfig, registry
from ttt_lm.model.lm import PREFILL_CHUNK, model_class
from tests.model.mixer_checks import preset_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
#: the tiny presets of models that decode (a variant without carried states, LM.supports_decode
#: False, refuses prefill and generate at entry: its own tests hold that)
PRESETS = sorted(p.name for p in CONFIGS.glob("tiny*.yaml")
                 if model_class(load_config(str(p)).model).supports_decode)
KINDS = list(registry.builtin_kinds())
V = 61
#: allowed |chunked − one pass| as a fraction of the largest |logit| (module docstring)
REL_TOL = 2e-5
NEW_TOKENS = 6


def kind_model(kind: str, n: int = 8) -> LM:
    """A 2-layer LM of ``kind``, each mixer section shortened to chunks of ``n`` tokens (``short``)."""
    cfg = ModelConfig(vocab_size=V, d_model=32, n_heads=2, n_layers=2, layer_pattern=[kind], max_seq_len=4096)
    for name, section in cfg.sections().items():
        if callable(getattr(section, "short", None)):
            setattr(cfg, name, section.short(n))
    torch.manual_seed(0)
    return LM(cfg.validate()).eval()


def preset_model(name: str) -> LM:
    torch.manual_seed(0)
    return LM(load_config(str(CONFIGS / name)).model).eval()


def prompt(model: LM, T: int, B: int = 2) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


def piece_lengths(model: LM):
    """Records the length of every forward the blocks run (the embedding's input) and every
    input of the LM head: (lengths, head input shapes, the hooks to remove)."""
    lengths, head = [], []
    hooks = [model.embed.register_forward_hook(lambda m, a, o: lengths.append(a[0].shape[1])),
             model.lm_head.register_forward_hook(lambda m, a, o: head.append(tuple(a[0].shape)))]
    return lengths, head, hooks


def check_chunked_equals_one_pass(model: LM, T: int, pieces) -> None:
    ids = prompt(model, T)
    B = ids.shape[0]
    with torch.no_grad():
        full = model(ids).logits[:, -1]           # the former path: one pass, every position's logits
    one, _ = model.prefill(ids, None)
    tol = REL_TOL * full.abs().max().item()
    torch.testing.assert_close(one, full, atol=tol, rtol=0)
    want = model.generate(ids, NEW_TOKENS, temperature=0, prefill_chunk=None)
    assert want.shape == (B, T + NEW_TOKENS)
    for n in pieces:
        assert T % n != 0 and n < T
        lengths, head, hooks = piece_lengths(model)
        got, states = model.prefill(ids, n)
        for h in hooks:
            h.remove()
        # read in pieces of n (the last one the remainder), and the head only at the last position,
        # but for a model whose state update reads the head (``state_update_head_tokens``: TTT-E2E's
        # inner loss over each whole chunk of that many tokens)
        assert lengths == [n] * (T // n) + [T % n], lengths
        D, upd = model.cfg.d_model, getattr(model, "state_update_head_tokens", 0)
        assert head[-1:] == [(B, 1, D)] and all(s == (B, upd, D) for s in head[:-1]), head
        assert len(head) - 1 == (upd and (T - 1) // upd), head   # one per whole chunk followed by a token
        assert len(states) == model.cfg.n_layers and all(s.pos is not None for s in states)
        for st in states:   # the decode state keeps nothing of the pieces' activations alive
            for t in st.tensors():
                assert t.untyped_storage().nbytes() <= 2 * t.nbytes + 4096, \
                    f"a state tensor {tuple(t.shape)} keeps a {t.untyped_storage().nbytes()}-byte storage alive"
        torch.testing.assert_close(got, full, atol=tol, rtol=0, msg=lambda s: f"prefill_chunk={n}: {s}")
        gen = model.generate(ids, NEW_TOKENS, temperature=0, prefill_chunk=n)
        assert torch.equal(gen, want), \
            f"prefill_chunk={n}: greedy tokens {gen[:, T:].tolist()} != {want[:, T:].tolist()}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_chunked_prefill_equals_one_pass(kind):
    check_chunked_equals_one_pass(kind_model(kind), T=77, pieces=(3, 16))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_tiny_preset_chunked_prefill_equals_one_pass(preset):
    check_chunked_equals_one_pass(preset_model(preset), T=151, pieces=(3, 64))


def test_presets_and_kinds_found():
    assert len(PRESETS) >= 2 and "tiny.yaml" in PRESETS
    assert len(KINDS) >= 2


def test_default_reads_a_prompt_up_to_the_default_in_one_pass_and_a_longer_one_in_pieces():
    m = kind_model(KINDS[0])
    for T, want in ((5, [5]), (PREFILL_CHUNK + 3, [PREFILL_CHUNK, 3])):
        lengths, _, hooks = piece_lengths(m)
        m.prefill(prompt(m, T, B=1))
        for h in hooks:
            h.remove()
        assert lengths == want


def test_a_subclass_with_its_own_forward_runs_it_per_piece():
    """The tensor-parallel LM keeps its own forward (gathered logits): prefill calls it per piece."""
    class OwnForward(LM):
        def forward(self, input_ids, labels=None, states=None, output_states=False, position_ids=None):
            self.calls.append(input_ids.shape[1])
            return super().forward(input_ids, labels, states, output_states, position_ids)

    base = kind_model(KINDS[-1])
    m = OwnForward(base.cfg).eval()
    m.load_state_dict(base.state_dict())
    m.calls = []
    ids = prompt(m, 10)
    got, _ = m.prefill(ids, 4)
    assert m.calls == [4, 4, 2]
    want, _ = base.prefill(ids, None)
    torch.testing.assert_close(got, want, atol=REL_TOL * want.abs().max().item(), rtol=0)


# ---- refusals at entry ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_refuses_a_prefill_chunk_that_is_not_a_positive_integer(bad):
    m = kind_model(KINDS[0])
    lengths, _, hooks = piece_lengths(m)
    with pytest.raises(ValueError, match=rf"prefill_chunk .* must be an integer >= 1.*got {bad!r}"):
        m.generate(prompt(m, 5), 2, temperature=0, prefill_chunk=bad)
    for h in hooks:
        h.remove()
    assert lengths == []   # refused before any forward


@pytest.mark.parametrize("bad,row,pos", [(-1, 1, 2), (V, 0, 4), (V + 100, 1, 0)])
def test_refuses_a_prompt_id_outside_the_model_vocabulary(bad, row, pos):
    m = kind_model(KINDS[0])
    ids = prompt(m, 5)
    ids[row, pos] = bad
    msg = rf"prompt token id {bad} \(row {row}, position {pos}\) is outside \[0, model.vocab_size={V}\)"
    with pytest.raises(ValueError, match=msg):
        m.generate(ids, 2, temperature=0)
    with pytest.raises(ValueError, match=msg):
        m.prefill(ids, 2)


def test_vocab_size_limits_the_prompt_and_what_is_drawn():
    """``vocab_size`` (a tokenizer's, below a padded model vocabulary) limits the drawn ids and the
    prompt: an id of the padding range is refused naming vocab_size, one beyond the embedding
    naming model.vocab_size."""
    m = kind_model(KINDS[0])
    ids = torch.full((1, 4), 3)
    out = m.generate(ids, 4, temperature=1.0, vocab_size=50, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and int(out[0, 4:].max()) < 50
    ids[0, 2] = 55                      # in the padding range [50, 61)
    m.generate(ids, 2, temperature=0)   # the model embeds it
    with pytest.raises(ValueError, match=r"prompt token id 55 \(row 0, position 2\) is outside \[0, vocab_size=50\)"):
        m.generate(ids, 2, temperature=0, vocab_size=50)
    ids[0, 2] = V
    msg = rf"prompt token id {V} \(row 0, position 2\) is outside \[0, model.vocab_size={V}\)"
    with pytest.raises(ValueError, match=msg):
        m.generate(ids, 2, temperature=0)


@pytest.mark.parametrize("ids,match", [(torch.zeros(5, dtype=torch.long), r"\[B, T0\] .* got \(5,\)"),
                                       (torch.zeros(2, 0, dtype=torch.long), r"T0 >= 1, got \(2, 0\)"),
                                       (torch.zeros(1, 3), "integer token ids, got dtype torch.float32")])
def test_refuses_a_prompt_that_is_not_a_batch_of_token_ids(ids, match):
    m = kind_model(KINDS[0])
    with pytest.raises(ValueError, match=match):
        m.generate(ids, 2, temperature=0)


# ---- python -m ttt_lm.generate --prefill-chunk ---------------------------------------------

@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A tiny TTT-Linear + local-attention export with a byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ttt_lm.artifacts import save_export
    from ttt_lm.config import ExperimentConfig
    d = tmp_path_factory.mktemp("prefill_cli")
    vocab = 300
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                           trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    tk.save(str(d / "tokenizer.json"))
    cfg = preset_config("tiny", 4, vocab_size=vocab, d_model=32, n_heads=2, n_layers=2)   # its hybrid, tiny
    torch.manual_seed(0)
    model = LM(cfg.validate()).eval()
    return save_export(model, ExperimentConfig(model=cfg), str(d / "export"), str(d / "tokenizer.json"))


def _generate(export_dir, capsys, monkeypatch, *extra):
    from ttt_lm.generate import main
    lengths = []
    hidden = LM.hidden

    def spy(self, input_ids, *a, **kw):
        lengths.append(input_ids.shape[1])
        return hidden(self, input_ids, *a, **kw)

    monkeypatch.setattr(LM, "hidden", spy)
    rc = main(["--checkpoint", export_dir, "--prompt", "the quick brown fox jumps over the lazy dog " * 3,
               "--max-new-tokens", "5", "--temperature", "0", "--device", "cpu", "--json", *extra])
    monkeypatch.setattr(LM, "hidden", hidden)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out), lengths


def test_cli_prefill_chunk_reads_the_prompt_in_pieces_with_the_same_text(export_dir, capsys, monkeypatch):
    one, one_lengths = _generate(export_dir, capsys, monkeypatch, "--prefill-chunk", "100000")
    chunked, lengths = _generate(export_dir, capsys, monkeypatch, "--prefill-chunk", "5")
    T = one_lengths[0]
    assert T > 10 and one_lengths == [T]
    assert lengths == [5] * (T // 5) + ([T % 5] if T % 5 else [])
    assert chunked == one and len(one["ids"]) == 5
    default, d_lengths = _generate(export_dir, capsys, monkeypatch)
    assert d_lengths == [T] and default == one   # the default (2048) reads this prompt in one pass


@pytest.mark.parametrize("bad", ["0", "-3", "x"])
def test_cli_refuses_a_prefill_chunk_below_one(export_dir, capsys, bad):
    from ttt_lm.generate import main
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", export_dir, "--prefill-chunk", bad])
    assert e.value.code == 2
    assert "--prefill-chunk: must be" in capsys.readouterr().err


def test_generate_text_refuses_a_prefill_chunk_below_one(export_dir):
    from ttt_lm.data import load_tokenizer
    from ttt_lm.eval.checkpoint import load_checkpoint
    from ttt_lm.generate import generate_text
    ck = load_checkpoint(export_dir)
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 1 .*got 0"):
        generate_text(ck, load_tokenizer(ck.tokenizer_path), "the", 3, prefill_chunk=0)
