"""A shard corrupted while a run is going (gloo, CPU, one rank, real prepared corpus): the shards
are verified ahead of the reader, so the run stops before the step that would read the bad one,
with a checkpoint of the step before it and a message on its own line naming the shard and the
fix; once the shard is restored, the same command resumes and the losses equal the
uninterrupted run's (same layout: bit-identical)."""
import os
import shutil

import pytest

from launch import losses_by_step, run
from tests.data.corpus import SHARD_TOKENS, VOCAB, data_cfg, make_texts, write_corpus
from ttt_lm.data import build_train_loader
from ttt_lm.data.prepare import prepare

pytestmark = pytest.mark.dist

MICRO, STEPS = 4, 10
#: one data stream: its shards are read one after another, so some are first read late in the run
#: (with the default 8 streams every stream opens a shard in the first steps)
STREAMS = 1
#: the metrics (and with them the stop signal) are read every READ steps; each read verifies the
#: shards of the next READ steps, so the run stops at the last read before the bad shard's step
READ = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    base = tmp_path_factory.mktemp("stopcorpus")
    raw = write_corpus(str(base / "raw"), make_texts(40))
    prepare([raw], str(base / "data"), vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
            progress=False, overwrite=True)
    return str(base / "data")


def _first_read_at(corpus, step_min):
    """A train shard that the run reads for the first time at some step >= step_min, and that step."""
    ld = build_train_loader(data_cfg(corpus, streams=STREAMS), MICRO, 0, 1)
    seen, it = set(), iter(ld)
    for step in range(1, STEPS + 1):
        now = ld.shards_ahead(MICRO)
        new = [i for i in now if i not in seen]
        if step >= step_min and new:
            return ld.plan.shards[new[0]]["name"], step
        seen.update(now)
        next(it)
    pytest.fail("the corpus has no shard first read late enough: the test needs a larger corpus")


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_shard_costs_no_step(tmp_path, corpus, capsys):
    args = lambda d: [f"data.path={d}", f"model.vocab_size={VOCAB + 20}", f"train.max_steps={STEPS}",
                      f"train.micro_batch_size={MICRO}", "checkpoint.every=100", f"logging.log_every={READ}",
                      f"data.streams={STREAMS}"]
    ref = str(tmp_path / "ref")
    run(ref, args(corpus), env={"TTT_TEST_REAL_DATA": "1"})

    data = str(tmp_path / "data")
    shutil.copytree(corpus, data)
    name, k = _first_read_at(corpus, 3)
    _flip(os.path.join(data, name))
    d = str(tmp_path / "run")
    r = run(d, args(data), env={"TTT_TEST_REAL_DATA": "1"}, expect=1)
    out = r.output()
    # the stop: a checkpoint at the last read of the metrics before step k, the one that reads the shard
    s = (k - 1) // READ * READ
    assert k - READ <= s < k
    assert os.path.isdir(os.path.join(d, "checkpoints", f"step_{s:08d}"))
    assert sorted(losses_by_step(d)) == list(range(1, s + 1))
    line = next(ln for ln in out.splitlines() if ln.startswith(f"[train] stopped at step {s} (checkpoint saved)"))
    assert name in line and "sha256 differs from the manifest" in line
    assert "restore the shard" in out and "run the same command again" in out
    # named by the background pass before the run reached it
    assert out.index("found ahead of the reader") < out.index("[train] stopped at step")

    shutil.copy(os.path.join(corpus, name), os.path.join(data, name))  # restored
    r = run(d, args(data), env={"TTT_TEST_REAL_DATA": "1"})
    assert f"resuming from {os.path.join(d, 'checkpoints', f'step_{s:08d}')}" in r.output()
    assert losses_by_step(d) == losses_by_step(ref)

    # export and eval of the run directory whose newest checkpoint fails verification: they fall
    # back as a resume does, and say which step they used
    from ttt_lm.eval.checkpoint import load_checkpoint
    from ttt_lm.train.export import main as export_main
    newest, before = (os.path.join(d, "checkpoints", f"step_{n:08d}") for n in (STEPS, s))
    assert os.path.isdir(newest)
    _flip(os.path.join(newest, "rank_00000.pt"))
    capsys.readouterr()
    assert export_main([d, str(tmp_path / "export")]) == 0
    err = capsys.readouterr().err
    assert f"passing over {newest}" in err and f"using {before} (step {s})" in err
    ck = load_checkpoint(d)
    assert f"using {before} (step {s})" in capsys.readouterr().err
    assert ck.model.cfg.vocab_size == VOCAB + 20


def test_a_bad_shard_in_the_first_step_stops_before_any_work(tmp_path, corpus):
    data = str(tmp_path / "data")
    shutil.copytree(corpus, data)
    ld = build_train_loader(data_cfg(data), MICRO, 0, 1)
    name = ld.plan.shards[ld.shards_ahead(MICRO)[0]]["name"]
    _flip(os.path.join(data, name))
    d = str(tmp_path / "run")
    r = run(d, [f"data.path={data}", f"model.vocab_size={VOCAB + 20}", "train.max_steps=3",
                f"train.micro_batch_size={MICRO}", "logging.log_every=1"], env={"TTT_TEST_REAL_DATA": "1"}, expect=1)
    assert f"{name}: sha256 differs from the manifest; one of the first 1 step(s) reads it" in r.output()
    assert not os.path.exists(os.path.join(d, "metrics.jsonl")) or losses_by_step(d) == {}
