"""Unit tests of the trainer's pieces, in-process and without DeepSpeed's engine."""
import json
import math
import os
import re

import pytest
import torch

from ttt_lm.config import ExperimentConfig
from ttt_lm.model import LM
from ttt_lm.model.config import ModelConfig
from ttt_lm.train import PREEMPTED_EXIT_CODE
from ttt_lm.train import checkpoint as ck
from ttt_lm.train.config import OptimConfig
from ttt_lm.train.dist import detect_env, export_env
from ttt_lm.train.engine import ParallelConfigError, check_parallel, deepspeed_config
from ttt_lm.train.optim import lr_multiplier, param_groups
from ttt_lm.train.trainer import DEFAULT_CONFIG, check_resume, invariants, parse_args


def tiny_model_cfg(**kw):
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, layer_pattern=["attention"], **kw)


# ---- optimizer ---------------------------------------------------------------------------------

def test_schedules():
    c = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    m = lr_multiplier(c, 104)
    assert [m(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert m(4) == 1.0 and abs(m(54) - 0.55) < 1e-12 and abs(m(104) - 0.1) < 1e-12
    c.schedule = "wsd"
    c.decay_fraction = 0.2
    m = lr_multiplier(c, 100)
    assert m(4) == m(79) == 1.0                 # stable until the last 20 steps
    assert abs(m(90) - 0.55) < 1e-12 and abs(m(100) - 0.1) < 1e-12
    c.schedule = "constant"
    assert lr_multiplier(c, 100)(99) == 1.0
    c.schedule = "linear"
    with pytest.raises(ValueError, match="optim.schedule"):
        lr_multiplier(c, 10)


def test_weight_decay_skips_norms_biases_embeddings():
    model = LM(tiny_model_cfg(tie_embeddings=False))
    model.layers[0].mixer.q_proj.bias = torch.nn.Parameter(torch.zeros(32))
    decay, keep = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in keep["params"]}
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert "embed.weight" in kept and "lm_head.weight" in decayed
    assert "layers.0.mixer.q_proj.bias" in kept and "layers.0.mixer_norm.weight" in kept
    assert all("norm" not in n for n in decayed)
    assert len(decayed) + len(kept) == len(list(model.parameters()))


# ---- engine config -----------------------------------------------------------------------------

def test_deepspeed_config_generated_and_from_file(tmp_path):
    cfg = ExperimentConfig()
    cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.parallel.zero_stage = 4, 3, 2
    cfg.train.precision = "bf16"
    ds = deepspeed_config(cfg, dp_world=2)
    assert ds["train_batch_size"] == 24 and ds["gradient_accumulation_steps"] == 3
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"]
    assert ds["gradient_clipping"] == cfg.optim.grad_clip
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    cfg.parallel.deepspeed_config = str(p)
    ds = deepspeed_config(cfg, dp_world=2)
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_micro_batch_size_per_gpu"] == 4
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16}))
    with pytest.raises(ParallelConfigError, match="train_micro_batch_size_per_gpu=16"):
        deepspeed_config(cfg, dp_world=2)


def test_adamw_is_fused_on_cuda_unless_offloaded(monkeypatch):
    """The choice of torch AdamW's form, made without a GPU: fused for parameters on a CUDA device,
    the default form on the CPU and when DeepSpeed offloads the optimizer to the host; and
    build_engine hands DeepSpeed an optimizer built that way for the model's device."""
    from ttt_lm.train import engine as eng
    from ttt_lm.train.optim import adamw_kwargs
    assert adamw_kwargs("cuda") == adamw_kwargs(torch.device("cuda", 1)) == {"fused": True}
    assert adamw_kwargs("cpu") == adamw_kwargs(None) == {}
    assert adamw_kwargs("cuda", offload=True) == {}
    assert eng.offloads_optimizer({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert not eng.offloads_optimizer({"zero_optimization": {"offload_optimizer": {"device": "none"}}})
    assert not eng.offloads_optimizer(deepspeed_config(ExperimentConfig(), dp_world=1))

    import deepspeed
    got = {}

    def initialize(model, optimizer, config, mpu, lr_scheduler):
        got["opt"], got["config"] = optimizer, config
        return object(), optimizer, None, lr_scheduler(optimizer)

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    cfg = ExperimentConfig()
    model = LM(tiny_model_cfg())
    eng.build_engine(model, cfg, dp_world=1)
    assert not got["opt"].defaults["fused"]                   # CPU parameters
    # parameters on a CUDA device (stood in for: torch's fused AdamW also accepts CPU tensors)
    monkeypatch.setattr(eng, "param_device", lambda m: torch.device("cuda", 0))
    eng.build_engine(model, cfg, dp_world=1)
    assert got["opt"].defaults["fused"] is True
    cfg.parallel.deepspeed_config = "ds.json"
    monkeypatch.setattr(eng, "deepspeed_config", lambda c, w: {"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}})
    eng.build_engine(model, cfg, dp_world=1)
    assert not got["opt"].defaults["fused"]


def test_tensor_parallel_refused_with_message(monkeypatch):
    from ttt_lm.model.registry import builtin_kinds, mixer_class
    # every built-in kind declares a plan: the last built-in kind with its plan removed stands for
    # one without, beside the first (which keeps its plan)
    first, stub = builtin_kinds()[0], builtin_kinds()[-1]
    monkeypatch.setattr(mixer_class(stub), "tp_plan", classmethod(lambda cls, cfg: None))
    cfg = ExperimentConfig()
    cfg.parallel.tensor_parallel = 2
    cfg.model.layer_pattern = [first, stub]
    with pytest.raises(ParallelConfigError, match=rf"layer kind\(s\) \[{re.escape(repr(stub))}\] .* not TP-ready"):
        check_parallel(cfg)
    cfg.model.layer_pattern = [first]
    check_parallel(cfg, world_size=2)
    cfg.parallel.tensor_parallel, cfg.parallel.zero_stage = 1, 0
    with pytest.raises(ParallelConfigError, match="zero_stage must be 1, 2 or 3"):
        check_parallel(cfg)


# ---- launch environment ------------------------------------------------------------------------

def test_env_from_torchrun_slurm_or_nothing(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
              "SLURM_STEP_NUM_TASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    e = detect_env()
    assert (e.rank, e.world_size, e.launcher) == (0, 1, "single")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    # the batch script's shell (no srun step): one process, not rank 0 of 8
    assert detect_env().launcher == "single"
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    e = detect_env()
    assert (e.rank, e.world_size, e.local_rank, e.launcher) == (3, 8, 1, "slurm")
    with pytest.raises(RuntimeError, match="MASTER_ADDR and MASTER_PORT not set"):
        export_env(e)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert detect_env().rank == 5  # torchrun/deepspeed variables win over Slurm's


def test_command_line():
    assert parse_args([]) == (DEFAULT_CONFIG, [])
    assert os.path.isfile(DEFAULT_CONFIG)
    assert parse_args(["optim.lr=1"]) == (DEFAULT_CONFIG, ["optim.lr=1"])
    assert parse_args(["--local_rank=3", "c.yaml", "a.b=1"]) == ("c.yaml", ["a.b=1"])
    assert PREEMPTED_EXIT_CODE not in (0, 1, 2)


# ---- checkpoints -------------------------------------------------------------------------------

class FakeEngine:
    """Writes what engine.save_checkpoint would, or dies half-way."""

    def __init__(self, die=False):
        self.die = die

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        os.makedirs(os.path.join(save_dir, tag))
        with open(os.path.join(save_dir, tag, "model.pt"), "w") as f:
            f.write("x")
        if self.die:
            raise KeyboardInterrupt("killed while saving")


def _save(root, step, die=False, keep=2):
    return ck.save(FakeEngine(die), root, step, {"step": step}, {"loader": {}}, "a: 1\n", rank=0, keep_last=keep)


def test_save_is_atomic_and_keeps_last_k(tmp_path):
    root = str(tmp_path / "checkpoints")
    for s in (1, 2, 3):
        _save(root, s)
    assert [s for s, _ in ck.list_checkpoints(root)] == [2, 3]
    assert open(os.path.join(root, "latest")).read().strip() == "step_00000003"
    with pytest.raises(KeyboardInterrupt):
        _save(root, 4, die=True)
    # the interrupted save left only a .tmp- dir; latest and resume still name step 3
    assert os.path.isdir(os.path.join(root, ".tmp-step_00000004"))
    assert ck.find_latest(root).endswith("step_00000003")
    assert ck.resolve(str(tmp_path)).endswith("step_00000003")
    _save(root, 4)  # a later save of the same step replaces the leftover
    assert ck.find_latest(root).endswith("step_00000004")
    assert not any(n.startswith((".tmp-", ".trash-")) for n in os.listdir(root))
    # a `latest` naming a checkpoint that is gone falls back to the newest complete one
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step_00000009\n")
    assert ck.find_latest(root).endswith("step_00000004")
    rs = torch.load(os.path.join(root, "step_00000004", ck.rank_file(0)), weights_only=False)
    assert set(rs["rng"]) >= {"python", "numpy", "torch"}


def test_resume_checks_what_must_not_change():
    cfg = ExperimentConfig()
    man = {"vocab_size": 4096, "tokenizer": "tok.model"}
    saved = {"invariants": invariants(cfg, man), "dp_world": 2}
    check_resume(saved, invariants(cfg, man), "ck", 2)
    cfg.model.kernel_backend = "torch"  # chooses kernels, not the model: allowed
    check_resume(saved, invariants(cfg, man), "ck", 2)
    cfg.model.d_model = 512
    with pytest.raises(ck.CheckpointError, match=r"model.d_model: 256 -> 512"):
        check_resume(saved, invariants(cfg, man), "ck", 2)
    # the data is its manifest's checksum, not its path: the same data elsewhere resumes, other
    # data under the same path does not
    man = {**man, "checksum": "abc"}
    saved = {"invariants": invariants(ExperimentConfig(), man), "dp_world": 2}
    for path in (os.path.abspath("data/shakespeare"), "/scratch/job1/shakespeare", "data/shakespeare/"):
        cfg = ExperimentConfig()
        cfg.data.path = path
        check_resume(saved, invariants(cfg, man), "ck", 2)
    with pytest.raises(ck.CheckpointError, match=r"data \(manifest checksum\): 'abc' at 'data/shakespeare' -> "
                                                 r"'def' at 'data/shakespeare'"):
        check_resume(saved, invariants(ExperimentConfig(), {**man, "checksum": "def"}), "ck", 2)
    with pytest.raises(ck.CheckpointError, match="vocab_size: 4096 -> 8192"):
        check_resume(saved, invariants(ExperimentConfig(), {**man, "vocab_size": 8192}), "ck", 2)



def test_resume_on_other_rank_count_or_global_batch_is_accepted_with_a_note(tmp_path):
    """Another number of data-parallel ranks and another global batch are both resumed (the data
    order is a sequence of samples); a changed global batch is said in one line."""
    from ttt_lm.config import save_config
    from ttt_lm.train.trainer import global_batch_note
    old = ExperimentConfig()
    old.train.micro_batch_size, old.train.grad_accum = 4, 2
    save_config(old, str(tmp_path / "config.yaml"))
    man = {"vocab_size": 4096, "tokenizer": "tok.model"}
    saved = {"invariants": invariants(old, man), "dp_world": 2}
    cfg = ExperimentConfig()
    cfg.train.micro_batch_size, cfg.train.grad_accum = 4, 4       # 4 × 4 × 1 = 4 × 2 × 2
    check_resume(saved, invariants(cfg, man), str(tmp_path), 1, cfg)
    assert global_batch_note(str(tmp_path), cfg, 2, 1) is None
    cfg.train.grad_accum = 1                                      # 4 × 1 × 4 = 16 as well
    assert global_batch_note(str(tmp_path), cfg, 2, 4) is None
    check_resume(saved, invariants(cfg, man), str(tmp_path), 1, cfg)
    note = global_batch_note(str(tmp_path), cfg, 2, 1)            # 4 × 1 × 1
    assert note.startswith("the global batch changes from 16 to 4 sequences") and "\n" not in note
    with pytest.raises(ck.CheckpointError, match="cannot read .*config.yaml"):
        global_batch_note(str(tmp_path / "missing"), cfg, 2, 1)


def test_resume_accepts_a_checkpoint_older_than_a_new_config_key():
    """A key added to the schema after a checkpoint was written counts as its default; a
    non-default value for it is a change."""
    man = {"vocab_size": 4096, "tokenizer": "tok.model"}
    saved = {"invariants": invariants(ExperimentConfig(), man), "dp_world": 1}
    del saved["invariants"]["model"]["reset_at_doc_boundaries"]
    check_resume(saved, invariants(ExperimentConfig(), man), "ck", 1)
    cfg = ExperimentConfig()
    cfg.model.reset_at_doc_boundaries = True
    with pytest.raises(ck.CheckpointError, match="reset_at_doc_boundaries: False -> True"):
        check_resume(saved, invariants(cfg, man), "ck", 1)


def test_preemption_signals_set_the_flag():
    import signal
    from ttt_lm.train.preempt import PreemptionFlag
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        flag = PreemptionFlag().install()
        try:
            assert not flag.requested
            os.kill(os.getpid(), sig)  # handled synchronously in the main thread: no exit
            assert flag.requested and flag.signum == sig
        finally:
            flag.uninstall()


def test_reshard_names_missing_zero_files(tmp_path):
    from ttt_lm.train.checkpoint.reshard import consolidate, optim_files
    with pytest.raises(ck.CheckpointError, match="holds no ZeRO optimizer file for tensor-parallel rank 0"):
        optim_files(str(tmp_path))
    for r in (0, 2):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ck.CheckpointError, match=r"are for data-parallel ranks \[0, 2\]; some are missing"):
        consolidate(str(tmp_path))
    (tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ck.CheckpointError, match="holds no model-states file"):
        consolidate(str(tmp_path))


def test_startup_notes_for_a_padded_vocabulary_and_a_finished_run():
    from ttt_lm.train.trainer import finished_note, vocab_padding_note
    note = vocab_padding_note(4096, 2000, "data/tiny")
    assert note.startswith("model.vocab_size=4096 is larger than the tokenizer's vocab_size=2000 (data/tiny)")
    assert "ids 2000..4095 are padding" in note and "never produce them" in note
    done = finished_note("runs/tiny/checkpoints/step_00000200", 200, 200)
    assert done.startswith("the run is complete: runs/tiny/checkpoints/step_00000200 is at step 200 and "
                           "train.max_steps=200")
    assert "train.max_steps=400" in done and "resumes from step 200" in done
