import json
import math

import pytest
import torch

from tests.eval.conftest import VOCAB, export_model, tiny_model
from ttt_lm.data import DataConfig, build_val_loader, iter_documents
from ttt_lm.eval import EvalError, evaluate_perplexity, token_byte_lengths
from ttt_lm.config import ExperimentConfig
from ttt_lm.eval.__main__ import main, perplexity_window
from ttt_lm.eval.checkpoint import save_export
from ttt_lm.eval.perplexity import text_batches


def test_matches_the_models_own_mean_loss_and_counts_every_token(prepared, tokenizer):
    m = tiny_model()
    loader = build_val_loader(DataConfig(path=prepared, seq_len=32, shuffle=False), 4)
    res = evaluate_perplexity(m, loader, token_byte_lengths(tokenizer), show_progress=False)
    with torch.no_grad():
        losses = [(m(b["input_ids"], labels=b["labels"]).loss.double() * b["labels"].numel(), b["labels"].numel())
                  for b in loader]
    n = sum(c for _, c in losses)
    assert res["tokens"] == n == loader.num_tokens
    # float32 logits, sums of ~4k terms: the two orders of summation agree to ~1e-6 relative
    assert res["loss"] == pytest.approx(float(sum(s for s, _ in losses)) / n, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]), rel=1e-12)
    again = evaluate_perplexity(m, loader, token_byte_lengths(tokenizer), show_progress=False)
    assert again == res  # deterministic: bit-identical on a second run


def test_bits_per_byte_counts_the_bytes_of_the_decoded_text(prepared, tokenizer):
    docs = list(iter_documents(prepared, "val"))
    tb = token_byte_lengths(tokenizer)
    for d in docs:
        assert int(tb[d].sum()) == len(tokenizer.decode(d.tolist()).encode("utf-8"))
    ids = torch.cat(docs)
    m = tiny_model()
    res = evaluate_perplexity(m, text_batches(ids, 64, 3), tb, show_progress=False)
    scored = ids[1:1 + res["tokens"]]
    assert res["tokens"] == ((len(ids) - 1) // 64) * 64
    assert res["bytes"] == len(tokenizer.decode(scored.tolist()).encode("utf-8"))
    assert res["bits_per_byte"] == pytest.approx(res["nll_sum"] / math.log(2) / res["bytes"], rel=1e-12)


def test_batch_size_does_not_change_the_result(prepared):
    m = tiny_model()
    ids = torch.cat(list(iter_documents(prepared, "val")))
    a = evaluate_perplexity(m, text_batches(ids, 32, 1), show_progress=False)
    b = evaluate_perplexity(m, text_batches(ids, 32, 7), show_progress=False)
    assert a["tokens"] == b["tokens"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)  # float32 matmuls batched differently


def test_bad_inputs(prepared, tmp_path, capsys):
    small = tiny_model(vocab_size=100)
    ids = torch.cat(list(iter_documents(prepared, "val")))
    with pytest.raises(EvalError, match="vocabulary mismatch.*vocab_size is 100"):
        evaluate_perplexity(small, text_batches(ids, 32, 2), show_progress=False)
    with pytest.raises(EvalError, match="exceeds model.max_seq_len=256"):
        evaluate_perplexity(tiny_model(), text_batches(ids, 512, 1), show_progress=False)
    # the CLI checks the manifest before reading anything: a table smaller than the tokenizer's
    d = export_model(tiny_model(vocab_size=256), str(tmp_path / "v256"), prepared)
    assert main(["perplexity", "--checkpoint", d, "--out", str(tmp_path), "--no-progress"]) == 2
    assert "vocabulary mismatch: the model has vocab_size=256" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["perplexity", "long_context"])
def test_a_padded_vocabulary_is_evaluated_as_it_trains_and_generates(task, prepared, tmp_path, capsys):
    """A model.vocab_size above the tokenizer's (a table padded to a multiple of 64) is accepted, as
    the trainer, the exporter and generate accept it, with one line saying so; the padding ids are
    never targets, and the loss is the model's own, as evaluate_perplexity gives it directly."""
    m = tiny_model(vocab_size=320)
    d = export_model(m, str(tmp_path / "v320"), prepared)
    extra = ["--seq-len", "64"] if task == "perplexity" else ["--max-len", "64", "--windows"]
    assert main([task, "--checkpoint", d, "--out", str(tmp_path), "--no-progress", *extra]) == 0
    err = capsys.readouterr().err
    assert f"model.vocab_size=320 is larger than the vocab_size={VOCAB} of the data in {prepared}" in err, err
    assert err.count("model.vocab_size=320") == 1, err
    out = json.loads((tmp_path / f"{task}.json").read_text())["result"]
    if task == "perplexity":
        loader = build_val_loader(DataConfig(path=prepared, seq_len=64, shuffle=False), 8)
        direct = evaluate_perplexity(m, loader, show_progress=False)
        assert out["tokens"] == direct["tokens"] > 0
        assert out["loss"] == pytest.approx(direct["loss"], rel=1e-6)
    else:
        curve = next(iter(out.values()))
        assert curve["documents"] > 0 and math.isfinite(curve["mean_loss_at_length"]["64"]["loss"])


def test_cli_writes_json(attn_export, tmp_path, capsys):
    assert main(["perplexity", "--checkpoint", attn_export, "--seq-len", "64", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    out = json.loads((tmp_path / "perplexity.json").read_text())
    r = out["result"]
    assert r["tokens"] > 0 and r["seq_len"] == 64 and 0 < r["bits_per_byte"] < 20
    # an untrained model is close to uniform over the vocabulary
    assert abs(r["loss"] - math.log(VOCAB)) < 0.2
    printed = capsys.readouterr().out
    assert "perplexity" in printed
    assert printed.endswith(f"wrote {tmp_path / 'perplexity.json'}\n"), printed


def test_the_window_defaults_to_the_training_context(prepared, tmp_path, capsys):
    """Without --seq-len the windows are the checkpoint's data.seq_len, and the summary line says
    the window, where it comes from and how many tokens it scored."""
    e = ExperimentConfig(model=tiny_model(max_seq_len=512).cfg)
    e.data.path, e.data.seq_len = prepared, 48
    d = save_export(tiny_model(max_seq_len=512), str(tmp_path / "ck"), e)
    assert main(["perplexity", "--checkpoint", d, "--out", str(tmp_path), "--no-progress"]) == 0
    r = json.loads((tmp_path / "perplexity.json").read_text())["result"]
    assert r["seq_len"] == 48 and r["seq_len_from"] == "the training context, data.seq_len"
    out = capsys.readouterr().out
    assert f"over {r['tokens']:,} tokens in windows of 48 (the training context, data.seq_len)" in out
    # the validation loader's windows of 48: a multiple of 48 tokens
    assert r["tokens"] % 48 == 0
    assert main(["perplexity", "--checkpoint", d, "--seq-len", "64", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "in windows of 64 (--seq-len)" in capsys.readouterr().out


def test_perplexity_window_rules():
    assert perplexity_window(None, 256, 4096) == (256, "the training context, data.seq_len")
    assert perplexity_window(None, None, 4096)[0] == 2048
    assert perplexity_window(None, None, 512)[0] == 512
    assert perplexity_window(128, 256, 4096) == (128, "--seq-len")
    with pytest.raises(EvalError, match="--seq-len must be >= 2"):
        perplexity_window(1, 256, 4096)
