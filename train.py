"""Pretrain a language model.

    python train.py                                   # configs/tiny.yaml: tiny hybrid, bundled corpus, CPU
    python train.py configs/x.yaml optim.lr=3e-4      # a preset plus dotted overrides
    torchrun --nproc_per_node 8 train.py configs/x.yaml
    deepspeed --num_gpus 8 train.py configs/x.yaml
    srun python train.py configs/x.yaml               # with MASTER_ADDR / MASTER_PORT exported

Exit status 0 when done, ttt_lm.train.PREEMPTED_EXIT_CODE after SIGTERM/SIGUSR1 (checkpoint saved).
"""
import sys

from ttt_lm.train import main

if __name__ == "__main__":
    sys.exit(main())
