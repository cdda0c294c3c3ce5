"""A training step with DeepSpeed's real engine (one gloo rank, CPU, ZeRO-1, bf16 as on a GPU) and
the LM with its chunked loss: every host read of a tensor made inside the step is recorded with
the code that made it. None may come from ttt-lm's own code (the model, the loss, the loop);
DeepSpeed's optimizer step makes its own (its overflow flag and its gradient-norm check), which are
listed so that a change in them is seen."""
import os
import traceback

import pytest
import torch
import torch.distributed as tdist

from tests.distributed import free_port

SYNCS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


@pytest.fixture
def ds_one_rank(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                     LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    from ttt_lm.train.dist import init_distributed
    init_distributed("cpu")
    yield
    tdist.destroy_process_group()


def _origin(stack) -> str:
    """The first frame, from the innermost outwards, that is neither torch's nor this file's."""
    for fr in reversed(stack):
        f = fr.filename.replace(os.sep, "/")
        if "/torch/" in f or f.endswith("test_step_sync.py"):
            continue
        return f"{f.split('/site-packages/')[-1] if '/site-packages/' in f else os.path.relpath(f)}:{fr.lineno}"
    return "?"


def test_no_host_read_of_ttt_lm_inside_a_deepspeed_step(ds_one_rank):
    from ttt_lm.config import ExperimentConfig
    from ttt_lm.model import LM
    from ttt_lm.train.engine import build_engine
    from ttt_lm.train.trainer import Trainer

    from tests.model.mixer_checks import preset_config

    cfg = ExperimentConfig()
    # the default preset's hybrid (a TTT layer and attention) at the shared tests' section sizes
    cfg.model = preset_config("tiny", 4, vocab_size=64, d_model=32, n_layers=2, n_heads=2, loss_chunk_size=5)
    cfg.train.precision = "bf16"
    torch.manual_seed(0)
    engine, sched = build_engine(LM(cfg.model), cfg, dp_world=1)

    def batches():
        g = torch.Generator().manual_seed(1)
        while True:
            ids = torch.randint(0, 64, (2, 9), generator=g)
            yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    trainer = Trainer(engine=engine, scheduler=sched, batches=batches(), device=torch.device("cpu"), max_steps=10,
                      grad_accum=2, rank=0, world=1, dp_world=1, read_every=100)
    trainer.train_step()   # the first step builds DeepSpeed's buffers
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        for name in SYNCS:
            orig = getattr(torch.Tensor, name)

            def record(self, *a, _name=name, _orig=orig, **k):
                seen.append((_name, _origin(traceback.extract_stack()[:-1])))
                return _orig(self, *a, **k)
            mp.setattr(torch.Tensor, name, record)
        trainer.train_step()
        trainer.train_step()
        n_step = len(seen)
        recs = trainer.read_metrics()
    ours = [s for s in seen[:n_step] if "deepspeed/" not in s[1]]
    assert not ours, f"host reads inside the training step from ttt-lm's code: {ours}"
    # DeepSpeed's own, per step (ZeRO-1, bf16): the overflow flag's .item() and the checks of the
    # gradient norm's finiteness
    assert n_step and all("deepspeed/" in s[1] for s in seen[:n_step])
    # the recorder does see reads: the read of the queued metrics is one, in the loop
    assert [s for s in seen[n_step:] if "ttt_lm/train/trainer.py" in s[1]]
    assert [r["step"] for r in recs] == [1, 2, 3] and all(r["loss"] > 0 and not r["skipped"] for r in recs)
