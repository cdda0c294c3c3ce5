"""TTT-E2E through the real trainer: a process of ``tests/train/runner.py`` (train.py's ``main`` on the
synthetic counting corpus) trains a tiny E2E model for twelve optimizer steps under DeepSpeed's
ZeRO-1 engine, the inner lr warm-up read from the step, and writes its checkpoint; and ZeRO-2 and
ZeRO-3 run the same steps to the same losses."""
from __future__ import annotations

import math
import os

import pytest

from tests.train.launch import losses_by_step, run

pytestmark = pytest.mark.slow

E2E = ["model.ttt_e2e.enabled=true", "model.ttt_e2e.suffix_len=1", "model.ttt_e2e.inner_batch=4",
       "model.ttt_e2e.window=6", "model.ttt_e2e.ilr_warmup_steps=2", "model.d_ff=64", "train.max_steps=12",
       "logging.log_every=1"]


def test_a_tiny_e2e_model_trains_through_the_trainer(tmp_path):
    one = str(tmp_path / "zero1")
    r = run(one, E2E, timeout=300)
    out = r.output(0)
    assert "e2e_ttt_blocks attention:math" in out, out[-2000:]
    losses = losses_by_step(one)
    assert sorted(losses) == list(range(1, 13)), losses
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[12] < losses[1] - 0.1, losses    # lr 1e-2 on a counting task: twelve steps lower the loss
    ckpts = os.listdir(os.path.join(one, "checkpoints"))
    assert any(c.startswith("step_00000012") for c in ckpts), ckpts
    two = str(tmp_path / "zero2")
    run(two, [*E2E, "parallel.zero_stage=2"], timeout=300)
    other = losses_by_step(two)
    assert all(abs(other[s] - losses[s]) < 1e-5 for s in losses), (losses, other)


def test_zero3_trains_to_the_zero1_losses(tmp_path):
    """ZeRO-3 with every parameter partitioned between steps (persistence threshold 0): the model
    gathers its parameters for each step (E2ELM.gathers_zero3_parameters) and gets ZeRO-1's losses,
    and its checkpoint exports to ZeRO-1's weights."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}')
    short = [a for a in E2E if not a.startswith("train.max_steps")] + ["train.max_steps=4"]
    one, three = str(tmp_path / "z1"), str(tmp_path / "z3")
    run(one, short, timeout=300)
    run(three, [*short, "parallel.zero_stage=3", f"parallel.deepspeed_config={ds}"], timeout=300)
    a, b = losses_by_step(one), losses_by_step(three)
    assert sorted(b) == [1, 2, 3, 4], b
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    # the partitioned ZeRO-3 checkpoint exports to ZeRO-1's weights (4 AdamW steps of lr 1e-2)
    from ttt_lm.train.export import export, load_pretrained
    sds = []
    for d in (one, three):
        out = d + "_export"
        export(d, out, tokenizer=None)
        sds.append(load_pretrained(out).state_dict())
    assert sds[0].keys() == sds[1].keys()
    for name, v in sds[0].items():
        assert (sds[1][name] - v).abs().max() <= 1e-5, name


def test_tensor_parallel_2_trains_to_the_one_process_losses(tmp_path):
    """parallel.tensor_parallel=2 (two gloo ranks; heads, MLP features and the fast weights split,
    the inner clip's norm summed over the ranks) against one process: every step's loss and the
    logged gradient norm (the outer clip acts: norm > optim.grad_clip) agree, and the TP checkpoint
    exports to the one-process weights. Tolerance: fp32 summation order only (~1e-7 per step);
    1e-4 absolute on the losses and 1e-4 relative on the norm, as tests/train/test_train_tp.py,
    far below what a missing or doubled all-reduce in the inner step moves (O(1) on the gradient)."""
    short = [a for a in E2E if not a.startswith("train.max_steps")] + ["train.max_steps=4", "optim.lr=1e-3",
                                                                        "model.ttt_e2e.inner_clip=0.05"]
    one, two = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    run(one, short, timeout=300)
    r = run(two, [*short, "parallel.tensor_parallel=2"], nprocs=2, timeout=300)
    assert "tensor parallel 2" in r.output(0), r.output(0)[-2000:]
    a, b = losses_by_step(one), losses_by_step(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4], (a, b)
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)
    from tests.train.launch import metrics
    na = {m["step"]: m["grad_norm"] for m in metrics(one)}
    nb = {m["step"]: m["grad_norm"] for m in metrics(two)}
    assert all(abs(na[s] - nb[s]) <= 1e-4 * na[s] for s in na), (na, nb)
    from ttt_lm.train.export import export, load_pretrained
    sds = []
    for d in (one, two):
        export(d, d + "_export", tokenizer=None)
        sds.append(load_pretrained(d + "_export").state_dict())
    assert sds[0].keys() == sds[1].keys()
    for name, v in sds[0].items():
        assert (sds[1][name] - v).abs().max() <= 1e-4, name



@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared corpus (the synthetic counting data cannot carry its loader state to another
    parallel layout; the prepared shards' loader can)."""
    from tests.data.corpus import SHARD_TOKENS, VOCAB, make_texts, write_corpus
    from ttt_lm.data.prepare import prepare
    base = tmp_path_factory.mktemp("e2ecorpus")
    raw = write_corpus(str(base / "raw"), make_texts(40))
    prepare([raw], str(base / "data"), vocab_size=VOCAB, shard_tokens=SHARD_TOKENS, val_fraction=0.05, workers=1,
            progress=False, overwrite=True)
    return str(base / "data"), VOCAB + 20


def test_tensor_parallel_2_under_zero_2_and_3_and_a_resume_at_tp_1(tmp_path, corpus):
    """parallel.tensor_parallel=2 under ZeRO-2 and under ZeRO-3 (every parameter of each TP slice
    partitioned between steps over its data-parallel group: persistence threshold 0) trains to the
    one-process losses; and the ZeRO-2 run's checkpoint after step 2 resumes at tensor_parallel=1
    (the slices joined along the checkpoint's partition_dims, AdamW's moments with them) to the
    one-process losses of steps 3 and 4. On a prepared corpus, whose loader state carries across
    layouts. Tolerances as the test above (fp32 summation order)."""
    path, vocab = corpus
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}')
    short = ([a for a in E2E if not a.startswith("train.max_steps")] +
             ["train.max_steps=4", "optim.lr=1e-3", "model.ttt_e2e.inner_clip=0.05", f"data.path={path}",
              f"model.vocab_size={vocab}", "data.streams=2", "parallel.zero_stage=2"])
    env = {"TTT_TEST_REAL_DATA": "1"}
    one, z2, z3, back = (str(tmp_path / n) for n in ("tp1", "tp2_zero2", "tp2_zero3", "tp1_resumed"))
    run(one, short, timeout=300, env=env)
    run(z2, [*short, "parallel.tensor_parallel=2", "checkpoint.every=2"], nprocs=2, timeout=300, env=env)
    run(z3, [*short, "parallel.tensor_parallel=2", "parallel.zero_stage=3", f"parallel.deepspeed_config={ds}"],
        nprocs=2, timeout=300, env=env)
    ckpt = os.path.join(z2, "checkpoints", "step_00000002")
    r = run(back, [*short, f"train.resume_from={ckpt}"], timeout=300, env=env)
    assert f"resuming from {ckpt} at step 2" in r.output(0), r.output(0)[-2000:]
    ref = losses_by_step(one)
    assert sorted(ref) == [1, 2, 3, 4], ref
    for d, steps in ((z2, [1, 2, 3, 4]), (z3, [1, 2, 3, 4]), (back, [3, 4])):
        got = losses_by_step(d)
        assert sorted(got) == steps, (d, got)
        assert all(abs(got[s] - ref[s]) < 1e-4 for s in steps), (d, ref, got)
