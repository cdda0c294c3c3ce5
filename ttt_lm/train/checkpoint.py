"""Checkpoints that a killed run can never leave half-written.

Layout of ``<run_dir>/checkpoints``::

    latest                  text: the name of the newest complete checkpoint (replaced atomically)
    step_00000100/
        ds/                 DeepSpeed's engine.save_checkpoint (module, ZeRO optimizer shards, lr schedule)
        trainer_state.json  step, tokens seen, skipped steps, world size, what must not change
        rank_00000.pt       per-rank RNG states (Python, numpy, torch[, CUDA]) and data-loader state
        config.yaml         the resolved experiment config

Every rank writes into ``.tmp-step_…``; after a barrier rank 0 renames it to ``step_…`` and only
then rewrites ``latest`` with ``os.replace``. A directory named ``step_…`` is therefore always
complete, and ``latest`` never names anything else. Old checkpoints are renamed to ``.trash-…``
before they are deleted, so an interrupted clean-up leaves nothing that looks complete.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as tdist

DS_TAG = "ds"
STATE_FILE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed here, with what to do about it."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _barrier() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Complete checkpoints under root, oldest first, as (step, path)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def find_latest(root: str) -> Optional[str]:
    """The checkpoint ``latest`` names, or else the newest complete one; None if there is none."""
    p = os.path.join(root, "latest")
    if os.path.isfile(p):
        with open(p) as f:
            cand = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(cand, STATE_FILE)):
            return cand
    cks = list_checkpoints(root)
    return cks[-1][1] if cks else None


def resolve(path: str) -> str:
    """A checkpoint dir from a checkpoint dir, a checkpoints/ root or a run dir."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        c = find_latest(root)
        if c is not None:
            return c
    raise CheckpointError(f"no complete checkpoint at {path}")


def rng_state() -> Dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: Dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def save(engine, root: str, step: int, state: Dict[str, Any], rank_state: Dict[str, Any],
         config_yaml: str, rank: int, keep_last: int) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    name = step_dir_name(step)
    final, tmp = os.path.join(root, name), os.path.join(root, ".tmp-" + name)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # left by a run killed while saving
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    engine.save_checkpoint(tmp, tag=DS_TAG, save_latest=False)
    torch.save({**rank_state, "rng": rng_state()}, os.path.join(tmp, rank_file(rank)))
    if rank == 0:
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(config_yaml)
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, STATE_FILE), "w") as f:  # written last: marks the dir complete
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # a checkpoint of this very step from an earlier attempt
            _trash(root, final)
        os.rename(tmp, final)
        _write_latest(root, name)
        _prune(root, keep_last, keep=name)
    _barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))


def _trash(root: str, path: str) -> None:
    trash = os.path.join(root, ".trash-" + os.path.basename(path))
    if os.path.exists(trash):
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _prune(root: str, keep_last: int, keep: str) -> None:
    if keep_last <= 0:
        return
    cks = list_checkpoints(root)
    for _, path in cks[:-keep_last]:
        if os.path.basename(path) != keep:
            _trash(root, path)


def load(engine, ckpt: str, rank: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Collective: restore the engine (module, optimizer, schedule) and return
    (trainer_state, this rank's state); RNG states are restored here too."""
    with open(os.path.join(ckpt, STATE_FILE)) as f:
        state = json.load(f)
    path, _ = engine.load_checkpoint(ckpt, tag=DS_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {ckpt}/{DS_TAG}")
    rs = torch.load(os.path.join(ckpt, rank_file(rank)), map_location="cpu", weights_only=False)
    set_rng_state(rs["rng"])
    return state, rs


def read_state(ckpt: str) -> Dict[str, Any]:
    with open(os.path.join(ckpt, STATE_FILE)) as f:
        return json.load(f)
