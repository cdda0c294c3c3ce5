"""Spawning real training processes for the tests: each rank is its own ``python
tests/train/runner.py`` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* in its environment (what torchrun
or srun would set), gloo on CPU, OMP_NUM_THREADS=1. Ranks are forked from a server that has
imported torch, deepspeed and the trainer once (``forkserver.py``; ``TTT_TEST_FORKSERVER=0``
starts each with ``subprocess.Popen`` instead)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence
from tests.distributed import free_port
from tests.train import forkserver

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a 2-layer d_model=32 attention-only model on 16-token sequences: seconds per run
TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "model.layer_pattern=[attention]", "data.seq_len=16", "train.micro_batch_size=2",
        "optim.warmup_steps=2", "optim.lr=1e-2", "logging.tensorboard=false", "logging.progress=false",
        "eval.every=0", "checkpoint.every=0", "train.device=cpu"]


def model_overrides(pattern: Sequence[str], n: Optional[int] = None) -> List[str]:
    """The overrides of a model of one layer of each kind of ``pattern`` (kinds read from the
    registry or a preset, not named by the test) on ``TINY``'s sizes; with ``n``, also every field
    that ``tests/model/mixer_checks.short_sections(cfg, n)`` changes in the sections these kinds use
    (mini-batches, chunks, windows of ``n`` tokens)."""
    from ttt_lm.model.config import ModelConfig
    from ttt_lm.model.registry import mixer_class
    pat = list(pattern)
    if not pat:
        raise ValueError("model_overrides: the layer pattern is empty")
    out = [f"model.layer_pattern=[{','.join(pat)}]", f"model.n_layers={len(pat)}"]
    if n is None:
        return out
    from tests.model.mixer_checks import short_sections
    cfg = short_sections(ModelConfig(layer_pattern=pat, n_layers=len(pat)), n)
    for name in dict.fromkeys(mixer_class(k).config_section for k in pat):
        if name is None:
            continue
        section, default = getattr(cfg, name), type(getattr(cfg, name))()
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if v != getattr(default, f.name):
                text = "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                out.append(f"model.{name}.{f.name}={text}")
    return out


def attention_and_scan() -> List[str]:
    """The registry's first global-attention kind (keys and values gathered across context-parallel
    ranks) and its first chunk-summary scan that reads segment positions (its conv halo and resets
    at a rank's first token): attention and the RG-LRU among the built-in kinds."""
    from ttt_lm.model.registry import builtin_kinds, kinds_with
    kinds = builtin_kinds()
    return [kinds_with(lambda c: c.global_attention and c.cp_form == "kv_exchange", kinds)[0],
            kinds_with(lambda c: c.cp_form == "summary" and c.takes_segment_pos, kinds)[0]]


@dataclass
class Run:
    procs: List[subprocess.Popen]
    logs: List[str]
    run_dir: str

    def wait(self, timeout: float = 180) -> List[int]:
        end = time.time() + timeout
        rcs = []
        for p in self.procs:
            try:
                rcs.append(p.wait(max(1.0, end - time.time())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise AssertionError(f"training timed out; logs:\n{self.output()}")
        return rcs

    def signal(self, sig=signal.SIGTERM, ranks: Optional[Sequence[int]] = None) -> None:
        for r, p in enumerate(self.procs):
            if ranks is None or r in ranks:
                p.send_signal(sig)

    def output(self, rank: int = 0) -> str:
        with open(self.logs[rank]) as f:
            return f.read()


def spawn(run_dir: str, overrides: Sequence[str] = (), nprocs: int = 1, env: Optional[Dict[str, str]] = None,
          tag: str = "run", preset: Optional[str] = None, fresh: bool = False) -> Run:
    """``nprocs`` ranks of the runner (synthetic data, the ``TINY`` model); with ``preset`` (a config
    path relative to the repository) ranks of ``train.py <preset>`` instead, as a user starts it
    (with torchrun's environment), without ``TINY``. ``fresh`` starts each rank in a new interpreter
    (``subprocess.Popen``), not forked from one that has imported torch already: for the tests of
    what a rank does while it imports."""
    head = [RUNNER] if preset is None else [os.path.join(REPO, "train.py"), preset]
    tail = TINY if preset is None else []
    port = str(free_port())
    procs, logs = [], []
    os.makedirs(run_dir, exist_ok=True)
    for r in range(nprocs):
        e = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
            e.pop(k, None)
        e.update({"RANK": str(r), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(nprocs),
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
                  "DS_ACCELERATOR": "cpu", "PYTHONPATH": REPO, "PYTHONFAULTHANDLER": "1"})
        e.update(env or {})
        log = os.path.join(os.path.dirname(run_dir.rstrip("/")), f"{os.path.basename(run_dir)}.{tag}.rank{r}.log")
        argv = [*head, f"train.run_dir={run_dir}", *tail, *overrides]
        p = None if fresh else forkserver.start(argv, e, REPO, log)
        if p is None:
            with open(log, "w") as f:
                p = subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, env=e, cwd=REPO)
        procs.append(p)
        logs.append(log)
    return Run(procs, logs, run_dir)


def run(run_dir: str, overrides: Sequence[str] = (), nprocs: int = 1, env=None, tag="run", timeout=180,
        expect: Optional[int] = 0, preset: Optional[str] = None, fresh: bool = False) -> Run:
    r = spawn(run_dir, overrides, nprocs, env, tag, preset, fresh)
    rcs = r.wait(timeout)
    if expect is not None:
        # rank 0's log, and that of every other rank that exited otherwise (a crash there, e.g. an
        # abort at exit, shows its own traceback: PYTHONFAULTHANDLER is set for every rank)
        shown = [0] + [k for k in range(1, nprocs) if rcs[k] != expect]
        logs = "".join(f"\nrank {k} log:\n{r.output(k)[-4000:]}" for k in shown)
        assert rcs == [expect] * nprocs, f"exit codes {rcs}, expected {expect};{logs}"
    return r


def metrics(run_dir: str, kind: str = "train") -> List[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [rec for rec in map(json.loads, f) if rec["kind"] == kind]


def losses_by_step(run_dir: str) -> Dict[int, float]:
    """The last logged loss of each step (a resumed run appends to the same file)."""
    return {rec["step"]: rec["loss"] for rec in metrics(run_dir)}
