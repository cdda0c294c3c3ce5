"""Training processes forked from a warm interpreter, for the tests that start many of them.

A test's training rank is ``python <script> args…`` (``tests/train/runner.py`` or ``train.py``).
About 7 of the 12 CPU-seconds a short run costs on a 2-core machine are imports (torch,
deepspeed, torch._dynamo, the trainer), paid again by every rank of every run. A server started
once per test process (and per environment) imports them once; each rank is then a fork of it,
which runs the script as ``__main__`` — a real process with its own pid, signals, exit status and
interpreter shutdown (non-daemon threads joined, atexit handlers run), its output in its log file.

What a rank gets, as ``subprocess.Popen`` would give it:

* its environment (``os.environ`` replaced before the script runs), working directory, argv and
  ``sys.path[0]`` (the script's folder);
* stdout and stderr on its log file (file descriptors 1 and 2), stdin on /dev/null;
* default signal dispositions (SIGINT raises KeyboardInterrupt, as in a fresh interpreter), but
  those the requesting process ignores stay ignored, as across exec (SIGINT in a shell's
  background job, SIGHUP under nohup);
* its exit status: the script's ``sys.exit`` code, 1 after an uncaught exception (its traceback in
  the log), or minus the signal that killed it.

The environment a module reads when it is imported is the server's: servers are keyed by the
environment without the per-rank variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), the tests' own ``TTT_TEST_*`` switches (read by the runner at run time)
and pytest's per-test variables, so a run whose environment differs in anything else gets a
server of its own. ``TTT_TEST_FORKSERVER=0`` starts every rank with ``subprocess.Popen`` instead.
The server refuses to fork (and the caller falls back to Popen) if its imports started a thread:
a fork would copy a lock that thread may hold.

multiprocessing's own fork server (which ``tests/distributed.py`` uses for in-process checks)
does not fit here: its children run a function and leave with ``os._exit``, so a script's atexit
handlers and non-daemon threads, which the preemption and checkpoint tests depend on, would not
run as they do in ``python script.py``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

#: imported once by the server: what a training rank imports before its first step
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "numpy",
           "ttt_lm.train", "ttt_lm.train.trainer", "ttt_lm.model.lm", "ttt_lm.data")
#: variables that differ per rank or per test, not per interpreter (see the module docstring)
PER_RUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_key(env: Dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in PER_RUN and not k.startswith(("TTT_TEST_", "PYTEST_"))))


def _ignored_signals() -> list:
    """The signals this (requesting) process ignores, which a process it starts would inherit."""
    return [s.name for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
            if signal.getsignal(s) is signal.SIG_IGN]


# ---- the server (``python forkserver.py FD``) ------------------------------------------------------
def _child(req: dict, sock: socket.socket) -> None:
    """In the forked process: become ``python argv…`` and run the script; never returns into the
    server loop (its exit is the interpreter's)."""
    sock.close()
    # what a started process of the requester gets: a signal the requester ignores stays ignored
    # across exec (SIGINT in a background job, SIGHUP under nohup); the rest start at their defaults
    ignored = set(req.get("ignored", ()))
    for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN if s.name in ignored else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if "SIGINT" in ignored else signal.default_int_handler)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if req["env"].get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import runpy
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        __import__(name)
    threads = len(os.listdir("/proc/self/task"))
    hello = {"ready": threads == 1, "threads": threads}
    sock.sendall((json.dumps(hello) + "\n").encode())
    if threads != 1:
        return
    buf = b""
    children = set()
    while True:
        r, _, _ = select.select([sock], [], [], 0.05)
        if r:
            data = sock.recv(1 << 16)
            if not data:      # the test process is gone: so are its ranks
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, sock)
                children.add(pid)
                sock.sendall((json.dumps({"id": req["id"], "pid": pid}) + "\n").encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            sock.sendall((json.dumps({"pid": pid, "status": status}) + "\n").encode())


# ---- the client (in the test process) ---------------------------------------------------------------
class _Server:
    def __init__(self, env: Dict[str, str], log: str):
        a, b = socket.socketpair()
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(b.fileno())],
                                         pass_fds=(b.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                         stdout=f, stderr=subprocess.STDOUT)
        b.close()
        self.sock, self.buf, self.lock, self.next_id = a, b"", threading.Lock(), 0
        self.status: Dict[int, int] = {}
        self.replies: Dict[int, int] = {}
        self.log = log
        hello = self._read(timeout=300)
        self.ready = bool(hello and hello.get("ready"))
        self.why = "no reply" if hello is None else f"{hello.get('threads')} threads after its imports"

    def _read(self, timeout: float) -> Optional[dict]:
        end = time.time() + timeout
        while b"\n" not in self.buf:
            if not select.select([self.sock], [], [], max(0.0, end - time.time()))[0]:
                return None
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError(f"the fork server died; its log {self.log}:\n{open(self.log).read()[-3000:]}")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _pump(self, timeout: float) -> bool:
        msg = self._read(timeout)
        if msg is None:
            return False
        if "status" in msg:
            self.status[msg["pid"]] = msg["status"]
        else:
            self.replies[msg["id"]] = msg["pid"]
        return True

    def fork(self, argv: Sequence[str], env: Dict[str, str], cwd: str, log: str) -> "Proc":
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            req = {"id": rid, "argv": list(argv), "env": env, "cwd": cwd, "log": log, "ignored": _ignored_signals()}
            self.sock.sendall((json.dumps(req) + "\n").encode())
            while rid not in self.replies:
                if not self._pump(60):
                    raise RuntimeError(f"the fork server did not start {argv}; its log {self.log}")
            return Proc(self, self.replies.pop(rid))

    def returncode(self, pid: int, timeout: float) -> Optional[int]:
        """The exit code of ``pid`` once it ends within ``timeout`` seconds, else None (the lock
        is held a fifth of a second at a time, so that other threads' polls go on)."""
        end = time.time() + timeout
        while True:
            with self.lock:
                while self._pump(0):
                    pass
                if pid in self.status:
                    return os.waitstatus_to_exitcode(self.status[pid])
                left = end - time.time()
                if left <= 0:
                    return None
                self._pump(min(left, 0.2))


class Proc:
    """What the tests use of ``subprocess.Popen``: pid, poll, wait, send_signal, terminate, kill,
    returncode."""

    def __init__(self, server: _Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, 1e9 if timeout is None else timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired([f"pid {self.pid}"], timeout)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SERVERS: Dict[tuple, Optional[_Server]] = {}
_LOG_DIR: List[str] = []    # the servers' own logs, removed when this process exits


def start(argv: Sequence[str], env: Dict[str, str], cwd: str, log: str) -> Optional[Proc]:
    """Rank process ``python argv…`` forked from a warm server for ``env``; None when forking is
    off (``TTT_TEST_FORKSERVER=0``, or not Linux) or no server can fork for it: then the caller
    starts it with Popen."""
    if os.environ.get("TTT_TEST_FORKSERVER", "1") == "0" or sys.platform != "linux":
        return None
    key = server_key(env)
    if key not in _SERVERS:
        if not _LOG_DIR:
            import tempfile
            _LOG_DIR.append(tempfile.mkdtemp(prefix="ttt-lm-forkserver-"))
        srv = _Server(env, os.path.join(_LOG_DIR[0], f"server{len(_SERVERS)}.log"))
        if not srv.ready:
            sys.stderr.write(f"tests/train/forkserver.py: not forking ({srv.why}); ranks start with Popen\n")
            srv.sock.close()
            srv = None
        _SERVERS[key] = srv
    srv = _SERVERS[key]
    return None if srv is None else srv.fork(argv, env, cwd, log)


def _shutdown() -> None:
    for srv in _SERVERS.values():
        if srv is not None:
            srv.sock.close()
            try:
                srv.proc.wait(10)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
    if _LOG_DIR:
        import shutil
        shutil.rmtree(_LOG_DIR[0], ignore_errors=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
else:
    import atexit
    atexit.register(_shutdown)
