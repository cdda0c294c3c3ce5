"""The Trainer's callback mechanism, in-process on a one-rank gloo group with a stand-in engine
(the hooks and the step's collective are what is tested, not DeepSpeed)."""
import re
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist

from ttt_lm.train import PREEMPTED_EXIT_CODE
from ttt_lm.train.callbacks import EvalCallback, NonFiniteLossCallback, NonFiniteLossError, PreemptionCallback
from ttt_lm.train.loop import Callback
from ttt_lm.train.trainer import Trainer

V, T, B = 16, 8, 2


@pytest.fixture
def one_rank_group():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, V)
        self.train_steps = []

    def set_train_step(self, step):
        self.train_steps.append(step)

    def forward(self, ids, labels, nan=False):
        loss = torch.nn.functional.cross_entropy(self.emb(ids).flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss * float("nan") if nan else loss)


class Engine:
    """The part of DeepSpeed's engine the loop uses."""

    def __init__(self):
        self.module = Model()
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.applied = True

    def __call__(self, ids, labels, **kw):
        return self.module(ids, labels, **kw)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.applied = all(torch.isfinite(p.grad).all() for p in self.module.parameters())
        if self.applied:
            self.opt.step()
        self.opt.zero_grad()

    def was_step_applied(self):
        return self.applied

    def get_global_grad_norm(self):
        return 1.0


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, V, (B, T + 1), generator=g)
        yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def make_trainer(callbacks=(), **kw):
    engine = Engine()
    sched = torch.optim.lr_scheduler.LambdaLR(engine.opt, lambda s: 1.0)
    args = dict(engine=engine, scheduler=sched, batches=batches(), device=torch.device("cpu"), max_steps=10,
                grad_accum=2, rank=0, world=1, dp_world=1, callbacks=callbacks)
    args.update(kw)
    return Trainer(**args)


class Recorder(Callback):
    """Records every hook with the step it saw; asks for a stop after ``stop_at``."""

    def __init__(self, stop_at=None, code=None):
        self.calls, self.stop_at, self.code = [], stop_at, code

    def pre_train(self, trainer):
        self.calls.append(("pre_train", trainer.step))

    def pre_step(self, trainer):
        self.calls.append(("pre_step", trainer.step))

    def post_step(self, trainer):
        self.calls.append(("post_step", trainer.step, trainer.record["loss"]))
        if trainer.step == self.stop_at:
            trainer.request_stop(self.code)

    def post_train(self, trainer):
        self.calls.append(("post_train", trainer.step))

    def on_error(self, trainer, exc):
        self.calls.append(("on_error", trainer.step, type(exc).__name__))


def test_callback_sees_every_step_and_can_stop_the_run(one_rank_group):
    rec = Recorder(stop_at=3, code=7)
    trainer = make_trainer().add_callback(rec)
    assert trainer.fit() == 7
    assert trainer.step == 3 and trainer.tokens == 3 * 2 * B * T
    names = [c[0] for c in rec.calls]
    assert names == ["pre_train"] + ["pre_step", "post_step"] * 3 + ["post_train"]
    # pre_step of step k + 1 sees k finished steps, its post_step k + 1
    assert [c[1] for c in rec.calls if c[0] == "pre_step"] == [0, 1, 2]
    assert [c[1] for c in rec.calls if c[0] == "post_step"] == [1, 2, 3]
    losses = [c[2] for c in rec.calls if c[0] == "post_step"]
    assert all(0 < x < 10 for x in losses) and losses[-1] < losses[0]   # it trains
    assert trainer.engine.module.train_steps == [1, 2, 3]


def test_post_train_runs_in_reverse_order_and_max_steps_ends_the_run(one_rank_group):
    order = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def post_train(self, trainer):
            order.append(self.name)

    trainer = make_trainer([Named("a"), Named("b")], max_steps=2)
    assert trainer.fit() == 0 and trainer.step == 2
    assert order == ["b", "a"]


def test_an_error_reaches_on_error_then_propagates(one_rank_group):
    rec = Recorder()

    class Boom(Callback):
        def post_step(self, trainer):
            if trainer.step == 2:
                raise RuntimeError("boom")

    trainer = make_trainer([rec, Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert rec.calls[-1] == ("on_error", 2, "RuntimeError")
    assert ("post_train", 2) not in rec.calls


def test_a_signal_stops_with_the_preemption_exit_code(one_rank_group):
    signalled = {"now": False}
    rec = Recorder()

    class SignalAtStep2(Callback):
        def pre_step(self, trainer):
            signalled["now"] = trainer.step == 1

    trainer = make_trainer([SignalAtStep2(), PreemptionCallback(), rec], signalled=lambda: signalled["now"])
    assert trainer.fit() == PREEMPTED_EXIT_CODE
    assert trainer.step == 2 and trainer.preempted


def test_nonfinite_losses_in_a_row_stop_the_run(one_rank_group):
    nan_steps = {2, 3}
    trainer = make_trainer([NonFiniteLossCallback(2, lambda: "ckpt/step_1")],
                           forward_kwargs=lambda b: {"nan": trainer.step + 1 in nan_steps})
    with pytest.raises(NonFiniteLossError, match=r"2 steps in a row \(steps 2..3.*ckpt/step_1"):
        trainer.fit()
    assert trainer.skipped_total == 2 and trainer.record["skipped"] and trainer.record["grad_norm"] is None


def test_the_validation_loader_is_built_once(one_rank_group):
    built, logged = [], []

    def build():
        built.append(1)
        g = torch.Generator().manual_seed(2)
        for _ in range(5):
            ids = torch.randint(0, V, (B, T + 1), generator=g)
            yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    writer = SimpleNamespace(log=logged.append)
    ev = EvalCallback(build, every=2, n_batches=3, writer=writer)
    trainer = make_trainer([ev], max_steps=6, write=lambda line: None)
    trainer.fit()
    assert len(built) == 1 and len(ev.batches) == 3
    assert [r["step"] for r in logged] == [2, 4, 6] and all(r["kind"] == "val" for r in logged)
    assert logged[-1]["loss"] < logged[0]["loss"]


def _val_batches(n=5):
    g = torch.Generator().manual_seed(2)
    for _ in range(n):
        ids = torch.randint(0, V, (B, T + 1), generator=g)
        yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@pytest.mark.parametrize("max_steps, every, want", [(7, 3, [3, 6, 7]), (6, 3, [3, 6]), (7, 0, [])])
def test_validation_runs_at_the_last_step_too(one_rank_group, max_steps, every, want):
    """A run whose max_steps is not a multiple of eval.every still ends with a validation pass
    (once: not twice when it is a multiple); every = 0 turns validation off altogether."""
    logged, lines = [], []
    ev = EvalCallback(_val_batches, every=every, n_batches=3, writer=SimpleNamespace(log=logged.append))
    make_trainer([ev], max_steps=max_steps, write=lines.append).fit()
    assert [r["step"] for r in logged] == want
    assert len(lines) == len(want)


def test_the_validation_line_says_how_many_tokens_it_covered(one_rank_group):
    logged, lines = [], []
    ev = EvalCallback(_val_batches, every=2, n_batches=3, writer=SimpleNamespace(log=logged.append))
    make_trainer([ev], max_steps=2, write=lines.append).fit()
    assert logged[0]["tokens"] == 3 * B * T
    assert lines == [f"[val] step 2 loss {logged[0]['loss']:.4f} ppl {logged[0]['ppl']:.2f} over {3 * B * T:,} "
                     "tokens (3 batches per rank × 1 data-parallel rank)"]
    # labels at -100 are not counted
    masked = lambda: ({**b, "labels": b["labels"].masked_fill(torch.arange(T) < 2, -100)}  # noqa: E731
                      for b in _val_batches())
    logged.clear()
    ev = EvalCallback(masked, every=1, n_batches=2, writer=SimpleNamespace(log=logged.append))
    make_trainer([ev], max_steps=1, write=lambda line: None).fit()
    assert logged[0]["tokens"] == 2 * B * (T - 2)


@pytest.mark.slow
def test_a_callback_given_to_main_sees_the_steps_and_stops_the_run(tmp_path):
    """End to end (DeepSpeed, one rank): a callback passed to ``ttt_lm.train.main`` runs after the
    built-in ones; its stop request ends the run after that step, which is checkpointed."""
    from tests.train.launch import run
    from ttt_lm.train import checkpoint as ck
    hooks = tmp_path / "hooks.log"
    r = run(str(tmp_path / "run"), ["train.max_steps=8"],
            env={"TTT_TEST_HOOK_LOG": str(hooks), "TTT_TEST_STOP_AT": "3"})
    lines = hooks.read_text().split("\n")[:-1]
    assert lines == ["pre_train 0", "pre_step 0", "post_step 1", "pre_step 1", "post_step 2", "pre_step 2",
                     "post_step 3", "post_train 3"]
    root = str(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in ck.list_checkpoints(root)] == [3]
    assert ck.read_state(ck.find_latest(root))["step"] == 3
    assert "[train]   checkpoint:" in r.output()


@pytest.mark.slow
def test_a_run_validates_at_its_last_step_and_a_rerun_says_it_is_complete(tmp_path):
    """End to end (one rank): a padded vocabulary gets its startup line; max_steps=3 with
    eval.every=2 validates at steps 2 and 3, each line with its token count; running the same
    command again trains nothing and says the run is complete and how to extend it."""
    from tests.train.launch import metrics, run
    d = str(tmp_path / "run")
    args = ["model.vocab_size=96", "train.max_steps=3", "eval.every=2", "eval.batches=2", "checkpoint.at_end=true"]
    out = run(d, args).output()
    assert out.count("[train] model.vocab_size=96 is larger than the tokenizer's vocab_size=64") == 1
    assert "ids 64..95 are padding" in out
    # runner.py's synthetic data: micro-batch 2 × 16 tokens, 2 batches
    assert re.search(r"\[val\] step 2 loss [\d.]+ ppl [\d.]+ over 64 tokens \(2 batches per rank", out)
    assert re.search(r"\[val\] step 3 loss [\d.]+ ppl [\d.]+ over 64 tokens", out)
    assert [(r["step"], r["tokens"]) for r in metrics(d, "val")] == [(2, 64), (3, 64)]
    again = run(d, args, tag="again").output()
    assert "the run is complete:" in again and "is at step 3 and train.max_steps=3" in again
    assert "run the same command with a larger train.max_steps (e.g. train.max_steps=6)" in again
    assert "[val]" not in again and [r["step"] for r in metrics(d, "val")] == [2, 3]
# ---- metrics read every read_every steps, nothing read inside a step ---------------------------

class Collect(Callback):
    def __init__(self):
        self.reads, self.post = [], []

    def on_metrics(self, trainer, records):
        self.reads.append((trainer.step, [r["step"] for r in records]))

    def post_step(self, trainer):
        self.post.append((trainer.step, trainer.record.get("step")))


def test_metrics_are_read_every_read_every_steps_and_at_the_end(one_rank_group):
    col = Collect()
    trainer = make_trainer([col], max_steps=10, read_every=4)
    trainer.fit()
    assert col.reads == [(4, [1, 2, 3, 4]), (8, [5, 6, 7, 8]), (10, [9, 10])]
    # between reads, post_step sees the newest record read (none before the first read)
    assert col.post[:5] == [(1, None), (2, None), (3, None), (4, 4), (5, 4)]
    with pytest.raises(ValueError, match="read_every"):
        make_trainer(read_every=0)


def test_a_callback_that_wants_metrics_gets_a_read_at_its_step(one_rank_group):
    class At3(Callback):
        def wants_metrics(self, trainer):
            return trainer.step == 3

    col = Collect()
    make_trainer([At3(), col], max_steps=5, read_every=100).fit()
    assert col.reads == [(3, [1, 2, 3]), (5, [4, 5])]


def test_nonfinite_losses_stop_the_run_at_the_next_read(one_rank_group):
    """Losses are read every 4 steps: NaN at steps 2 and 3 (limit 2) stops the run at the read of
    step 4, naming steps 2..3."""
    nan_steps = {2, 3}
    trainer = make_trainer([NonFiniteLossCallback(2, lambda: None)], read_every=4,
                           forward_kwargs=lambda b: {"nan": trainer.step + 1 in nan_steps})
    with pytest.raises(NonFiniteLossError, match=r"2 steps in a row \(steps 2..3"):
        trainer.fit()
    assert trainer.step == 4 and trainer.skipped_total == 2 and trainer.nonfinite_run == 0


def test_a_signal_is_seen_at_the_next_read(one_rank_group):
    signalled = {"now": False}

    class SignalAtStep2(Callback):
        def pre_step(self, trainer):
            signalled["now"] = signalled["now"] or trainer.step == 1

    trainer = make_trainer([SignalAtStep2(), PreemptionCallback()], read_every=3,
                           signalled=lambda: signalled["now"])
    assert trainer.fit() == PREEMPTED_EXIT_CODE
    assert trainer.step == 3 and trainer.preempted


SYNCS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def forbid_syncs(monkeypatch):
    """Every way of reading a tensor's values on the host raises (a sync on a GPU)."""
    for name in SYNCS:
        def refuse(self, *a, _name=name, **k):
            raise AssertionError(f"Tensor.{_name} called inside a training step")
        monkeypatch.setattr(torch.Tensor, name, refuse)


class SyncFreeEngine(Engine):
    """The stand-in engine without its own host reads (DeepSpeed's are its own business)."""

    def step(self):
        self.opt.step()
        self.opt.zero_grad()


def test_a_training_step_reads_nothing_from_the_device(one_rank_group):
    """Training steps (grad_accum 2: forward, loss, backward, optimizer, the loss summed on the
    device, the metrics queued) with every host read of a tensor made to raise; the read of the
    queued metrics, with reads allowed, gives both steps' records. The same read with them
    forbidden raises: the patch does catch a read."""
    trainer = make_trainer(engine=SyncFreeEngine(), read_every=100)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.engine.opt, lambda s: 1.0)
    with pytest.MonkeyPatch.context() as mp:
        forbid_syncs(mp)
        trainer.train_step()
        trainer.train_step()
    recs = trainer.read_metrics()
    assert [r["step"] for r in recs] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and not r["skipped"] for r in recs)
    with pytest.MonkeyPatch.context() as mp:
        forbid_syncs(mp)
        trainer.train_step()
        with pytest.raises(AssertionError, match="inside a training step"):
            trainer.read_metrics()
