"""A training run: DeepSpeed engine, checkpoints, exact resume, preemption and metrics.

``main(argv)`` is what ``train.py`` runs; ``train(cfg)`` runs a resolved ExperimentConfig and
returns the process exit status (0, or PREEMPTED_EXIT_CODE after a preemption checkpoint).

``_train`` builds the pieces (process groups, model, engine, loaders, resume) and hands them to
``ttt_lm.train.loop.Trainer``, whose ``fit()`` runs the steps; metrics, evaluation, the
non-finite-loss stop, preemption and checkpoints are its callbacks (``ttt_lm.train.callbacks``).
One step = ``train.grad_accum`` micro-batches per rank, then one optimizer update. With
``parallel.tensor_parallel`` = p > 1 the model is built whole from the same seed on every rank,
then ``parallelize_tp`` keeps this rank's slice; the p ranks of a TP group read the same batches
(the loaders are split over the world / p data-parallel ranks). With
``parallel.context_parallel`` = c > 1 the c ranks of a CP group also read the same batches and each
computes its contiguous slice of every row (``ttt_lm.parallel.cp_model.ContextParallelLM``); DeepSpeed
averages gradients over the dp × c ranks. A step whose
loss is NaN/Inf on any rank is skipped: DeepSpeed sees a non-finite gradient norm and drops the
update (optimizer state and the lr schedule do not move); the loop counts it and stops with
NonFiniteLossError after ``train.max_nonfinite_steps`` of them in a row. No checkpoint is written
while the last step's loss was non-finite, so the newest checkpoint is always one saved after a
finite loss; the error names it, and a rerun resumes from it.

Startup, in order: the SIGTERM/SIGUSR1 handler (installed by ``ttt_lm.train.main`` before the heavy
imports; a signal during startup ends the run with PREEMPTED_EXIT_CODE and nothing to save), the
config check, the process group, the run directory's lock (``ttt_lm.train.lock``: one run per
``train.run_dir``), removal of what killed saves left behind, the choice of checkpoint (the newest
that verifies, ``ttt_lm.train.checkpoint.select``) and the resume checks. A resumed run takes its
optimizer hyperparameters from its own config (``ttt_lm.train.optim.apply_hyperparameters``) and
says which changed.

A checkpoint written on another number of data-parallel ranks (tensor- and context-parallel
sizes unchanged) is resumed, with the same or another global batch (micro-batch × grad_accum ×
data-parallel ranks; another one is said in one line): ``ttt_lm.train.reshard`` rebuilds the ZeRO
optimizer state for the new partition count, and the loader states of all old ranks are merged
(``ttt_lm.data.merge_states``) so that the global sample order continues at the next sample
(docs/training.md "Resuming"). Before every step the shards it reads are verified (``_DataStop``);
a bad one stops the run like a preemption, with a checkpoint, before the step that would read it.
"""
from __future__ import annotations

import importlib.util
import os
import random
import sys
from typing import Optional, Sequence

import numpy as np

from ttt_lm.config import ConfigError, load_config, save_config, to_yaml
from ttt_lm.train.callbacks import NonFiniteLossError  # noqa: F401 - raised by a callback; main() reports it
from ttt_lm.train.preempt import PREEMPTED_EXIT_CODE, PreemptionFlag

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "tiny.yaml")
#: model-config keys that may differ on resume: they choose kernels, not the model's shape
RUNTIME_MODEL_KEYS = ("kernel_backend", "attention.backend", "compile", "compile_backend", "loss_chunk_size")


def _pos(batch: dict):
    """Position of each token in its document (0 at a document's first token), which the model
    uses to reset its state at document boundaries when model.reset_at_doc_boundaries is set.
    Kept where the loader made it; ``LM.forward`` moves it to the model's device and checks it and
    builds the document layout there, with one host read per batch (``ttt_lm.model.docs``)."""
    return batch.get("position_ids")


def parse_args(argv: Sequence[str]):
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment instead
    argv = [a for a in argv if not a.startswith("--local_rank")]
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python train.py [config.yaml] [dotted.key=value ...]\n"
              f"  with no config, runs {os.path.relpath(DEFAULT_CONFIG)} (tiny hybrid on the bundled corpus, CPU)")
        sys.exit(0)
    path = DEFAULT_CONFIG
    if argv and "=" not in argv[0]:
        path = argv.pop(0)
    return path, argv


def main(argv: Optional[Sequence[str]] = None, data_api=None, preempt: Optional[PreemptionFlag] = None,
         callbacks: Sequence = ()) -> int:
    path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    from ttt_lm.train.checkpoint import CheckpointError
    from ttt_lm.data import DataError
    from ttt_lm.train.engine import ParallelConfigError
    try:
        cfg = load_config(path, overrides)
        return train(cfg, data_api=data_api, preempt=preempt, callbacks=callbacks)
    except (ConfigError, CheckpointError, ParallelConfigError, NonFiniteLossError, DataError) as e:
        # an error that every rank raises alike (the config, the resume checks) is said once, by rank 0
        alike = isinstance(e, (ConfigError, ParallelConfigError)) or getattr(e, "same_on_every_rank", False)
        if not alike or int(os.environ.get("RANK", "0")) == 0:
            # on a line of its own: a run that fails mid-way has a progress bar on the last line
            print(f"{chr(10) if isinstance(e, (DataError, NonFiniteLossError)) else ''}error: {e}", file=sys.stderr,
                  flush=True)
        return 2 if isinstance(e, (ConfigError, ParallelConfigError)) else 1


def vocab_padding_note(model_vocab: int, tokenizer_vocab: int, data_path: str) -> str:
    """The startup line of a model whose vocabulary is larger than its tokenizer's (padding, e.g.
    to a multiple of 64 for the matrix units, is legitimate; the extra rows are never a target)."""
    return (f"model.vocab_size={model_vocab} is larger than the tokenizer's vocab_size={tokenizer_vocab} "
            f"({data_path}): ids {tokenizer_vocab}..{model_vocab - 1} are padding that no data holds; generation "
            f"and the evals never produce them")


def finished_note(ckpt: str, step: int, max_steps: int) -> str:
    """What a rerun of a finished run says: nothing is left to train, and how to train further."""
    return (f"the run is complete: {ckpt} is at step {step} and train.max_steps={max_steps}, so there is nothing "
            f"to train. To train further, run the same command with a larger train.max_steps (e.g. "
            f"train.max_steps={2 * max(step, 1)}): the run resumes from step {step}, and the learning-rate "
            f"schedule, unless optim.total_steps fixes its length, stretches to the new total")


# ---- resume checks ---------------------------------------------------------------------------

def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def invariants(cfg, manifest: dict) -> dict:
    """What a resumed run must share with the checkpoint it resumes. ``tensor_parallel`` is among
    them: DeepSpeed writes the module and the ZeRO state per TP rank, sliced for that TP size; so
    is ``context_parallel``: ZeRO shards over data_parallel × context_parallel ranks."""
    from omegaconf import OmegaConf
    model = _flat(OmegaConf.to_container(OmegaConf.structured(cfg.model)))
    for k in RUNTIME_MODEL_KEYS:
        model.pop(k, None)
    # the data is identified by its manifest's checksum (tokenizer and every shard's digest), not by
    # its path: the same data under another path (absolute, or copied to node-local scratch) is
    # the same data; data_path is kept for the record only
    from ttt_lm.data.remote import is_remote
    data_path = cfg.data.path if is_remote(cfg.data.path) else os.path.normpath(cfg.data.path)
    return {"model": model, "data_path": data_path, "data_checksum": manifest.get("checksum"),
            "vocab_size": manifest.get("vocab_size"),
            "tokenizer": manifest.get("tokenizer_sha256") or manifest.get("tokenizer"),
            "tensor_parallel": cfg.parallel.tensor_parallel, "context_parallel": cfg.parallel.context_parallel}


def check_resume(saved: dict, now: dict, ckpt: str, dp_world: int = None, cfg_now=None) -> None:
    """Refuse a resume that cannot continue the run: another model, tokenizer, data, or tensor-
    or context-parallel size. The number of data-parallel ranks and the global batch may change
    (``global_batch_note``); ``dp_world`` and ``cfg_now`` are accepted for callers that pass them."""
    from ttt_lm.train.checkpoint import CheckpointError
    from omegaconf import OmegaConf
    from ttt_lm.model.config import ModelConfig
    inv = saved["invariants"]
    # a key the checkpoint lacks was added to the schema after it was written: its default is
    # what that run used
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(ModelConfig())))
    old = {**{k: v for k, v in defaults.items() if k in now["model"]}, **inv["model"]}
    diff = [f"model.{k}: {old.get(k)!r} -> {now['model'].get(k)!r}"
            for k in sorted(set(old) | set(now["model"])) if old.get(k) != now["model"].get(k)]
    for k in ("vocab_size", "tokenizer"):
        if inv.get(k) != now.get(k):
            diff.append(f"{k}: {inv.get(k)!r} -> {now.get(k)!r}")
    # checkpoints from before data_checksum was recorded: the loader state's own data checksum
    # still refuses other data when it is loaded
    if "data_checksum" in inv and inv["data_checksum"] != now.get("data_checksum"):
        diff.append(f"data (manifest checksum): {inv['data_checksum']!r} at {inv.get('data_path')!r} -> "
                    f"{now.get('data_checksum')!r} at {now.get('data_path')!r}")
    # checkpoints written before tensor parallelism was recorded were all tensor_parallel=1
    tp_old, tp_new = inv.get("tensor_parallel", 1), now.get("tensor_parallel", 1)
    if tp_old != tp_new:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was written with parallel.tensor_parallel={tp_old} and this run has "
            f"{tp_new}; the weights and ZeRO optimizer state are stored as per-TP-rank slices. Resume with "
            f"parallel.tensor_parallel={tp_old}, or export the weights with `python -m ttt_lm.train.export {ckpt} "
            "<out>` (which consolidates the slices) and start a new run with train.init_from=<out> "
            "(fresh optimizer state)")
    cp_old, cp_new = inv.get("context_parallel", 1), now.get("context_parallel", 1)
    if cp_old != cp_new:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was written with parallel.context_parallel={cp_old} and this run has "
            f"{cp_new}; ZeRO's optimizer state is sharded over data_parallel × context_parallel ranks and the "
            f"data-loader states are per data-parallel rank. Resume with parallel.context_parallel={cp_old}, or "
            f"export the weights with `python -m ttt_lm.train.export {ckpt} <out>` and start a new run with "
            "train.init_from=<out> (fresh optimizer state)")
    if diff:
        raise CheckpointError(
            f"cannot resume from {ckpt}: the run changed what a resumed run must keep:\n  " + "\n  ".join(diff)
            + "\nrestore those settings, or start a new run (another train.run_dir)")


def global_batch_note(ckpt: str, cfg, saved_dp: int, dp_world: int) -> Optional[str]:
    """One line when the run's global batch (micro-batch × grad_accum × data-parallel ranks)
    differs from the checkpoint's, else None. Allowed: the data order is a sequence of samples
    (``ttt_lm.data.loader``), and the run continues at the sample where the checkpoint stopped."""
    from ttt_lm.train.checkpoint import CheckpointError
    from omegaconf import OmegaConf
    try:
        old = OmegaConf.to_container(OmegaConf.load(os.path.join(ckpt, "config.yaml")))["train"]
    except Exception as e:  # noqa: BLE001 - verified at select(); yaml errors name the file
        raise CheckpointError(f"cannot read {ckpt}/config.yaml: {e}") from e
    g_old = old["micro_batch_size"] * old["grad_accum"] * saved_dp
    g_new = cfg.train.micro_batch_size * cfg.train.grad_accum * dp_world
    if g_old == g_new:
        return None
    return (f"the global batch changes from {g_old} to {g_new} sequences (micro_batch_size × grad_accum × "
            f"data-parallel ranks): the data order goes on from the checkpoint's sample position, each step now "
            f"reads {g_new}")


# ---- the run ---------------------------------------------------------------------------------

def _device(cfg) -> str:
    import torch
    d = cfg.train.device
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d not in ("cpu", "cuda"):
        raise ConfigError(f"train.device must be auto, cpu or cuda, got {d!r}")
    return d


def _seed_all(seed: int) -> None:
    import torch
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _alike(e: Exception) -> Exception:
    """Mark an error that every rank raises alike (``main`` prints it once, on rank 0)."""
    e.same_on_every_rank = True
    return e


def _build_loader(data_api, cfg, dp_rank: int, dp_world: int, resume: Optional[str], saved_loaders):
    """The train loader with the run's number of data streams: a resumed run's from its
    checkpoint (``data.streams``, if set, must agree), a new run's from the config.
    ``saved_loaders``: every old rank's state, when the number of data-parallel ranks changed."""
    from ttt_lm.train.checkpoint import CheckpointError, rank_file
    sd = None
    if saved_loaders is not None:
        if not hasattr(data_api, "merge_states"):
            raise _alike(CheckpointError(f"cannot resume from {resume} on another number of data-parallel ranks: "
                                         "this data pipeline cannot convert its loader state"))
        sd = saved_loaders[0].get("loader")
    elif resume is not None:
        import torch
        sd = torch.load(os.path.join(resume, rank_file(0)), map_location="cpu", weights_only=False).get("loader")
    if not isinstance(sd, dict) or "total_streams" not in sd:  # a new run, or a pipeline without streams
        if isinstance(sd, dict) and "n_streams" in sd:
            raise _alike(CheckpointError(f"cannot resume from {resume}: its data-loader state (version "
                                         f"{sd.get('version')}) was written by an older version of this code, whose "
                                         "data order differs; resume it with that version, or start a new run with "
                                         "train.init_from=<exported weights>"))
        return data_api.build_train_loader(cfg.data, cfg.train.micro_batch_size, dp_rank, dp_world)
    V = int(sd["total_streams"])
    want = getattr(cfg.data, "streams", None)
    if want is not None and want != V:
        raise _alike(CheckpointError(f"cannot resume from {resume} with data.streams={want}: the run reads {V} data "
                                     f"streams (fixed when it started); set data.streams={V} or leave it unset"))
    return data_api.build_train_loader(cfg.data, cfg.train.micro_batch_size, dp_rank, dp_world, total_streams=V)


class _DataStop:
    """The trainer's side of verifying shards ahead of the reader (``TrainLoader.check_ahead``).
    The signal is taken at each read of the metrics (every ``logging.log_every`` = R steps, no
    host read in between), so each read verifies the shards of the next ``horizon`` = R steps
    (most already hashed by the loader's background pass): a bad one makes that read's collective
    stop the run like a preemption, with a checkpoint of the read's step, which comes before the
    step that would read the shard; ``reason`` (collective) says which shard and what to do."""

    def __init__(self, loader, per_step: int, horizon: int = 1):
        self.loader, self.per_step, self.horizon, self.bad = loader, per_step, max(1, horizon), None

    def check(self) -> bool:
        ahead = getattr(self.loader, "check_ahead", None)
        if ahead is not None and self.bad is None:
            self.bad = ahead(self.per_step * self.horizon)
        return self.bad is not None

    def reason(self) -> Optional[str]:
        from ttt_lm.train.checkpoint import gather
        bad = [b for b in gather(self.bad) if b]
        if not bad:
            return None
        return (f"{bad[0]}\nOne of the next {self.horizon} step(s) reads that shard, so the run stopped before it with "
                "a checkpoint of this step: restore the shard (copy it again, or prepare the data again with the same command), or check "
                "the connection for a remote one, then run the same command again: it resumes exactly here")

    def close(self) -> None:
        stop = getattr(self.loader, "stop_verifier", None)
        if stop is not None:
            stop()


def _verify_ahead(loader, per_step: int, rank: int, horizon: int = 1) -> _DataStop:
    """Verify the shards of the steps before the first read of the metrics now (a bad one stops
    the run before any work: nothing to lose), then keep verifying ahead in the background
    (``_DataStop``)."""
    from ttt_lm.data import DataError
    stop = _DataStop(loader, per_step, horizon)
    if stop.check():
        raise DataError(f"{stop.bad}; one of the first {stop.horizon} step(s) reads it: restore it (copy it again, "
                        "or prepare the data again with the same command) and run again")
    if hasattr(loader, "start_verifier"):
        loader.start_verifier(per_step * max(8, 2 * stop.horizon), say=lambda m: print(f"\n[data] rank {rank}: {m}", file=sys.stderr,
                                                                  flush=True))
    return stop


def train(cfg, data_api=None, preempt: Optional[PreemptionFlag] = None, callbacks: Sequence = ()) -> int:
    """Run ``cfg``; the run directory's lock (taken inside) is released however the run ends.
    ``callbacks`` (``ttt_lm.train.loop.Callback``) run after the built-in ones, on every rank."""
    held = []
    try:
        return _train(cfg, data_api, preempt, held, list(callbacks))
    finally:
        for lock in held:
            lock.release()


def _optim_changes(ckpt: str, cfg) -> list:
    """What the running config changes in the optimizer against the checkpoint's config.yaml."""
    from omegaconf import OmegaConf
    from ttt_lm.train.optim import changed_hyperparameters
    try:
        old = OmegaConf.to_container(OmegaConf.load(os.path.join(ckpt, "config.yaml")))
    except Exception as e:  # noqa: BLE001 - verified at select(); yaml errors name the file
        from ttt_lm.train.checkpoint import CheckpointError
        raise CheckpointError(f"cannot read {ckpt}/config.yaml: {e}") from e
    o, t = old.get("optim", {}), old.get("train", {})
    old_total = o.get("total_steps") or t.get("max_steps")
    return changed_hyperparameters(o, cfg.optim, old_total, cfg.optim.total_steps or cfg.train.max_steps)


def _train(cfg, data_api, preempt, held, extra_callbacks=()) -> int:
    from ttt_lm.train.config import check_training_config
    try:
        check_training_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package, which is not installed: "
                          "pip install 'ttt-lm[wandb]', or set logging.wandb=false")
    device = _device(cfg)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks one
    from ttt_lm.train.engine import check_parallel
    from ttt_lm.train.dist import detect_env
    # before any process group exists: fail fast and the same on every rank
    check_parallel(cfg, detect_env().world_size)

    import torch
    import torch.distributed as tdist

    from ttt_lm.model import LM
    from ttt_lm.model.flops import flops_per_token
    from ttt_lm.parallel.groups import build_groups
    from ttt_lm.train import checkpoint as ck
    from ttt_lm.train.dist import init_distributed
    from ttt_lm.train.engine import build_engine
    from ttt_lm.train.metrics import MetricsWriter, git_commit, resolve_peak_flops

    if data_api is None:
        import ttt_lm.data as data_api

    preempt = preempt if preempt is not None else PreemptionFlag().install()
    env = init_distributed(device)
    rank, world = env.rank, env.world_size
    tp, cp = cfg.parallel.tensor_parallel, cfg.parallel.context_parallel
    # TP peers (consecutive ranks), then CP peers, see the same batches: the data is split dp ways
    groups = build_groups(tp_size=tp, cp_size=cp)
    dp_rank, dp_world = groups.dp_rank, groups.dp_size
    from ttt_lm.train.engine import resolve_grad_accum
    cfg.train.grad_accum = resolve_grad_accum(cfg.train, dp_world)  # saved with the config: the value used
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    dev = torch.device("cuda", env.local_rank) if device == "cuda" else torch.device("cpu")
    t, run_dir = cfg.train, cfg.train.run_dir
    ckpt_root = os.path.join(run_dir, "checkpoints")

    # one run per run directory: rank 0 holds the lock, every rank learns the outcome
    from ttt_lm.train.lock import RunDirInUse, RunDirLock
    refused = None
    if rank == 0:
        lock = RunDirLock(run_dir)
        try:
            try:
                took_over = lock.acquire()
            except OSError as e:
                # not even the lock file fits: a disk filled by a killed save's leftovers. No lock
                # file existed (creating one failed), so no other run is using them: remove, retry
                import errno
                if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not ck.clean_stale(ckpt_root, say=print):
                    raise
                took_over = lock.acquire()
            held.append(lock)
            if took_over:
                print(f"[train] {took_over}", flush=True)
        except RunDirInUse as e:
            refused = str(e)
    refused = ck.gather(refused)[0]
    if refused:
        raise RunDirInUse(refused)

    def startup_preempted() -> bool:
        """Collective: was any rank signalled? Then end now, before the first step: nothing to save."""
        flag = torch.tensor([float(preempt.requested)])
        tdist.all_reduce(flag)
        if float(flag) == 0:
            return False
        if rank == 0:
            print(f"[train] preempted during startup (signal {preempt.signum or 'on another rank'}), before the "
                  f"first step: nothing to save; exiting with {PREEMPTED_EXIT_CODE}", flush=True)
        preempt.uninstall()
        tdist.barrier()
        tdist.destroy_process_group()
        return True

    if startup_preempted():
        return PREEMPTED_EXIT_CODE
    if rank == 0:
        ck.clean_stale(ckpt_root, say=print)

    from ttt_lm.data.manifest import vocab_fits
    manifest = data_api.load_manifest(cfg.data.path)
    if manifest.get("vocab_size") is not None and not vocab_fits(
            cfg.model.vocab_size, int(manifest["vocab_size"]), allow_padding=True):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocab_size={manifest['vocab_size']} ({cfg.data.path}); set model.vocab_size >= it")
    if rank == 0 and manifest.get("vocab_size") is not None and cfg.model.vocab_size > int(manifest["vocab_size"]):
        print(f"[train] {vocab_padding_note(cfg.model.vocab_size, int(manifest['vocab_size']), cfg.data.path)}",
              flush=True)
    inv = invariants(cfg, manifest)

    say = (lambda m: print(f"[train] {m}", flush=True)) if rank == 0 else (lambda m: None)
    resume, passed = None, []
    if t.resume_from:
        resume, passed = ck.select(t.resume_from, accept=ck.after_nonfinite_losses, note=say)
    elif ck.list_checkpoints(ckpt_root):
        resume, passed = ck.select(ckpt_root, accept=ck.after_nonfinite_losses, note=say)
    if resume is not None:
        try:
            check_resume(ck.read_state(resume), inv, resume, dp_world, cfg)
        except ck.CheckpointError as e:
            raise _alike(e)  # every rank read the same checkpoint and config
        note = global_batch_note(resume, cfg, ck.read_state(resume)["dp_world"], dp_world)
        if note:
            say(note)
        # newer checkpoints of this run directory that are not resumed from are renamed aside
        # (kept, never pruned): a later restart must not pick them over the new branch
        if rank == 0:
            rejected = {os.path.abspath(c) for c, _ in passed}
            r_step = ck.read_state(resume)["step"]
            for s_, c in ck.list_checkpoints(ckpt_root):
                if s_ > r_step:
                    why = "rejected" if os.path.abspath(c) in rejected else "superseded"
                    print(f"[train] {c} is newer than the checkpoint resumed from: renamed to "
                          f"{ck.set_aside(c, why)} (delete it when no longer needed)", flush=True)
        tdist.barrier()

    _seed_all(t.seed)  # same initial weights on every rank: each TP rank slices the same full model
    if cp > 1:
        from ttt_lm.parallel.context_parallel import wait_pending
        from ttt_lm.parallel.cp_model import ContextParallelLM
        model = ContextParallelLM(cfg.model, groups.cp_group, cfg.parallel.cp_pipeline_chunks)
    else:
        model = LM(cfg.model)
    model.activation_checkpointing = t.activation_checkpointing
    if t.init_from and resume is None:
        from ttt_lm.artifacts import load_state_dict_into
        load_state_dict_into(model, t.init_from)  # full weights: the conversion below slices them
    n_params = model.num_params()  # of the whole model, before TP keeps a slice per rank
    # which implementation every layer kind runs here (never a silent fallback: kernel_backend=triton
    # where no kernel applies stops the run now, naming the layer kind)
    try:
        backends = model.kernel_backends(dev)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pdims = {}
    if tp > 1:
        from ttt_lm.parallel.tp_model import parallelize_tp, partition_dims
        parallelize_tp(model, groups, cfg.parallel.sequence_parallel)
        pdims = {k: d for k, d in partition_dims(model).items() if d is not None}
    model.to(dev)
    if cfg.model.compile:
        model.compile_blocks(cfg.model.compile_backend)  # in place: parameter names and checkpoints unchanged
    from ttt_lm.train.optim import apply_hyperparameters, param_groups
    group_wd = [g["weight_decay"] for g in param_groups(model, cfg.optim.weight_decay)]  # as build_engine's
    # DeepSpeed's data-parallel group is dp × cp (the mpu's): those ranks average gradients
    engine, sched = build_engine(model, cfg, dp_world * cp, mpu=groups.mpu() if tp > 1 or cp > 1 else None)
    _seed_all(t.seed + 1 + rank)  # per-rank streams for anything random in the loop

    resharded = resume is not None and ck.read_state(resume)["dp_world"] != dp_world
    saved_loaders = ck.rank_states(resume) if resharded else None
    loader = _build_loader(data_api, cfg, dp_rank, dp_world, resume, saved_loaders)
    if hasattr(loader, "total_streams"):
        cfg.data.streams = loader.total_streams  # saved with the config: the value used
    if getattr(loader, "shared_streams", False):
        say(f"{loader.total_streams} data stream(s) on {dp_world} data-parallel rank(s) × "
            f"{max(1, cfg.data.num_workers)} loader worker(s): a stream is shared, and each of its readers reads all "
            "its windows to keep its own (exact, but more reading; runs that may change rank count start with "
            "data.streams a multiple of every ranks × workers they will use)")
    step, tokens, skipped_total, nonfinite_run = 0, 0, 0, 0
    changes, last_bytes = [], None
    if resharded:
        old_dp = ck.read_state(resume)["dp_world"]
        from ttt_lm.train.reshard import load_resharded
        state = load_resharded(engine, resume, groups.tp_rank)
        loader.load_merged_state(data_api.merge_states([s_["loader"] for s_ in saved_loaders]))
        # RNG states are per rank: with another rank count each rank starts a stream of its own,
        # from the seed, its rank and the step
        _seed_all(t.seed + 1 + rank + 1_000_003 * state["step"])
        if rank == 0:
            print(f"[train] {resume} was written by {old_dp} data-parallel rank(s), this run has {dp_world}: "
                  f"optimizer state resharded, the data order continues ({loader.total_streams} streams)",
                  flush=True)
    elif resume is not None:
        state, rs = ck.load(engine, resume, rank)
        loader.load_state_dict(rs["loader"])
    if resume is not None:
        step, tokens, skipped_total = state["step"], state["tokens"], state["skipped_steps"]
        nonfinite_run = state.get("nonfinite_in_a_row", 0)
        changes = _optim_changes(resume, cfg)
        if changes:
            # the checkpoint restored the old rates into the optimizer and the schedule
            apply_hyperparameters(sched, cfg.optim, group_wd)
            if rank == 0:
                print(f"[train] resumed with changed optimizer settings, in force from step {step + 1}: "
                      + "; ".join(changes), flush=True)
        last_bytes = ck.checkpoint_bytes(resume)
    if startup_preempted():
        return PREEMPTED_EXIT_CODE

    data_stop = _verify_ahead(loader if getattr(cfg.data, "verify_ahead", True) else None,
                              t.micro_batch_size * t.grad_accum, rank, max(1, cfg.logging.log_every))
    batches = iter(loader)  # after load_state_dict: continues with the next batch
    peak, peak_from = resolve_peak_flops(cfg.logging.peak_flops, dev)
    commit = git_commit() if rank == 0 else None
    run_info = {"git_commit": commit or "unknown (not a git checkout)", "n_params": n_params, "world_size": world,
                "device": torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
                "peak_flops": peak or 0.0, "peak_flops_from": peak_from}
    log = MetricsWriter(run_dir, cfg, enabled=rank == 0, start_step=step,
                        restart={"checkpoint": resume, "changed": changes} if resume else None, run_info=run_info)
    if rank == 0:
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
        print(f"[train] {'resuming from ' + resume if resume else 'starting'} at step {step}; "
              f"{world} rank(s) on {device} (data parallel {dp_world} × context parallel {cp} × tensor parallel {tp}"
              f"{', sequence parallel' if cfg.parallel.sequence_parallel else ''}), "
              f"ZeRO-{cfg.parallel.zero_stage}, {t.precision}, {n_params / 1e6:.2f}M parameters", flush=True)
        print("[train] kernels: " + ", ".join(f"{k} {v}" for k, v in backends.items())
              + f" (model.kernel_backend={cfg.model.kernel_backend})"
              + (f"; blocks torch.compile-d ({cfg.model.compile_backend}, Triton ops left uncompiled)"
                 if cfg.model.compile else ""), flush=True)
        print(f"[train] MFU against {peak / 1e12:.1f} TFLOP/s per device ({peak_from})" if peak
              else f"[train] MFU not reported: {peak_from}", flush=True)
        print(f"[train] git commit {run_info['git_commit']}", flush=True)
        if resume is not None and step >= t.max_steps:
            print(f"[train] {finished_note(resume, step, t.max_steps)}", flush=True)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    cfg_yaml = to_yaml(cfg)

    def fwd_kw(b):
        # the document layout, whatever the parallel layout (TP, CP and their LMs take it as the LM
        # does); on the host (see _pos)
        return {"position_ids": _pos(b)}

    from ttt_lm.train.callbacks import (CheckpointCallback, EvalCallback, MetricsCallback, NonFiniteLossCallback,
                                        PreemptionCallback)
    from ttt_lm.train.loop import Trainer
    callbacks = [
        MetricsCallback(log, device, fpt, peak, cfg.logging.log_every, cfg.logging.progress),
        NonFiniteLossCallback(t.max_nonfinite_steps, lambda: ck.find_latest(ckpt_root)),
        EvalCallback(lambda: data_api.build_val_loader(cfg.data, t.micro_batch_size, dp_rank, dp_world),
                     cfg.eval.every, cfg.eval.batches, log),
        PreemptionCallback(why=data_stop.reason),
        CheckpointCallback(engine, ckpt_root, loader, cfg_yaml,
                           {"dp_world": dp_world, "invariants": inv, "zero_stage": cfg.parallel.zero_stage,
                            "tensor_parallel": tp, "context_parallel": cp, "partition_dims": pdims},
                           rank, cfg.checkpoint.every, cfg.checkpoint.at_end, cfg.checkpoint.keep_last,
                           lock=held[0] if held else None, last_bytes=last_bytes),
        *extra_callbacks,
    ]
    trainer = Trainer(engine=engine, scheduler=sched, batches=batches, device=dev, max_steps=t.max_steps,
                      grad_accum=t.grad_accum, rank=rank, world=world, dp_world=dp_world, callbacks=callbacks,
                      signalled=lambda: preempt.requested or data_stop.check(), forward_kwargs=fwd_kw,
                      after_backward=(lambda: (wait_pending(), model.release_parameters())) if cp > 1 else None,
                      stop_after=t.stop_after,
                      step=step, tokens=tokens, skipped_total=skipped_total, nonfinite_run=nonfinite_run,
                      # the step's metrics stay on the device until a console line needs them
                      read_every=max(1, cfg.logging.log_every))
    trainer.last_saved = step if resume is not None else -1
    try:
        exit_code = trainer.fit()
    finally:
        data_stop.close()
    if rank == 0:
        latest = ck.find_latest(ckpt_root)
        print(f"[train] run directory: {os.path.abspath(run_dir)}\n"
              f"[train]   metrics:     {os.path.abspath(os.path.join(run_dir, 'metrics.jsonl'))}\n"
              + (f"[train]   tensorboard: {os.path.abspath(os.path.join(run_dir, 'tb'))}\n" if cfg.logging.tensorboard else "")
              + f"[train]   checkpoint:  {os.path.abspath(latest) if latest else '(none)'}", flush=True)
    preempt.uninstall()
    tdist.barrier()
    tdist.destroy_process_group()
    return exit_code
