import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.eval.conftest import export_model, global_kind, recurrent_kind, tiny_model, windowed_kind
from ttt_lm.eval import EvalError, loss_by_position, summarize
from ttt_lm.eval.__main__ import main
from ttt_lm.eval.long_context import log_buckets, paired_difference, plot_loss_by_position, windows
from ttt_lm.model.registry import builtin_kinds, kinds_with


@pytest.mark.parametrize("kind", builtin_kinds())
def test_chunked_with_carried_state_equals_one_pass(kind):
    """Per-position losses from 16-token chunks with states carried equal those of one forward over
    the whole document (float32; 1e-4 absolute on losses ~5.7 covers reassociated sums)."""
    m = tiny_model((kind, global_kind()), max_seq_len=64)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 300, (n,), generator=g) for n in (49, 60, 49)]
    st = loss_by_position(m, docs, max_len=48, chunk_len=16, batch_size=2, show_progress=False)
    with torch.no_grad():
        want = sum(F.cross_entropy(m(d[None, :48]).logits[0], d[1:49], reduction="none").double() for d in docs)
    np.testing.assert_allclose(st["sum"], want.numpy(), atol=1e-4, rtol=0)
    assert (st["count"] == 3).all() and st["documents"] == 3


def test_short_documents_are_skipped_or_counted_where_they_reach():
    m = tiny_model()
    docs = [torch.randint(3, 300, (n,)) for n in (10, 33, 5)]
    st = loss_by_position(m, docs, max_len=32, chunk_len=8, show_progress=False)
    assert st["documents"] == 1 and st["skipped"] == 2 and (st["count"] == 1).all()
    st = loss_by_position(m, docs, max_len=32, chunk_len=8, min_len=2, show_progress=False)
    assert list(st["count"][:4]) == [3, 3, 3, 3] and st["count"][4] == 2 and st["count"][9] == 1 and st["count"][31] == 1
    with pytest.raises(EvalError, match="no document has >= 100 tokens"):
        loss_by_position(m, docs, max_len=99, show_progress=False)


def test_context_beyond_max_seq_len_is_refused_for_global_attention_only():
    docs = [torch.randint(3, 300, (80,))]
    with pytest.raises(EvalError, match="exceeds model.max_seq_len=64 .*global attention"):
        loss_by_position(tiny_model((global_kind(),), max_seq_len=64), docs, 72, show_progress=False)
    # every kind without global attention, in one model, reads past max_seq_len
    local = kinds_with(lambda c: not c.global_attention, builtin_kinds())
    st = loss_by_position(tiny_model(local, max_seq_len=64, n_layers=len(local)), docs, 72, chunk_len=32,
                          show_progress=False)
    assert st["count"].sum() == 72


def test_buckets_partition_the_positions_and_lengths_average_prefixes():
    e = log_buckets(1000, 16)
    assert e[0] == 1 and e[-1] == 1001 and (np.diff(e) > 0).all()
    S = np.arange(1, 101, dtype=np.float64)
    C = np.ones(100, dtype=np.int64)
    s = summarize({"sum": S, "count": C, "documents": 1, "skipped": 0}, [10, 100], n_buckets=8)
    assert sum(b["tokens"] for b in s["buckets"]) == 100
    assert s["mean_loss_at_length"]["10"]["loss"] == pytest.approx(5.5)
    assert s["mean_loss_at_length"]["100"]["loss"] == pytest.approx(50.5)
    first = s["buckets"][0]
    assert first["start"] == 1 and first["loss"] == pytest.approx(1.0)


def test_cli_plots_several_checkpoints(prepared, attn_export, tmp_path, capsys):
    other = export_model(tiny_model((recurrent_kind(), windowed_kind()), seed=1), str(tmp_path / "other"), prepared)
    rc = main(["long_context", "--checkpoint", attn_export, "--checkpoint", other, "--names", "attn,other",
               "--max-len", "256", "--lengths", "64,256", "--chunk-len", "128", "--max-docs", "2",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = json.loads((tmp_path / "long_context.json").read_text())
    assert set(out["result"]) == {"attn", "other"}
    for r in out["result"].values():
        assert r["documents"] == 2 and set(r["mean_loss_at_length"]) == {"64", "256"}
    png = (tmp_path / "long_context.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the second checkpoint against the first, paired over the same documents: every document reaches
    # every position here, so a range's difference is the difference of the two curves' means over it
    pd = out["paired"]["other"]
    assert pd["reference"] == "attn" and [(r["start"], r["end"]) for r in pd["ranges"]] == [(1, 64), (65, 256)]
    at = {n: out["result"][n]["mean_loss_at_length"] for n in ("attn", "other")}
    assert pd["ranges"][0]["diff"] == pytest.approx(at["other"]["64"]["loss"] - at["attn"]["64"]["loss"], abs=1e-5)
    whole = (256 * (at["other"]["256"]["loss"] - at["attn"]["256"]["loss"]) - 64 * pd["ranges"][0]["diff"]) / 192
    assert pd["ranges"][1]["diff"] == pytest.approx(whole, abs=1e-5)
    assert pd["change"]["diff"] == pytest.approx(pd["ranges"][1]["diff"] - pd["ranges"][0]["diff"], abs=1e-6)
    assert all(r["documents"] == 2 and r["ci95"] > 0 for r in pd["ranges"])
    # the console says what L is and where the files went
    printed = capsys.readouterr().out
    assert "long_context attn: mean loss over the first L tokens of each document: L=64: " in printed, printed
    assert "long_context other - attn, paired over documents, by position (1-based; 95% interval): [1, 64]: " in printed
    assert "change [1, 64] -> [65, 256]: " in printed, printed
    assert f"wrote {tmp_path / 'long_context.png'}, {tmp_path / 'long_context.json'}\n" in printed, printed


def test_windows_cut_documents_into_consecutive_pieces():
    docs = [torch.arange(10), torch.arange(100, 105)]
    pieces = list(windows(docs, 4))
    assert [p.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [100, 101, 102, 103], [104]]
    with pytest.raises(EvalError, match="window size"):
        list(windows(docs, 1))


def test_per_document_losses_sum_to_the_totals_and_give_bands():
    m = tiny_model()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 300, (n,), generator=g) for n in (33, 20, 33, 33)]
    st = loss_by_position(m, docs, max_len=32, chunk_len=8, min_len=2, batch_size=2, show_progress=False)
    assert st["per_doc"].shape == (4, 32) and st["doc_len"].tolist() == [32, 19, 32, 32]
    np.testing.assert_allclose(st["per_doc"].sum(0), st["sum"], rtol=1e-5)  # float32 rows vs float64 sums
    assert (st["per_doc"][1, 19:] == 0).all() and (st["per_doc"][1, :19] > 0).all()
    s = summarize(st, [32], n_buckets=4)
    for b in s["buckets"]:
        a, e = b["start"] - 1, b["end"]
        reach = np.clip(st["doc_len"] - a, 0, e - a)
        means = st["per_doc"][reach > 0, a:e].sum(1) / reach[reach > 0]
        assert b["ci95"] == pytest.approx(1.96 * means.std(ddof=1) / np.sqrt(len(means)), rel=1e-5)
        assert b["documents"] == int((reach > 0).sum())
    assert s["mean_loss_at_length"]["32"]["ci95"] > 0
    one = summarize(loss_by_position(m, docs[:1], max_len=32, show_progress=False), [32])
    assert all(b["ci95"] is None for b in one["buckets"])  # one document: no interval


def _stats(per_doc, doc_len, fingerprint="same"):
    per_doc = np.asarray(per_doc, dtype=np.float32)
    return {"sum": per_doc.sum(0).astype(np.float64), "count": np.ones(per_doc.shape[1], dtype=np.int64),
            "documents": len(per_doc), "skipped": 0, "per_doc": per_doc,
            "doc_len": np.asarray(doc_len, dtype=np.int64), "fingerprint": fingerprint}


def test_paired_difference_by_range_and_its_change():
    g = np.random.default_rng(0)
    ref = g.uniform(2, 6, (5, 12))
    ref[4, 7:] = 0  # the last document reaches 7 positions: it counts in [1, 4] and [5, 8] only
    shift = np.where(np.arange(12) < 4, 0.1, 0.3) + g.normal(0, 0.02, (5, 12))  # other - ref, larger later
    other = np.where(ref > 0, ref + shift, 0)
    doc_len = [12, 12, 12, 12, 7]
    r = paired_difference(_stats(ref, doc_len), _stats(other, doc_len), [4, 8])
    assert [(x["start"], x["end"], x["documents"]) for x in r["ranges"]] == [(1, 4, 5), (5, 8, 5), (9, 12, 4)]
    for x in r["ranges"]:
        a, b = x["start"] - 1, x["end"]
        n = np.clip(np.asarray(doc_len) - a, 0, b - a)
        d = (shift[:, a:b] * (np.arange(a, b) < np.asarray(doc_len)[:, None])).sum(1)[n > 0] / n[n > 0]
        assert x["diff"] == pytest.approx(d.mean(), abs=1e-5)
        assert x["ci95"] == pytest.approx(1.96 * d.std(ddof=1) / np.sqrt(len(d)), rel=1e-3)
    c = r["change"]
    assert c["from"] == [1, 4] and c["to"] == [9, 12] and c["documents"] == 4  # documents reaching both
    d = shift[:4, 8:].mean(1) - shift[:4, :4].mean(1)
    assert c["diff"] == pytest.approx(d.mean(), abs=1e-5) and c["diff"] > 0.15
    assert c["ci95"] == pytest.approx(1.96 * d.std(ddof=1) / 2, rel=1e-3)
    # the same curves, one range: no change to state
    assert "change" not in paired_difference(_stats(ref, doc_len), _stats(other, doc_len), [12])
    with pytest.raises(EvalError, match="different documents"):
        paired_difference(_stats(ref, doc_len), _stats(other, doc_len, "another"), [4, 8])


def test_documents_fingerprint_tells_the_scored_tokens_apart():
    m = tiny_model()
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, 300, (17,), generator=g) for _ in range(3)]
    fp = [loss_by_position(m, d, max_len=16, show_progress=False)["fingerprint"]
          for d in (docs, [x.clone() for x in docs], docs[::-1], docs[:2])]
    assert fp[0] == fp[1] and len({fp[0], fp[2], fp[3]}) == 3


def test_plot_shows_document_counts_bands_and_training_context():
    from matplotlib.collections import PolyCollection
    m = tiny_model()
    docs = [torch.randint(3, 300, (65,)) for _ in range(3)]
    curves = {"a": summarize(loss_by_position(m, docs, 64, show_progress=False)),
              "b": summarize(loss_by_position(m, docs[:2], 64, show_progress=False))}
    fig = plot_loss_by_position(curves, None, "t", train_len={"a": 16, "b": 16})
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "a (3 documents)" in labels and "b (2 documents)" in labels
    assert "training context (16 tokens)" in labels
    vlines = [ln for ln in ax.get_lines() if ln.get_label().startswith("training context")]
    assert len(vlines) == 1 and list(vlines[0].get_xdata()) == [16, 16]
    assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 2  # one band per curve
    markers = [ln.get_marker() for ln in ax.get_lines() if "documents" in ln.get_label()]
    assert len(set(markers)) == 2
    assert "95%" in ax.get_title() and ax.get_ylabel().startswith("mean loss")
    import matplotlib.pyplot as plt
    plt.close(fig)
