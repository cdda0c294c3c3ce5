"""Resuming a run: which checkpoint, whether this run may continue it, and putting it back.

``CheckpointManager`` owns the whole resume, in this order:

1. **select** the checkpoint: ``train.resume_from`` (a step directory, a checkpoints/ root or a
   run directory), else the run directory's newest; from a root the newest that **verifies**
   (every file's size and sha256 as recorded at save, ``ttt_lm.train.checkpoint.select``) and was
   not saved during non-finite losses, each newer one passed over said once;
2. **check** what must not change (``invariants``/``check_resume``: model shape, tokenizer, data)
   and say in one line when the global batch changes (``global_batch_note``); newer checkpoints
   of this run directory that are not resumed from are renamed aside (kept, never pruned);
3. build the train **loader** with the run's number of data streams (fixed when it started);
4. **load** the engine, or **reshard** it when the checkpoint was written on another layout
   (another number of data-parallel ranks or another tensor-parallel size:
   ``ttt_lm.train.checkpoint.reshard``): weights, AdamW moments and step, lr schedule, engine counters;
5. the **trainer state** for ``Trainer.load_state_dict`` (``Restored.state``): the counters, the
   loader state (this rank's own on the same layout, or every old rank's merged into the global
   position, ``ttt_lm.data.merge_states``, so that the global sample order continues at the next
   sample) and the RNG states (this rank's own on the same layout, else a seed from the seed, the
   rank and the step);
6. **optimizer overrides**: lr, betas, eps or weight decay that the running config changes are put
   in force from the next step (``ttt_lm.train.optim.apply_hyperparameters``) and said.

What can be resumed on what (docs/training.md, "Resuming"): the same or another number of data-
parallel ranks, the same or another tensor-parallel size, the same or another global batch; not
another context-parallel size (refused once, on rank 0, saying why and what to do instead), nor
another model, tokenizer or data. Every refusal is a ``CheckpointError`` marked
``same_on_every_rank`` (``alike``): every rank reads the same checkpoint and config, so it is said
once.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as tdist
from omegaconf import OmegaConf

from ttt_lm.data.remote import is_remote
from ttt_lm.model.config import ModelConfig
from ttt_lm.train import checkpoint as ck
from ttt_lm.train.checkpoint import CheckpointError
from ttt_lm.train.engine import keep_global_batch, resolve_grad_accum
from ttt_lm.train.optim import apply_hyperparameters, changed_hyperparameters
from ttt_lm.train.checkpoint.reshard import load_resharded

#: the batch settings of a command (``CheckpointManager.requested``)
BATCH_KEYS = ("micro_batch_size", "grad_accum", "global_batch_size")

#: model-config keys that may differ on resume: they choose kernels, not the model's shape
RUNTIME_MODEL_KEYS = ("kernel_backend", "attention.backend", "compile", "compile_backend", "loss_chunk_size")


def seed_all(seed: int) -> None:
    """Python's, numpy's and torch's generators from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def alike(e: Exception) -> Exception:
    """Mark an error that every rank raises alike (``trainer.main`` prints it once, on rank 0)."""
    e.same_on_every_rank = True
    return e


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
    """What a resumed run must share with the checkpoint it resumes (the model's shape, the
    tokenizer, the data), and the parallel sizes the checkpoint was written with (the
    tensor-parallel size may change on resume, ``reshard``; the context-parallel one not)."""
    model = _flat(OmegaConf.to_container(OmegaConf.structured(cfg.model)))
    for k in RUNTIME_MODEL_KEYS:
        model.pop(k, None)
    # the data is identified by its manifest's checksum (tokenizer and every shard's digest), not by
    # its path: the same data under another path (absolute, or copied to node-local scratch) is
    # the same data; data_path is kept for the record only
    data_path = cfg.data.path if is_remote(cfg.data.path) else os.path.normpath(cfg.data.path)
    return {"model": model, "data_path": data_path, "data_checksum": manifest.get("checksum"),
            "vocab_size": manifest.get("vocab_size"),
            "tokenizer": manifest.get("tokenizer_sha256") or manifest.get("tokenizer"),
            "tensor_parallel": cfg.parallel.tensor_parallel, "context_parallel": cfg.parallel.context_parallel}


def check_resume(saved: dict, now: dict, ckpt: str, dp_world: int = None, cfg_now=None) -> None:
    """Refuse a resume that cannot continue the run: another model, tokenizer, data or
    context-parallel size. The number of data-parallel ranks, the tensor-parallel size and the
    global batch may change (``reshard``, ``global_batch_note``); ``dp_world`` and ``cfg_now`` are
    accepted for callers that pass them."""
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
    # checkpoints written before context parallelism was recorded were all context_parallel=1
    cp_old, cp_new = inv.get("context_parallel", 1), now.get("context_parallel", 1)
    if cp_old != cp_new:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it was written with parallel.context_parallel={cp_old} and this run has "
            f"{cp_new}; resuming on another context-parallel size is not supported (its resharding is not "
            f"tested). Resume with parallel.context_parallel={cp_old}, or export the weights with `python -m "
            f"ttt_lm.train.export {ckpt} <out>` and start a new run with train.init_from=<out> (fresh optimizer "
            "state)")
    if diff:
        raise CheckpointError(
            f"cannot resume from {ckpt}: the run changed what a resumed run must keep:\n  " + "\n  ".join(diff)
            + "\nrestore those settings, or start a new run (another train.run_dir)")


def _saved_config(ckpt: str) -> dict:
    try:
        return OmegaConf.to_container(OmegaConf.load(os.path.join(ckpt, "config.yaml")))
    except Exception as e:  # noqa: BLE001 - verified at select(); yaml errors name the file
        raise CheckpointError(f"cannot read {ckpt}/config.yaml: {e}") from e


def global_batch_note(ckpt: str, cfg, saved_dp: int, dp_world: int) -> Optional[str]:
    """One line when the run's global batch (micro-batch × grad_accum × data-parallel ranks)
    differs from the checkpoint's, else None. Allowed: the data order is a sequence of samples
    (``ttt_lm.data.loader``), and the run continues at the sample where the checkpoint stopped."""
    old = _saved_config(ckpt)["train"]
    g_old = old["micro_batch_size"] * old["grad_accum"] * saved_dp
    g_new = cfg.train.micro_batch_size * cfg.train.grad_accum * dp_world
    if g_old == g_new:
        return None
    return (f"the global batch changes from {g_old} to {g_new} sequences (micro_batch_size × grad_accum × "
            f"data-parallel ranks): the data order goes on from the checkpoint's sample position, each step now "
            f"reads {g_new}")


def optim_changes(ckpt: str, cfg) -> list:
    """What the running config changes in the optimizer against the checkpoint's config.yaml."""
    old = _saved_config(ckpt)
    o, t = old.get("optim", {}), old.get("train", {})
    old_total = o.get("total_steps") or t.get("max_steps")
    return changed_hyperparameters(o, cfg.optim, old_total, cfg.optim.total_steps or cfg.train.max_steps)


def layout(dp: int, tp: int = 1, cp: int = 1) -> str:
    """``"2 data-parallel rank(s)"``, ``"1 data-parallel rank(s) × tensor parallel 2"``, …"""
    return f"{dp} data-parallel rank(s)" + (f" × tensor parallel {tp}" if tp > 1 else "") + (
        f" × context parallel {cp}" if cp > 1 else "")


@dataclass
class Restored:
    """Where the run goes on: ``state``, the trainer state to put back (``Trainer.load_state_dict``;
    None for a new run), the optimizer settings the running config changed, and the checkpoint's
    size (the next save's space check). ``step`` … ``nonfinite_run`` read ``state``."""
    state: Optional[dict] = None
    changes: List[str] = field(default_factory=list)
    last_bytes: Optional[int] = None

    def _get(self, key: str) -> int:
        return int((self.state or {}).get(key, 0))

    @property
    def step(self) -> int:
        return self._get("step")

    @property
    def tokens(self) -> int:
        return self._get("tokens")

    @property
    def skipped_total(self) -> int:
        return self._get("skipped_steps")

    @property
    def nonfinite_run(self) -> int:
        return self._get("nonfinite_in_a_row")


class CheckpointManager:
    """One run's resume (see the module docstring). Every method is collective.

    ``groups``: the run's ``ttt_lm.parallel.groups.ParallelGroups`` (or anything with ``rank``,
    ``dp_rank``, ``dp_size``, ``tp_rank``, ``tp_size``, ``cp_size``); ``say``: rank 0's console."""

    def __init__(self, cfg, ckpt_root: str, groups, say: Callable[[str], None] = lambda m: None):
        self.cfg, self.root, self.g, self.say = cfg, ckpt_root, groups, say
        #: the batch settings as the command gave them (before any is derived): a resumed run whose
        #: command gives the same keeps the checkpoint's global batch (``select``)
        self.requested = {k: getattr(cfg.train, k) for k in BATCH_KEYS}
        self.ckpt: Optional[str] = None
        self.state: dict = {}
        self._data_api, self._saved_loaders = None, None

    # -- 1, 2: select, verify, check ----------------------------------------------------------
    def select(self, inv: dict) -> Optional[str]:
        """The checkpoint this run resumes from (None: a new run), verified and checked against
        ``inv`` (``invariants``); newer ones of this run directory are renamed aside."""
        src = self.cfg.train.resume_from or (self.root if ck.list_checkpoints(self.root) else None)
        if src is None:
            return None
        ckpt, passed = ck.select(src, accept=ck.after_nonfinite_losses, note=self.say)
        state = ck.read_state(ckpt)
        try:
            check_resume(state, inv, ckpt)
            self._check_layout(ckpt, state)
        except CheckpointError as e:
            raise alike(e)  # every rank read the same checkpoint and config
        t, G = self.cfg.train, self._global_batch(ckpt, state)
        if G is not None:
            adapted = keep_global_batch(t, self.g.dp_size, G)
            if adapted:
                self.say(adapted)
        else:
            t.grad_accum = resolve_grad_accum(t, self.g.dp_size)
        note = global_batch_note(ckpt, self.cfg, state["dp_world"], self.g.dp_size)
        if note:
            self.say(note)
        if self.g.rank == 0:
            self._set_aside_newer(state["step"], {os.path.abspath(c) for c, _ in passed})
        if tdist.is_available() and tdist.is_initialized():
            tdist.barrier()
        self.ckpt, self.state = ckpt, state
        return ckpt

    def _global_batch(self, ckpt: str, state: dict) -> Optional[int]:
        """The global batch the resumed run keeps: ``train.global_batch_size`` when given, else the
        checkpoint's when the command's batch settings are those the checkpointed run was started
        with (the same command on another number of ranks); None when the command changes
        micro_batch_size or grad_accum (the global batch is then theirs × the ranks)."""
        t = self.cfg.train
        if t.global_batch_size is not None:
            return t.global_batch_size
        saved, old = state.get("batch") or {}, _saved_config(ckpt)["train"]
        requested = saved.get("requested") or {k: old.get(k) for k in BATCH_KEYS}
        if requested != self.requested:
            return None
        return saved.get("global") or old["micro_batch_size"] * old["grad_accum"] * state["dp_world"]

    def _check_layout(self, ckpt: str, state: dict) -> None:
        tp_old = state.get("tensor_parallel", 1)
        if tp_old > 1 and tp_old != self.g.tp_size and not state.get("partition_dims"):
            raise CheckpointError(f"cannot resume from {ckpt} with parallel.tensor_parallel={self.g.tp_size}: it "
                                  f"was written with tensor_parallel={tp_old} by a version that did not record how "
                                  f"each parameter is split; resume with tensor_parallel={tp_old}")

    def _set_aside_newer(self, step: int, rejected: set) -> None:
        # kept, never pruned: a later restart must not pick them over the new branch
        for s, c in ck.list_checkpoints(self.root):
            if s > step:
                why = "rejected" if os.path.abspath(c) in rejected else "superseded"
                print(f"[train] {c} is newer than the checkpoint resumed from: renamed to {ck.set_aside(c, why)} "
                      "(delete it when no longer needed)", flush=True)

    @property
    def resharded(self) -> bool:
        """Was the checkpoint written on another layout (data-parallel ranks or tensor-parallel size)?"""
        s = self.state
        return self.ckpt is not None and (s["dp_world"] != self.g.dp_size
                                          or s.get("tensor_parallel", 1) != self.g.tp_size)

    # -- 3: the loader --------------------------------------------------------------------------
    def build_loader(self, data_api):
        """The train loader with the run's number of data streams: a resumed run's from its
        checkpoint (``data.streams``, if set, must agree), a new run's from the config."""
        cfg, ckpt = self.cfg, self.ckpt
        self._data_api = data_api
        self._saved_loaders = ck.rank_states(ckpt) if self.resharded else None
        sd = None
        if self._saved_loaders is not None:
            if not hasattr(data_api, "merge_states"):
                raise alike(CheckpointError(f"cannot resume from {ckpt} on another parallel layout: this data "
                                            "pipeline cannot convert its loader state"))
            sd = self._saved_loaders[0].get("loader")
        elif ckpt is not None:
            sd = torch.load(os.path.join(ckpt, ck.rank_file(0)), map_location="cpu", weights_only=False).get("loader")
        args = (cfg.data, cfg.train.micro_batch_size, self.g.dp_rank, self.g.dp_size)
        if not isinstance(sd, dict) or "total_streams" not in sd:  # a new run, or a pipeline without streams
            if isinstance(sd, dict) and "n_streams" in sd:
                raise alike(CheckpointError(f"cannot resume from {ckpt}: its data-loader state (version "
                                            f"{sd.get('version')}) was written by an older version of this code, "
                                            "whose data order differs; resume it with that version, or start a new "
                                            "run with train.init_from=<exported weights>"))
            return data_api.build_train_loader(*args)
        V = int(sd["total_streams"])
        want = getattr(cfg.data, "streams", None)
        if want is not None and want != V:
            raise alike(CheckpointError(f"cannot resume from {ckpt} with data.streams={want}: the run reads {V} "
                                        f"data streams (fixed when it started); set data.streams={V} or leave it "
                                        "unset"))
        return data_api.build_train_loader(*args, total_streams=V)

    # -- 4-7: engine, the trainer state (loader position, RNG), optimizer overrides ----------------
    def restore(self, engine, loader, sched, group_weight_decay: List[float]) -> Restored:
        """Put the checkpoint back into ``engine`` and the running config's optimizer settings into
        ``sched``; return the trainer state (``Restored.state``) for ``Trainer.load_state_dict``,
        which puts back the counters, ``loader``'s position and the RNGs (nothing for a new run)."""
        ckpt, g = self.ckpt, self.g
        if ckpt is None:
            return Restored()
        if self.resharded:
            s = self.state
            state = load_resharded(engine, ckpt, g.tp_rank, g.tp_size)
            merged = self._data_api.merge_states([r["loader"] for r in self._saved_loaders])
            # RNG states are per rank: on another layout each rank starts a stream of its own, from
            # the seed, its rank and the step
            trainer_state = {**state, "loader": None, "loader_merged": merged, "rng": None,
                             "rng_seed": self.cfg.train.seed + 1 + g.rank + 1_000_003 * state["step"]}
            tp_old = s.get("tensor_parallel", 1)
            now = g.dp_size if tp_old == g.tp_size else layout(g.dp_size, g.tp_size)
            self.say(f"{ckpt} was written by {layout(s['dp_world'], tp_old)}, this run has {now}: optimizer state "
                     f"resharded, the data order continues ({getattr(loader, 'total_streams', '?')} streams)")
        else:
            state, rs = ck.load(engine, ckpt, g.rank)
            trainer_state = {**state, **rs}   # this rank's own entries (loader, rng) beside the shared ones
        out = Restored(trainer_state, optim_changes(ckpt, self.cfg), ck.checkpoint_bytes(ckpt))
        if out.changes:
            # the checkpoint restored the old rates into the optimizer and the schedule
            apply_hyperparameters(sched, self.cfg.optim, group_weight_decay)
            self.say(f"resumed with changed optimizer settings, in force from step {out.step + 1}: "
                     + "; ".join(out.changes))
        return out


__all__ = ["CheckpointManager", "Restored", "invariants", "check_resume", "global_batch_note", "optim_changes",
           "seed_all", "alike", "layout", "RUNTIME_MODEL_KEYS"]
