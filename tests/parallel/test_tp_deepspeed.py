"""DeepSpeed ZeRO 1/2/3 over the data-parallel group of a TP=2 × DP=2 layout (4 gloo processes),
given the ``mpu`` of ttt_lm.parallel.groups: one optimizer step with gradient clipping must equal
the single-process step on the mean of the two replicas' losses. This checks that ZeRO shards and
reduces over the DP group only, and that the clipping norm counts TP-sharded parameters once per
shard and replicated ones once (the ``tensor_model_parallel`` marks).

Tolerance: float32 (DeepSpeed's ZeRO flat buffers); the updated weights differ by summation order
only, ~1e-7 on weights of size ~1e-2 after an AdamW step of lr 1e-2; 1e-5 absolute catches a wrong
reduction (a factor of 2 in a gradient moves the clipped, Adam-normalized step by ~lr).
"""
from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from tests.distributed import free_port, start_method

pytestmark = pytest.mark.dist

STAGES = (1, 2, 3)


def _one_stage(stage):
    import deepspeed

    from ttt_lm.model.config import AttentionConfig, ModelConfig
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel import build_groups, gather_full_state_dict, parallelize_tp

    g = build_groups(tp_size=2)
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, layer_pattern=["attention"], d_ff=24,
                      max_seq_len=64, attention=AttentionConfig(num_kv_heads=2))
    torch.manual_seed(0)
    ref = LM(cfg)
    tpm = parallelize_tp(copy.deepcopy(ref), g, sequence_parallel=True)
    B, T, clip, lr = 2, 8, 0.05, 1e-2
    data = []
    for d in range(g.dp_size):
        gen = torch.Generator().manual_seed(100 + d)
        data.append((torch.randint(0, 32, (B, T), generator=gen), torch.randint(0, 32, (B, T), generator=gen)))
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
          "train_batch_size": B * g.dp_size, "gradient_clipping": clip,
          # persistence threshold 0: ZeRO-3 partitions every parameter (by default it keeps those
          # under 1e5 elements whole on every rank, which is all of this tiny model's)
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True}
    eng, _, _, _ = deepspeed.initialize(model=tpm, optimizer=torch.optim.AdamW(tpm.parameters(), lr=lr),
                                        config=ds, mpu=g.mpu())
    ids, lab = data[g.dp_rank]
    out = eng(ids, labels=lab)
    eng.backward(out.loss)
    eng.step()
    if stage == 3:   # each rank holds a shard of every parameter, not the whole of any
        whole = [n for n, p in eng.module.named_parameters()
                 if p.ds_persist or p.data.numel() > 0 or p.ds_tensor.numel() >= p.ds_numel > 1]
        assert not whole, f"ZeRO-3 left these parameters whole: {whole}"
    with deepspeed.zero.GatheredParameters(list(eng.module.parameters()), enabled=stage == 3):
        full = {k: v.clone() for k, v in gather_full_state_dict(eng.module).items()}

    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses = [ref(i, labels=l).loss for i, l in data]
    torch.testing.assert_close(out.loss.detach(), losses[g.dp_rank].detach(), rtol=1e-5, atol=1e-6)
    (sum(losses) / len(losses)).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ropt.step()
    torch.testing.assert_close(torch.tensor(float(eng.get_global_grad_norm())), norm.detach(), rtol=1e-5, atol=0)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-5, msg=lambda m: f"ZeRO-{stage} {k}: {m}")


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
                _one_stage(stage)
                results[stage] = None
            except Exception:  # noqa: BLE001 - reported by the test of that stage
                results[stage] = traceback.format_exc()
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_zero")
    mp.start_processes(_worker, args=(4, free_port(), str(d)), nprocs=4, join=True, start_method=start_method())
    return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(4)]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_with_tp2_dp2(zero_results, stage):
    errs = [f"rank {r}:\n{res.get(stage, 'not run')}" for r, res in enumerate(zero_results)
            if res.get(stage, "not run") is not None]
    assert not errs, "\n".join(errs)
