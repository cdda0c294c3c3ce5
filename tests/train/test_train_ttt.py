"""The trainer with TTT layers: the checks of TTT's own settings under tensor parallelism
(in-process) and the inner learning rate's warm-up in a real training process."""
import pytest

from ttt_lm.config import ExperimentConfig
from ttt_lm.train.engine import ParallelConfigError, check_parallel

from launch import run


def test_ttt_pre_conv_refused_with_sequence_parallel_only():
    cfg = ExperimentConfig()
    cfg.parallel.tensor_parallel = 2
    cfg.model.layer_pattern = ["ttt_linear"]
    cfg.model.ttt.pre_conv, cfg.parallel.sequence_parallel = True, True
    with pytest.raises(ParallelConfigError, match="pre_conv is not available with parallel.sequence_parallel"):
        check_parallel(cfg, world_size=2)
    cfg.parallel.sequence_parallel = False
    check_parallel(cfg, world_size=2)   # TTT with pre_conv under plain TP is supported


@pytest.mark.dist
def test_trainer_warms_up_ttt_inner_lr(tmp_path):
    """The trainer tells the model each optimizer step, so TTT-MLP's η_base warmup (ttt-lm-jax's
    get_ttt_lr_mult) runs: with base_lr_init 0.01 → 0.1 over 2 steps the multipliers before the
    forwards of steps 1..4 are 0.1, 0.55, 1, 1 in every TTT layer."""
    d = str(tmp_path / "warm")
    mults = str(tmp_path / "mults.txt")
    run(d, ["train.max_steps=4", "model.layer_pattern=[ttt_mlp]", "model.ttt.mini_batch_size=4",
            "model.ttt.base_lr_init=0.01", "model.ttt.base_lr_warmup=2"], env={"TTT_TEST_LR_MULTS": mults})
    got = {int(line.split()[0]): [float(v) for v in line.split()[1:]] for line in open(mults)}
    want = {1: 0.1, 2: 0.55, 3: 1.0, 4: 1.0}
    assert sorted(got) == [1, 2, 3, 4]
    for step, m in want.items():
        assert len(got[step]) == 2 and all(abs(v - m) < 1e-12 for v in got[step]), (step, got[step])
