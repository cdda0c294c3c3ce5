"""Elastic resume across data and tensor parallelism (gloo, CPU, fp32, a real prepared corpus): a
run trained on 2 data-parallel ranks (micro-batch 4) is resumed after 6 steps on 1 data-parallel
rank × tensor parallel 2 (micro-batch 8: the same global batch of 8), and after 9 steps back on 2
data-parallel ranks. Against the uninterrupted 1-rank run: every step reads the samples that run
read (counted by global sample index: none twice, none skipped) and the losses agree within 1e-4
relative at every step.

Why 1e-4: the runs compute the same sums in other orders. On 2 data-parallel ranks the gradient is
two half-batch means averaged; under tensor parallelism the matmuls are split across the 2 ranks
and their partial sums all-reduced, the loss's softmax taken over vocabulary shards (fp32 summation
order, ~1e-7 relative per step, test_train_tp). AdamW amplifies such noise for gradient components
near zero (their update is nearly their sign); over 12 steps at optim.lr=1e-3 the differences stay
below 1e-5 (measured: at most 7e-6, at step 11; 0 at step 7, the first on the restored weights),
while a wrongly joined or cut slice of the weights or AdamW moments changes the losses by far more
(AdamW's first moment zeroed at the cut moves step 8 by 5e-3 relative: tried). The data order is global (it depends on the seed and
the global batch, not the layout), data.streams=2 on every run.
"""
import os

import pytest

from launch import losses_by_step, run
from test_resume_dp import global_rows
from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus
from ttt_lm.data.prepare import prepare

pytestmark = pytest.mark.dist

G = 8  # sequences per step
RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("tpresumecorpus")
    raw = write_corpus(str(base / "raw"), make_texts(40))
    prepare([raw], str(base / "data"), vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
            progress=False, overwrite=True)
    return str(base / "data")


def _args(corpus, micro, *extra):
    return [f"data.path={corpus}", f"model.vocab_size={VOCAB + 20}", "train.max_steps=12",
            f"train.micro_batch_size={micro}", "checkpoint.every=3", "data.streams=2", "optim.lr=1e-3", *extra]


def _run(d, args, nprocs=2):
    return run(d, args, nprocs=nprocs, env={"TTT_TEST_REAL_DATA": "1", "TTT_TEST_BATCH_LOG": d + ".batches"})


def _ckpt(d, step):
    return os.path.join(d, "checkpoints", f"step_{step:08d}")


def test_dp2_to_tp2_and_back_reads_the_same_samples_and_learns_the_same(tmp_path, corpus):
    full, dp, tp, back = (str(tmp_path / k) for k in ("full", "dp", "tp", "back"))
    _run(full, _args(corpus, 8), nprocs=1)
    # stop_after, not max_steps: the learning-rate schedule spans train.max_steps
    _run(dp, _args(corpus, 4, "train.stop_after=6"))
    r_tp = _run(tp, _args(corpus, 8, "parallel.tensor_parallel=2", "train.stop_after=9",
                          f"train.resume_from={_ckpt(dp, 6)}"))
    r_back = _run(back, _args(corpus, 4, f"train.resume_from={_ckpt(tp, 9)}"))

    # said once, on rank 0: the layouts, and that the data order continues
    out0, out1 = r_tp.output(0), r_tp.output(1)
    assert out0.count("was written by 2 data-parallel rank(s), this run has 1 data-parallel rank(s) × tensor "
                      "parallel 2: optimizer state resharded") == 1
    assert "was written by" not in out1
    assert r_back.output(0).count("was written by 1 data-parallel rank(s) × tensor parallel 2, this run has 2 "
                                  "data-parallel rank(s)") == 1
    assert "global batch changes" not in out0 + r_back.output(0)

    # samples: every run reads exactly the uninterrupted run's samples of its steps
    ref, a, b, c = global_rows(full), global_rows(dp), global_rows(tp), global_rows(back)
    assert sorted(ref) == list(range(12 * G))
    assert sorted(a) == list(range(6 * G)) and sorted(b) == list(range(6 * G, 9 * G))
    assert sorted(c) == list(range(9 * G, 12 * G))
    assert all(part[i] == ref[i] for part in (a, b, c) for i in part)
    read = [part[i] for part in (a, b, c) for i in sorted(part)]
    assert len(read) == len(set(read)) == 12 * G  # 0 repeated, 0 lost

    # losses: within fp32 reduction-order noise of the uninterrupted run at every step
    lf, ld, lt, lb = (losses_by_step(d) for d in (full, dp, tp, back))
    assert sorted(ld) == list(range(1, 7)) and sorted(lt) == [7, 8, 9] and sorted(lb) == [10, 11, 12]
    for s in range(1, 13):
        got = ld[s] if s <= 6 else lt[s] if s <= 9 else lb[s]
        assert got == pytest.approx(lf[s], rel=RTOL, abs=0), (s, got, lf[s])
    assert lf[12] < lf[1]
