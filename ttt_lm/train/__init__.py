"""Training: DeepSpeed ZeRO engine, loop, checkpoints with exact resume, preemption, metrics.

Light to import: the engine and DeepSpeed load only when a run starts."""
from ttt_lm.train.preempt import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "main", "train"]


def main(argv=None, data_api=None, callbacks=()) -> int:
    # First thing, before the imports and the distributed start-up that take the first seconds:
    # a SIGTERM/SIGUSR1 (preemption) from now on ends the run with PREEMPTED_EXIT_CODE, which the
    # Slurm scripts requeue, instead of killing it with -15/-10.
    from ttt_lm.train.preempt import PreemptionFlag
    flag = PreemptionFlag().install()
    from ttt_lm.train.trainer import main as _main
    return _main(argv, data_api=data_api, preempt=flag, callbacks=callbacks)


def train(cfg, data_api=None, callbacks=()) -> int:
    """Run a resolved ExperimentConfig; ``callbacks`` (``ttt_lm.train.loop.Callback``) run after
    the built-in ones (metrics, evaluation, non-finite losses, preemption, checkpoints)."""
    from ttt_lm.train.trainer import train as _train
    return _train(cfg, data_api=data_api, callbacks=callbacks)
