"""The run's one checkpointer: saves and loads a dict of states with the engine.

A state is anything with ``state_dict()`` / ``load_state_dict(sd)`` (torchtitan hands its
checkpointer ``states={"train_state": trainer}``; OLMo-core's trainer is one such state). The
trainer's own (``TRAIN_STATE``, ``ttt_lm.train.trainer.Trainer.state_dict``: step, counters, loader
position, RNG, callbacks' states) is written as the entries of ``trainer_state.json``, its
``RANK_KEYS`` to each rank's ``rank_*.pt``; any other state is written under its name in
``trainer_state.json`` and must be the same on every rank. The engine (weights, optimizer, lr
schedule) is DeepSpeed's files. Writing goes through ``ttt_lm.train.checkpoint.save`` (digests,
atomic rename, space checks, pruning); loading through ``ttt_lm.train.checkpoint.resume.CheckpointManager``
(selection with fallback, the checks, resharding on another layout).
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional

from ttt_lm.train import checkpoint as ck

#: the name of the trainer's state in ``states``
TRAIN_STATE = "train_state"


class Checkpointer:
    """``record`` is what every checkpoint's ``trainer_state.json`` holds beside the states (the
    layout it was written on, the invariants, the batch); ``lock`` is the run directory's lock on
    rank 0 (None elsewhere): a lost lock stops the run without saving. ``manager``, the run's
    ``CheckpointManager``, loads (``load``); ``last_bytes`` is the size of the checkpoint resumed
    from (the first save's space check)."""

    def __init__(self, engine, root: str, config_yaml: str, record: Dict[str, Any], rank: int, keep_last: int,
                 manager=None, lock=None, last_bytes: Optional[int] = None):
        self.engine, self.root, self.config_yaml, self.record = engine, root, config_yaml, record
        self.rank, self.keep_last, self.manager, self.lock, self.last_bytes = rank, keep_last, manager, lock, last_bytes

    def save(self, step: int, states: Dict[str, Any]) -> str:
        """Collective: the checkpoint of ``step`` with every state's ``state_dict()``; its path."""
        from ttt_lm.train.lock import RunDirInUse
        lost = ck.gather(self.lock.lost if self.lock is not None else None)[0]
        if lost:
            raise RunDirInUse(f"{lost}: stopping without saving")
        shared: Dict[str, Any] = {}
        per_rank: Dict[str, Any] = {}
        for name, obj in states.items():
            sd = dict(obj.state_dict())
            if name == TRAIN_STATE:
                per_rank.update({k: sd.pop(k) for k in getattr(obj, "RANK_KEYS", ()) if k in sd})
                shared.update(sd)
            else:
                shared[name] = sd
        path = ck.save(self.engine, self.root, step, {**shared, **self.record, "time": time.time()}, per_rank,
                       self.config_yaml, self.rank, self.keep_last, need_bytes=self.last_bytes)
        self.last_bytes = ck.checkpoint_bytes(path)
        return path

    def load(self, states: Dict[str, Any], loader, scheduler, group_weight_decay):
        """Collective: the checkpoint the manager selected (nothing for a new run) back into the
        engine (loaded or resharded; the running config's optimizer settings in force) and into
        every state; returns the manager's ``Restored``."""
        at = self.manager.restore(self.engine, loader, scheduler, group_weight_decay)
        if at.state is not None:
            self.last_bytes = at.last_bytes
            for name, obj in states.items():
                if name == TRAIN_STATE:
                    obj.load_state_dict(at.state)
                elif name in at.state:
                    obj.load_state_dict(at.state[name])
        return at


__all__ = ["Checkpointer", "TRAIN_STATE"]
