"""A real one-node Slurm cluster on this machine, for tests: munged, slurmctld and slurmd started
from a slurm.conf written under a temporary directory, stopped by their pid files.

Debian's packages (``slurmctld slurmd slurm-client munge``) are installed with apt-get when the
binaries are missing. Every daemon and client reads the private config through ``SLURM_CONF``
and the private munge socket through ``AuthInfo=socket=...``, so nothing under /etc is used and
a cluster already running on the machine is not touched.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "munged"]
CPUS = 8  # more than the machine's cores, accepted through SlurmdParameters=config_overrides


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here (no root or no apt-get)."""


def _which(name: str) -> Optional[str]:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def ensure_installed() -> None:
    """Install Slurm and munge with apt-get unless their binaries are already present."""
    if all(_which(b) for b in BINARIES):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root (apt-get)")
    if not _which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{r.stdout[-3000:]}")
    missing = [b for b in BINARIES if not _which(b)]
    if missing:
        raise SlurmUnavailable(f"apt-get installed {PACKAGES} but these are still missing: {missing}")


def unavailable(reason: str) -> None:
    """Skip the calling test with the reason, or fail it under CI=true (CI must run this tier)."""
    import pytest
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"slurm tier cannot run in CI: {reason}", pytrace=False)
    pytest.skip(f"slurm tier skipped: {reason}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LocalSlurm:
    """One controller and one compute node (``hostname -s``, address 127.0.0.1)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.root, "slurm.conf")
        # munged runs as the munge user, which cannot enter pytest's private (0700) temporary tree
        self.munge_dir = tempfile.mkdtemp(prefix="ttt-munge-")
        self.munge_socket = os.path.join(self.munge_dir, "munge.socket")
        self.pidfiles = {name: os.path.join(self.root, f"{name}.pid") for name in ("slurmd", "slurmctld")}
        self.pidfiles["munged"] = os.path.join(self.munge_dir, "munged.pid")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(self.env):
            # a test run inside a Slurm job must not leak that job's settings into these clients
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]

    # ---------------------------------------------------------------- daemons
    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        try:
            self._start_munged()
            self._write_conf()
            for name in ("slurmctld", "slurmd"):
                self._run([_which(name), "-f", self.conf])
            self._wait_node_ready()
        except BaseException:
            self.stop()
            raise

    def _start_munged(self) -> None:
        munge = pwd.getpwnam("munge")
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        key = os.path.join(self.munge_dir, "munge.key")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o600)
            os.chown(key, munge.pw_uid, munge.pw_gid)
        # the directory holding the socket must be reachable by clients (root here) and not writable by others
        os.chmod(self.munge_dir, 0o755)
        cmd = [_which("munged"), f"--socket={self.munge_socket}", f"--key-file={key}",
               f"--pid-file={self.pidfiles['munged']}", f"--log-file={self.munge_dir}/munged.log",
               f"--seed-file={self.munge_dir}/munged.seed", "--force"]
        self._run(["runuser", "-u", "munge", "--", *cmd])
        self._wait(lambda: os.path.exists(self.munge_socket), 10, "munged socket")

    def _write_conf(self) -> None:
        d = self.root
        lines = [
            "ClusterName=ttt-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job may start again only after this many seconds (default 120)
            f"AuthInfo=cred_expire=10,socket={self.munge_socket}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={self.pidfiles['slurmctld']}",
            f"SlurmdPidFile={self.pidfiles['slurmd']}",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            # a requeued job becomes eligible after cred_expire: look for it every second, not every minute
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            # SIGTERM to SIGKILL: the ranks save a checkpoint in between, which takes more than 10 s
            # when the other test processes share the 2 CPUs (Slurm's own default is 30 s)
            "KillWait=60",
            "MinJobAge=600",
            "InactiveLimit=0",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _wait_node_ready(self) -> None:
        def ready():
            r = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
            return r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated")
        self._wait(ready, 30, f"node {self.node} idle (see {self.root}/slurmd.log, slurmctld.log)")

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged by their pid files."""
        if os.path.exists(self.conf) and self._pid("slurmctld"):
            self.run(["scancel", "--full", "--user=root"], check=False)
            try:
                self._wait(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), 20, "jobs gone")
            except TimeoutError:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pid(name)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
                self._wait(lambda: not _pid_alive(pid), 15, f"{name} exit")
            except ProcessLookupError:
                pass
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def _pid(self, name: str) -> Optional[int]:
        try:
            with open(self.pidfiles[name]) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    # ---------------------------------------------------------------- clients
    def run(self, cmd: List[str], check: bool = True, env: Optional[Dict[str, str]] = None,
            **kw) -> subprocess.CompletedProcess:
        e = dict(self.env, **(env or {}))
        r = subprocess.run(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    # a client killed by a signal (SIGPIPE when slurmctld drops the connection under load) or
    # refused by a busy controller; a read-only query is safe to repeat after these
    TRANSIENT = ("Socket timed out", "Unable to contact slurm controller", "Zero Bytes were transmitted",
                 "Connection reset", "Resource temporarily unavailable")

    def query(self, cmd: List[str], attempts: int = 5, delay: float = 0.5) -> subprocess.CompletedProcess:
        """Run a read-only client command, repeating it after a transient failure (see TRANSIENT);
        any other failure, or the last attempt's, raises with every attempt's return code."""
        codes = []
        for i in range(attempts):
            r = self.run(cmd, check=False)
            if r.returncode == 0:
                return r
            codes.append(r.returncode)
            transient = r.returncode < 0 or any(t in r.stderr for t in self.TRANSIENT)
            if not transient or i == attempts - 1:
                raise RuntimeError(f"{' '.join(cmd)} failed (return codes {codes}): {r.stderr.strip()}")
            time.sleep(delay * (i + 1))
        raise AssertionError("unreachable")

    def _run(self, cmd: List[str]) -> None:
        r = subprocess.run(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stdout.strip()}")

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        r = self.query(["scontrol", "show", "job", "-o", str(job_id)])
        out: Dict[str, str] = {}
        for tok in r.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                out.setdefault(k, v)
        return out

    def wait_job(self, job_id: str, states=("COMPLETED",), timeout: float = 60.0) -> Dict[str, str]:
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED"}
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            state = info.get("JobState", "")
            if state in states:
                return info
            if state in final or time.time() > deadline:
                raise AssertionError(f"job {job_id} is {state}, waited for {states}: {info}")
            time.sleep(0.5)

    @staticmethod
    def _wait(pred, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not pred():
            if time.time() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.2)
