"""Where this process runs: its rank, the number of processes and its local rank, read from whatever
launched it, for training and evaluation alike.

torchrun and the DeepSpeed launcher set RANK/WORLD_SIZE/LOCAL_RANK; srun sets
SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID in each task of a step; neither means one process.
MASTER_ADDR/MASTER_PORT name the rendezvous of a multi-process run."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import List, Mapping, Optional

#: the variables torch.distributed's env:// rendezvous needs besides RANK and WORLD_SIZE
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "env" (torchrun/deepspeed) | "slurm" | "single"


def detect_env(environ: Optional[Mapping[str, str]] = None) -> DistEnv:
    """This process's place from ``environ`` (default ``os.environ``). The torchrun/DeepSpeed
    variables win over Slurm's.

    The Slurm variables count only inside an srun step (SLURM_STEP_NUM_TASKS set): the shell of an
    sbatch script also has SLURM_PROCID=0 and SLURM_NTASKS=<the allocation's tasks>, yet a program
    started there directly is one process, not rank 0 of ranks that will never start. The step's
    own task count is used: an `srun -n 2` inside a 4-task allocation is 2 processes."""
    e = os.environ if environ is None else environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return DistEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)), "env")
    if "SLURM_PROCID" in e and "SLURM_STEP_NUM_TASKS" in e:
        return DistEnv(int(e["SLURM_PROCID"]), int(e["SLURM_STEP_NUM_TASKS"]), int(e.get("SLURM_LOCALID", 0)),
                       "slurm")
    return DistEnv(0, 1, 0, "single")


def missing_rendezvous(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Which of MASTER_ADDR/MASTER_PORT are not set."""
    e = os.environ if environ is None else environ
    return [k for k in RENDEZVOUS if k not in e]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_env(env: DistEnv) -> None:
    """Write the RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables torch.distributed reads (a
    one-process run gets a local rendezvous on a free port)."""
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    if env.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    missing = missing_rendezvous()
    if missing:
        raise RuntimeError(
            f"{' and '.join(missing)} not set for a {env.world_size}-process run launched by {env.launcher}: "
            "export MASTER_ADDR (the first node's host name) and MASTER_PORT (a free port) before srun, "
            "or launch with torchrun / deepspeed, which set them")
