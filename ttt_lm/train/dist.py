"""Process-group setup from whatever launched us: torchrun and the deepspeed launcher set
RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID in each task of a step; a bare
``python train.py`` is one process. MASTER_ADDR/MASTER_PORT name the rendezvous."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun/deepspeed" | "slurm" | "single"


def detect_env() -> DistEnv:
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return DistEnv(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)), "env")
    # Slurm ranks only inside an srun step: the batch script's own shell also has SLURM_PROCID=0
    # and SLURM_NTASKS=<allocation>, and must not wait for ranks that will never start
    if "SLURM_PROCID" in e and "SLURM_STEP_NUM_TASKS" in e:
        return DistEnv(int(e["SLURM_PROCID"]), int(e["SLURM_STEP_NUM_TASKS"]), int(e.get("SLURM_LOCALID", 0)),
                       "slurm")
    return DistEnv(0, 1, 0, "single")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_env(env: DistEnv) -> None:
    """Write the RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* variables torch.distributed reads."""
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    if env.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"{' and '.join(missing)} not set for a {env.world_size}-process run launched by {env.launcher}: "
            "export MASTER_ADDR (the first node's host name) and MASTER_PORT (a free port) before srun, "
            "or launch with torchrun / deepspeed, which set them")


def init_distributed(device: str) -> DistEnv:
    """Initialize torch.distributed (gloo on CPU, NCCL on CUDA) through DeepSpeed."""
    import deepspeed
    import torch
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    if device == "cpu":
        # DeepSpeed JIT-compiles a shared-memory all-reduce on CPU (minutes on a fresh machine)
        # that only its inference_all_reduce uses; training collectives go through gloo anyway.
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    env = detect_env()
    export_env(env)
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not tdist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   auto_mpi_discovery=False, verbose=False)
    return env
