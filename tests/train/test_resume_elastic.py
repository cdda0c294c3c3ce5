"""Elastic resume on a real prepared corpus (gloo, CPU, fp32): a 1-rank run with one data stream
(data.streams=1, so that 2 ranks share it) and micro-batch 8 is resumed after 6 steps on 2 ranks with micro-batch 4 (the same
global batch of 8), and after 9 steps back on 1 rank. Every step reads the samples the
uninterrupted 1-rank run read at that step (counted by global sample index: none twice, none
skipped), and the losses agree within 1e-4 relative: the same sequences, with the gradient summed
in another order (two half-batch means averaged instead of one mean over 8) and the 2-rank run's
one data stream read by both ranks.
"""
import os

import pytest

from launch import losses_by_step, run
from test_resume_dp import global_rows
from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus
from ttt_lm.data.prepare import prepare

pytestmark = pytest.mark.dist

G = 8  # sequences per step


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("elasticcorpus")
    raw = write_corpus(str(base / "raw"), make_texts(40))
    prepare([raw], str(base / "data"), vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
            progress=False, overwrite=True)
    return str(base / "data")


def _args(corpus, steps, micro):
    return [f"data.path={corpus}", f"model.vocab_size={VOCAB + 20}", f"train.max_steps={steps}",
            f"train.micro_batch_size={micro}", "checkpoint.every=3", "data.streams=1"]


def _run(d, args, nprocs):
    return run(d, args, nprocs=nprocs, env={"TTT_TEST_REAL_DATA": "1", "TTT_TEST_BATCH_LOG": d + ".batches"})


def _ckpt(d, step):
    return os.path.join(d, "checkpoints", f"step_{step:08d}")


def test_one_to_two_to_one_rank_reads_the_same_samples_and_learns_the_same(tmp_path, corpus):
    full = str(tmp_path / "full")
    _run(full, _args(corpus, 12, 8), 1)
    two = str(tmp_path / "two")
    # stop_after, not max_steps: the learning-rate schedule spans train.max_steps
    r2 = _run(two, _args(corpus, 12, 4) + ["train.stop_after=9", f"train.resume_from={_ckpt(full, 6)}"], 2)
    back = str(tmp_path / "back")
    _run(back, _args(corpus, 12, 8) + [f"train.resume_from={_ckpt(two, 9)}"], 1)

    # said once, on rank 0: the data order continues, and the one stream is shared by the ranks
    out0, out1 = r2.output(0), r2.output(1)
    assert out0.count("was written by 1 data-parallel rank(s), this run has 2") == 1
    assert out0.count("a stream is shared") == 1
    assert "a stream is shared" not in out1 and "data-parallel rank(s), this run has" not in out1
    assert "global batch changes" not in out0  # 8 × 1 × 1 = 4 × 1 × 2

    # samples: the resumed runs read exactly samples 48..71 and 72..95, as the uninterrupted run
    ref, a, b = global_rows(full), global_rows(two), global_rows(back)
    assert sorted(ref) == list(range(12 * G))
    assert sorted(a) == list(range(6 * G, 9 * G)) and sorted(b) == list(range(9 * G, 12 * G))
    assert all(a[i] == ref[i] for i in a) and all(b[i] == ref[i] for i in b)
    read = [ref[i] for i in range(6 * G)] + [a[i] for i in sorted(a)] + [b[i] for i in sorted(b)]
    assert len(read) == len(set(read)) == 12 * G  # 0 repeated, 0 lost

    # losses: within fp32 reduction-order noise of the uninterrupted run at every step
    lf, l2, l1 = losses_by_step(full), losses_by_step(two), losses_by_step(back)
    assert sorted(l2) == [7, 8, 9] and sorted(l1) == [10, 11, 12]
    for s in range(7, 13):
        got = l2[s] if s <= 9 else l1[s]
        assert got == pytest.approx(lf[s], rel=1e-4, abs=0), (s, got, lf[s])
    assert lf[12] < lf[1]
