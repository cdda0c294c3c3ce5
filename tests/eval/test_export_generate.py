"""Self-contained exports and the generate CLI: a tiny model trained by train.py on a prepared corpus
is exported, the export moved away from the data (which is then renamed out of reach), and
perplexity on --text and generation still work from it. Sampling rules on fixed logits."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.eval.conftest import VOCAB
from ttt_lm.model.lm import filter_logits, sample_next

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _run(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([PY, *args], cwd=kw.pop("cwd", ROOT), env=env, capture_output=True, text=True,
                          timeout=300, **kw)


@pytest.fixture(scope="module")
def trained_run(prepared, tmp_path_factory):
    """train.py for 3 steps of configs/tiny.yaml as it stands (its vocabulary the prepared tokenizer's)
    on a private copy of the prepared corpus (the tests rename it away afterwards)."""
    base = tmp_path_factory.mktemp("selfcontained")
    data = str(base / "data")
    shutil.copytree(prepared, data)
    run = str(base / "run")
    r = _run(["train.py", "configs/tiny.yaml", f"data.path={data}", f"model.vocab_size={VOCAB}",
              "data.seq_len=64", "train.micro_batch_size=2", "train.max_steps=3",
              "optim.warmup_steps=1", "eval.every=0", "logging.tensorboard=false", "logging.progress=false",
              "train.device=cpu", f"train.run_dir={run}"])
    assert r.returncode == 0, r.stdout + r.stderr
    return base, data, run


#: DeepSpeed's lines on every consolidation of a checkpoint, which the exporter silences
DS_NOISE = ("Setting accelerator to CPU", "Processing zero checkpoint", "Parsing checkpoint created by",
            "Reconstructed fp32 state dict", "Loading checkpoint shards")


def assert_no_deepspeed_noise(out: str) -> None:
    said = [n for n in DS_NOISE if n in out]
    assert not said, f"DeepSpeed's lines came through: {said}\n{out}"


@pytest.fixture(scope="module")
def moved_export(trained_run):
    base, data, run = trained_run
    out = str(base / "export")
    r = _run(["-m", "ttt_lm.train.export", run, out])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokenizer.model" in r.stdout
    assert_no_deepspeed_noise(r.stdout + r.stderr)
    from ttt_lm.data.tokenizer import sha256_file
    with open(os.path.join(data, "manifest.json")) as f:
        assert sha256_file(os.path.join(out, "tokenizer.model")) == json.load(f)["tokenizer_sha256"]
    # the export travels; the data directory it was trained on is gone
    moved = str(base / "elsewhere" / "tiny")
    os.makedirs(os.path.dirname(moved))
    shutil.move(out, moved)
    os.rename(data, data + ".gone")
    return moved


@pytest.mark.slow
def test_an_eval_of_a_run_directory_prints_no_deepspeed_lines(trained_run, prepared, tmp_path):
    """An eval given the run itself exports it on the fly through DeepSpeed's zero_to_fp32: its
    accelerator and 'Processing zero checkpoint' lines stay out of the eval's output. It reads the
    prepared corpus itself: the run's private copy is renamed away by ``moved_export``, which may
    run first."""
    _, _, run = trained_run
    r = _run(["-m", "ttt_lm.eval", "perplexity", "--checkpoint", run, "--data", prepared, "--max-batches", "1",
              "--out", str(tmp_path / "ev"), "--no-progress"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "perplexity run on" in r.stdout
    assert_no_deepspeed_noise(r.stdout + r.stderr)


def test_the_exporter_keeps_deepspeeds_real_warnings(capfd):
    """Only the accelerator line and zero_to_fp32's progress output are dropped: another DeepSpeed
    warning, and Python warnings, come through."""
    import io
    import logging
    import warnings

    from ttt_lm.train.export import _quiet_deepspeed
    # the records are read from a handler of this test's own: DeepSpeed's handler writes to the
    # sys.stdout of wherever deepspeed was first imported (another test's capture, in some orders)
    seen = logging.StreamHandler(io.StringIO())
    logging.getLogger("DeepSpeed").addHandler(seen)
    try:
        with _quiet_deepspeed() as z2f:
            logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU ...")
            logging.getLogger("DeepSpeed").warning("a real problem: checkpoint tag mismatch")
            print("Processing zero checkpoint 'x'")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.warn("a real deprecation", FutureWarning)
            assert [str(w.message) for w in caught] == ["a real deprecation"]
            assert list(z2f.tqdm([1, 2])) == [1, 2]
    finally:
        logging.getLogger("DeepSpeed").removeHandler(seen)
    out, err = capfd.readouterr()
    logged = seen.stream.getvalue()
    assert "a real problem: checkpoint tag mismatch" in logged
    assert "Setting accelerator" not in logged + out + err and "Processing zero checkpoint" not in out + err
    print("Processing zero checkpoint 'y'")  # outside, everything as it was
    assert "Processing zero checkpoint 'y'" in capfd.readouterr().out
    assert not logging.getLogger("DeepSpeed").filters


@pytest.mark.slow
def test_perplexity_on_text_from_a_moved_export(moved_export, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over a lazy dog and then the cat sat on my mat\n" * 20)
    r = _run(["-m", "ttt_lm.eval", "perplexity", "--checkpoint", moved_export, "--text", str(text),
              "--seq-len", "64", "--out", str(tmp_path / "ev"), "--no-progress"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "ev" / "perplexity.json") as f:
        res = json.load(f)["result"]
    assert res["tokens"] > 0 and 0 < res["loss"] < 10 and res["bits_per_byte"] > 0


@pytest.mark.slow
def test_generate_cli_from_a_moved_export(moved_export, tmp_path):
    args = ["-m", "ttt_lm.generate", "--checkpoint", moved_export, "--prompt", "the quick brown",
            "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.9", "--seed", "3",
            "--num-samples", "2", "--device", "cpu", "--json"]
    r = _run(args, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    samples = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(samples) == 2
    for s in samples:
        assert s["prompt"] == "the quick brown"
        assert s["stop"] in ("eos", "length") and 2 not in s["ids"]
        assert (len(s["ids"]) == 12) == (s["stop"] == "length") and len(s["ids"]) <= 12
    # the same seed draws the same text; the model's own generate with the same generator agrees
    again = _run(args, cwd=str(tmp_path))
    assert [json.loads(line) for line in again.stdout.splitlines()] == samples
    from ttt_lm.data import load_tokenizer
    from ttt_lm.eval.checkpoint import load_checkpoint
    from ttt_lm.generate import generate_text
    ck = load_checkpoint(moved_export)
    assert generate_text(ck, load_tokenizer(ck.tokenizer_path), "the quick brown", 12, 0.9, 40, 0.9, 3, 2) == samples


@pytest.mark.slow
def test_generate_without_a_tokenizer_says_why(trained_run, moved_export, tmp_path):
    bare = str(tmp_path / "bare")
    shutil.copytree(moved_export, bare)
    os.remove(os.path.join(bare, "tokenizer.model"))
    r = _run(["-m", "ttt_lm.generate", "--checkpoint", bare, "--prompt", "x", "--device", "cpu"])
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "data.path" in err[0] and "is not a prepared data directory here" in err[0]
    assert "names no prepared data" not in err[0]
    r = _run(["-m", "ttt_lm.generate", "--checkpoint", bare, "--prompt", "x", "--temperature", "-1",
              "--tokenizer", os.path.join(moved_export, "tokenizer.model"), "--device", "cpu"])
    assert r.returncode == 2 and "temperature must be >= 0" in r.stderr


@pytest.mark.slow
def test_export_without_the_data_writes_no_tokenizer_and_says_so(trained_run, moved_export, tmp_path):
    _, _, run = trained_run  # moved_export has renamed the data away
    r = _run(["-m", "ttt_lm.train.export", run, str(tmp_path / "e")])
    assert r.returncode == 0, r.stderr
    assert "gets no tokenizer.model" in r.stderr and not (tmp_path / "e" / "tokenizer.model").exists()
    r = _run(["-m", "ttt_lm.train.export", run, str(tmp_path / "f"), "--tokenizer",
              os.path.join(moved_export, "tokenizer.model")])
    assert r.returncode == 0 and (tmp_path / "f" / "tokenizer.model").exists()
    r = _run(["-m", "ttt_lm.train.export", run, str(tmp_path / "g"), "--tokenizer", str(tmp_path / "nope")])
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.slow
def test_export_takes_only_the_tokenizer_the_run_trained_with(trained_run, moved_export, tmp_path):
    """Another corpus prepared at the run's data.path (another tokenizer, same vocabulary size): the
    checkpoint's recorded tokenizer digest keeps it out of the export."""
    from ttt_lm.data.prepare import prepare
    _, data, run = trained_run
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(10):
        (raw / f"d{i}.txt").write_text("zebra yak xylophone walrus vulture umbrella tiger\n" * 40)
    prepare([str(raw)], data, vocab_size=300, shard_tokens=4000, val_fraction=0.1, workers=1, progress=False,
            overwrite=True)
    try:
        r = _run(["-m", "ttt_lm.train.export", run, str(tmp_path / "e")])
        assert r.returncode == 0, r.stderr
        assert "is not the one this checkpoint was trained with" in r.stderr
        assert not (tmp_path / "e" / "tokenizer.model").exists()
        r = _run(["-m", "ttt_lm.train.export", run, str(tmp_path / "f"), "--tokenizer", data])
        assert r.returncode == 2 and "is not the one this checkpoint was trained with" in r.stderr
    finally:
        shutil.rmtree(data)


# ---- sampling rules on fixed logits ------------------------------------------------------------

LOGITS = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]))  # probabilities by token: 1 > 2 > 3 > 0


def _kept(lg):
    return torch.isfinite(lg[0]).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_most_likely():
    assert _kept(filter_logits(LOGITS, top_k=1)) == [1]
    assert _kept(filter_logits(LOGITS, top_k=2)) == [1, 2]
    assert _kept(filter_logits(LOGITS, top_k=10)) == [0, 1, 2, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # sorted mass: 0.5, 0.8, 0.95, 1.0
    assert _kept(filter_logits(LOGITS, top_p=0.45)) == [1]
    assert _kept(filter_logits(LOGITS, top_p=0.55)) == [1, 2]
    assert _kept(filter_logits(LOGITS, top_p=0.75)) == [1, 2]
    assert _kept(filter_logits(LOGITS, top_p=0.9)) == [1, 2, 3]
    assert _kept(filter_logits(LOGITS, top_p=0.01)) == [1]  # the most likely token always stays
    assert _kept(filter_logits(LOGITS, top_p=1.0)) == [0, 1, 2, 3]
    # top-k first, then top-p of the renormalized rest: among {1: 0.5, 2: 0.3} token 1 holds 0.625
    assert _kept(filter_logits(LOGITS, top_k=2, top_p=0.6)) == [1]
    assert _kept(filter_logits(LOGITS, top_k=2, top_p=0.7)) == [1, 2]


def test_temperature_scales_before_the_nucleus():
    lg = filter_logits(LOGITS, temperature=2.0)
    assert torch.allclose(lg.softmax(-1), (LOGITS / 2).softmax(-1))
    # at temperature 2 the distribution flattens, so p = 0.6 needs a third token
    p = (LOGITS / 2).softmax(-1)[0].sort(descending=True).values
    assert p[0] + p[1] < 0.75 and _kept(filter_logits(LOGITS, temperature=2.0, top_p=0.75)) == [1, 2, 3]
    assert _kept(filter_logits(LOGITS, temperature=1.0, top_p=0.75)) == [1, 2]


def test_sampling_draws_only_kept_tokens_in_proportion():
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(LOGITS, 1.0, None, g, top_p=0.75) for _ in range(4000)]).flatten()
    assert set(draws.tolist()) == {1, 2}
    assert (draws == 1).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    assert sample_next(LOGITS, 0.0).tolist() == [1]


def test_bad_sampling_settings_are_refused():
    for kw, msg in [({"temperature": -0.5}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"),
                    ({"top_p": 1.5}, "top_p")]:
        with pytest.raises(ValueError, match=msg):
            filter_logits(LOGITS, **kw)


def test_generate_stops_every_row_at_eos():
    from tests.eval.conftest import preset_pattern, tiny_model
    m = tiny_model(preset_pattern(), vocab_size=16)
    p = torch.randint(3, 16, (3, 5), generator=torch.Generator().manual_seed(0))
    free = m.generate(p, 8, temperature=0)
    eos = int(free[1, 6])  # row 1's second generated token: make it the end of document
    out = m.generate(p, 8, temperature=0, eos_id=eos)
    for row, ref in zip(out, free):
        gen, want = row[5:].tolist(), ref[5:].tolist()
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert gen[:cut] == want[:cut] and all(t == eos for t in gen[cut:])
    assert out.shape[1] <= free.shape[1] and eos in out[1, 5:].tolist()


class _PaddingFavoured(torch.nn.Module):
    """An LM head whose logits favour the ids from ``n`` on by 100: the padding of a vocabulary
    larger than the tokenizer's, which an unmasked argmax or draw would then always produce."""

    def __init__(self, head, n):
        super().__init__()
        self.head, self.n = head, n

    def forward(self, h):
        out = self.head(h).clone()
        out[..., self.n:] += 100.0
        return out


def _padded_model(tok_vocab=300, model_vocab=320):
    from tests.eval.conftest import preset_pattern, tiny_model
    m = tiny_model(preset_pattern(), vocab_size=model_vocab)
    m.lm_head = _PaddingFavoured(m.lm_head, tok_vocab)
    return m


def test_mask_vocab_and_sampling_keep_to_the_tokenizers_ids():
    from ttt_lm.model.lm import mask_vocab
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    assert mask_vocab(logits, None) is logits and mask_vocab(logits, 4) is logits
    assert mask_vocab(logits, 2).tolist() == [[0.0, 1.0, float("-inf"), float("-inf")]]
    assert logits[0, 3] == 9.0  # the input is left as it was
    assert int(sample_next(logits, 0.0, vocab_size=2)) == 1 and int(sample_next(logits, 0.0)) == 3
    g = torch.Generator().manual_seed(0)
    draws = [int(sample_next(logits, 1.0, top_k=3, generator=g, vocab_size=2)) for _ in range(50)]
    assert set(draws) <= {0, 1}
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        mask_vocab(logits, 0)


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 5}])
def test_generate_never_produces_padding_ids(kw):
    m = _padded_model()
    p = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(0))
    free = m.generate(p, 6, generator=torch.Generator().manual_seed(1), **kw)[:, 4:]
    assert bool((free >= 300).all())  # unmasked, the padding wins every time
    out = m.generate(p, 6, generator=torch.Generator().manual_seed(1), vocab_size=300, **kw)[:, 4:]
    assert out.shape == (2, 6) and bool((out < 300).all())
    with pytest.raises(ValueError, match=r"vocab_size .* must be in \[1, model.vocab_size=320\], got 321"):
        m.generate(p, 2, vocab_size=321)


def test_generate_text_and_passkey_decoding_keep_to_the_tokenizer(tokenizer):
    from types import SimpleNamespace

    from ttt_lm.eval.passkey import greedy_continue
    from ttt_lm.generate import generate_text
    m = _padded_model(tokenizer.vocab_size, tokenizer.vocab_size + 20)
    for t in (0.0, 1.0):
        for s in generate_text(SimpleNamespace(model=m), tokenizer, "the quick", 8, temperature=t, num_samples=2):
            assert s["ids"] and all(i < tokenizer.vocab_size for i in s["ids"])
    ids = tokenizer.encode("the quick brown")
    assert all(i >= tokenizer.vocab_size for i in greedy_continue(m, ids, 4))
    assert all(i < tokenizer.vocab_size for i in greedy_continue(m, ids, 4, vocab_size=tokenizer.vocab_size))


def test_passkey_practice_accuracy_counts_the_best_real_token():
    from ttt_lm.eval.passkey import answer_metrics
    m = _padded_model()
    x = torch.randint(3, 300, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = m(x).logits[..., :300].argmax(-1)
    y[:, :4] = -100  # the prompt; the last 4 positions are the answer
    assert answer_metrics(m, [(x, y)], 300)["prompt_accuracy"] == 1.0
    assert answer_metrics(m, [(x, y)])["token_accuracy"] == 0.0  # unmasked, the padding wins
