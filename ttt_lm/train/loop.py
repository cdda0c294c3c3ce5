"""The training loop's shape: ``ttt_lm.train.trainer.Trainer.fit()`` runs steps and hands everything
else to callbacks, whose base class (``Callback``) is here.

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

from typing import Any, Dict, List, Optional


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
