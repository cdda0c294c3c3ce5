"""The training loop: a ``Trainer`` whose ``fit()`` runs steps and hands everything else to callbacks.

One step = ``train.grad_accum`` micro-batches per rank, then one optimizer update, then one
collective (the mean loss over ranks and whether any rank was signalled to stop), read on the host
once. The loss of each micro-batch is summed on the device: no host sync per micro-batch.

Around the steps, ``fit()`` calls each callback's hooks (OLMo-core's shape)::

    pre_train                 once, before the first step
    pre_step / post_step      around every step (``trainer.step`` is the number of finished steps:
                              k in pre_step of step k + 1, k + 1 in its post_step)
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
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence


class Callback:
    """A hook set for ``Trainer.fit()``; override what you need. ``trainer`` is the running Trainer."""

    def pre_train(self, trainer: "Trainer") -> None:
        pass

    def pre_step(self, trainer: "Trainer") -> None:
        pass

    def post_step(self, trainer: "Trainer") -> None:
        pass

    def post_train(self, trainer: "Trainer") -> None:
        pass

    def on_error(self, trainer: "Trainer", exc: BaseException) -> None:
        pass


class Trainer:
    """Runs ``max_steps`` optimizer steps of ``engine`` (a DeepSpeed engine) on ``batches``.

    ``step``/``tokens``/``skipped_total``/``nonfinite_run`` continue from a resumed checkpoint's.
    After each step ``record`` holds the step's metrics (the ``kind: train`` record of
    metrics.jsonl). ``forward_kwargs(batch)`` gives the model's extra keyword arguments for a
    batch; ``after_backward`` runs after each backward pass (context parallelism waits for its
    state sends there). ``preempted`` reads whether this rank was signalled (``PreemptionFlag``);
    the step's collective turns it into ``trainer.preempted`` (any rank signalled)."""

    def __init__(self, *, engine, scheduler, batches: Iterator[dict], device, max_steps: int, grad_accum: int,
                 rank: int, world: int, dp_world: int, callbacks: Sequence[Callback] = (),
                 signalled: Callable[[], bool] = lambda: False,
                 forward_kwargs: Callable[[dict], dict] = lambda b: {},
                 after_backward: Optional[Callable[[], None]] = None, stop_after: Optional[int] = None,
                 step: int = 0, tokens: int = 0, skipped_total: int = 0, nonfinite_run: int = 0,
                 write: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.engine, self.scheduler, self.batches, self.device = engine, scheduler, batches, device
        self.max_steps, self.grad_accum, self.stop_after = max_steps, grad_accum, stop_after
        self.rank, self.world, self.dp_world = rank, world, dp_world
        self.callbacks: List[Callback] = list(callbacks)
        self.signalled, self.forward_kwargs, self.after_backward = signalled, forward_kwargs, after_backward
        self.step, self.tokens, self.skipped_total, self.nonfinite_run = step, tokens, skipped_total, nonfinite_run
        #: the step's metrics (set before post_step); the collective's verdict on preemption
        self.record: Dict[str, Any] = {}
        self.preempted = False
        self.stop_requested = False
        self.exit_code = 0
        #: step of the newest checkpoint this run wrote or resumed from (-1: none), kept by the checkpoint callback
        self.last_saved = -1
        #: a console line (rank 0 prints; a progress bar, when shown, replaces this to keep its line intact)
        self.write = write

    def add_callback(self, cb: Callback) -> "Trainer":
        self.callbacks.append(cb)
        return self

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
                    self.request_stop()
                self._call("post_step", self.callbacks)
                if self.stop_requested:
                    break
            self._call("post_train", list(reversed(self.callbacks)))
        except BaseException as e:
            for cb in self.callbacks:
                cb.on_error(self, e)
            raise
        return self.exit_code

    def train_step(self) -> None:
        """One optimizer step; fills ``record``. One collective, read on the host once."""
        import torch
        import torch.distributed as tdist
        engine, dev = self.engine, self.device
        t0 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        # summed on the device: the host reads it once per step, not once per micro-batch
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
        # one collective per step: mean loss over ranks, and whether any rank was signalled.
        # TP peers hold the same (full, vocab-parallel) loss of the same batch and CP peers loss
        # shares whose mean is that loss, so the mean over the world is the mean over the
        # data-parallel replicas.
        # Built on the training device (NCCL reduces CUDA tensors only) and read on the host once.
        agg = torch.stack([loss_sum / self.grad_accum,
                           torch.tensor(float(self.signalled()), dtype=torch.float64, device=dev)])
        tdist.all_reduce(agg)
        agg = agg.tolist()
        loss = agg[0] / self.world
        self.preempted = agg[1] > 0
        self.step += 1
        self.tokens += local_tokens * self.dp_world
        skipped = not math.isfinite(loss) or not engine.was_step_applied()
        if skipped:
            self.skipped_total += 1
            self.nonfinite_run += 1
        else:
            self.nonfinite_run = 0
        gn = engine.get_global_grad_norm()
        gn = float(gn) if gn is not None else None
        dt = time.perf_counter() - t0
        self.record = {"kind": "train", "step": self.step, "loss": loss, "lr": lr,
                       "grad_norm": gn if not skipped else None, "tokens": self.tokens,
                       "tokens_per_s": local_tokens * self.dp_world / dt, "step_time_s": dt,
                       "skipped": skipped, "skipped_total": self.skipped_total}
