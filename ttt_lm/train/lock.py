"""One writer per run directory: an exclusive lock file, ``<run_dir>/run.lock``.

Rank 0 creates it with ``O_CREAT | O_EXCL`` (atomic on local and network file systems alike),
writing who holds it: host, pid, Slurm job id and restart count, start time. While the run lives
a background thread touches the file every ``heartbeat_s`` seconds. A second run on the same
directory is refused with a message naming the holder, unless the lock is stale:

- the holder ran on this host and its pid no longer exists (a killed run, a requeue on the same
  node);
- the holder was an earlier attempt of this very Slurm job (same job id, lower
  ``SLURM_RESTART_COUNT``): Slurm runs one attempt of a job at a time, so a requeue that lands on
  another node takes over at once;
- its heartbeat is older than ``stale_s`` (a dead node's run, seen from another node).

A stale lock is taken over by renaming it to a name of our own (only one contender's rename can
succeed) and creating a fresh one. ``flock``/``fcntl`` locks are not used: on network file systems
they are either unsupported or outlive a crashed node until a lease expires.

Limits: a pid reused on the same host by an unrelated process keeps a stale lock alive until its
heartbeat ages out; two different jobs racing for one stale lock in the same instant may both see
it stale (the loser's later heartbeat check then stops it, see ``lost``).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

from ttt_lm.train.checkpoint import CheckpointError

LOCK_FILE = "run.lock"


class RunDirInUse(CheckpointError):
    """Another live run holds the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDirLock:
    def __init__(self, run_dir: str, stale_s: float = 600.0, heartbeat_s: float = 30.0):
        self.run_dir, self.stale_s, self.heartbeat_s = run_dir, stale_s, heartbeat_s
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.token = uuid.uuid4().hex
        self.lost: Optional[str] = None  # set by the heartbeat when the file is no longer ours
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.held = False

    def _info(self) -> dict:
        e = os.environ
        return {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                "slurm_job_id": e.get("SLURM_JOB_ID"), "slurm_restart_count": int(e.get("SLURM_RESTART_COUNT", 0)),
                "started": time.time()}

    def _read(self) -> Optional[dict]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or damaged: judged by its age alone

    def _stale(self, info: dict, age: float) -> Optional[str]:
        """Why the holder described by ``info`` is gone, or None while it may be alive."""
        me = self._info()
        if info.get("host") == me["host"] and isinstance(info.get("pid"), int) and not _pid_alive(info["pid"]):
            return f"process {info['pid']} on this host ({me['host']}) no longer exists"
        job = info.get("slurm_job_id")
        if job and job == me["slurm_job_id"] and int(info.get("slurm_restart_count", 0)) < me["slurm_restart_count"]:
            return f"it was attempt {info.get('slurm_restart_count', 0)} of this Slurm job {job} (now requeued)"
        if age > self.stale_s:
            return f"its heartbeat is {age:.0f} s old (more than {self.stale_s:.0f} s)"
        return None

    def _describe(self, info: dict, age: float) -> str:
        job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if info.get("started") else "?"
        return (f"pid {info.get('pid', '?')} on {info.get('host', '?')}{job}, started {started}, "
                f"last heartbeat {age:.0f} s ago")

    def acquire(self) -> Optional[str]:
        """Take the lock; return a note when a stale one was taken over, raise RunDirInUse when a
        live run holds it."""
        os.makedirs(self.run_dir, exist_ok=True)
        note = None
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self._read()
                if info is None:
                    continue  # released meanwhile
                try:
                    age = time.time() - os.path.getmtime(self.path)
                except FileNotFoundError:
                    continue
                why = self._stale(info, age)
                if why is None:
                    raise RunDirInUse(
                        f"run directory {os.path.abspath(self.run_dir)} is in use by another run "
                        f"({self._describe(info, age)}); two runs on one directory would overwrite each other's "
                        f"checkpoints and metrics. Wait for it to end or use another train.run_dir. A lock left by a "
                        f"run that died on another node expires {self.stale_s:.0f} s after its last heartbeat "
                        f"({self.path})") from None
                aside = f"{self.path}.stale-{self.token}"
                try:
                    os.rename(self.path, aside)  # only one contender succeeds
                except FileNotFoundError:
                    continue
                os.remove(aside)
                note = f"took over the lock of a run that is gone ({self._describe(info, age)}): {why}"
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self._info(), f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:  # a full disk: the caller may free space (it held no lock) and retry
                os.remove(self.path)
                raise
            self.held = True
            self._thread = threading.Thread(target=self._beat, name="run-dir-lock", daemon=True)
            self._thread.start()
            return note
        raise RunDirInUse(f"could not take the lock {self.path}: other runs keep taking it")

    def owned(self) -> bool:
        info = self._read()
        return bool(info) and info.get("token") == self.token

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self.owned():
                self.lost = f"the lock {self.path} was taken by another run"
                return
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.held and self.owned():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.held = False


__all__ = ["LOCK_FILE", "RunDirLock", "RunDirInUse"]
