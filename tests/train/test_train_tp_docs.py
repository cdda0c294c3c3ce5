"""Tensor and context parallelism with packed documents through ``train.py`` as a user runs it: ``python train.py
configs/<preset>.yaml`` on each rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_*), gloo
on CPU, fp32, on a prepared corpus of short documents (3–4 document starts in every 64-token row,
rows starting inside a document), so the loader's ``position_ids`` matter: TP=2 against one
process, 3 steps.

Presets (a representative set: each comparison costs ~35–80 s on a 2-core machine; the module-level
checks of ``tests/parallel/test_tp_mixers.py`` cover every registered kind with packed positions,
with and without resets, and the weight-decay group of every parameter):

* ``tiny_hawk``: the RG-LRU reads the positions as segment positions (it resets where they are 0);
  a trainer that does not pass them to the TP model restarts it at stream positions instead and
  the first step's loss already differs.
* ``tiny_titans_mac``: the Titans MLP memory's norm gains and the embedding are not weight-decayed;
  their TP slices must not be either (a decayed slice agrees at step 1 and drifts from step 2 on).
* ``tiny.yaml`` (TTT-Linear + local attention) with ``model.reset_at_doc_boundaries=true``: every
  layer restarts at each document start, under TP through the same per-document path, and under
  context parallelism (CP=2) through the slices' document layout (the module-level checks of
  ``tests/parallel/test_cp_docs_forms.py`` and ``test_cp_docs_state.py`` cover every kind).

Tolerance. The TP run is the one-process computation with matmuls split across ranks and their
partial sums added by all-reduces, so the losses differ by fp32 summation order. optim.warmup_steps=1
runs the full learning rate (3e-3) from step 1, where AdamW moves every weight by ~lr (an update
m/(√v + ε) is nearly the sign of the gradient), so a missing position, a wrong weight-decay group or
a wrong reduction shows at step 1 or 2. Measured (2-core CPU): ≤ 2.5e-7 relative over the 3 steps
for every run here; without the positions tiny_hawk's step-1 loss differs by 8.7e-4 relative, and
with the Titans norm gains and the embedding decayed under TP tiny_titans_mac's step-2 loss by
2.1e-5. LOSS_RTOL = 1e-5 leaves a 40× margin and fails on both.
"""
import random

import pytest

from launch import losses_by_step, metrics, run
from tests.data.corpus import SHARD_TOKENS, VOCAB, WORDS, data_cfg, write_corpus
from ttt_lm.data.prepare import prepare

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ_LEN = 64
STEPS = 3
LOSS_RTOL = 1e-5
#: representative presets (module docstring); resets: the default preset's hybrid
PRESETS = ["configs/tiny_hawk.yaml", "configs/tiny_titans_mac.yaml"]
RESETS = "configs/tiny.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 1–4 words (~15–20 tokens each): several documents per 64-token row."""
    base = tmp_path_factory.mktemp("packed")
    rng = random.Random(0)
    texts = [f"Doc {i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) + "\n" for i in range(120)]
    raw = write_corpus(str(base / "raw"), texts)
    prepare([raw], str(base / "data"), vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
            progress=False, overwrite=True)
    return str(base / "data")


def _args(corpus):
    return [f"data.path={corpus}", f"data.seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB + 20}",
            "train.micro_batch_size=2", f"train.max_steps={STEPS}", "optim.warmup_steps=1", "logging.log_every=1",
            "logging.tensorboard=false", "logging.progress=false", "eval.every=0", "checkpoint.every=0",
            "train.device=cpu"]


def test_corpus_rows_hold_several_documents(corpus):
    """What the runs below read: every row has document starts inside it."""
    import ttt_lm.data
    it = iter(ttt_lm.data.build_train_loader(data_cfg(corpus, seq_len=SEQ_LEN), 2, 0, 1))
    for _ in range(STEPS):
        starts = (next(it)["position_ids"][:, 1:] == 0).sum(1)
        assert bool((starts >= 2).all()), starts


def _tp2_vs_one(tmp_path, corpus, preset, extra=()):
    args = [*_args(corpus), *extra]
    one, tp2 = str(tmp_path / "one"), str(tmp_path / "tp2")
    run(one, args, nprocs=1, preset=preset)
    run(tp2, [*args, "parallel.tensor_parallel=2"], nprocs=2, preset=preset)
    a, b = losses_by_step(tp2), losses_by_step(one)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_RTOL * abs(b[s]), (preset, s, a[s], b[s])
    # TP peers read the same batches: the tokens count the one data-parallel rank
    assert metrics(tp2)[-1]["tokens"] == metrics(one)[-1]["tokens"] == STEPS * 2 * SEQ_LEN
    return one


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.split("/")[-1][:-5])
def test_tp2_packed_documents_match_one_process(tmp_path, corpus, preset):
    _tp2_vs_one(tmp_path, corpus, preset)


def test_tp2_and_cp2_document_resets_match_one_process(tmp_path, corpus):
    """Document resets under TP=2, then under CP=2 (each row split in two halves of 32 tokens;
    documents cross the split, so the TTT layer's state for a row's document travels to the
    second rank, and the attention's keys of earlier ranks are masked by document), both against
    the same one-process run."""
    one = _tp2_vs_one(tmp_path, corpus, RESETS, ["model.reset_at_doc_boundaries=true"])
    cp2 = str(tmp_path / "cp2")
    run(cp2, [*_args(corpus), "model.reset_at_doc_boundaries=true", "parallel.context_parallel=2"], nprocs=2,
        preset=RESETS)
    a, b = losses_by_step(cp2), losses_by_step(one)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in b:
        assert abs(a[s] - b[s]) <= LOSS_RTOL * abs(b[s]), ("cp2", s, a[s], b[s])
    # CP peers read the same rows: the tokens count the one data-parallel rank
    assert metrics(cp2)[-1]["tokens"] == metrics(one)[-1]["tokens"] == STEPS * 2 * SEQ_LEN
