"""A training run: DeepSpeed engine, checkpoints, exact resume, preemption and metrics.

``main(argv)`` is what ``train.py`` runs; ``train(cfg)`` runs a resolved ExperimentConfig and
returns the process exit status (0, or PREEMPTED_EXIT_CODE after a preemption checkpoint).

``Trainer.from_config(cfg)`` builds the pieces (process groups, model, engine, loaders, resume)
into a ``Trainer``, whose ``fit()`` runs the steps (the loop's hooks: ``ttt_lm.train.loop``) and
whose ``state_dict()`` is the run's whole resumable state but the engine's; metrics, evaluation,
the non-finite-loss stop, preemption and checkpoints are its callbacks (``ttt_lm.train.callbacks``).
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

Startup, in order (``build``, one build step a line or a function): the SIGTERM/SIGUSR1 handler
(installed by ``ttt_lm.train.main`` before the heavy imports; a signal during startup ends the run
with PREEMPTED_EXIT_CODE and nothing to save), the config check (``_check_config``: every rule once,
before any process group), the process group, the run directory's lock (``ttt_lm.train.lock``: one
run per ``train.run_dir``), removal of what killed saves left behind, then the resume, which
``ttt_lm.train.checkpoint.resume.CheckpointManager`` owns (through the run's ``Checkpointer``):
select → verify → check → loader → load or reshard → the trainer's state (counters, loader
position, RNG: ``Trainer.load_state_dict``) → optimizer overrides. A checkpoint written on another number of data-parallel
ranks or another tensor-parallel size (the context-parallel size unchanged) is resumed, with the
same or another global batch, and the global sample order continues at the next sample
(docs/training.md "Resuming"). Before every step the shards it reads are verified (``_DataStop``);
a bad one stops the run like a preemption, with a checkpoint, before the step that would read it.
"""
from __future__ import annotations

import errno
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as tdist

import ttt_lm.data
from ttt_lm.artifacts import load_state_dict_into
from ttt_lm.config import ConfigError, load_config, save_config, to_yaml
from ttt_lm.data import DataError
from ttt_lm.data.manifest import vocab_fits
from ttt_lm.model import LM
from ttt_lm.model.flops import flops_per_token
from ttt_lm.parallel.cp import wait_pending
from ttt_lm.parallel.cp_model import ContextParallelLM
from ttt_lm.parallel.groups import build_groups
from ttt_lm.parallel.tp_model import parallelize_tp, partition_dims
from ttt_lm.train import checkpoint as ck
from ttt_lm.train.callbacks import (CheckpointCallback, EvalCallback, MetricsCallback, NonFiniteLossCallback,
                                    NonFiniteLossError, PreemptionCallback)
from ttt_lm.train.checkpoint import CheckpointError
from ttt_lm.train.checkpoint.checkpointer import TRAIN_STATE, Checkpointer
from ttt_lm.train.config import check_training_config
from ttt_lm.train.dist import detect_env, init_distributed
from ttt_lm.train.engine import (ParallelConfigError, build_engine, check_parallel, gathers_zero3_parameters,
                                  resolve_grad_accum)
from ttt_lm.train.lock import RunDirInUse, RunDirLock
from ttt_lm.train.loop import Callback
from ttt_lm.train.metrics import MetricsWriter, git_commit, resolve_peak_flops
from ttt_lm.train.optim import param_groups
from ttt_lm.train.preempt import PREEMPTED_EXIT_CODE, PreemptionFlag
# the resume checks, importable from here as before
from ttt_lm.train.checkpoint.resume import (RUNTIME_MODEL_KEYS, CheckpointManager, check_resume,  # noqa: F401
                                 global_batch_note, invariants, seed_all)

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "configs", "tiny.yaml")


def _pos(batch: dict):
    """Position of each token in its document (0 at a document's first token), which the model
    uses to reset its state at document boundaries when model.reset_at_doc_boundaries is set.
    Kept where the loader made it (the host): ``LM.forward`` checks it and builds the document
    layout there, then moves the layout to the model's device, with no read back from the device
    (``ttt_lm.model.docs``)."""
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
        # refused input (a config): 2; a checkpoint or data error may arise while working (a full
        # disk at a save, a shard cut short mid-run), and so may a non-finite loss: 1 (README,
        # "Exit status"; docs/limitations.md)
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


# ---- the loop ----------------------------------------------------------------------------------

@dataclass
class _Queued:
    """A step whose metrics are not read yet: its loss on the device, the rest from the host."""
    step: int
    loss: Any                 # 0-dim float64 tensor on the training device: this rank's mean loss
    lr: float
    applied: bool             # DeepSpeed applied the update (False: skipped for a non-finite gradient)
    grad_norm: Any            # as DeepSpeed returns it: a tensor, a float or None
    local_tokens: int
    tokens: int               # the run's tokens after this step


class Trainer:
    """Runs ``max_steps`` optimizer steps of ``engine`` (a DeepSpeed engine) on ``batches``.

    ``step``/``tokens``/``skipped_total``/``nonfinite_run`` continue from a resumed checkpoint's.
    ``record`` holds the newest step's metrics that were read (the ``kind: train`` record of
    metrics.jsonl); ``read_every`` steps are read at once (module docstring). ``forward_kwargs(batch)`` gives the model's extra keyword arguments for a
    batch; ``after_backward`` runs after each backward pass (context parallelism waits for its
    state sends there). ``preempted`` reads whether this rank was signalled (``PreemptionFlag``);
    the step's collective turns it into ``trainer.preempted`` (any rank signalled)."""

    def __init__(self, *, engine, scheduler, batches: Optional[Iterator[dict]] = None, device, max_steps: int,
                 grad_accum: int, rank: int, world: int, dp_world: int, callbacks: Sequence[Callback] = (),
                 loader=None,
                 signalled: Callable[[], bool] = lambda: False,
                 forward_kwargs: Callable[[dict], dict] = lambda b: {},
                 after_backward: Optional[Callable[[], None]] = None, stop_after: Optional[int] = None,
                 step: int = 0, tokens: int = 0, skipped_total: int = 0, nonfinite_run: int = 0,
                 write: Callable[[str], None] = lambda line: print(line, flush=True), read_every: int = 1):
        if read_every < 1:
            raise ValueError(f"read_every must be >= 1 step, got {read_every}")
        #: the train loader whose position is part of ``state_dict`` (anything with state_dict /
        #: load_state_dict; None: the batches carry no state); ``batches`` default to iterating it
        self.loader = loader
        self._batches = batches
        self.engine, self.scheduler, self.device = engine, scheduler, device
        self.max_steps, self.grad_accum, self.stop_after = max_steps, grad_accum, stop_after
        self.rank, self.world, self.dp_world = rank, world, dp_world
        self.callbacks: List[Callback] = list(callbacks)
        self.signalled, self.forward_kwargs, self.after_backward = signalled, forward_kwargs, after_backward
        self.step, self.tokens, self.skipped_total, self.nonfinite_run = step, tokens, skipped_total, nonfinite_run
        #: the step's metrics (set before post_step); the collective's verdict on preemption
        self.record: Dict[str, Any] = {}
        self.preempted = False
        self.stop_requested = False
        #: the run ended at ``stop_after``, before ``max_steps``
        self.stopped_after = False
        self.exit_code = 0
        #: step of the newest checkpoint this run wrote or resumed from (-1: none), kept by the checkpoint callback
        self.last_saved = -1
        #: a console line (rank 0 prints; a progress bar, when shown, replaces this to keep its line intact)
        self.write = write
        self.read_every = read_every
        self._queue: List[_Queued] = []
        self._t_read = time.perf_counter()   # start of the steps the next read covers
        self._callback_states: Dict[str, Any] = {}   # loaded for callbacks added later

    @classmethod
    def from_config(cls, cfg, data_api=None, preempt=None, callbacks: Sequence[Callback] = (),
                    held: Optional[list] = None) -> Optional["Trainer"]:
        """The run of a resolved ExperimentConfig, built (process group, model, engine, loader,
        callbacks) and, for a resumed run, with the checkpoint's state loaded: ``fit()`` trains it.
        None when the run was signalled during startup. ``held`` receives the run directory's lock
        (``ttt_lm.train.train`` releases it). ``callbacks`` run after the built-in ones."""
        return build(cfg, data_api, preempt, callbacks, held, cls)

    @property
    def batches(self) -> Iterator[dict]:
        if self._batches is None:
            self._batches = iter(self.loader)   # after load_state_dict: from the restored position
        return self._batches

    def add_callback(self, cb: Callback) -> "Trainer":
        self.callbacks.append(cb)
        if cb.state_key in self._callback_states:
            cb.load_state_dict(self._callback_states[cb.state_key])
        return self

    # -- resumable state ----------------------------------------------------------------------------
    #: the entries of ``state_dict`` that differ between ranks (a checkpoint keeps them per rank)
    RANK_KEYS = ("loader", "rng")

    def state_dict(self) -> Dict[str, Any]:
        """Every piece of this run's resumable state but the engine's (weights, optimizer, lr
        schedule: DeepSpeed's files): the counters, the loader's position, this rank's RNG states
        and the callbacks' own states. The entries of ``RANK_KEYS`` are this rank's; the rest are
        the same on every rank. Adding a piece of resumable state is one entry here and its line in
        ``load_state_dict``."""
        cbs = {cb.state_key: st for cb in self.callbacks if (st := cb.state_dict()) is not None}
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_total,
                "nonfinite_in_a_row": self.nonfinite_run, **({"callbacks": cbs} if cbs else {}),
                "loader": self.loader.state_dict() if self.loader is not None else None, "rng": ck.rng_state()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Put back what ``state_dict`` returned (a resumed run's, from ``ttt_lm.train.checkpoint.resume``).
        On another layout the checkpointer hands over ``loader_merged`` (every old rank's loader
        state merged, ``load_merged_state``) instead of ``loader``, and ``rng_seed`` (a seed of this
        rank's own) instead of ``rng``. Call it before the first batch is read."""
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        self.skipped_total, self.nonfinite_run = int(sd["skipped_steps"]), int(sd.get("nonfinite_in_a_row", 0))
        if self.loader is not None and sd.get("loader_merged") is not None:
            self.loader.load_merged_state(sd["loader_merged"])
        elif self.loader is not None and sd.get("loader") is not None:
            self.loader.load_state_dict(sd["loader"])
        if sd.get("rng") is not None:
            ck.set_rng_state(sd["rng"])
        elif sd.get("rng_seed") is not None:
            seed_all(int(sd["rng_seed"]))
        self._callback_states = dict(sd.get("callbacks") or {})
        for cb in self.callbacks:
            if cb.state_key in self._callback_states:
                cb.load_state_dict(self._callback_states[cb.state_key])

    def request_stop(self, exit_code: Optional[int] = None) -> None:
        """End the run after the current step (callbacks later in the list still see this step);
        ``exit_code`` becomes ``fit()``'s return value."""
        self.stop_requested = True
        if exit_code is not None:
            self.exit_code = exit_code

    def _call(self, hook: str, order: Sequence[Callback]) -> None:
        for cb in order:
            getattr(cb, hook)(self)

    def fit(self) -> int:
        """Run until ``max_steps`` or a stop request; returns the exit status (0 unless a callback set one)."""
        try:
            self._call("pre_train", self.callbacks)
            self.engine.train()
            while self.step < self.max_steps:
                self._call("pre_step", self.callbacks)
                self.train_step()
                if self.stop_after is not None and self.step >= self.stop_after:
                    self.stopped_after = self.step < self.max_steps
                    self.request_stop()
                if self._read_due():
                    self.read_metrics()
                self._call("post_step", self.callbacks)
                if self.stop_requested:
                    break
            self.read_metrics()   # steps after the last read (a stop requested at a step not read)
            self._call("post_train", list(reversed(self.callbacks)))
        except BaseException as e:
            for cb in self.callbacks:
                cb.on_error(self, e)
            raise
        return self.exit_code

    def _read_due(self) -> bool:
        return (self.step % self.read_every == 0 or self.step >= self.max_steps or self.stop_requested
                or any(cb.wants_metrics(self) for cb in self.callbacks))

    def train_step(self) -> None:
        """One optimizer step, queued for the next read: nothing is read from the device."""
        import torch
        engine, dev = self.engine, self.device
        if not self._queue:
            self._t_read = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        # summed on the device
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        local_tokens = 0
        engine.module.set_train_step(self.step + 1)   # schedules inside the model (TTT's η_base warmup)
        for _ in range(self.grad_accum):
            b = next(self.batches)
            ids = b["input_ids"].to(dev, non_blocking=True)
            out = engine(ids, labels=b["labels"].to(dev, non_blocking=True), **self.forward_kwargs(b))
            engine.backward(out.loss)
            if self.after_backward is not None:
                self.after_backward()
            engine.step()
            loss_sum += out.loss.detach().to(torch.float64)
            local_tokens += ids.numel()
        self.step += 1
        self.tokens += local_tokens * self.dp_world
        self._queue.append(_Queued(self.step, loss_sum / self.grad_accum, lr, bool(engine.was_step_applied()),
                                   engine.get_global_grad_norm(), local_tokens, self.tokens))

    def read_metrics(self) -> List[Dict[str, Any]]:
        """Read the queued steps' metrics: one collective (the losses' sum over ranks and whether
        any rank was signalled) and one device-to-host read; sets ``record``, ``skipped_total``,
        ``nonfinite_run`` and ``preempted``, calls every callback's ``on_metrics`` and returns the
        records (none when nothing is queued). A collective: every rank calls it at the same step.
        Tokens/s and step time are the means over the steps read: the host runs ahead of the
        device between reads, so a single step's wall time would measure only its launch."""
        import torch
        import torch.distributed as tdist
        if not self._queue:
            return []
        q, self._queue = self._queue, []
        dev = self.device
        # one collective: TP peers hold the same (full, vocab-parallel) loss of the same batch and
        # CP peers loss shares whose mean is that loss, so the mean over the world is the mean
        # over the data-parallel replicas. On the training device (NCCL reduces CUDA tensors only).
        agg = torch.stack([e.loss for e in q] + [torch.full((), float(self.signalled()), dtype=torch.float64,
                                                              device=dev)])
        tdist.all_reduce(agg)
        norms = [i for i, e in enumerate(q) if torch.is_tensor(e.grad_norm)]
        dev_vals = agg if not norms else torch.cat(
            [agg, torch.stack([q[i].grad_norm.detach().reshape(()).to(device=dev, dtype=torch.float64)
                               for i in norms])])
        host = dev_vals.tolist()   # the read: one device-to-host copy for all the queued steps
        dt = time.perf_counter() - self._t_read
        gn = {i: host[len(q) + 1 + k] for k, i in enumerate(norms)}
        self.preempted = host[len(q)] > 0
        tps = sum(e.local_tokens for e in q) * self.dp_world / dt
        records = []
        for i, e in enumerate(q):
            loss = host[i] / self.world
            skipped = not math.isfinite(loss) or not e.applied
            if skipped:
                self.skipped_total += 1
                self.nonfinite_run += 1
            else:
                self.nonfinite_run = 0
            g = gn.get(i, e.grad_norm)
            records.append({"kind": "train", "step": e.step, "loss": loss, "lr": e.lr,
                            "grad_norm": float(g) if g is not None and not skipped else None, "tokens": e.tokens,
                            "tokens_per_s": tps, "step_time_s": dt / len(q), "skipped": skipped,
                            "skipped_total": self.skipped_total, "nonfinite_run": self.nonfinite_run})
        self.record = records[-1]
        for cb in self.callbacks:
            cb.on_metrics(self, records)
        return records


# ---- the run ---------------------------------------------------------------------------------

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
        bad = [b for b in ck.gather(self.bad) if b]
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
    run_dir = cfg.train.run_dir
    created = not os.path.exists(run_dir)   # by this run: removed again if the run leaves it empty
    try:
        # built, with a resumed run's state loaded; None: signalled during startup, nothing to save
        trainer = Trainer.from_config(cfg, data_api=data_api, preempt=preempt, callbacks=callbacks, held=held)
        return PREEMPTED_EXIT_CODE if trainer is None else trainer.fit()
    finally:
        for lock in held:
            lock.release()
        if created and int(os.environ.get("RANK", "0")) == 0:
            _remove_if_empty(run_dir)


def _remove_if_empty(run_dir: str) -> None:
    """A run refused at startup (a data path that does not exist, a bad layout) wrote nothing but
    its lock: the run directory it created is removed, empty folders inside it included."""
    if not os.path.isdir(run_dir):
        return
    for d, dirs, files in os.walk(run_dir, topdown=False):
        if files:
            return
        for sub in dirs:
            if os.path.exists(os.path.join(d, sub)):
                return
        try:
            os.rmdir(d)
        except OSError:
            return




def _check_config(cfg) -> str:
    """Every rule on the config, before any process group exists (fail fast, the same on every
    rank): the training sections' values (``check_training_config``), the parallel layout
    (``check_parallel``, the one place for its rules). Returns the device, cpu or cuda."""
    try:
        check_training_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package, which is not installed: "
                          "pip install 'ttt-lm[wandb]', or set logging.wandb=false")
    device = cfg.train.device if cfg.train.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks one
    check_parallel(cfg, detect_env().world_size)
    return device


def _lock_run_dir(run_dir: str, ckpt_root: str, rank: int, held: list) -> None:
    """One run per run directory: rank 0 holds the lock (appended to ``held``), every rank learns
    the outcome (RunDirInUse on every rank when another run holds it)."""
    refused = None
    if rank == 0:
        lock = RunDirLock(run_dir)
        try:
            try:
                took_over = lock.acquire()
            except OSError as e:
                # not even the lock file fits: a disk filled by a killed save's leftovers. No lock
                # file existed (creating one failed), so no other run is using them: remove, retry
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


def _startup_preempted(preempt: PreemptionFlag, rank: int) -> bool:
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


def _manifest(cfg, data_api, say) -> dict:
    """The data's manifest, after checking that the model's vocabulary holds the tokenizer's."""
    manifest = data_api.load_manifest(cfg.data.path)
    v = manifest.get("vocab_size")
    if v is not None and not vocab_fits(cfg.model.vocab_size, int(v), allow_padding=True):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"vocab_size={v} ({cfg.data.path}); set model.vocab_size >= it")
    if v is not None and cfg.model.vocab_size > int(v):
        say(vocab_padding_note(cfg.model.vocab_size, int(v), cfg.data.path))
    return manifest


def _build_model(cfg, groups, dev, init_weights: bool):
    """The model, the same on every rank (from the seed; ``train.init_from`` for a new run), then
    this rank's TP slice, on ``dev``: (model, parameters of the whole model, kernel backends,
    partition dims of the TP-split parameters)."""
    seed_all(cfg.train.seed)  # same initial weights on every rank: each TP rank slices the same full model
    cp, tp = cfg.parallel.context_parallel, cfg.parallel.tensor_parallel
    model = ContextParallelLM(cfg.model, groups.cp_group, cfg.parallel.cp_pipeline_chunks) if cp > 1 \
        else LM(cfg.model)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    if cfg.train.init_from and init_weights:
        load_state_dict_into(model, cfg.train.init_from)  # full weights: the conversion below slices them
    n_params = model.num_params()  # of the whole model, before TP keeps a slice per rank
    # which implementation every layer kind runs here (never a silent fallback: kernel_backend=triton
    # where no kernel applies stops the run now, naming the layer kind)
    try:
        backends = model.kernel_backends(dev)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pdims = {}
    if tp > 1:
        parallelize_tp(model, groups, cfg.parallel.sequence_parallel)
        pdims = {k: d for k, d in partition_dims(model).items() if d is not None}
    model.to(dev)
    if cfg.model.compile:
        model.compile_blocks(cfg.model.compile_backend)  # in place: parameter names and checkpoints unchanged
    return model, n_params, backends, pdims


def _streams_note(loader, cfg, dp_world: int, say) -> None:
    if hasattr(loader, "total_streams"):
        cfg.data.streams = loader.total_streams  # saved with the config: the value used
    if getattr(loader, "shared_streams", False):
        say(f"{loader.total_streams} data stream(s) on {dp_world} data-parallel rank(s) × "
            f"{max(1, cfg.data.num_workers)} loader worker(s): a stream is shared, and each of its readers reads all "
            "its windows to keep its own (exact, but more reading; runs that may change rank count start with "
            "data.streams a multiple of every ranks × workers they will use)")


def _startup_lines(cfg, resume, step, world, device, dp_world, n_params, backends, run_info) -> None:
    """Rank 0's account of the run before the first step."""
    t, p = cfg.train, cfg.parallel
    save_config(cfg, os.path.join(t.run_dir, "config.yaml"))
    print(f"[train] {'resuming from ' + resume if resume else 'starting'} at step {step}; "
          f"{world} rank(s) on {device} (data parallel {dp_world} × context parallel {p.context_parallel} × tensor "
          f"parallel {p.tensor_parallel}{', sequence parallel' if p.sequence_parallel else ''}), "
          f"ZeRO-{p.zero_stage}, {t.precision}, {n_params / 1e6:.2f}M parameters", flush=True)
    print("[train] kernels: " + ", ".join(f"{k} {v}" for k, v in backends.items())
          + f" (model.kernel_backend={cfg.model.kernel_backend})"
          + (f"; blocks torch.compile-d ({cfg.model.compile_backend}, Triton ops left uncompiled)"
             if cfg.model.compile else ""), flush=True)
    peak, peak_from = run_info["peak_flops"], run_info["peak_flops_from"]
    print(f"[train] MFU against {peak / 1e12:.1f} TFLOP/s per device ({peak_from})" if peak
          else f"[train] MFU not reported: {peak_from}", flush=True)
    print(f"[train] git commit {run_info['git_commit']}", flush=True)
    if resume is not None and step >= t.max_steps:
        print(f"[train] {finished_note(resume, step, t.max_steps)}", flush=True)


def _forward_kwargs(b) -> dict:
    # the document layout, whatever the parallel layout (TP, CP and their LMs take it as the LM
    # does); on the host (see _pos)
    return {"position_ids": _pos(b)}


def _end_lines(cfg, ckpt_root: str, trainer: Trainer) -> None:
    run_dir, latest, t = cfg.train.run_dir, ck.find_latest(ckpt_root), cfg.train
    if trainer.stopped_after and trainer.exit_code == 0:
        saved = "checkpoint saved" if trainer.last_saved == trainer.step else "no checkpoint (non-finite loss)"
        print(f"[train] stopped after step {trainer.step} of {t.max_steps} (train.stop_after={t.stop_after}): "
              f"{saved}; run the same command without train.stop_after (or with a larger one) to go on", flush=True)
    print(f"[train] run directory: {os.path.abspath(run_dir)}\n"
          f"[train]   metrics:     {os.path.abspath(os.path.join(run_dir, 'metrics.jsonl'))}\n"
          + (f"[train]   tensorboard: {os.path.abspath(os.path.join(run_dir, 'tb'))}\n"
             if cfg.logging.tensorboard else "")
          + f"[train]   checkpoint:  {os.path.abspath(latest) if latest else '(none)'}", flush=True)


class _RunEnd(Callback):
    """First in the list, so its ``post_train`` runs last: stops the verifier of the shards ahead,
    prints the run's end lines, puts the signal handlers back and ends the process group."""

    def __init__(self, cfg, ckpt_root: str, data_stop, preempt):
        self.cfg, self.ckpt_root, self.data_stop, self.preempt = cfg, ckpt_root, data_stop, preempt

    def post_train(self, trainer: Trainer) -> None:
        self.data_stop.close()
        if trainer.rank == 0:
            _end_lines(self.cfg, self.ckpt_root, trainer)
        self.preempt.uninstall()
        tdist.barrier()
        tdist.destroy_process_group()

    def on_error(self, trainer: Trainer, exc: BaseException) -> None:
        self.data_stop.close()


def build(cfg, data_api=None, preempt: Optional[PreemptionFlag] = None, callbacks: Sequence = (),
          held: Optional[list] = None, cls=Trainer) -> Optional[Trainer]:
    """The run's build steps, in order (``Trainer.from_config``): a Trainer whose state is the
    checkpoint's for a resumed run, ready to ``fit``; None when the run was signalled during startup
    (nothing to save: the process group is ended). ``held`` receives the run directory's lock (the
    caller releases it)."""
    held = held if held is not None else []
    extra_callbacks = list(callbacks)
    device = _check_config(cfg)
    data_api = data_api if data_api is not None else ttt_lm.data
    preempt = preempt if preempt is not None else PreemptionFlag().install()
    env = init_distributed(device)
    rank, world = env.rank, env.world_size
    t, par = cfg.train, cfg.parallel
    tp, cp = par.tensor_parallel, par.context_parallel
    # TP peers (consecutive ranks), then CP peers, see the same batches: the data is split dp ways
    groups = build_groups(tp_size=tp, cp_size=cp)
    dp_rank, dp_world = groups.dp_rank, groups.dp_size
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
    dev = torch.device("cuda", env.local_rank) if device == "cuda" else torch.device("cpu")
    ckpt_root = os.path.join(t.run_dir, "checkpoints")
    say = (lambda m: print(f"[train] {m}", flush=True)) if rank == 0 else (lambda m: None)

    _lock_run_dir(t.run_dir, ckpt_root, rank, held)
    if _startup_preempted(preempt, rank):
        return None
    if rank == 0:
        ck.clean_stale(ckpt_root, say=print)
    inv = invariants(cfg, _manifest(cfg, data_api, say))
    ckpts = CheckpointManager(cfg, ckpt_root, groups, say)
    resume = ckpts.select(inv)   # a resumed run's batch: its global batch kept, grad_accum derived
    if resume is None:
        t.grad_accum = resolve_grad_accum(t, dp_world)  # saved with the config: the value used

    model, n_params, backends, pdims = _build_model(cfg, groups, dev, init_weights=resume is None)
    group_wd = [g["weight_decay"] for g in param_groups(model, cfg.optim.weight_decay)]  # as build_engine's
    # DeepSpeed's data-parallel group is dp × cp (the mpu's): those ranks average gradients
    engine, sched = build_engine(model, cfg, dp_world * cp, mpu=groups.mpu() if tp > 1 or cp > 1 else None)
    seed_all(t.seed + 1 + rank)  # per-rank streams for anything random in the loop
    loader = ckpts.build_loader(data_api)
    _streams_note(loader, cfg, dp_world, say)
    checkpointer = Checkpointer(engine, ckpt_root, to_yaml(cfg), {}, rank, cfg.checkpoint.keep_last, manager=ckpts,
                                lock=held[0] if held else None)
    # what every checkpoint records beside the states: the layout, what must not change, the batch
    checkpointer.record.update({
        "dp_world": dp_world, "invariants": inv, "zero_stage": par.zero_stage, "tensor_parallel": tp,
        "context_parallel": cp,
        # parameter name → dimension sliced across TP ranks (export concatenates along it)
        "partition_dims": pdims,
        # the global batch and the command's batch settings: a resume keeps the former (resume.py)
        "batch": {"requested": ckpts.requested, "global": t.micro_batch_size * t.grad_accum * dp_world}})
    trainer = cls(engine=engine, scheduler=sched, loader=loader, device=dev, max_steps=t.max_steps,
                  grad_accum=t.grad_accum, rank=rank, world=world, dp_world=dp_world,
                  signalled=lambda: preempt.requested or data_stop.check(), forward_kwargs=_forward_kwargs,
                  after_backward=((lambda: (wait_pending(), model.release_parameters())) if cp > 1 else
                                  model.release_parameters if par.zero_stage == 3 and gathers_zero3_parameters(model)
                                  else None),
                  stop_after=t.stop_after,
                  # the step's metrics stay on the device until a console line needs them
                  read_every=max(1, cfg.logging.log_every))
    # the engine, and the trainer's counters, loader position and RNGs
    at = checkpointer.load({TRAIN_STATE: trainer}, loader, sched, group_wd)
    if at.state is not None:
        trainer.last_saved = trainer.step
    if _startup_preempted(preempt, rank):
        return None

    data_stop = _verify_ahead(loader if getattr(cfg.data, "verify_ahead", True) else None,
                              t.micro_batch_size * t.grad_accum, rank, max(1, cfg.logging.log_every))
    peak, peak_from = resolve_peak_flops(cfg.logging.peak_flops, dev)
    run_info = {"git_commit": (git_commit() if rank == 0 else None) or "unknown (not a git checkout)",
                "n_params": n_params, "world_size": world,
                "device": torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
                "peak_flops": peak or 0.0, "peak_flops_from": peak_from}
    log = MetricsWriter(t.run_dir, cfg, enabled=rank == 0, start_step=trainer.step,
                        restart={"checkpoint": resume, "changed": at.changes} if resume else None, run_info=run_info)
    if rank == 0:
        _startup_lines(cfg, resume, trainer.step, world, device, dp_world, n_params, backends, run_info)

    for cb in [
        _RunEnd(cfg, ckpt_root, data_stop, preempt),
        MetricsCallback(log, device, flops_per_token(cfg.model, cfg.data.seq_len)["train"], peak,
                        cfg.logging.log_every, cfg.logging.progress),
        NonFiniteLossCallback(t.max_nonfinite_steps, lambda: ck.find_latest(ckpt_root)),
        EvalCallback(lambda: data_api.build_val_loader(cfg.data, t.micro_batch_size, dp_rank, dp_world),
                     cfg.eval.every, cfg.eval.batches, log),
        PreemptionCallback(why=data_stop.reason),
        CheckpointCallback(checkpointer, rank, cfg.checkpoint.every, cfg.checkpoint.at_end),
        *extra_callbacks,
    ]:
        trainer.add_callback(cb)
    return trainer
