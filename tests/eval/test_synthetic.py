import json
import os
import re

import pytest
import torch

from ttt_lm.eval.__main__ import main
from ttt_lm.eval.synthetic import (SyntheticResult, apply_impl, build_tiny_lm, evaluate_task, induction_heads,
                                   make_task, merge_results, mqar, pick_best, plot_accuracy, plot_accuracy_vs_width,
                                   result_dict, result_from_dict, result_trials, results_table, run_synthetic,
                                   seeds_table, selective_copying, state_size, train_task,
                                   trial_accuracy, update_report)
from ttt_lm.model.registry import builtin_kinds, kinds_with

#: the kinds these tests train, read from the registry: global attention, and the recurrences (the
#: kinds that do not attend), R0 and R1 the first two of them
ATT = kinds_with(lambda c: c.global_attention, builtin_kinds())[0]
REC = kinds_with(lambda c: not c.attends, builtin_kinds())
R0, R1 = REC[:2]


def _bounded_field(kind):
    """(section, field) of the first int field of ``kind``'s section with a lower bound of 1
    (``option(..., ge=1)``): 0 is a value its own checks refuse."""
    import dataclasses
    from ttt_lm.model.registry import mixer_class
    cls = mixer_class(kind)
    for f in dataclasses.fields(cls.config_class):
        if f.type in (int, "int") and f.metadata.get("ge") == 1:
            return cls.config_section, f.name
    raise AssertionError(f"{kind}: no int field with ge=1 in its section")


#: a recurrence's bounded int field (the delta rule's chunk size), for overrides of a section of
#: the model that the layer pattern does not use, and for a value the section refuses
SEC, FIELD = _bounded_field(R0)
#: names of the rows of made-up results (the tables, plots and merges read them as labels only)
X, Y, Z, W = "mixer_x", "mixer_y", "mixer_z", "mixer_w"


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


@pytest.mark.slow
def test_two_layer_attention_learns_induction_heads():
    """Budget: at most 800 AdamW steps of 32 sequences of length 16 (vocabulary 8) for a 2-layer
    d_model=64 attention model (about 15 s on one CPU core; the bound is the step count, not the
    time); solved means >= 95% accuracy on 64 held-out sequences (chance is 1/7)."""
    task = make_task("induction", vocab_size=8)
    m = build_tiny_lm([ATT], 8, n_layers=2, d_model=64, max_seq_len=64, seed=0)
    _, solved_at = train_task(m, task, 16, 800, batch_size=32, lr=3e-3, warmup=20, stop_at=0.95, check_every=25)
    assert solved_at is not None, "no induction head within 800 steps"
    assert evaluate_task(m, task, 16, num_examples=128, seed=5) >= 0.9


def test_cli_table(tmp_path):
    rc = main(["synthetic", "--task", "mqar", "--mixers", f"{ATT},{R0}+{ATT}", "--train-len", "32",
               "--test-lens", "32,64", "--steps", "3", "--vocab-size", "32", "--num-kv-pairs", "4",
               "--d-model", "32", "--num-eval", "8", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    md = (tmp_path / "mqar.md").read_text()
    assert f"| {ATT} |" in md and f"| {R0}+{ATT} | {R0},{ATT} |" in md and "32*" in md
    res = json.loads((tmp_path / "mqar.json").read_text())["results"]
    assert [r["mixer"] for r in res] == [ATT, f"{R0}+{ATT}"]
    assert all(0 <= a <= 1 for r in res for a in r["accuracy"].values())
    assert (tmp_path / "mqar.png").exists()


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if i == 0 else pytest.mark.slow)
                                  for i, k in enumerate(REC)])
def test_cli_takes_every_recurrence(tmp_path, kind):
    """Every recurrence (a kind that does not attend) runs in the synthetic suite: alone and in a
    hybrid with global attention, with a state whose size does not grow with the length. The
    first in the unit tier, the others in the slow one."""
    rc = main(["synthetic", "--task", "mqar", "--mixers", f"{kind},{kind}+{ATT}",
               "--train-len", "32", "--test-lens", "32", "--steps", "2", "--vocab-size", "32",
               "--num-kv-pairs", "4", "--d-model", "32", "--num-eval", "8", "--out", str(tmp_path),
               "--no-progress"])
    assert rc == 0
    res = json.loads((tmp_path / "mqar.json").read_text())["results"]
    assert [r["mixer"] for r in res] == [kind, f"{kind}+{ATT}"]
    task = make_task("mqar", vocab_size=64, num_kv_pairs=4)
    m = build_tiny_lm([kind], 64, d_model=32, max_seq_len=128)
    assert state_size(m, task, 64) == state_size(m, task, 32) > 0


def test_tiny_models_take_each_sections_short_chunks():
    """build_tiny_lm asks every mixer section with a ``short`` method for its short-sequence form
    (16-token chunks, mini-batches and windows); a section without one keeps its defaults, and so
    does every field ``short`` leaves alone."""
    import dataclasses
    cfg = build_tiny_lm([R0], 64, d_model=32).cfg
    with_short = 0
    for name, section in cfg.sections().items():
        default = type(section)()
        short = getattr(default, "short", None)
        want = short(16) if callable(short) else default
        assert section == want, name
        if callable(short):
            with_short += 1
            # what short(16) changes is set to 16 tokens
            changed = [f.name for f in dataclasses.fields(want) if getattr(want, f.name) != getattr(default, f.name)]
            assert all(getattr(want, f) == 16 for f in changed), (name, changed)
    assert with_short >= 6


def test_chance_is_one_over_the_possible_answers():
    assert make_task("induction", vocab_size=16).chance == pytest.approx(1 / 15)
    assert make_task("mqar", vocab_size=64).chance == pytest.approx(1 / 32)
    assert make_task("selective_copying", vocab_size=10).chance == pytest.approx(1 / 8)


def test_pick_best_prefers_fewest_steps_to_solve_then_accuracy():
    a = {"lr": 1e-3, "steps_to_solve": None, "train_acc": 0.9, "final_train_loss": 0.3}
    b = {"lr": 3e-3, "steps_to_solve": 400, "train_acc": 0.99, "final_train_loss": 0.1}
    c = {"lr": 1e-2, "steps_to_solve": 200, "train_acc": 0.98, "final_train_loss": 0.2}
    assert pick_best([a, b, c]) is c and pick_best([a, b]) is b
    d = {"lr": 3e-4, "steps_to_solve": None, "train_acc": 0.9, "final_train_loss": 0.2}
    assert pick_best([a, d]) is d  # same accuracy: the lower loss
    assert pick_best([a, {**d, "train_acc": 0.5}]) is a


@pytest.mark.slow
def test_lr_sweep_trains_one_model_per_lr_and_keeps_the_solver():
    """Induction at length 16 (vocabulary 8): lr 3e-3 solves it within 300 steps (see the test above
    at 800), lr 1e-5 cannot move a fresh model off chance in 300 steps; the sweep keeps 3e-3."""
    task = make_task("induction", vocab_size=8)
    r = run_synthetic(task, ATT, 16, [16, 32], 300, lr=1.0, lrs=[1e-5, 3e-3], d_model=64,
                      num_eval=64, stop_at=0.95, check_every=25)
    assert [t["lr"] for t in r.lr_trials] == [1e-5, 3e-3]
    slow, fast = r.lr_trials
    assert slow["steps_to_solve"] is None and slow["steps"] == 300 and slow["budget"] == fast["budget"] == 300
    assert fast["steps_to_solve"] is not None and fast["steps_to_solve"] % 25 == 0
    assert r.lr == 3e-3 and r.steps_to_solve == fast["steps_to_solve"] == r.steps and r.budget == 300
    assert r.accuracy[16] == fast["train_acc"] >= 0.9 and set(r.accuracy) == {16, 32}
    table = results_table([r, SyntheticResult("induction", "x", ["x"], 16, 300, 2.0, 1.0, {16: 0.1}, 1000,
                                              None, lr=1e-3, budget=300)])
    assert "| 3e-3 |" not in table and "| 0.003 |" in table and "not solved in 300" in table


def test_state_size_grows_with_length_for_attention_only():
    """Global attention's cache doubles with the length; every recurrence's state stays as it is."""
    task = make_task("mqar", vocab_size=64, num_kv_pairs=4)
    att = build_tiny_lm([ATT], 64, d_model=32, max_seq_len=128)
    assert state_size(att, task, 64) == 2 * state_size(att, task, 32) > 0
    for kind in REC:
        m = build_tiny_lm([kind], 64, d_model=32, max_seq_len=128)
        assert state_size(m, task, 64) == state_size(m, task, 32) > 0, kind
    dn = build_tiny_lm([R0], 64, d_model=32, max_seq_len=128)
    wide = build_tiny_lm([R0], 64, d_model=64, max_seq_len=128)
    assert state_size(wide, task, 32) > state_size(dn, task, 32)


def _fake(mixer, acc, d=32, state=100, lr=1e-3, solved=None):
    return SyntheticResult("mqar", mixer, [mixer], 64, 100, 1.0, 1.0, acc, 1000, solved, lr=lr, d_model=d,
                           state_size=state, chance=1 / 32, budget=100)


def test_accuracy_plot_has_chance_line_train_length_and_distinct_curves():
    import matplotlib.pyplot as plt
    rs = [_fake(m, {64: 1 / 32, 128: 1 / 32, 256: 1 / 32}) for m in (X, Y, Z)]
    fig = plot_accuracy(rs, None, "t")
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert "chance (0.031)" in lines and set(lines["chance (0.031)"].get_ydata()) == {1 / 32}
    assert "train length (64)" in lines and list(lines["train length (64)"].get_xdata()) == [64, 64]
    curves = [lines[f"{m} (lr 0.001, not solved in 100)"] for m in (X, Y, Z)]
    assert len({c.get_marker() for c in curves}) == 3 and len({c.get_linestyle() for c in curves}) == 3
    xs = [tuple(c.get_xdata()) for c in curves]
    assert len(set(xs)) == 3 and all(abs(x[0] / 64 - 1) < 0.1 for x in xs)  # offset, but near the true length
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == len(set(legend)) == 5
    plt.close(fig)
    # one mixer at several widths: the width names each curve
    fig = plot_accuracy([_fake(X, {64: 0.5}, d) for d in (16, 32)], None, "t")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert {f"{X} d=16 (lr 0.001, not solved in 100)", f"{X} d=32 (lr 0.001, not solved in 100)"} <= set(legend)
    fig2 = plot_accuracy([_fake(Y, {64: 1.0}, solved=40)], None, "t")
    assert [t.get_text() for t in fig2.axes[0].get_legend().get_texts()][0] == f"{Y} (lr 0.001, solved in 40)"
    plt.close(fig2)
    plt.close(fig)


def test_results_round_trip_through_json():
    r = _fake(Y, {64: 0.9, 128: 0.5}, solved=300)
    r.lr_trials = [{"lr": 1e-3, "steps_to_solve": 300, "train_acc": 0.9, "final_train_loss": 0.1}]
    back = result_from_dict(json.loads(json.dumps(result_dict(r))))
    assert back == r


def test_width_plot_puts_accuracy_against_width_and_state():
    import matplotlib.pyplot as plt
    rs = [_fake(X, {64: 0.5}, 32, 4096), _fake(X, {64: 1.0}, 64, 8192),
          _fake(Y, {64: 0.2}, 32, 1024), _fake(Y, {64: 0.6}, 64, 2048)]
    fig = plot_accuracy_vs_width(rs, None, "t")
    left, right = fig.axes[:2]
    att = [ln for ln in left.get_lines() if ln.get_label() == X][0]
    assert list(att.get_ydata()) == [0.5, 1.0] and "width" in left.get_xlabel()
    dn = [ln for ln in right.get_lines() if ln.get_label() == Y][0]
    assert [x / s for x, s in zip(dn.get_xdata(), (1024, 2048))] == pytest.approx([1.0, 1.0], abs=0.1)
    assert "state" in right.get_xlabel()
    assert any(ln.get_label().startswith("chance") for ln in right.get_lines())
    fig.canvas.draw()   # the legend sits right of both plots, where it hides no point
    box = right.get_legend().get_window_extent()
    assert box.x0 >= right.get_window_extent().x1 and box.x0 >= left.get_window_extent().x1
    plt.close(fig)


def test_cli_width_sweep_and_bad_options(tmp_path):
    rc = main(["synthetic", "--task", "mqar", "--mixers", R0, "--train-len", "32", "--test-lens", "32",
               "--steps", "2", "--vocab-size", "32", "--num-kv-pairs", "4", "--d-models", "16,32",
               "--lrs", "1e-3,3e-3", "--stop-at", "0.99", "--check-every", "1", "--num-eval", "8",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = json.loads((tmp_path / "mqar.json").read_text())
    res = out["results"]
    assert out["partial"] is False
    assert [r["d_model"] for r in res] == [16, 32] and all(len(r["lr_trials"]) == 2 for r in res)
    assert res[1]["state_size"] > res[0]["state_size"]
    md = (tmp_path / "mqar.md").read_text()
    assert "| d_model |" in md and "learning rates 0.001, 0.003" in md and "chance 0.062" in md
    assert (tmp_path / "mqar_width.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["synthetic", "--stop-at", "1.5", "--out", str(tmp_path), "--no-progress"]) == 2
    assert main(["synthetic", "--lrs", "0,1e-3", "--out", str(tmp_path), "--no-progress"]) == 2


def test_impl_per_layer_kind():
    m = build_tiny_lm([R0, ATT], 16, n_layers=2, d_model=32)
    apply_impl(m, f"{R0}=reference")
    assert [b.mixer.impl for b in m.layers] == ["reference", "chunked"]
    apply_impl(m, "reference")
    assert [b.mixer.impl for b in m.layers] == ["reference", "reference"]
    with pytest.raises(ValueError, match="expected <layer kind>=chunked|reference"):
        apply_impl(m, f"{R0}=fast")
    with pytest.raises(ValueError, match="impl must be"):
        apply_impl(m, "fast")


def test_cli_keeps_finished_models_when_a_sweep_stops(tmp_path, monkeypatch):
    import ttt_lm.eval.synthetic as syn
    real = syn.run_synthetic

    def second_fails(task, mixer, *a, **k):
        if mixer == R0:
            raise KeyboardInterrupt  # as when a long run is stopped by hand
        return real(task, mixer, *a, **k)

    monkeypatch.setattr(syn, "run_synthetic", second_fails)
    with pytest.raises(KeyboardInterrupt):
        main(["synthetic", "--task", "mqar", "--mixers", f"{ATT},{R0}", "--train-len", "32",
              "--test-lens", "32", "--steps", "2", "--vocab-size", "32", "--num-kv-pairs", "4", "--d-model", "16",
              "--num-eval", "8", "--out", str(tmp_path), "--no-progress"])
    out = json.loads((tmp_path / "mqar.json").read_text())
    assert out["partial"] is True and [r["mixer"] for r in out["results"]] == [ATT]


def _trial(lr, solved, acc, loss=1.0):
    return {"lr": lr, "steps_to_solve": solved, "steps": solved or 100, "train_acc": acc, "final_train_loss": loss,
            "seconds": 2.0}


def test_merge_results_joins_one_run_per_lr_into_one_row():
    slow = _fake(Z, {64: 0.99, 256: 0.5}, lr=1e-3, solved=90)
    slow.lr_trials = [_trial(1e-3, 90, 0.99)]
    fast = _fake(Z, {64: 0.98, 256: 0.7}, lr=3e-3, solved=40)
    fast.lr_trials = [_trial(3e-3, 40, 0.98)]
    other = _fake(X, {64: 0.2, 256: 0.1})
    merged = merge_results([slow, other, fast], ["a", "b", "c"])
    assert [r.mixer for r in merged] == [Z, X]
    m = merged[0]
    assert m.lr == 3e-3 and m.steps_to_solve == 40 and m.accuracy == {64: 0.98, 256: 0.7}
    assert [t["lr"] for t in m.lr_trials] == [1e-3, 3e-3] and m.train_seconds == 2.0
    assert merged[1] is other
    # the run not kept keeps its accuracy at every length in its trial (nothing measured is dropped)
    assert m.lr_trials[0]["accuracy"] == {"64": 0.99, "256": 0.5}
    assert trial_accuracy(m, m.lr_trials[0]) == {64: 0.99, 256: 0.5}
    assert trial_accuracy(m, m.lr_trials[1]) == {64: 0.98, 256: 0.7}
    sweep = _fake(Z, {64: 0.9, 256: 0.4}, lr=1e-3, solved=80)     # one --lrs sweep: the lr not kept
    sweep.lr_trials = [_trial(1e-3, 80, 0.9), _trial(3e-4, None, 0.2)]  # was tested at the train length only
    assert trial_accuracy(sweep, sweep.lr_trials[1]) is None
    # and through a later join (an earlier report's row with a new lr) and a JSON round trip
    newer = _fake(Z, {64: 1.0, 256: 0.9}, lr=5e-4, solved=30)
    newer.lr_trials = [_trial(5e-4, 30, 1.0)]
    again = result_from_dict(json.loads(json.dumps(result_dict(merge_results([m, newer])[0]))))
    assert again.lr == 5e-4 and [trial_accuracy(again, t)[256] for t in again.lr_trials] == [0.5, 0.7, 0.9]
    # neither solved: the more accurate one is kept
    a, b = _fake(W, {64: 0.3}, lr=1e-3), _fake(W, {64: 0.6}, lr=3e-3)
    a.lr_trials, b.lr_trials = [_trial(1e-3, None, 0.3)], [_trial(3e-3, None, 0.6)]
    assert merge_results([a, b])[0].lr == 3e-3
    # widths stay separate rows
    assert len(merge_results([_fake("x", {64: 0.5}, d=16), _fake("x", {64: 0.5}, d=32)])) == 2
    # budgets may differ: every trial states its own
    b.budget = 50
    assert [t["budget"] for t in merge_results([a, b])[0].lr_trials] == [100, 50]
    b.lr_trials = [_trial(1e-3, None, 0.6)]
    with pytest.raises(ValueError, match="lr 0.001 was run in both x and y"):
        merge_results([a, b], ["x", "y"])


def test_results_table_states_each_rows_budget_when_budgets_differ():
    a = _fake(X, {64: 0.99}, solved=1850)
    b = _fake(Y, {64: 0.3})
    same = results_table([a, b])
    assert "budget" not in same.splitlines()[0] and "| 1850 |" in same and "not solved in 100" in same
    a.budget = 3000
    head, _, row_a, row_b = results_table([a, b]).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols.index("budget") == cols.index("lr") + 1
    assert [c.strip() for c in row_a.strip("|").split("|")][cols.index("budget")] == "3000"
    assert [c.strip() for c in row_b.strip("|").split("|")][cols.index("budget")] == "100"
    # one row whose lrs were tried at different budgets (joined runs) names the others' budgets
    slow, fast = _fake(W, {64: 0.3}, lr=1e-3), _fake(W, {64: 0.6}, lr=3e-3)
    slow.budget, fast.budget = 2000, 3000
    slow.lr_trials, fast.lr_trials = [_trial(1e-3, None, 0.3)], [_trial(3e-3, None, 0.6)]
    row = merge_results([slow, fast])[0]
    table = results_table([row])
    assert "budget" in table.splitlines()[0] and "| 3000 (lr 0.001: 2000) | not solved in 3000 |" in table


def test_update_report_replaces_reruns_joins_new_lrs_and_refuses_a_partial_rerun():
    old_t = _fake(X, {64: 0.3}, lr=3e-3)
    old_t.lr_trials = [_trial(3e-3, None, 0.3)]
    old_r = _fake(Y, {64: 0.97}, lr=3e-3, solved=80)
    old_r.lr_trials = [_trial(3e-3, 80, 0.97)]
    keep = _fake(Z, {64: 1.0}, lr=1e-3, solved=90)
    new_t = _fake(X, {64: 0.9}, lr=1e-3)
    new_t.budget, new_t.lr_trials = 300, [dict(_trial(1e-3, None, 0.9), budget=300), dict(_trial(3e-3, None, 0.5),
                                                                                           budget=300)]
    new_r = _fake(Y, {64: 0.99}, lr=1e-3, solved=60)
    new_r.budget, new_r.lr_trials = 300, [dict(_trial(1e-3, 60, 0.99), budget=300)]
    new_m = _fake(W, {64: 0.5})
    rows, replaced = update_report([old_t, old_r, keep], [new_r, new_m, new_t])
    assert [r.mixer for r in rows] == [X, Y, Z, W]
    assert rows[0] is new_t and replaced == [old_t]          # both lrs rerun at a larger budget
    r = rows[1]                                              # a new lr joins the old one as one sweep
    assert r.lr == 1e-3 and r.steps_to_solve == 60 and r.budget == 300 and replaced[0] is not r
    assert [(t["lr"], t["budget"]) for t in r.lr_trials] == [(3e-3, 100), (1e-3, 300)]
    assert rows[2] is keep and rows[3] is new_m
    # rows saved without lr_trials count as their one kept trial
    assert [t["lr"] for t in result_trials(keep)] == [1e-3] and result_trials(keep)[0]["steps_to_solve"] == 90
    # rerunning one lr of a two-lr row would keep half of the old sweep: refused
    two = _fake(X, {64: 0.6}, lr=1e-3)
    two.lr_trials = [_trial(1e-3, None, 0.6), _trial(3e-3, None, 0.1)]
    one = _fake(X, {64: 0.7}, lr=1e-3)
    one.lr_trials = [_trial(1e-3, None, 0.7)]
    with pytest.raises(ValueError, match="rerun lr 0.001 of old.json but not 0.003"):
        update_report([two], [one], "old.json")


def _tiny_run(out, mixer, *extra):
    assert main(["synthetic", "--task", "mqar", "--mixers", mixer, "--train-len", "32", "--test-lens", "32,64",
                 "--steps", "2", "--vocab-size", "32", "--num-kv-pairs", "4", "--d-model", "16", "--num-eval", "8",
                 "--lrs", "1e-3", "--stop-at", "0.99", "--out", str(out), "--no-progress", *extra]) == 0


def test_synthetic_report_merges_saved_runs_into_one_table_and_plot(tmp_path, capsys):
    _tiny_run(tmp_path / "a", ATT)
    _tiny_run(tmp_path / "b", R0, "--steps", "3")
    rc = main(["synthetic_report", "--from", f"{tmp_path / 'a'},{tmp_path / 'b' / 'mqar.json'}", "--task", "mqar",
               "--out", str(tmp_path / "merged"), "--title", "Shortened for the CPU."])
    assert rc == 0
    out = json.loads((tmp_path / "merged" / "mqar.json").read_text())
    assert [r["mixer"] for r in out["results"]] == [ATT, R0]
    assert [s["args"]["steps"] for s in out["sources"]] == [2, 3] and out["partial"] is False
    saved_b = json.loads((tmp_path / "b" / "mqar.json").read_text())["results"][0]
    assert out["results"][1]["accuracy"] == saved_b["accuracy"]   # copied, not recomputed
    md = (tmp_path / "merged" / "mqar.md").read_text()
    assert "Shortened for the CPU." in md and "Merged from 2 runs" in md
    assert f"| {ATT} |" in md and f"| {R0} |" in md and "not solved in 2" in md and "not solved in 3" in md
    assert "## Every lr tried" in md and "32*" in md
    assert re.search(fr"\| {ATT} \| 16 \| 0 \| 0\.001 \| 2 \| not solved in 2 \| [0-9.]+ \| 64: [0-9.]+ \|", md)
    assert (tmp_path / "merged" / "mqar.png").read_bytes()[:4] == b"\x89PNG"


def test_synthetic_report_takes_an_earlier_report_and_updates_it_with_new_runs(tmp_path, capsys):
    _tiny_run(tmp_path / "a", ATT)
    _tiny_run(tmp_path / "b", R0)
    assert main(["synthetic_report", "--from", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--task", "mqar",
                 "--out", str(tmp_path / "r1")]) == 0
    # a report written before sources carried mixers and seconds, and trials their budget
    r1 = json.loads((tmp_path / "r1" / "mqar.json").read_text())
    for s in r1["sources"]:
        del s["mixers"], s["train_seconds"]
    for r in r1["results"]:
        for t in r["lr_trials"]:
            del t["budget"]
    del r1["replaced"]
    (tmp_path / "r1" / "mqar.json").write_text(json.dumps(r1))
    _tiny_run(tmp_path / "c", ATT, "--steps", "3")                   # a rerun with a larger budget
    _tiny_run(tmp_path / "d", R0, "--steps", "3", "--lrs", "3e-3")   # a new lr for deltanet
    _tiny_run(tmp_path / "e", R1)                                       # a new mixer
    assert main(["synthetic_report", "--from", ",".join(str(tmp_path / x) for x in ("r1", "c", "d", "e")),
                 "--task", "mqar", "--out", str(tmp_path / "r2")]) == 0
    out = json.loads((tmp_path / "r2" / "mqar.json").read_text())
    assert [r["mixer"] for r in out["results"]] == [ATT, R0, R1]
    att, dn = out["results"][0], out["results"][1]
    assert att["budget"] == 3 and [t["lr"] for t in att["lr_trials"]] == [1e-3]
    assert [(t["lr"], t["budget"]) for t in dn["lr_trials"]] == [(1e-3, 2), (3e-3, 3)]
    assert [r["mixer"] for r in out["replaced"]] == [ATT] and out["replaced"][0]["budget"] == 2
    # the runs behind the old report stay listed, with their mixers and seconds
    assert [os.path.basename(os.path.dirname(s["path"])) for s in out["sources"]] == ["a", "b", "c", "d", "e"]
    assert out["sources"][0]["mixers"] == [ATT] and out["sources"][0]["train_seconds"] > 0
    md = (tmp_path / "r2" / "mqar.md").read_text()
    assert "Merged from 5 runs" in md and "## Replaced by later runs" in md
    assert md.count(f"| {ATT} | 16 | 0 | 0.001 | 2 | not solved in 2 |") == 1   # only among the replaced
    assert f"| {R0} | 16 | 0 | 0.003 | 3 | not solved in 3 |" in md
    # the updated report is itself an input; a run already in it is refused
    assert main(["synthetic_report", "--from", f"{tmp_path / 'r2'},{tmp_path / 'e'}", "--task", "mqar",
                 "--out", str(tmp_path / "r3")]) == 2
    assert "is in both" in capsys.readouterr().err


def test_synthetic_report_refuses_what_cannot_share_a_table(tmp_path, capsys):
    _tiny_run(tmp_path / "a", ATT)
    _tiny_run(tmp_path / "c", R0, "--train-len", "64", "--test-lens", "64")
    before = (tmp_path / "a" / "mqar.json").read_text()
    cases = [
        (["--from", str(tmp_path / "missing")], "no such file"),
        (["--from", f"{tmp_path / 'a'},{tmp_path / 'c'}"], "train_len is 32"),
        (["--from", str(tmp_path / "a"), "--task", "induction"], "no file"),
        (["--from", f"{tmp_path / 'a'},{tmp_path / 'a' / 'mqar.json'}"], "more than once"),
        (["--from", str(tmp_path / "a"), "--out", str(tmp_path / "a")], "would overwrite"),
    ]
    for extra, msg in cases:
        argv = ["synthetic_report", "--task", "mqar", "--out", str(tmp_path / "m"), *extra]
        assert main(argv) == 2, extra
        assert msg in capsys.readouterr().err, extra
    (tmp_path / "a" / "perplexity.json").write_text(json.dumps({"task": "perplexity"}))
    assert main(["synthetic_report", "--task", "mqar", "--from", str(tmp_path / "a" / "perplexity.json"),
                 "--out", str(tmp_path / "m")]) == 2
    assert "not the JSON of a synthetic run" in capsys.readouterr().err
    assert (tmp_path / "a" / "mqar.json").read_text() == before


def _seeded(mixer, seed, acc, solved=None, lr=1e-3):
    r = _fake(mixer, acc, lr=lr, solved=solved)
    r.seed, r.lr_trials = seed, [_trial(lr, solved, acc[64])]
    return r


def test_seeds_are_separate_rows_summarized_across_seeds():
    rs = [_seeded(X, 0, {64: 1.0, 256: 0.5}, 40), _seeded(X, 1, {64: 0.8, 256: 0.2}),
          _seeded(Y, 0, {64: 0.99, 256: 0.9}, 30), _seeded(X, 2, {64: 0.9, 256: 0.2}, 60)]
    merged = merge_results(rs)                       # the same lr at another seed is another row, not a clash
    assert [(r.mixer, r.seed) for r in merged] == [(X, 0), (X, 1), (Y, 0),
                                                    (X, 2)]
    lines = seeds_table(merged).splitlines()
    assert lines[0] == "| mixer | seeds | lr | solved | steps to solve (per seed) | 64* | 256 |"
    assert lines[2] == (f"| {X} | 0, 1, 2 | 0.001 | 2 of 3 | 40 · >100 · 60 | 0.90 (0.80–1.00) "
                        "| 0.30 (0.20–0.50) |")
    assert lines[3] == f"| {Y} | 0 | 0.001 | 1 of 1 | 30 | 0.99 | 0.90 |"
    head = [c.strip() for c in results_table(merged).splitlines()[0].strip("|").split("|")]
    assert head[:2] == ["mixer", "seed"]
    assert "seed" not in results_table(merged[:1])       # one seed: no seed column
    # a report's seed-0 rows stay; runs at other seeds join as rows of their own; a seed-0 rerun replaces
    old = [_seeded(X, 0, {64: 1.0, 256: 0.5}, 40)]
    rows, replaced = update_report(old, [_seeded(X, 1, {64: 0.8, 256: 0.2})])
    assert [r.seed for r in rows] == [0, 1] and rows[0] is old[0] and replaced == []
    rerun = _seeded(X, 0, {64: 0.9, 256: 0.4}, 50)
    rows, replaced = update_report(old, [rerun])
    assert rows == [rerun] and replaced == old


def test_accuracy_plot_draws_the_mean_over_seeds_with_min_max_bars():
    import matplotlib.pyplot as plt
    rs = [_seeded(X, 0, {64: 1.0, 256: 0.5}, 40), _seeded(X, 1, {64: 0.8, 256: 0.2}),
          _seeded(Y, 0, {64: 0.6, 256: 0.4})]
    fig = plot_accuracy(rs, None, "t")
    ax = fig.axes[0]
    curves = {c.get_label(): c for c in ax.containers}
    att = curves[f"{X} (lr 0.001, solved by 1 of 2 seeds)"]
    assert list(att.lines[0].get_ydata()) == pytest.approx([0.9, 0.35])
    assert list(curves[f"{Y} (lr 0.001, solved by 0 of 1 seeds)"].lines[0].get_ydata()) == pytest.approx([0.6, 0.4])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"{X} (lr 0.001, solved by 1 of 2 seeds)" in legend and "chance (0.031)" in legend
    segs = att.lines[2][0].get_segments()            # attention's bars span its seeds' min to max
    assert [(s[0][1], s[1][1]) for s in segs] == [pytest.approx((0.8, 1.0)), pytest.approx((0.2, 0.5))]
    assert "min–max" in ax.get_ylabel()
    plt.close(fig)
    # the width plot averages the seeds of a width
    fig = plot_accuracy_vs_width(rs[:2], None, "t")
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == pytest.approx([0.9])
    plt.close(fig)


def test_cli_seeds_and_reports_of_runs_at_different_seeds(tmp_path, capsys):
    _tiny_run(tmp_path / "s", R0, "--seeds", "0,1")
    out = json.loads((tmp_path / "s" / "mqar.json").read_text())
    assert [r["seed"] for r in out["results"]] == [0, 1]
    assert out["results"][0]["accuracy"] != out["results"][1]["accuracy"] or \
        out["results"][0]["final_train_loss"] != out["results"][1]["final_train_loss"]
    md = (tmp_path / "s" / "mqar.md").read_text()
    assert "seeds 0, 1" in md and "Across seeds" in md and f"| {R0} | 0, 1 | 0.001 | 0 of 2 | >2 · >2 |" in md
    # one run per seed, the older one saved before results carried their seed: the run's --seed is used
    _tiny_run(tmp_path / "a", ATT)
    _tiny_run(tmp_path / "b", ATT, "--seed", "3")
    saved = json.loads((tmp_path / "b" / "mqar.json").read_text())
    del saved["results"][0]["seed"]
    (tmp_path / "b" / "mqar.json").write_text(json.dumps(saved))
    assert main(["synthetic_report", "--task", "mqar", "--from", f"{tmp_path / 'a'},{tmp_path / 'b'}",
                 "--out", str(tmp_path / "m")]) == 0
    rep = json.loads((tmp_path / "m" / "mqar.json").read_text())
    assert [(r["mixer"], r["seed"]) for r in rep["results"]] == [(ATT, 0), (ATT, 3)]
    assert f"| {ATT} | 0, 3 | 0.001 | 0 of 2 | >2 · >2 |" in (tmp_path / "m" / "mqar.md").read_text()
    # the same run at the same seed twice is still one lr run twice: refused
    _tiny_run(tmp_path / "c", ATT, "--seed", "3")
    assert main(["synthetic_report", "--task", "mqar", "--from", f"{tmp_path / 'b'},{tmp_path / 'c'}",
                 "--out", str(tmp_path / "m2")]) == 2
    assert "seed 3: lr 0.001 was run in both" in capsys.readouterr().err
    assert main(["synthetic", "--task", "mqar", "--mixers", R0, "--seeds", "1,1", "--steps", "1",
                 "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "--seeds needs distinct" in capsys.readouterr().err


def test_synthetic_report_keeps_only_the_widths_asked_for_and_lists_the_rest(tmp_path, capsys):
    _tiny_run(tmp_path / "a", R0, "--d-models", "16,32")
    _tiny_run(tmp_path / "b", ATT, "--d-models", "32")
    assert main(["synthetic_report", "--task", "mqar", "--from", f"{tmp_path / 'a'},{tmp_path / 'b'}",
                 "--d-models", "32", "--out", str(tmp_path / "m")]) == 0
    out = json.loads((tmp_path / "m" / "mqar.json").read_text())
    assert [(r["mixer"], r["d_model"]) for r in out["results"]] == [(R0, 32), (ATT, 32)]
    assert [(r["mixer"], r["d_model"]) for r in out["left_out"]] == [(R0, 16)]
    md = (tmp_path / "m" / "mqar.md").read_text()
    table, rest = md.split("## Runs")
    assert f"| {R0} |" in table and "| 16 |" not in table and "d_model 32," in table
    assert "## Other widths (left out by --d-models)" in rest and f"| {R0} | 16 | 0 | 0.001 | 2 |" in rest
    assert "width_plot" not in out                                  # one width left: no width figure
    # the report as a source brings its left-out rows back
    assert main(["synthetic_report", "--task", "mqar", "--from", str(tmp_path / "m"),
                 "--out", str(tmp_path / "m2")]) == 0
    out2 = json.loads((tmp_path / "m2" / "mqar.json").read_text())
    assert sorted((r["mixer"], r["d_model"]) for r in out2["results"]) == [(ATT, 32), (R0, 16),
                                                                          (R0, 32)]
    assert out2["left_out"] == [] and "width_plot" in out2
    assert main(["synthetic_report", "--task", "mqar", "--from", str(tmp_path / "a"), "--d-models", "8",
                 "--out", str(tmp_path / "m3")]) == 2
    assert "--d-models 8: no row at these widths (the runs have 16, 32)" in capsys.readouterr().err


def test_accuracy_plot_gives_up_to_twenty_curves_distinct_colours():
    import matplotlib.pyplot as plt
    rs = [_fake(f"m{k}", {64: 0.5, 128: 0.4}) for k in range(12)]
    fig = plot_accuracy(rs, None, "t")
    curves = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("m")]
    assert len(curves) == 12 and len({tuple(ln.get_color()) for ln in curves}) == 12
    plt.close(fig)


def test_model_overrides_change_the_tiny_model_and_refuse_bad_options():
    from ttt_lm.eval.synthetic import apply_overrides
    from ttt_lm.model import ModelConfig

    m = build_tiny_lm(["ttt_linear"], 16, overrides={"ttt.pre_conv": "true", f"{SEC}.{FIELD}": "24"})
    assert m.cfg.ttt.pre_conv is True and getattr(getattr(m.cfg, SEC), FIELD) == 24
    assert m.cfg.ttt.mini_batch_size == 16                      # the tiny model's own settings stay
    plain = build_tiny_lm(["ttt_linear"], 16)
    assert any("pre_conv" in n for n, _ in m.named_parameters())
    assert not any("pre_conv" in n for n, _ in plain.named_parameters())
    base = ModelConfig(vocab_size=16, layer_pattern=[ATT])
    for bad, why in [({"ttt.bogus": "1"}, "bogus"), ({"ttt.pre_conv": "maybe"}, "maybe"),
                     ({f"{SEC}.{FIELD}": "x"}, FIELD)]:
        with pytest.raises(ValueError, match=why):
            apply_overrides(base, bad)
    with pytest.raises(ValueError, match=f"{FIELD} must be"):   # refused by the section's own checks
        build_tiny_lm([R0], 16, overrides={f"{SEC}.{FIELD}": "0"})


def test_cli_set_names_the_rows_and_refuses_bad_options_before_training(tmp_path, capsys):
    args = ["synthetic", "--task", "mqar", "--mixers", "ttt_linear", "--train-len", "32", "--test-lens", "32",
            "--steps", "1", "--vocab-size", "32", "--num-kv-pairs", "4", "--num-eval", "4", "--no-progress"]
    assert main(args + ["--set", "model.ttt.pre_conv=true", "--set", "ttt.conv_width=2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "mqar.json").read_text())["results"][0]
    assert r["mixer"] == "ttt_linear [ttt.pre_conv=true, ttt.conv_width=2]"
    assert r["overrides"] == {"ttt.pre_conv": "true", "ttt.conv_width": "2"}
    assert "| ttt_linear [ttt.pre_conv=true, ttt.conv_width=2] |" in (tmp_path / "mqar.md").read_text()
    back = result_from_dict(r)
    assert back.overrides == r["overrides"] and result_dict(back)["mixer"] == r["mixer"]
    # a run without overrides is a separate row when merged with it
    assert main(args + ["--out", str(tmp_path / "plain")]) == 0
    plain = result_from_dict(json.loads((tmp_path / "plain" / "mqar.json").read_text())["results"][0])
    assert len(merge_results([back, plain])) == 2 and plain.overrides == {}
    capsys.readouterr()
    for bad, why in [("ttt.pre_conv", "KEY=VALUE"), ("ttt.nope=1", "nope"), (f"{SEC}.{FIELD}=0", FIELD)]:
        out = tmp_path / bad.replace("=", "_")
        assert main(args + ["--mixers", R0, "--set", bad, "--out", str(out)]) == 2
        assert why in capsys.readouterr().err and not (out / "mqar.json").exists()
    # results saved before overrides existed still load
    old = {k: v for k, v in r.items() if k != "overrides"}
    assert result_from_dict(old).overrides == {}


def test_synthetic_report_drops_rows_of_an_earlier_report_by_name(tmp_path, capsys):
    """--drop NAME: the earlier report's rows of that name (and the runs behind them) leave the table,
    listed apart and kept in the JSON, also through a later merge; a new run of that name joins afresh."""
    _tiny_run(tmp_path / "a", ATT)
    _tiny_run(tmp_path / "b", R0)
    assert main(["synthetic_report", "--from", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--task", "mqar",
                 "--out", str(tmp_path / "r1")]) == 0
    _tiny_run(tmp_path / "c", R0, "--steps", "3", "--lrs", "3e-3")   # the changed model, another lr
    assert main(["synthetic_report", "--from", f"{tmp_path / 'r1'},{tmp_path / 'c'}", "--task", "mqar",
                 "--drop", R0, "--out", str(tmp_path / "r2")]) == 0
    out = json.loads((tmp_path / "r2" / "mqar.json").read_text())
    assert [r["mixer"] for r in out["results"]] == [ATT, R0]
    assert [t["lr"] for t in out["results"][1]["lr_trials"]] == [3e-3]      # not joined with the old 1e-3
    assert [(r["mixer"], r["lr"]) for r in out["dropped"]] == [(R0, 1e-3)]
    assert [os.path.basename(os.path.dirname(s["path"])) for s in out["sources"]] == ["a", "c"]
    assert [os.path.basename(os.path.dirname(s["path"])) for s in out["dropped_sources"]] == ["b"]
    md = (tmp_path / "r2" / "mqar.md").read_text()
    assert "Merged from 2 runs" in md and "## Dropped from the earlier reports (--drop)" in md
    assert f"| {R0} | 16 | 0 | 0.001 | 2 | not solved in 2 |" in md
    # carried through a later merge without --drop
    _tiny_run(tmp_path / "d", R1)
    assert main(["synthetic_report", "--from", f"{tmp_path / 'r2'},{tmp_path / 'd'}", "--task", "mqar",
                 "--out", str(tmp_path / "r3")]) == 0
    out3 = json.loads((tmp_path / "r3" / "mqar.json").read_text())
    assert [r["mixer"] for r in out3["dropped"]] == [R0] and len(out3["dropped_sources"]) == 1
    assert [r["mixer"] for r in out3["results"]] == [ATT, R0, R1]
    # a name no report has, and dropping everything, are refused
    capsys.readouterr()
    assert main(["synthetic_report", "--from", str(tmp_path / "r1"), "--task", "mqar", "--drop", f"{R0}t",
                 "--out", str(tmp_path / "r4")]) == 2
    assert f"--drop {R0}t: no row of the reports given has that name (they have: {ATT}, {R0})" in \
        capsys.readouterr().err
    assert main(["synthetic_report", "--from", str(tmp_path / "r1"), "--task", "mqar", "--drop", R0,
                 "--drop", ATT, "--out", str(tmp_path / "r4")]) == 2
    assert "leaves no run to report" in capsys.readouterr().err


def test_a_run_without_a_criterion_is_labelled_so_not_unsolved(tmp_path, capsys):
    """Without --stop-at nothing is checked during training: the table, the seed summary, the plot, the
    printed line and a merged report say "no criterion", never "not solved"; results saved before the
    field existed take it from their run's stop_at."""
    args = ["synthetic", "--task", "mqar", "--mixers", R0, "--train-len", "32", "--test-lens", "32,64",
            "--steps", "2", "--vocab-size", "32", "--num-kv-pairs", "4", "--d-model", "16", "--num-eval", "8",
            "--lrs", "1e-3", "--no-progress"]
    assert main(args + ["--seeds", "0,1", "--out", str(tmp_path / "free")]) == 0
    assert "2 steps, no criterion" in capsys.readouterr().out
    saved = json.loads((tmp_path / "free" / "mqar.json").read_text())
    assert [r["criterion"] for r in saved["results"]] == [False, False]
    md = (tmp_path / "free" / "mqar.md").read_text()
    assert "not solved" not in md and ">2" not in md
    assert "| no criterion | 2 (no criterion) · 2 (no criterion) |" in md and "no criterion (2 steps)" in md
    rs = [result_from_dict(d) for d in saved["results"]]
    import matplotlib.pyplot as plt
    for group, label in [(rs, f"{R0} (lr 0.001, no criterion, 2 seeds)"),
                         (rs[:1], f"{R0} (lr 0.001, 2 steps, no criterion)")]:
        fig = plot_accuracy(group, None, "t")
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert label in legend and not any("solved" in x for x in legend)
        plt.close(fig)
    # a model with one seed trained to a criterion and one without: the count covers the checked seed only
    mixed = [_fake(ATT, {64: 0.2}), _fake(ATT, {64: 0.3})]
    mixed[1].seed, mixed[1].criterion = 1, False
    assert f"| {ATT} | 0, 1 | 0.001 | 0 of 1 (1 without a criterion) | >100 · 100 (no criterion) |" in \
        seeds_table(mixed)
    assert f"| {ATT} | 0 | {ATT} | 1k | 0.1k | 0.001 | not solved in 100 |" in results_table(mixed)
    # merged through synthetic_report, also from a JSON saved before results carried the field
    for d in saved["results"]:
        del d["criterion"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "mqar.json").write_text(json.dumps(saved))
    assert main(["synthetic_report", "--from", str(tmp_path / "old"), "--task", "mqar",
                 "--out", str(tmp_path / "rep")]) == 0
    rep = (tmp_path / "rep" / "mqar.md").read_text()
    assert "not solved" not in rep and f"| {R0} | 16 | 0 | 0.001 | 2 | no criterion |" in rep
    assert [r["criterion"] for r in json.loads((tmp_path / "rep" / "mqar.json").read_text())["results"]] == [False] * 2
    # a run with a criterion keeps "not solved in N", also when loaded from a JSON without the field
    _tiny_run(tmp_path / "crit", R0)
    crit = json.loads((tmp_path / "crit" / "mqar.json").read_text())
    assert crit["results"][0]["criterion"] is True
    del crit["results"][0]["criterion"]
    (tmp_path / "crit" / "mqar.json").write_text(json.dumps(crit))
    assert main(["synthetic_report", "--from", str(tmp_path / "crit"), "--task", "mqar",
                 "--out", str(tmp_path / "rep2")]) == 0
    assert f"| {R0} | 16 | 0 | 0.001 | 2 | not solved in 2 |" in (tmp_path / "rep2" / "mqar.md").read_text()
