"""The training process group: torch.distributed through DeepSpeed, on the ranks that
``ttt_lm.env.detect_env`` reads from the launcher (torchrun, deepspeed, srun, or one process)."""
from __future__ import annotations

from ttt_lm.env import DistEnv, detect_env, export_env

__all__ = ["DistEnv", "detect_env", "export_env", "init_distributed"]


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
