"""Shared by the tests that spawn real gloo processes.

``spawn_checks`` runs a module's checks in ``world`` spawned processes joined in one gloo group
and collects, per rank, each check's result: what the check returned (None for a check that
only asserts) or the traceback of its failure (a str).

The processes are started by multiprocessing's fork server, which imports torch and the parallel
layers once (``PRELOAD``) and forks a fresh process per rank: a new interpreter per rank spent
about 5 CPU-seconds importing them. Each rank gets the caller's environment at the time of the
call. ``TTT_TEST_FORKSERVER=0`` spawns a new interpreter per rank instead.
"""
from __future__ import annotations

import datetime
import importlib
import os
import socket
import traceback
from pathlib import Path
from typing import List, Optional, Sequence, Tuple


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the rendezvous of a spawned process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: imported once by the fork server the ranks are forked from
PRELOAD = ["torch", "torch.distributed", "pytest", "deepspeed", "ttt_lm.model.lm", "ttt_lm.parallel.tp_model",
           "ttt_lm.parallel.cp_model", "tests.distributed"]


def start_method() -> str:
    """"forkserver" (with PRELOAD), or "spawn" under TTT_TEST_FORKSERVER=0."""
    if os.environ.get("TTT_TEST_FORKSERVER", "1") == "0":
        return "spawn"
    import multiprocessing
    multiprocessing.set_forkserver_preload(PRELOAD)   # read when the server starts (once per process)
    return "forkserver"


def _run_checks(rank, world, port, out_dir, module, attr, suite, names, setup, stop_on_failure, timeout_s,
                env=None):
    if env is not None:   # the caller's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kw)
    mod = importlib.import_module(module)
    results = {}
    try:
        if setup is not None:
            getattr(mod, setup)()
        checks = getattr(mod, attr)
        if suite is not None:
            checks = checks[suite]
        if callable(checks):
            checks = checks(rank, world)
        for name, fn in (checks.items() if isinstance(checks, dict) else checks):
            if names is not None and name not in names:
                continue
            try:
                results[name] = fn()
            except Exception:  # noqa: BLE001 - reported to the test of that check
                results[name] = traceback.format_exc()
                if stop_on_failure:
                    raise   # the other ranks would wait on this one's collectives
            if not stop_on_failure:
                dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def spawn_checks(world: int, module: str, out_dir, attr: str = "CHECKS", *, suite: Optional[str] = None,
                 names: Optional[Sequence[str]] = None, setup: Optional[str] = None,
                 stop_on_failure: bool = False, timeout_s: Optional[float] = None
                 ) -> Tuple[List[dict], Optional[BaseException]]:
    """Run the checks ``module.attr`` (``[(name, fn)]`` or ``{name: fn}``; ``[suite]`` of it if
    given; called as ``attr(rank, world)`` first if callable) on every rank of a ``world``-process
    gloo group, after ``module.setup()`` if named. Only ``names`` run, if given. After each check
    the ranks meet at a barrier, so a failed check does not stop the others; with
    ``stop_on_failure`` a failure ends its rank instead (for checks whose failure leaves peers
    waiting on collectives), and ``timeout_s`` bounds every collective. Returns the per-rank
    ``{name: result or traceback}`` dicts ({} for a rank that saved none) and the spawn's
    exception, if any (the per-check results say which check broke)."""
    import torch
    import torch.multiprocessing as mp
    out_dir = Path(out_dir)
    os.environ["OMP_NUM_THREADS"] = "1"
    err = None
    try:
        mp.start_processes(_run_checks, args=(world, free_port(), str(out_dir), module, attr, suite,
                                              None if names is None else list(names), setup, stop_on_failure,
                                              timeout_s, dict(os.environ)),
                           nprocs=world, join=True, start_method=start_method())
    except Exception as e:  # noqa: BLE001
        err = e
    res = []
    for r in range(world):
        p = out_dir / f"rank{r}.pt"
        res.append(torch.load(p) if p.exists() else {})
    return res, err


def assert_all_passed(results: List[dict], name: str, err: Optional[BaseException] = None) -> None:
    """Every rank ran the assert-only check ``name`` and it passed (returned None)."""
    errs = [f"rank {r}:\n{res.get(name, 'not run')}" for r, res in enumerate(results)
            if res.get(name, "not run") is not None]
    assert not errs, "\n".join(errs) + (f"\n(spawn error: {err})" if err is not None else "")


def assert_within(results: Tuple[int, List[dict], Optional[BaseException]], name: str, tol: float) -> None:
    """Every rank of the ``(world, per-rank results, spawn error)`` run reported for the check
    ``name`` a measured difference (a number) below ``tol``."""
    world, res, err = results
    for r, rr in enumerate(res):
        v = rr.get(name)
        assert v is not None, f"{name}: rank {r} of {world} did not report (spawn error: {err})"
        assert not isinstance(v, str), f"{name}, rank {r} of {world}:\n{v}"
        assert v < tol, f"{name}, rank {r} of {world}: max relative difference {v:.3e} ≥ {tol}"
