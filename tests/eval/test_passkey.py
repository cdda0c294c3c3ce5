import json
import math
import re

import pytest
import torch

from tests.eval.conftest import global_kind, recurrent_kind, tiny_model, windowed_kind
from ttt_lm.eval import EvalError, build_prompt, passkey_grid
from ttt_lm.eval.__main__ import main
from ttt_lm.eval.passkey import (FILLER, FILLER_SENTENCES, INTRO, NEEDLE, QUESTION, answer_nll, greedy_continue,
                                 grid_keys, plot_heatmap, practice_batch, practice_documents, practice_finetune)


def test_prompt_length_and_needle_depth(tokenizer):
    filler = len(tokenizer.encode(FILLER))
    positions = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        ids, ans, pos = build_prompt(tokenizer, 600, depth, "48213")
        assert 600 - filler < len(ids) <= 600
        text = tokenizer.decode(ids)
        assert text.count("48213") == 2 and len(re.findall(r"\d{5}", text)) == 2  # only in the needle
        assert tokenizer.decode(ids[pos:]).startswith(" The pass key is 48213.")
        assert text.endswith("The pass key is") and tokenizer.decode(ans) == " 48213"
        positions.append(pos)
    assert positions == sorted(positions) and positions[0] < positions[-1]
    with pytest.raises(EvalError, match="too short"):
        build_prompt(tokenizer, 50, 0.5, "48213")


def test_every_depth_is_its_own_placement_in_the_shortest_prompt(tokenizer):
    # with whole five-sentence filler groups a prompt with room for one group had two placements:
    # depths 0, 0.25 and 0.5 built the same prompt (round(0.5) == 0), 0.75 and 1 another
    intro, needle = tokenizer.encode(INTRO), tokenizer.encode(NEEDLE.format(key="48213"))
    question = tokenizer.encode(QUESTION)
    shortest = len(intro) + len(needle) + len(question) + len(tokenizer.encode(FILLER))
    filler_text = "".join(FILLER_SENTENCES * 3)
    for L in (shortest, shortest + 10, 300):
        prompts = [build_prompt(tokenizer, L, d, "48213") for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
        positions = [pos for _, _, pos in prompts]
        assert positions == sorted(set(positions)), (L, positions)  # five distinct, in order
        assert positions[0] == len(intro)  # depth 0: right after the introduction
        for ids, ans, pos in prompts:
            assert len(ids) == len(prompts[0][0]) <= L  # the same filler, only the needle moves
            assert ids[pos:pos + len(needle)] == needle and ids[-len(question):] == question
            assert ids[:len(intro)] == intro
            rest = ids[len(intro):pos] + ids[pos + len(needle):-len(question)]
            assert filler_text.startswith(tokenizer.decode(rest))  # whole sentences, in order
        last, _, pos = prompts[-1]
        assert pos + len(needle) == len(last) - len(question)  # depth 1: right before the question
    with pytest.raises(EvalError, match="too short"):
        build_prompt(tokenizer, shortest - 1, 0.5, "48213")


def test_scoring_counts_exactly_the_correct_retrievals(tokenizer):
    m = tiny_model((recurrent_kind(), windowed_kind()), max_seq_len=64)

    def oracle(ids, n):  # reads the key out of the prompt, as a perfect model would
        return tokenizer.encode(" " + re.search(r"pass key is (\d+)", tokenizer.decode(ids)).group(1))[:n]

    def wrong(ids, n):
        return tokenizer.encode(" 00000")[:n]

    # the recurrent/windowed model accepts lengths beyond max_seq_len=64
    good = passkey_grid(m, tokenizer, [400, 600], [0.0, 0.5, 1.0], trials=3, generate=oracle, show_progress=False)
    assert good["accuracy"] == [[1.0] * 3] * 2 and good["mean_accuracy"] == 1.0
    assert [s["key"] for s in good["samples"][:3]] == grid_keys(3)
    bad = passkey_grid(m, tokenizer, [400], [0.5], trials=3, generate=wrong, show_progress=False)
    assert bad["accuracy"] == [[0.0]]
    with pytest.raises(EvalError, match="exceeds model.max_seq_len"):
        passkey_grid(tiny_model((global_kind(),), max_seq_len=64), tokenizer, [400], [0.5], show_progress=False)


def test_chunked_greedy_decoding_matches_generate():
    m = tiny_model((recurrent_kind(), global_kind()), max_seq_len=64)
    ids = torch.randint(3, 300, (37,))
    want = m.generate(ids[None], 6, temperature=0)[0, 37:].tolist()
    assert greedy_continue(m, ids.tolist(), 6, chunk_len=8) == want


def test_answer_loss_is_the_teacher_forced_loss_of_the_answer_per_cell(tokenizer):
    m = tiny_model((recurrent_kind(), global_kind()), max_seq_len=512)
    ids, ans, _ = build_prompt(tokenizer, 300, 0.5, "48213")
    with torch.no_grad():
        logits = m(torch.tensor([ids + ans[:-1]])).logits[0, len(ids) - 1:]
    want = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ans)))
    assert answer_nll(m, ids, ans) == pytest.approx(want, rel=1e-5)
    assert answer_nll(m, ids, ans, chunk_len=7) == pytest.approx(want, rel=1e-4)  # states carried across chunks
    res = passkey_grid(m, tokenizer, [300, 400], [0.0, 1.0], trials=2, show_progress=False)
    keys = grid_keys(2)
    for i, L in enumerate((300, 400)):
        for j, d in enumerate((0.0, 1.0)):
            per_key = [answer_nll(m, *build_prompt(tokenizer, L, d, k)[:2]) for k in keys]
            assert res["answer_loss"][i][j] == pytest.approx(sum(per_key) / 2, rel=1e-6)
    assert res["answer_loss"][0][0] != res["answer_loss"][0][1]


def test_cli_heatmap(attn_export, tmp_path, capsys):
    assert main(["passkey", "--checkpoint", attn_export, "--lengths", "300,400", "--depths", "0,1",
                 "--trials", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    r = json.loads((tmp_path / "passkey.json").read_text())["result"]
    assert len(r["accuracy"]) == 2 and all(len(row) == 2 for row in r["accuracy"])
    assert (tmp_path / "passkey.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert printed.endswith(f"wrote {tmp_path / 'passkey.png'}, {tmp_path / 'passkey.json'}\n"), printed


def test_heatmap_has_a_labelled_colorbar_and_contrasting_percentages():
    import matplotlib.pyplot as plt
    res = {"lengths": [128, 256, 512], "depths": [0.0, 1.0], "trials": 5,
           "accuracy": [[1.0, 0.0], [0.6, 0.2], [0.0, 0.0]]}
    fig = plot_heatmap(res, None, "t", train_len=256)
    ax, cax = fig.axes
    label = " ".join(cax.get_ylabel().split())  # wrapped to the colorbar's height
    assert "accuracy" in label and "5 random passkeys per cell" in label
    cells = {t.get_text(): t for t in ax.texts}
    assert set(cells) == {"100%", "0%", "60%", "20%"} and len(ax.texts) == 6
    assert cells["0%"].get_color() == "white" and cells["100%"].get_color() == "black"
    assert all(t.get_fontsize() >= 8 for t in ax.texts)
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["128", "256\n(train)", "512\n(> train)"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0% (start)", "100% (end)"]
    plt.close(fig)


def test_heatmap_shows_the_answer_loss_beside_the_accuracy():
    import matplotlib.pyplot as plt
    res = {"lengths": [128, 256], "depths": [0.0, 0.5, 1.0], "trials": 10,
           "accuracy": [[1.0, 0.0, 0.2], [0.0, 0.0, 0.0]], "answer_loss": [[0.01, 3.5, 1.2], [2.0, 2.2, 0.4]]}
    fig = plot_heatmap(res, None, "t", train_len=256)
    acc_ax, loss_ax = (a for a in fig.axes if a.texts)
    assert len(fig.axes) == 4 and len(loss_ax.texts) == 6
    cbar_labels = [a.get_ylabel() for a in fig.axes if not a.texts]
    assert "accuracy" in cbar_labels[0] and "nats per answer token" in " ".join(cbar_labels[1].split())
    cells = {t.get_text(): t for t in loss_ax.texts}
    assert set(cells) == {"0.01", "3.50", "1.20", "2.00", "2.20", "0.40"}
    # the loss map is reversed (low loss bright): dark text on the best cell, light on the worst
    assert cells["0.01"].get_color() == "black" and cells["3.50"].get_color() == "white"
    assert [t.get_text() for t in loss_ax.get_xticklabels()] == ["128", "256\n(train)"]
    plt.close(fig)


def _cut_off_texts(fig):
    """The titles, axis labels and tick labels (colorbars' included) that reach outside the figure."""
    fig.canvas.draw()
    r, box = fig.canvas.get_renderer(), fig.bbox
    out = []
    for ax in fig.axes:
        for t in (ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()):
            if t.get_text() and t.get_visible():
                b = t.get_window_extent(r)
                if b.x0 < box.x0 - 1 or b.y0 < box.y0 - 1 or b.x1 > box.x1 + 1 or b.y1 > box.y1 + 1:
                    out.append(t.get_text())
    return out


@pytest.mark.parametrize("n_lengths, n_depths", [(1, 1), (2, 2), (4, 5), (8, 9)])
def test_heatmap_text_stays_inside_and_the_loss_colours_cover_the_data(n_lengths, n_depths):
    """Every title and colorbar label fits in the figure, whatever the grid; a loss far above ln 10
    (an untrained model's ~11.8 nats) gets the colour scale's top, not a clipped ln 10."""
    import matplotlib.pyplot as plt
    res = {"lengths": [256 * 2 ** i for i in range(n_lengths)],
           "depths": [j / max(n_depths - 1, 1) for j in range(n_depths)], "trials": 5,
           "accuracy": [[0.0] * n_depths for _ in range(n_lengths)],
           "answer_loss": [[11.8 - 0.1 * j for j in range(n_depths)] for _ in range(n_lengths)]}
    fig = plot_heatmap(res, None, "passkey retrieval: a-checkpoint-with-a-long-name", train_len=512)
    assert _cut_off_texts(fig) == []
    acc_im, loss_im = (a.images[0] for a in fig.axes if a.texts)
    assert (acc_im.norm.vmin, acc_im.norm.vmax) == (0, 1)
    assert loss_im.norm.vmin == 0 and loss_im.norm.vmax == pytest.approx(11.8)
    # a loss grid below ln 10 keeps ln 10 as the top: the colour of a uniform guess stays the same
    res["answer_loss"] = [[0.5] * n_depths for _ in range(n_lengths)]
    fig2 = plot_heatmap(res, None, "t")
    assert [a.images[0] for a in fig2.axes if a.texts][1].norm.vmax == pytest.approx(math.log(10))
    plt.close(fig)
    plt.close(fig2)


def test_practice_documents_follow_the_prompt_format():
    docs = practice_documents(20, 3, seed=0)
    assert len(docs) == 20 and docs == practice_documents(20, 3, seed=0)
    for d in docs:
        key = re.search(r"pass key is (\d{5})\.", d).group(1)
        assert d.startswith(INTRO) and d.endswith(QUESTION + " " + key + ".") and d.count(key) == 3
    assert len({d.count("The grass is green") for d in docs}) > 1  # filler counts vary
    with pytest.raises(EvalError, match="n >= 1"):
        practice_documents(0, 3)


def _keys(docs):
    return [re.search(r"pass key is (\d+)\.", d).group(1) for d in docs]


def test_practice_keys_are_not_the_test_keys():
    # practice and test keys once came from the same stream, random.Random(seed): the first
    # practice document of seed s held the first key passkey_grid tests with seed s
    for seed in range(5):
        assert not set(_keys(practice_documents(50, 1, seed=seed))) & set(grid_keys(10, seed))
    docs = practice_documents(300, 0, digits=2, exclude=[str(k) for k in range(10, 98)])
    assert set(_keys(docs)) == {"98", "99"}  # exclude is honoured
    with pytest.raises(EvalError, match="every 2-digit key"):
        practice_documents(1, 0, digits=2, exclude=[str(k) for k in range(10, 100)])


def test_practice_batch_labels_exactly_the_answer_tokens(tokenizer):
    import random
    banned = grid_keys(50)
    x, y = practice_batch(tokenizer, 6, 300, random.Random(0), exclude=banned)
    assert x.shape == y.shape and x.shape[0] == 6
    for b in range(6):
        scored = (y[b] != -100).nonzero().flatten().tolist()
        text = tokenizer.decode(x[b, :scored[0] + 1].tolist())
        key = re.search(r"pass key is (\d{5})\.", text).group(1)
        ans = tokenizer.encode(" " + key)
        assert key not in banned and text.endswith(QUESTION)
        # contiguous, exactly the tokens the eval decodes, each the next input token
        assert scored == list(range(scored[0], scored[0] + len(ans))) and y[b, scored].tolist() == ans
        assert x[b, scored[0] + 1:scored[-1] + 1].tolist() == ans[:-1]
        assert build_prompt(tokenizer, 300, 0.0, key)[0][:10] == x[b, :10].tolist()
    only = practice_batch(tokenizer, 8, 300, random.Random(1), digits=2, exclude=[str(k) for k in range(10, 99)])[0]
    assert all("pass key is 99." in tokenizer.decode(row.tolist()) for row in only)
    with pytest.raises(EvalError, match="every 2-digit key"):
        practice_batch(tokenizer, 1, 300, random.Random(0), digits=2, exclude=[str(k) for k in range(10, 100)])


@pytest.mark.slow
def test_practice_finetune_lowers_the_answer_loss(tokenizer):
    m = tiny_model((global_kind(),), max_seq_len=512)
    res = practice_finetune(m, tokenizer, [300, 400], steps=25, batch_size=8, lr=3e-3, warmup=5,
                            exclude=grid_keys(10), held_out=16)
    assert res["after"]["answer_loss"] < res["before"]["answer_loss"] - 1.0
    assert res["after"]["token_accuracy"] > res["before"]["token_accuracy"]
    with pytest.raises(EvalError, match="exceeds model.max_seq_len"):
        practice_finetune(m, tokenizer, [600], steps=1)
    with pytest.raises(EvalError, match="too short"):
        practice_finetune(m, tokenizer, [40], steps=1)


def test_cli_passkey_train_writes_an_export_the_eval_reads(attn_export, tmp_path):
    out = str(tmp_path / "pk")
    args = ["passkey_train", "--checkpoint", attn_export, "--out", out, "--steps", "3", "--batch-size", "2",
            "--lengths", "300", "--held-out", "2", "--no-progress"]
    assert main(args) == 0
    rec = json.loads((tmp_path / "pk" / "passkey_train.json").read_text())
    assert rec["result"]["steps"] == 3 and set(rec["result"]["after"]) >= {"answer_loss", "prompt_accuracy"}
    before = torch.load(f"{attn_export}/model.pt")
    after = torch.load(f"{out}/model.pt")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # trained, and the original kept
    assert main(["passkey", "--checkpoint", out, "--lengths", "300,400", "--depths", "0,1", "--trials", "1",
                 "--out", str(tmp_path / "ev"), "--no-progress"]) == 0
    ticks = json.loads((tmp_path / "ev" / "passkey.json").read_text())["result"]
    assert len(ticks["accuracy"]) == 2
    assert main(args) == 2  # a non-empty --out is not overwritten without --overwrite
    assert torch.equal(torch.load(f"{out}/model.pt")[next(iter(after))], after[next(iter(after))])
    assert main(args + ["--overwrite"]) == 0
    assert main(args[:3] + ["--out", attn_export, "--steps", "1"]) == 2
