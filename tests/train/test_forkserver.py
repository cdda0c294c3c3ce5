"""A rank forked from the warm server (``forkserver.py``) is what ``python script args…``
started with ``subprocess.Popen`` would be: the same argv, environment, working directory and
``sys.path[0]``; its output in its log; the same exit status for ``sys.exit``, an uncaught
exception and a signal; atexit handlers run and non-daemon threads joined at exit."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.dist

SCRIPT = """
import atexit, json, os, signal, sys, threading, time
mode = sys.argv[1]
print("started", flush=True)
if mode == "describe":
    keep = {k: v for k, v in os.environ.items() if k.startswith(("TTT_TEST_FS", "RANK"))}
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": keep,
                      "main": __name__, "file": __file__, "pid": os.getpid(),
                      "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                      "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}))
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise ValueError("broken on purpose")
elif mode == "sleep":
    if len(sys.argv) > 2:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(sys.argv[2])))
    time.sleep(60)
elif mode == "shutdown":
    out = sys.argv[2]
    atexit.register(lambda: open(out, "a").write("atexit\\n"))
    def late():
        time.sleep(0.5)
        open(out, "a").write("thread\\n")
    threading.Thread(target=late).start()
    sys.stdout.write("buffered, never flushed by the script")
"""


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "bin" / "prog.py"
    p.parent.mkdir()
    p.write_text(SCRIPT)
    return str(p)


def _env(**extra):
    """The environment launch.py gives a rank (so these tests share its server)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=REPO, PYTHONFAULTHANDLER="1")
    e.update(extra)
    return e


def _fork(script, args, tmp_path, name, env=None):
    log = str(tmp_path / f"{name}.log")
    p = forkserver.start([script, *args], env or _env(), str(tmp_path), log)
    assert p is not None, "the server could not fork"
    return p, log


def test_a_forked_rank_sees_what_a_started_process_sees(script, tmp_path):
    env = _env(TTT_TEST_FS_A="1", RANK="3")
    p, log = _fork(script, ["describe", "x y"], tmp_path, "fork", env)
    assert p.wait(60) == 0
    with open(tmp_path / "popen.log", "w") as f:
        q = subprocess.run([sys.executable, script, "describe", "x y"], env=env, cwd=str(tmp_path), stdout=f,
                           stderr=subprocess.STDOUT)
    assert q.returncode == 0
    got, want = (json.loads(open(f).read().splitlines()[1]) for f in (log, tmp_path / "popen.log"))
    assert got["pid"] == p.pid and got["pid"] != os.getpid()
    for d in (got, want):
        del d["pid"]
    # SIGINT raises KeyboardInterrupt in both, unless this process ignores it (a shell's background
    # job), which a started process inherits across exec
    sigint = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    assert got == want and got["env"] == {"TTT_TEST_FS_A": "1", "RANK": "3"} and got["sigint"] is sigint
    assert got["sigterm"]


def test_exit_status_is_the_scripts(script, tmp_path):
    p, _ = _fork(script, ["exit", "7"], tmp_path, "exit")
    assert p.wait(60) == 7 and p.returncode == 7 and p.poll() == 7
    p, log = _fork(script, ["raise"], tmp_path, "raise")
    assert p.wait(60) == 1
    text = open(log).read()
    assert "Traceback" in text and "ValueError: broken on purpose" in text


def test_signals_reach_the_rank(script, tmp_path):
    p, log = _fork(script, ["sleep"], tmp_path, "kill")
    _started(log)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.kill()
    assert p.wait(30) == -signal.SIGKILL
    p, log = _fork(script, ["sleep", "42"], tmp_path, "term")   # a handler installed by the script
    _started(log)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 42


def test_exit_joins_threads_runs_atexit_and_flushes(script, tmp_path):
    out = str(tmp_path / "order.txt")
    p, log = _fork(script, ["shutdown", out], tmp_path, "shutdown")
    assert p.wait(60) == 0
    assert open(out).read().splitlines() == ["thread", "atexit"]
    assert open(log).read().endswith("buffered, never flushed by the script")


def test_environments_that_differ_at_import_get_their_own_server():
    base = {"A": "1", "PATH": "/bin"}
    same = dict(base, RANK="1", MASTER_PORT="9", TTT_TEST_NAN_STEPS="3", PYTEST_CURRENT_TEST="x")
    assert forkserver.server_key(base) == forkserver.server_key(same)
    assert forkserver.server_key(base) != forkserver.server_key(dict(base, TRITON_INTERPRET="0"))


def _started(log, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(log) and "started" in open(log).read():
            return
        time.sleep(0.02)
    raise AssertionError(f"the rank did not start: {open(log).read() if os.path.exists(log) else 'no log'}")
