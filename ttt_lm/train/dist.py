"""The training process group: torch.distributed through DeepSpeed, on the ranks that
``ttt_lm.env.detect_env`` reads from the launcher (torchrun, deepspeed, srun, or one process)."""
from __future__ import annotations

from ttt_lm.env import DistEnv, detect_env, export_env

__all__ = ["DistEnv", "detect_env", "export_env", "init_distributed", "quiet_deprecated_collectives"]

#: torch's FutureWarnings for the collectives DeepSpeed's ZeRO optimizer calls (inside DeepSpeed,
#: not in this code; torch names their successors): printed on every rank with a stray line of
#: its wrapper's source, and nothing a user of this project can act on
DEPRECATED_COLLECTIVES = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                          r"`torch\.distributed\.reduce_scatter_tensor` is deprecated")


def quiet_deprecated_collectives() -> None:
    """Ignore exactly the FutureWarnings of ``DEPRECATED_COLLECTIVES``; every other warning stays."""
    import warnings

    for msg in DEPRECATED_COLLECTIVES:
        warnings.filterwarnings("ignore", message=msg, category=FutureWarning)


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
    quiet_deprecated_collectives()
    env = detect_env()
    export_env(env)
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not tdist.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                   auto_mpi_discovery=False, verbose=False)
    return env
