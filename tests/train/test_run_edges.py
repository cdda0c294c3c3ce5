"""Edges of a run's start and end, on real processes (gloo, CPU): what a run stopped by
train.stop_after says, what a run refused at startup leaves behind, the data order on another
number of ranks, and the global batch of a run resumed on another number of ranks."""
import os

import pytest

from launch import run

pytestmark = pytest.mark.dist


def test_stop_after_says_where_the_run_stopped(tmp_path):
    d = str(tmp_path / "run")
    out = run(d, ["train.max_steps=4", "train.stop_after=2"]).output()
    line = next((ln for ln in out.splitlines() if ln.startswith("[train] stopped after step 2 of 4")), None)
    assert line is not None, out[-2000:]
    assert "train.stop_after=2" in line and "checkpoint saved" in line
    assert os.path.isdir(os.path.join(d, "checkpoints", "step_00000002"))
    # a run that reaches train.max_steps at train.stop_after has nothing left: no such line
    out = run(str(tmp_path / "whole"), ["train.max_steps=2", "train.stop_after=2"]).output()
    assert "stopped after step" not in out


def test_a_run_refused_at_startup_leaves_no_run_directory(tmp_path):
    d = str(tmp_path / "new" / "run")
    missing = str(tmp_path / "no-such-data")
    # the last train.run_dir wins: the spawner's own folder is not the run's
    r = run(str(tmp_path / "spawn"), [f"train.run_dir={d}", f"data.path={missing}", "train.max_steps=1"],
            env={"TTT_TEST_REAL_DATA": "1"}, expect=None)
    assert r.wait() != [0], r.output()
    assert missing in r.output()
    assert not os.path.exists(d), os.listdir(d)
    # a run directory that existed before is kept, with what it held
    os.makedirs(d)
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("mine\n")
    r = run(str(tmp_path / "spawn2"), [f"train.run_dir={d}", f"data.path={missing}", "train.max_steps=1"],
            env={"TTT_TEST_REAL_DATA": "1"}, expect=None)
    assert r.wait() != [0]
    assert os.listdir(d) == ["notes.txt"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus
    from ttt_lm.data.prepare import prepare
    base = tmp_path_factory.mktemp("edgescorpus")
    raw = write_corpus(str(base / "raw"), make_texts(40))
    prepare([raw], str(base / "data"), vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
            progress=False, overwrite=True)
    return str(base / "data")


def _real(corpus, steps, *extra):
    from tests.data.corpus import VOCAB
    return [f"data.path={corpus}", f"model.vocab_size={VOCAB + 20}", f"train.max_steps={steps}", *extra]


def _rows(d, nprocs, args):
    from test_resume_dp import global_rows
    r = run(d, args, nprocs=nprocs, env={"TTT_TEST_REAL_DATA": "1", "TTT_TEST_BATCH_LOG": d + ".batches"})
    return r, global_rows(d)


def test_the_data_order_does_not_depend_on_the_number_of_ranks(tmp_path, corpus):
    """data.streams unset: the same seed reads the same samples on 1 and on 2 ranks (global batch 8
    on both), and a run started on 2 ranks resumed on 1 reads what the 1-rank run read."""
    _, one = _rows(str(tmp_path / "one"), 1, _real(corpus, 4, "train.micro_batch_size=8"))
    r, two = _rows(str(tmp_path / "two"), 2, _real(corpus, 4, "train.micro_batch_size=4", "checkpoint.every=2"))
    assert sorted(one) == sorted(two) == list(range(4 * 8))
    assert all(two[i] == one[i] for i in one)
    assert "a stream is shared" not in r.output()
    ckpt = os.path.join(str(tmp_path / "two"), "checkpoints", "step_00000002")
    _, back = _rows(str(tmp_path / "back"), 1, _real(corpus, 4, "train.micro_batch_size=8",
                                                     f"train.resume_from={ckpt}"))
    assert sorted(back) == list(range(2 * 8, 4 * 8))
    assert all(back[i] == one[i] for i in back)


def test_a_resumed_run_keeps_its_global_batch_on_another_number_of_ranks(tmp_path, corpus):
    """Started on 1 rank with the global batch unset (micro-batch 4 × 1 rank), resumed with the same
    command on 2 ranks: 4 sequences a step still (the micro-batch adapts, said in one line), the
    1-rank run's samples; train.global_batch_size given instead works the same; a global batch the
    ranks cannot split is refused in one line naming an override that works."""
    from launch import metrics
    args = _real(corpus, 4, "train.micro_batch_size=4", "checkpoint.every=2")
    _, one = _rows(str(tmp_path / "one"), 1, args)
    ckpt = os.path.join(str(tmp_path / "one"), "checkpoints", "step_00000002")
    r, two = _rows(str(tmp_path / "two"), 2, [*args, f"train.resume_from={ckpt}"])
    out = r.output()
    assert out.count("keeping the run's global batch of 4 sequences on 2 data-parallel rank(s): "
                     "train.micro_batch_size 4 -> 2, grad_accum 1") == 1
    assert "global batch changes" not in out
    assert [m["tokens"] - p["tokens"] for p, m in zip(metrics(str(tmp_path / "one")), metrics(str(tmp_path / "one"))[1:])] \
        == [4 * 16] * 3
    assert [m["tokens"] for m in metrics(str(tmp_path / "two"))] == [3 * 4 * 16, 4 * 4 * 16]
    assert sorted(two) == list(range(2 * 4, 4 * 4)) and all(two[i] == one[i] for i in two)
    # the advice of slurm/README.md: the global batch named on the command line
    r, given = _rows(str(tmp_path / "given"), 2, [*args, "train.global_batch_size=4", f"train.resume_from={ckpt}"])
    assert given == two and "global batch changes" not in r.output()
    # 3 sequences a step cannot be split over 2 ranks: one line, no traceback
    odd = _real(corpus, 4, "train.micro_batch_size=3", "checkpoint.every=2")
    run(str(tmp_path / "odd"), odd)
    r = run(str(tmp_path / "odd"), odd, nprocs=2, expect=2, tag="again")
    err = [ln for ln in r.output().splitlines() if ln.startswith("error:")]
    assert err == ["error: the run's global batch of 3 sequences cannot be split over 2 data-parallel rank(s) (3 is "
                   "not a multiple of 2): run it on a number of ranks that divides 3, or set "
                   "train.global_batch_size=2 to change it"], r.output()
    assert "Traceback" not in r.output() and "Traceback" not in r.output(1)
