"""TTT-E2E under DeepSpeed ZeRO 1, 2 and 3 over two data-parallel gloo processes, against one process
(stage 0: plain AdamW on the mean of the two replicas' losses), for three optimizer steps with
gradient clipping: every step's loss, every parameter's full gradient (``safe_get_full_grad``,
averaged over the replicas), the clip norm and the weights after the last step agree. Under ZeRO-3
every parameter is partitioned between steps (persistence threshold 0) and the model gathers them
itself for each step (``E2ELM.gathers_zero3_parameters``: the engine removes DeepSpeed's per-module
hooks, whose releases the inner step would read empty).

And the layouts refused for TTT-E2E, naming the value and the reason: sequence and context parallelism
(tensor parallelism: tests/parallel/test_ttt_e2e_tp.py).

Tolerance: float32 through DeepSpeed's flat buffers; sums in another order only, ~1e-7 on gradients
of ~1e-2 and weights after lr-1e-2 AdamW steps; 1e-5 absolute catches a gradient that a wrong
gathering would drop (zero) or double.
"""
from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed import free_port, start_method

STAGES = (1, 2, 3)
SHAPE = ["model.vocab_size=32", "model.d_model=16", "model.n_layers=3", "model.n_heads=2", "model.d_ff=24",
         "model.ttt_e2e.enabled=true", "model.ttt_e2e.suffix_len=2", "model.ttt_e2e.window=6",
         "model.ttt_e2e.inner_batch=4", "model.max_seq_len=64", "data.seq_len=12"]
STEPS, B, T, CLIP, LR = 3, 2, 12, 0.5, 1e-2


def _batches(world):
    out = []
    for s in range(STEPS):
        row = []
        for d in range(world):
            g = torch.Generator().manual_seed(100 + d + 10 * s)
            ids = torch.randint(0, 32, (B, T), generator=g)
            row.append((ids, torch.randint(0, 32, (B, T), generator=g)))
        out.append(row)
    return out


def _one_stage(stage, rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ttt_lm.config import load_config
    from ttt_lm.model import LM
    from ttt_lm.train.engine import _explicit_zero3_gathering, gathers_zero3_parameters

    cfg = load_config(None, SHAPE).model
    torch.manual_seed(0)
    ref = LM(cfg).train()
    m = copy.deepcopy(ref)
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "train_batch_size": B * world,
          "gradient_clipping": CLIP, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True}
    eng, _, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=LR), config=ds)
    if stage == 3:   # as ttt_lm.train.engine.build_engine does for this model
        assert gathers_zero3_parameters(m)
        _explicit_zero3_gathering(eng)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    names = [n for n, _ in ref.named_parameters()]
    for step, data in enumerate(_batches(world)):
        for mod in (ref, m):
            mod.set_train_step(step + 1)
        ids, lab = data[rank]
        out = eng(ids, labels=lab)
        eng.backward(out.loss)
        m.release_parameters()
        grads = {n: safe_get_full_grad(p) for n, p in eng.module.named_parameters()}
        eng.step()
        if stage == 3:   # between steps each rank holds a shard of every parameter, not the whole of any
            whole = [n for n, p in eng.module.named_parameters() if p.data.numel() > 0 or p.ds_tensor.numel() >= p.ds_numel]
            assert not whole, f"step {step + 1}: ZeRO-3 left these parameters whole: {whole}"
        losses = [ref(i, labels=l).loss for i, l in data]
        torch.testing.assert_close(out.loss.detach(), losses[rank].detach(), rtol=1e-6, atol=1e-6)
        (sum(losses) / len(losses)).backward()
        for n, p in ref.named_parameters():
            assert grads[n] is not None, f"ZeRO-{stage} step {step + 1}: no gradient for {n}"
            torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-5,
                                       msg=lambda s, n=n: f"ZeRO-{stage} step {step + 1} grad {n}: {s}")
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        assert norm > CLIP, norm            # the clip acts, so a wrong norm moves the step
        torch.testing.assert_close(torch.tensor(float(eng.get_global_grad_norm())), norm.detach(), rtol=1e-5, atol=0)
        ropt.step()
        ropt.zero_grad()
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters()), enabled=stage == 3):
        full = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-5, msg=lambda s, n=n: f"ZeRO-{stage} {n}: {s}")
    assert len(full) == len(names)


def _worker(rank, world, port, out_dir):
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK="0")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist
    # DeepSpeed would JIT-compile a shared-memory all-reduce on CPU that training never uses
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    results = {}
    try:
        for stage in STAGES:
            try:
                _one_stage(stage, rank, world)
                results[stage] = None
            except Exception:  # noqa: BLE001 - reported by the test of that stage
                results[stage] = traceback.format_exc()
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e_zero")
    mp.start_processes(_worker, args=(2, free_port(), str(d)), nprocs=2, join=True, start_method=start_method())
    return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.dist
@pytest.mark.parametrize("stage", STAGES)
def test_zero_stages_equal_one_process(zero_results, stage):
    errs = [f"rank {r}:\n{res.get(stage, 'not run')}" for r, res in enumerate(zero_results)
            if res.get(stage, "not run") is not None]
    assert not errs, "\n".join(errs)


def test_sequence_and_context_parallelism_are_refused_with_the_reason():
    from ttt_lm.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true is not built for TTT-E2E .*replicated "
                                          r"final norm and LM head"):
        load_config("configs/tiny_ttt_e2e.yaml", ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match=r"parallel.context_parallel=2 is refused for TTT-E2E .*serialises the ranks"):
        load_config("configs/tiny_ttt_e2e.yaml", ["parallel.context_parallel=2"])
    cfg = load_config("configs/tiny_ttt_e2e.yaml", ["parallel.zero_stage=3"])   # ZeRO-3 is accepted
    assert cfg.parallel.zero_stage == 3
