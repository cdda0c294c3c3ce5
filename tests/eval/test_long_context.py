import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.eval.conftest import export_model, global_kind, recurrent_kind, tiny_model, windowed_kind
from ttt_lm.eval import EvalError, loss_by_position, summarize
from ttt_lm.eval.__main__ import main
from ttt_lm.eval.long_context import log_buckets, plot_loss_by_position, windows
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
    # the console says what L is and where the files went
    printed = capsys.readouterr().out
    assert "long_context attn: mean loss over the first L tokens of each document: L=64: " in printed, printed
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
