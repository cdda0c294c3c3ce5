"""The CheckpointManager (``ttt_lm.train.checkpoint.resume``) in one process, without DeepSpeed: checkpoints
written by ``ttt_lm.train.checkpoint.save`` with a stand-in engine, a stand-in loader that records
what it is given. Each step of the resume — select, verify, check, set aside, loader, load or
reshard, loader state, RNG, optimizer overrides — is asserted on its own; the real engines and
loaders are exercised end to end by the dist tests (test_resume_dp, test_resume_elastic,
test_resume_tp). Also: the tensor-parallel cut and join of the resharding, and the length of the
trainer's setup."""
import inspect
import os
import random
from types import SimpleNamespace

import pytest
import torch

from ttt_lm.config import ExperimentConfig, save_config, to_yaml
from ttt_lm.train import checkpoint as ck
from ttt_lm.train.checkpoint import reshard, resume
from ttt_lm.train.checkpoint.resume import CheckpointManager, invariants

MAN = {"vocab_size": 4096, "tokenizer": "tok.model", "checksum": "abc"}


class Engine:
    """DeepSpeed's save/load, as files: what was loaded is recorded."""

    def __init__(self):
        self.loaded = None

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag))
        with open(os.path.join(save_dir, tag, "model.pt"), "w") as f:
            f.write("weights")

    def load_checkpoint(self, ckpt, tag, load_optimizer_states, load_lr_scheduler_states):
        self.loaded = ckpt
        return os.path.join(ckpt, tag), {}


class Loader:
    total_streams = 2

    def __init__(self, *args, **kw):
        self.args, self.kw, self.state, self.merged = args, kw, None, None

    def load_state_dict(self, sd):
        self.state = sd

    def load_merged_state(self, sd):
        self.merged = sd


class Data:
    """The data pipeline's interface, recording what the manager builds and merges."""

    def __init__(self):
        self.merged_from = None

    def build_train_loader(self, *args, **kw):
        return Loader(*args, **kw)

    def merge_states(self, states):
        self.merged_from = states
        return {"merged": len(states)}


def _groups(rank=0, dp=1, tp=1, cp=1):
    return SimpleNamespace(rank=rank, dp_rank=rank // tp, dp_size=dp, tp_rank=rank % tp, tp_size=tp, cp_size=cp)


def _cfg(**train):
    cfg = ExperimentConfig()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def _save(root, step, cfg, dp=1, tp=1, cp=1, ranks=1, nonfinite=0, pdims=None):
    """A checkpoint as the trainer writes it: trainer state, every rank's loader state, config."""
    state = {"step": step, "tokens": 100 * step, "skipped_steps": 1, "nonfinite_in_a_row": nonfinite,
             "dp_world": dp, "invariants": invariants(cfg, MAN), "tensor_parallel": tp, "context_parallel": cp,
             "partition_dims": pdims if pdims is not None else ({"embed.weight": 0} if tp > 1 else {})}
    loader = {"total_streams": 2, "samples": 8 * step, "dp_rank": 0, "dp_world": dp}
    path = ck.save(Engine(), root, step, state, {"loader": loader}, to_yaml(cfg), rank=0, keep_last=0)
    for r in range(1, ranks):  # the other ranks' files (written by them in a real run)
        torch.save({"loader": dict(loader, dp_rank=r // tp), "rng": ck.rng_state()}, os.path.join(path, ck.rank_file(r)))
    return path


def _trainer(loader):
    """A Trainer with nothing to train: what its load_state_dict puts back into ``loader`` and the RNGs."""
    from ttt_lm.train.trainer import Trainer
    return Trainer(engine=None, scheduler=None, loader=loader, device="cpu", max_steps=10, grad_accum=1, rank=0,
                   world=1, dp_world=1)


def _said():
    lines = []
    return lines, lines.append


def test_a_new_run_has_nothing_to_resume(tmp_path):
    cfg = _cfg()
    m = CheckpointManager(cfg, str(tmp_path / "checkpoints"), _groups())
    assert m.select(invariants(cfg, MAN)) is None and not m.resharded
    loader = m.build_loader(Data())
    assert loader.args[2:] == (0, 1) and loader.kw == {}  # the config's streams, this rank's share
    assert m.restore(Engine(), loader, None, []) == resume.Restored()
    assert loader.state is None and loader.merged is None


def test_same_layout_loads_this_ranks_state_and_rng(tmp_path):
    cfg = _cfg()
    root = str(tmp_path / "checkpoints")
    random.seed(7)
    path = _save(root, 3, cfg)
    expected = [random.random() for _ in range(3)]  # what follows the saved RNG state
    random.seed(99)
    lines, say = _said()
    m = CheckpointManager(cfg, root, _groups(), say)
    assert m.select(invariants(cfg, MAN)) == path and not m.resharded
    loader = m.build_loader(Data())
    assert loader.kw == {"total_streams": 2}  # the run's streams, fixed when it started
    eng = Engine()
    at = m.restore(eng, loader, None, [])
    assert eng.loaded == path and loader.state is None   # the trainer puts the rest back
    _trainer(loader).load_state_dict(at.state)
    assert loader.state["samples"] == 24 and loader.merged is None
    assert [random.random() for _ in range(3)] == expected
    assert (at.step, at.tokens, at.skipped_total, at.nonfinite_run, at.changes) == (3, 300, 1, 0, [])
    assert at.last_bytes == ck.checkpoint_bytes(path) and lines == []


def test_newest_that_verifies_is_taken_and_newer_ones_are_set_aside(tmp_path):
    cfg = _cfg()
    root = str(tmp_path / "checkpoints")
    _save(root, 2, cfg)
    bad = _save(root, 4, cfg)
    with open(os.path.join(bad, "ds", "model.pt"), "w") as f:
        f.write("WEIGHTS")  # same size, another digest
    _save(root, 6, cfg, nonfinite=2)
    lines, say = _said()
    m = CheckpointManager(cfg, root, _groups(), say)
    assert m.select(invariants(cfg, MAN)).endswith("step_00000002")
    assert any("passing over" in s and "step_00000006" in s and "non-finite" in s for s in lines)
    assert any("passing over" in s and "step_00000004" in s and "sha256" in s for s in lines)
    # both newer ones are kept, under names that neither resume nor pruning picks
    assert sorted(os.listdir(root)) == ["latest", "rejected-step_00000004", "rejected-step_00000006",
                                        "step_00000002"]


def test_refusals_are_marked_alike_and_name_the_change(tmp_path):
    cfg = _cfg()
    root = str(tmp_path / "checkpoints")
    _save(root, 2, cfg)
    other = _cfg()
    other.model.d_model = 512
    with pytest.raises(ck.CheckpointError, match=r"model.d_model: 256 -> 512") as e:
        CheckpointManager(other, root, _groups()).select(invariants(other, MAN))
    assert e.value.same_on_every_rank
    cp = _cfg()
    cp.parallel.context_parallel = 2
    with pytest.raises(ck.CheckpointError, match=r"context_parallel=1 and this run has 2; resuming on another "
                                                  r"context-parallel size is not supported") as e:
        CheckpointManager(cp, root, _groups(cp=2)).select(invariants(cp, MAN))
    assert e.value.same_on_every_rank
    streams = _cfg()
    streams.data.streams = 3
    m = CheckpointManager(streams, root, _groups())
    m.select(invariants(streams, MAN))
    with pytest.raises(ck.CheckpointError, match="reads 2 data streams .* set data.streams=2") as e:
        m.build_loader(Data())
    assert e.value.same_on_every_rank


def test_a_tp_checkpoint_without_partition_dims_stays_on_its_tp_size(tmp_path):
    cfg = _cfg()
    root = str(tmp_path / "checkpoints")
    _save(root, 2, cfg, tp=2, ranks=2, pdims={})
    with pytest.raises(ck.CheckpointError, match="did not record how each parameter is split; resume with "
                                                  "tensor_parallel=2"):
        CheckpointManager(cfg, root, _groups()).select(invariants(cfg, MAN))
    # on its own size it resumes as before
    cfg.parallel.tensor_parallel = 2
    assert CheckpointManager(cfg, root, _groups(tp=2)).select(invariants(cfg, MAN)) is not None


def test_another_layout_reshards_merges_the_loaders_and_reseeds(tmp_path, monkeypatch):
    """2 data-parallel ranks → 1 × tensor parallel 2 (rank 1 here): the engine is resharded for TP
    rank 1 of 2, every old rank's loader state merged, the RNG seeded from seed, rank and step."""
    old = _cfg()
    root = str(tmp_path / "checkpoints")
    path = _save(root, 5, old, dp=2, ranks=2)
    cfg = _cfg(micro_batch_size=16)  # 16 × 1 × 1 = 8 × 1 × 2: the global batch is kept
    cfg.parallel.tensor_parallel = 2
    calls = []
    monkeypatch.setattr(resume, "load_resharded", lambda eng, c, r, s: calls.append((c, r, s)) or ck.read_state(c))
    lines, say = _said()
    m = CheckpointManager(cfg, root, _groups(rank=1, dp=1, tp=2), say)
    assert m.select(invariants(cfg, MAN)) == path and m.resharded
    data = Data()
    loader = m.build_loader(data)
    assert loader.args[2:] == (0, 1) and loader.kw == {"total_streams": 2}
    at = m.restore(Engine(), loader, None, [])
    assert calls == [(path, 1, 2)] and at.step == 5
    trainer = _trainer(loader)
    trainer.load_state_dict(at.state)
    assert trainer.step == 5 and trainer.tokens == 500 and trainer.skipped_total == 1
    assert [s["dp_rank"] for s in data.merged_from] == [0, 1] and loader.merged == {"merged": 2}
    assert loader.state is None
    draw = random.random()
    resume.seed_all(cfg.train.seed + 1 + 1 + 1_000_003 * 5)
    assert random.random() == draw
    assert lines == [f"{path} was written by 2 data-parallel rank(s), this run has 1 data-parallel rank(s) × "
                     "tensor parallel 2: optimizer state resharded, the data order continues (2 streams)"]
    # a pipeline that cannot merge its states cannot change layout
    m = CheckpointManager(cfg, root, _groups(rank=1, dp=1, tp=2))
    m.select(invariants(cfg, MAN))
    with pytest.raises(ck.CheckpointError, match="on another parallel layout: this data pipeline cannot convert"):
        m.build_loader(SimpleNamespace(build_train_loader=Loader))


def test_changed_optimizer_settings_are_put_in_force_and_said(tmp_path):
    old = _cfg()
    root = str(tmp_path / "checkpoints")
    _save(root, 4, old)
    cfg = _cfg()
    cfg.optim.lr = old.optim.lr / 10
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=old.optim.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    lines, say = _said()
    m = CheckpointManager(cfg, root, _groups(), say)
    m.select(invariants(cfg, MAN))
    at = m.restore(Engine(), m.build_loader(Data()), sched, [0.0])
    assert at.changes == [f"optim.lr: {old.optim.lr} -> {cfg.optim.lr}"]
    assert opt.param_groups[0]["lr"] == pytest.approx(cfg.optim.lr)
    assert lines == [f"resumed with changed optimizer settings, in force from step 5: optim.lr: {old.optim.lr} -> "
                     f"{cfg.optim.lr}"]


def test_global_batch_change_is_said_once(tmp_path):
    old = _cfg()
    root = str(tmp_path / "checkpoints")
    _save(root, 2, old)
    save_config(old, str(tmp_path / "config.yaml"))
    cfg = _cfg(grad_accum=2)
    lines, say = _said()
    CheckpointManager(cfg, root, _groups(), say).select(invariants(cfg, MAN))
    assert lines == ["the global batch changes from 8 to 16 sequences (micro_batch_size × grad_accum × data-parallel "
                     "ranks): the data order goes on from the checkpoint's sample position, each step now reads 16"]


@pytest.mark.parametrize("stride", [1, 2])
def test_tp_slices_join_back_to_the_full_tensor(stride):
    from ttt_lm.parallel.tensor_parallel import join_shards
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    for p in (1, 2, 4):
        if 8 % (p * stride):
            continue
        parts = [reshard.tp_slice(full, 0, r, p, stride) for r in range(p)]
        assert all(t.shape == (8 // p, 3) for t in parts)
        assert torch.equal(join_shards(parts, 0, stride), full)
    # fused [a | b]: rank 0 of 2 keeps the first half of each part
    assert reshard.tp_slice(full, 0, 0, 2, 2).tolist() == full[[0, 1, 4, 5]].tolist()
    assert reshard.tp_slice(full, None, 1, 2) is full
    with pytest.raises(ck.CheckpointError, match="not divisible by tensor_parallel=3"):
        reshard.tp_slice(full, 0, 0, 3)


def test_tp_slices_of_unequal_fused_parts_join_back():
    """A fused dimension of parts of unequal sizes (stride given as the sizes, ``fused_parts``):
    rank r keeps its chunk of each part; the parallel model's ``_shard`` cuts the same slices and
    ``join_shards`` inverts both; a part that the TP size does not divide is refused."""
    from types import SimpleNamespace
    from ttt_lm.parallel.tensor_parallel import _shard, join_shards
    full = torch.arange(12 * 2, dtype=torch.float32).view(12, 2)
    sizes = (4, 2, 6)
    parts = [reshard.tp_slice(full, 0, r, 2, sizes) for r in range(2)]
    assert parts[0][:, 0].tolist() == full[[0, 1, 4, 6, 7, 8], 0].tolist()
    assert parts[1][:, 0].tolist() == full[[2, 3, 5, 9, 10, 11], 0].tolist()
    assert torch.equal(join_shards(parts, 0, sizes), full)
    assert not torch.equal(torch.cat(parts), full)
    for r in range(2):
        ctx = SimpleNamespace(rank=r, world_size=2)           # what _shard reads of a TPContext
        assert torch.equal(_shard(full, 0, ctx, sizes), parts[r])
    with pytest.raises(ck.CheckpointError, match=r"fused parts \[4, 2, 6\] is not divisible by tensor_parallel=4"):
        reshard.tp_slice(full, 0, 0, 4, sizes)


def test_consolidate_all_joins_tp_slices_by_partition_dims(tmp_path, monkeypatch):
    """Two TP ranks' consolidated states → the single-rank parameters (moments joined alike,
    replicated ones from rank 0) → cut again for another TP size, by the new model's marks."""
    full = {"w": torch.randn(4, 6), "b": torch.randn(4), "g": torch.randn(6)}
    dims = {"w": 0, "b": 0}

    def rank_part(r):
        cut = {n: (t.chunk(2, 0)[r] if n in dims else t) for n, t in full.items()}
        return {"params": {n: {"fp32": t, "exp_avg": 2 * t, "exp_avg_sq": t * t} for n, t in cut.items()},
                "step": torch.tensor(3.0)}

    monkeypatch.setattr(reshard, "read_state", lambda c: {"tensor_parallel": 2, "partition_dims": dims})
    monkeypatch.setattr(reshard, "consolidate", lambda ds, r: rank_part(r))
    got = reshard.consolidate_all(str(tmp_path))
    for n, t in full.items():
        assert torch.equal(got["params"][n]["fp32"], t) and torch.equal(got["params"][n]["exp_avg"], 2 * t)
    model = torch.nn.Module()
    for n, t in full.items():
        model.register_parameter(n, torch.nn.Parameter(t.clone()))
    model.w.partition_dim = 0
    model.b.partition_dim = 0
    mine = reshard.for_tp_rank(got, model, 1, 2)
    assert torch.equal(mine["params"]["w"]["exp_avg_sq"], full["w"][2:] ** 2)
    assert torch.equal(mine["params"]["g"]["fp32"], full["g"])
    monkeypatch.setattr(reshard, "read_state", lambda c: {"tensor_parallel": 2})
    with pytest.raises(ck.CheckpointError, match="records no partition_dims"):
        reshard.consolidate_all(str(tmp_path))


def test_the_trainer_setup_fits_on_a_screen():
    from ttt_lm.train import trainer
    lines = inspect.getsource(trainer.build).splitlines()   # what Trainer.from_config runs
    assert len(lines) <= 100, f"build is {len(lines)} lines: move a build step into a function of its own"


def test_the_trainer_state_round_trips_through_the_checkpointer(tmp_path):
    """Trainer.state_dict is the run's whole resumable state: the counters, the loader's position,
    the RNGs and a callback's own state come back through one Checkpointer save and load."""
    from ttt_lm.train.checkpoint.checkpointer import TRAIN_STATE, Checkpointer
    from ttt_lm.train.loop import Callback

    class Counting(Callback):
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    class StatefulLoader(Loader):
        def state_dict(self):
            return {"total_streams": 2, "samples": 40}

    cfg = _cfg()
    root = str(tmp_path / "checkpoints")
    counting = Counting()
    counting.n = 3
    trainer = _trainer(StatefulLoader())
    trainer.add_callback(counting)
    trainer.step, trainer.tokens, trainer.skipped_total, trainer.nonfinite_run = 5, 500, 2, 0
    record = {"dp_world": 1, "invariants": invariants(cfg, MAN), "tensor_parallel": 1, "context_parallel": 1,
              "partition_dims": {}}
    random.seed(5)
    path = Checkpointer(Engine(), root, to_yaml(cfg), record, rank=0, keep_last=0).save(5, {TRAIN_STATE: trainer})
    expected = [random.random() for _ in range(2)]
    saved = ck.read_state(path)
    assert (saved["step"], saved["tokens"], saved["skipped_steps"], saved["nonfinite_in_a_row"]) == (5, 500, 2, 0)
    assert saved["callbacks"] == {"Counting": {"n": 3}} and saved["dp_world"] == 1
    assert "rng" not in saved and "loader" not in saved   # per rank: in rank_00000.pt
    assert torch.load(os.path.join(path, ck.rank_file(0)), weights_only=False)["loader"]["samples"] == 40

    random.seed(99)
    m = CheckpointManager(cfg, root, _groups())
    assert m.select(invariants(cfg, MAN)) == path
    loader = m.build_loader(Data())
    again, back = Counting(), _trainer(loader)
    back.add_callback(again)
    at = Checkpointer(Engine(), root, to_yaml(cfg), record, rank=0, keep_last=0, manager=m).load(
        {TRAIN_STATE: back}, loader, None, [])
    assert at.step == 5 and (back.step, back.tokens, back.skipped_total, back.nonfinite_run) == (5, 500, 2, 0)
    assert again.n == 3 and loader.state == {"total_streams": 2, "samples": 40}
    assert [random.random() for _ in range(2)] == expected
