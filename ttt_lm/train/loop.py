"""The training loop: a ``Trainer`` whose ``fit()`` runs steps and hands everything else to callbacks.

One step = ``train.grad_accum`` micro-batches per rank, then one optimizer update. The step reads
nothing back from the device (no ``.item()``, ``.tolist()``, ``float(tensor)``): its loss stays a
device tensor, queued with the host-side facts of the step (lr, whether DeepSpeed applied the
update, the gradient norm as DeepSpeed returns it). Every ``read_every`` steps (``logging.log_every``
in a run), and wherever a callback needs them (``Callback.wants_metrics``: checkpoint and evaluation
steps), at the last step and before a stop, ``read_metrics()`` turns the queue into records with
one collective (the losses' mean over ranks and whether any rank was signalled to stop) and one
device-to-host read, then hands them to every callback's ``on_metrics``. So a non-finite loss, a
preemption signal and the metrics are all seen at the next read, up to ``read_every`` − 1 steps
late; the steps in between keep the device busy. DeepSpeed's own optimizer step still reads its
overflow flag and gradient norm on the host (ZeRO-1/2 under bf16: one ``.item()`` and a few
``bool(tensor)`` per step; ZeRO-3 more): those are DeepSpeed's, not this loop's.

Around the steps, ``fit()`` calls each callback's hooks (OLMo-core's shape)::

    pre_train                 once, before the first step
    pre_step / post_step      around every step (``trainer.step`` is the number of finished steps:
                              k in pre_step of step k + 1, k + 1 in its post_step)
    wants_metrics             after a step, before post_step: True asks for a read at this step
    on_metrics(records)       after each read: the records of the steps read, in step order
    post_train                once, after the last step, in reverse order (teardown)
    on_error(exc)             when a step or a hook raised; the exception is re-raised after

Checkpointing, evaluation, metrics, preemption and the non-finite-loss stop are callbacks
(``ttt_lm.train.callbacks``); a callback ends the run after the current step with
``trainer.request_stop()``. Callbacks run in list order, so one that reads what another writes in
``post_step`` (the checkpoint callback saves when an earlier one asked for a stop) comes after it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence


class Callback:
    """A hook set for ``Trainer.fit()``; override what you need. ``trainer`` is the running Trainer."""

    def pre_train(self, trainer: "Trainer") -> None:
        pass

    def pre_step(self, trainer: "Trainer") -> None:
        pass

    def post_step(self, trainer: "Trainer") -> None:
        pass

    def wants_metrics(self, trainer: "Trainer") -> bool:
        """Whether this callback needs the metrics of the step just finished read in its
        post_step (the step's loss, skipped flag, preemption verdict)."""
        return False

    def on_metrics(self, trainer: "Trainer", records: List[Dict[str, Any]]) -> None:
        pass

    def post_train(self, trainer: "Trainer") -> None:
        pass

    def on_error(self, trainer: "Trainer", exc: BaseException) -> None:
        pass

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """This callback's resumable state (JSON-serializable, the same on every rank), saved in the
        trainer's ``state_dict`` under the callback's ``state_key``; None: it has none."""
        return None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    @property
    def state_key(self) -> str:
        return type(self).__name__


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
        from ttt_lm.train.trainer import build
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
        from ttt_lm.train.checkpoint import rng_state
        cbs = {cb.state_key: st for cb in self.callbacks if (st := cb.state_dict()) is not None}
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_total,
                "nonfinite_in_a_row": self.nonfinite_run, **({"callbacks": cbs} if cbs else {}),
                "loader": self.loader.state_dict() if self.loader is not None else None, "rng": rng_state()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Put back what ``state_dict`` returned (a resumed run's, from ``ttt_lm.train.resume``).
        On another layout the checkpointer hands over ``loader_merged`` (every old rank's loader
        state merged, ``load_merged_state``) instead of ``loader``, and ``rng_seed`` (a seed of this
        rank's own) instead of ``rng``. Call it before the first batch is read."""
        from ttt_lm.train.checkpoint import set_rng_state
        from ttt_lm.train.resume import seed_all
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        self.skipped_total, self.nonfinite_run = int(sd["skipped_steps"]), int(sd.get("nonfinite_in_a_row", 0))
        if self.loader is not None and sd.get("loader_merged") is not None:
            self.loader.load_merged_state(sd["loader_merged"])
        elif self.loader is not None and sd.get("loader") is not None:
            self.loader.load_state_dict(sd["loader"])
        if sd.get("rng") is not None:
            set_rng_state(sd["rng"])
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
