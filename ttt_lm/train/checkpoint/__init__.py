"""Checkpoints that a killed run can never leave half-written, that are verified before use, and
that never fill a disk silently: the file format (this module), the run's one ``Checkpointer``
(``checkpointer``: a dict of states with the engine), the resume selection and checks
(``resume.CheckpointManager``) and the resharding onto another layout (``reshard``).

Layout of ``<run_dir>/checkpoints``::

    latest                  text: the name of the newest complete checkpoint (for people and tools;
                            resuming derives the newest from the directories themselves)
    step_00000100/
        ds/                 DeepSpeed's engine.save_checkpoint (module, ZeRO optimizer shards, lr schedule)
        trainer_state.json  step, tokens seen, skipped steps, world size, what must not change, and
                            ``files``: the size and sha256 of every other file of the checkpoint
        rank_00000.pt       the trainer state's per-rank entries (``Trainer.RANK_KEYS``): RNG states
                            (Python, numpy, torch[, CUDA]) and data-loader state
        config.yaml         the resolved experiment config

Every rank writes into ``.tmp-step_…``; after a barrier the ranks hash the files (each rank a
share of them), rank 0 writes ``trainer_state.json`` with the digests, renames the directory to
``step_…`` and only then rewrites ``latest``. A directory named ``step_…`` with a
``trainer_state.json`` is therefore complete; ``verify`` checks that its files are still the ones
written (a missing file, another size, another digest), and ``select`` falls back to the newest
checkpoint that verifies, saying which one failed and why. Old checkpoints are renamed to
``.trash-…`` before they are deleted; ``clean_stale`` removes ``.tmp-…`` and ``.trash-…`` that a
killed run left behind. Before a save, ``check_space`` compares the free space with the size of
the last checkpoint and stops with "no space left on <path>: need ~X, have Y"; a save that fails
anyway (a disk filling up meanwhile) removes its partial directory and says the same.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as tdist

DS_TAG = "ds"
STATE_FILE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
#: prefixes of what a killed save or clean-up leaves behind (never a complete checkpoint)
STALE_PREFIXES = (".tmp-", ".trash-", "latest.tmp")
#: free space a save asks for, as a multiple of the last checkpoint's size
SPACE_MARGIN = 1.1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed here, with what to do about it."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _barrier() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()


def _dist() -> Tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def gather(obj) -> List[Any]:
    """Every rank's ``obj``, on every rank (just ``[obj]`` without a process group)."""
    _, world = _dist()
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    tdist.all_gather_object(out, obj)
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _note(msg: str) -> None:
    print(f"[checkpoint] {msg}", file=sys.stderr, flush=True)


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
    """The newest complete checkpoint under root (by step, from the directories: a run killed
    between the rename and the ``latest`` update still resumes from its newest), or None."""
    cks = list_checkpoints(root)
    return cks[-1][1] if cks else None


# ---- digests -----------------------------------------------------------------------------------

def _walk(ckpt: str) -> List[str]:
    """Every file of a checkpoint but trainer_state.json, as sorted relative paths."""
    out = []
    for d, _, files in os.walk(ckpt):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), ckpt)
            if rel != STATE_FILE:
                out.append(rel)
    return sorted(out)


def _sha256(path: str) -> str:
    from ttt_lm.data.tokenizer import sha256_file
    return sha256_file(path)


def digest_files(ckpt: str) -> Dict[str, Dict[str, Any]]:
    """Collective: {relative path: {"bytes", "sha256"}} of every file of ``ckpt`` but the state
    file. Each rank hashes every world-th file, so a large checkpoint is hashed in parallel."""
    rank, world = _dist()
    files = _walk(ckpt)
    mine = {}
    for rel in files[rank::world]:
        p = os.path.join(ckpt, rel)
        mine[rel] = {"bytes": os.path.getsize(p), "sha256": _sha256(p)}
    out: Dict[str, Dict[str, Any]] = {}
    for part in gather(mine):
        out.update(part)
    return out


def read_state(ckpt: str) -> Dict[str, Any]:
    p = os.path.join(ckpt, STATE_FILE)
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: {STATE_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {STATE_FILE} is damaged ({e})") from e


def verify(ckpt: str) -> List[str]:
    """Collective where a process group exists (same answer on every rank): what is wrong with
    ``ckpt`` — files missing, of another size or another sha256 than recorded at save — as
    messages naming each file; [] when it verifies. A checkpoint written before digests were
    recorded has nothing to compare and verifies (with a note)."""
    rank, world = _dist()
    problems: List[str] = []
    try:
        files = read_state(ckpt).get("files")
    except CheckpointError as e:
        files, problems = {}, [str(e)]
    if files is None:
        if rank == 0:
            _note(f"{ckpt} records no file digests (written by an older version): not verified")
        files = {}
    for rel in sorted(files)[rank::world]:
        p = os.path.join(ckpt, rel)
        want = files[rel]
        if not os.path.isfile(p):
            problems.append(f"{p} is missing")
        elif os.path.getsize(p) != want["bytes"]:
            problems.append(f"{p} is {os.path.getsize(p)} bytes, {want['bytes']} were written")
        elif _sha256(p) != want["sha256"]:
            problems.append(f"{p}: sha256 differs from the one recorded at save (the file is corrupt)")
    out: List[str] = []
    for part in gather(problems):
        out += [q for q in part if q not in out]
    return out


def _step_dir(path: str) -> bool:
    return bool(_STEP_RE.match(os.path.basename(os.path.normpath(path)))) or os.path.isfile(
        os.path.join(path, STATE_FILE))


def select(path: str, accept: Optional[Callable[[str], Optional[str]]] = None,
           note: Callable[[str], None] = _note, say_used: bool = True) -> Tuple[str, List[Tuple[str, str]]]:
    """The checkpoint to load from ``path`` (a step_… directory, a checkpoints/ root or a run
    directory) and the newer ones passed over, as ``(checkpoint, [(path, why), ...])``.

    A step directory must verify, or CheckpointError names the file at fault. From a root, the
    newest checkpoint that verifies (and that ``accept`` does not reject: it returns a reason or
    None) is taken; each newer one passed over is reported through ``note``. Collective when a
    process group exists. ``say_used=False``: the caller names the checkpoint taken itself (only
    the ones passed over are noted here)."""
    if _step_dir(path):
        problems = verify(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} does not verify: " + "; ".join(problems[:5])
                                  + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
        why = accept(path) if accept else None
        if why:
            raise CheckpointError(f"checkpoint {path}: {why}")
        return path, []
    for root in (path, os.path.join(path, "checkpoints")):
        cks = list_checkpoints(root)
        if not cks:
            continue
        passed: List[Tuple[str, str]] = []
        for _, c in reversed(cks):
            problems = verify(c)
            why = "; ".join(problems[:3]) if problems else (accept(c) if accept else None)
            if not why:
                if passed and say_used:
                    note(f"using {c}, the newest checkpoint that verifies")
                return c, passed
            note(f"passing over {c}: {why}")
            passed.append((c, why))
        raise CheckpointError(f"no checkpoint under {root} verifies: " + "; ".join(f"{c}: {w}" for c, w in passed))
    raise CheckpointError(f"no complete checkpoint at {path}")


def after_nonfinite_losses(ckpt: str) -> Optional[str]:
    """Why a checkpoint is not resumed from (nor exported, nor evaluated from a run directory):
    it was saved while the loss was non-finite; None for a good one. ``select``'s ``accept``."""
    n = read_state(ckpt).get("nonfinite_in_a_row", 0)
    return f"saved during {n} non-finite losses in a row" if n else None


def resolve(path: str, say: Optional[Callable[[str], Any]] = None) -> str:
    """A verified checkpoint dir from a checkpoint dir, a checkpoints/ root or a run dir, chosen
    as a resumed run chooses (``select`` with ``after_nonfinite_losses``). From a root or run
    directory ``say`` (default: stderr) is told which checkpoint and step were taken, in one line
    (after one line for each newer one passed over)."""
    say = say or _note
    ckpt, passed = select(path, accept=after_nonfinite_losses, note=say, say_used=False)
    if not _step_dir(path):
        say(f"using {ckpt} (step {read_state(ckpt).get('step')})"
                       + (", the newest checkpoint that verifies" if passed else ""))
    return ckpt


def set_aside(path: str, reason: str) -> str:
    """Rename a checkpoint so that it is neither resumed from nor pruned (``<reason>-step_…``);
    nothing is deleted. Returns the new path."""
    dst = os.path.join(os.path.dirname(path), f"{reason}-{os.path.basename(path)}")
    i = 1
    while os.path.exists(dst):
        dst = os.path.join(os.path.dirname(path), f"{reason}{i}-{os.path.basename(path)}")
        i += 1
    os.rename(path, dst)
    return dst


# ---- space and leftovers -----------------------------------------------------------------------

def clean_stale(root: str, say: Optional[Callable[[str], Any]] = None) -> List[Tuple[str, int]]:
    """Remove what killed saves and clean-ups left under root (``.tmp-step_…``, ``.trash-step_…``,
    ``latest.tmp``); returns [(name, bytes)], and tells ``say`` of each. Call on one rank, while
    holding the run's lock (or knowing that no other run holds it)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith(STALE_PREFIXES):
            p = os.path.join(root, name)
            size = _tree_bytes(p)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.remove(p)
            out.append((name, size))
            if say is not None:
                say(f"[train] removed {p} ({size} bytes) left by an interrupted save or clean-up")
    return out


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def checkpoint_bytes(ckpt: str) -> int:
    """Size of a checkpoint on disk (from its recorded digests when it has them)."""
    try:
        files = read_state(ckpt).get("files")
    except CheckpointError:
        files = None
    if files:
        return sum(f["bytes"] for f in files.values()) + os.path.getsize(os.path.join(ckpt, STATE_FILE))
    return _tree_bytes(ckpt)


def free_bytes(path: str) -> int:
    return shutil.disk_usage(free_path(path)).free


def check_space(root: str, need: Optional[int]) -> None:
    """Collective: stop (CheckpointError on every rank) when rank 0 sees less free space under
    ``root`` than ``need`` bytes (None: no estimate yet, nothing to check)."""
    rank, _ = _dist()
    msg = None
    if rank == 0 and need:
        have = free_bytes(root)
        if have < need:
            msg = _no_space(root, need, have)
    msg = gather(msg)[0]
    if msg:
        raise CheckpointError(msg)


def _no_space(root: str, need: Optional[int], have: int) -> str:
    need_s = f"~{_human(need)}" if need else "more"
    return (f"no space left on {os.path.abspath(root)}: need {need_s} for a checkpoint, have {_human(have)}. "
            "Free space there (older checkpoints: checkpoint.keep_last) or point train.run_dir elsewhere; "
            "the last complete checkpoint is intact and a rerun resumes from it")


def _disk_full(exc: BaseException, root: str) -> bool:
    """Did ``exc`` (raised while writing under root) come from a full disk? An ENOSPC/EDQUOT in
    its chain says so; torch.save's C++ writer reports a full disk without an errno ("basic_ios::
    clear: iostream error", "unexpected pos N vs M", "PytorchStreamWriter failed writing file"),
    so otherwise the disk itself is asked, before the partial files are removed: a failed write
    fills a file system to the brim, so less than max(1 MiB, min(1 % of it, 64 MiB)) free counts."""
    e: Optional[BaseException] = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    usage = shutil.disk_usage(free_path(root))
    return free_bytes(root) < max(1 << 20, min(0.01 * usage.total, 64 << 20))


def free_path(path: str) -> str:
    """The nearest existing directory at or above path (the one whose file system holds it)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return path


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
         config_yaml: str, rank: int, keep_last: int, need_bytes: Optional[int] = None) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path.

    ``need_bytes`` (the size of the last checkpoint, if known) is checked against the free space
    first. A failure while writing on any rank removes the partial directory and raises
    CheckpointError on every rank ("no space left on …" when the disk is full)."""
    name = step_dir_name(step)
    final, tmp = os.path.join(root, name), os.path.join(root, ".tmp-" + name)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    _barrier()
    check_space(root, int(need_bytes * SPACE_MARGIN) if need_bytes else None)
    err = None
    try:
        if rank == 0:
            if os.path.exists(tmp):  # left by a run killed while saving
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        _barrier()
        engine.save_checkpoint(tmp, tag=DS_TAG, save_latest=False)
        torch.save({"rng": rng_state(), **rank_state}, os.path.join(tmp, rank_file(rank)))
        if rank == 0:
            with open(os.path.join(tmp, "config.yaml"), "w") as f:
                f.write(config_yaml)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        err = e
    errs = gather(None if err is None else (rank, f"{type(err).__name__}: {err}", _disk_full(err, root)))
    failed = [e for e in errs if e is not None]
    if failed:
        written = _tree_bytes(tmp) if rank == 0 else 0
        have = free_bytes(root)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        if any(full for _, _, full in failed):
            msg = _no_space(root, need_bytes or written or None, have)
        else:
            msg = f"saving checkpoint {final} failed on rank {failed[0][0]}: {failed[0][1]}"
        raise CheckpointError(msg) from err
    _barrier()
    state = dict(state, files=digest_files(tmp))
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


def rank_states(ckpt: str) -> List[Dict[str, Any]]:
    """Every rank's state file of ``ckpt`` (``rank_*.pt``), in rank order, without RNG states:
    what a resume on another number of ranks merges (the data loaders' positions)."""
    names = sorted(n for n in os.listdir(ckpt) if re.match(r"^rank_\d{5}\.pt$", n))
    if not names:
        raise CheckpointError(f"checkpoint {ckpt} holds no rank_*.pt file")
    out = []
    for n in names:
        p = os.path.join(ckpt, n)
        try:
            rs = torch.load(p, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read {p}: {type(e).__name__}: {e}") from e
        rs.pop("rng", None)
        out.append(rs)
    return out


def load(engine, ckpt: str, rank: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Collective: restore the engine (module, optimizer, schedule) and return
    (trainer_state, this rank's state: its loader state and RNG states, which the trainer's
    ``load_state_dict`` puts back). ``ckpt`` should have
    passed ``verify``; whatever still goes wrong is a CheckpointError naming the checkpoint."""
    state = read_state(ckpt)
    try:
        path, _ = engine.load_checkpoint(ckpt, tag=DS_TAG, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except Exception as e:  # noqa: BLE001 - DeepSpeed asserts, zip and pickle errors alike
        raise CheckpointError(f"DeepSpeed could not load {ckpt}/{DS_TAG}: {type(e).__name__}: {e}") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {ckpt}/{DS_TAG}")
    rf = os.path.join(ckpt, rank_file(rank))
    try:
        rs = torch.load(rf, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read {rf}: {type(e).__name__}: {e}") from e
    return state, rs
