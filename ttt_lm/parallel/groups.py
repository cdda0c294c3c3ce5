"""Process groups for tensor (TP), context (CP) and data (DP) parallelism, laid out as Megatron-LM
lays them out: tensor-parallel peers are consecutive ranks (so on a multi-GPU node they share the
fastest links), then context-parallel, then data-parallel:

    rank = dp_index · (cp · tp) + cp_index · tp + tp_index          world = dp · cp · tp

With world 8, tp 2, cp 1: TP groups {0,1} {2,3} {4,5} {6,7}; DP groups {0,2,4,6} {1,3,5,7}.

``ParallelGroups.mpu()`` returns the object DeepSpeed takes as ``deepspeed.initialize(mpu=...)``.
Its *data-parallel* group is every rank that holds the same tensor-parallel shard (dp × cp ranks),
because those are the ranks whose gradients are summed and over which ZeRO partitions optimizer
state; its *model-parallel* group is the TP group, over which DeepSpeed sums the squared gradient
norm of TP-sharded parameters (marked ``tensor_model_parallel``) for clipping.
tests/parallel/test_tp_deepspeed.py checks ZeRO stages 1, 2 and 3 with TP = 2 × DP = 2 against
the single-process step (GPT-NeoX refuses ZeRO-2/3 with model parallelism; with this mpu and
these layers the combination gives the single-process result).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch.distributed as dist


@dataclass
class ParallelGroups:
    world_size: int
    rank: int
    tp_size: int
    cp_size: int
    dp_size: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    tp_group: Optional[dist.ProcessGroup] = field(repr=False)
    cp_group: Optional[dist.ProcessGroup] = field(repr=False)
    dp_group: Optional[dist.ProcessGroup] = field(repr=False)
    #: the ranks with this rank's TP shard: dp × cp of them (the gradient-reduction / ZeRO group)
    dp_cp_group: Optional[dist.ProcessGroup] = field(repr=False)
    tp_ranks: List[int] = field(default_factory=list)
    cp_ranks: List[int] = field(default_factory=list)
    dp_ranks: List[int] = field(default_factory=list)
    dp_cp_ranks: List[int] = field(default_factory=list)

    def mpu(self) -> "MPU":
        return MPU(self)


def rank_layout(world_size: int, tp_size: int, cp_size: int = 1):
    """The rank lists of every TP, CP, DP and DP×CP group (pure function, no communication)."""
    if tp_size < 1 or cp_size < 1:
        raise ValueError(f"tensor_parallel={tp_size} and context_parallel={cp_size} must be >= 1")
    if world_size % (tp_size * cp_size) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tensor_parallel × context_parallel "
                         f"= {tp_size} × {cp_size}")
    dp_size = world_size // (tp_size * cp_size)

    def r(d, c, t):
        return d * cp_size * tp_size + c * tp_size + t

    tp = [[r(d, c, t) for t in range(tp_size)] for d in range(dp_size) for c in range(cp_size)]
    cp = [[r(d, c, t) for c in range(cp_size)] for d in range(dp_size) for t in range(tp_size)]
    dp = [[r(d, c, t) for d in range(dp_size)] for c in range(cp_size) for t in range(tp_size)]
    dp_cp = [[r(d, c, t) for d in range(dp_size) for c in range(cp_size)] for t in range(tp_size)]
    return {"tp": tp, "cp": cp, "dp": dp, "dp_cp": dp_cp, "dp_size": dp_size}


def build_groups(tp_size: int = 1, cp_size: int = 1) -> ParallelGroups:
    """Create the groups on an initialized default process group. Every rank must call this (and
    in the same order as any other ``new_group`` calls): torch.distributed.new_group is collective."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed to be initialized first")
    world, rank = dist.get_world_size(), dist.get_rank()
    lay = rank_layout(world, tp_size, cp_size)
    mine = {}
    for kind in ("tp", "cp", "dp", "dp_cp"):
        for ranks in lay[kind]:
            g = dist.new_group(ranks)  # collective: all ranks create every group
            if rank in ranks:
                mine[kind] = (g, ranks)
    tp_idx = rank % tp_size
    cp_idx = (rank // tp_size) % cp_size
    dp_idx = rank // (tp_size * cp_size)
    return ParallelGroups(
        world_size=world, rank=rank, tp_size=tp_size, cp_size=cp_size, dp_size=lay["dp_size"],
        tp_rank=tp_idx, cp_rank=cp_idx, dp_rank=dp_idx,
        tp_group=mine["tp"][0], cp_group=mine["cp"][0], dp_group=mine["dp"][0], dp_cp_group=mine["dp_cp"][0],
        tp_ranks=mine["tp"][1], cp_ranks=mine["cp"][1], dp_ranks=mine["dp"][1], dp_cp_ranks=mine["dp_cp"][1])


class MPU:
    """The model-parallel-unit interface DeepSpeed's engine and ZeRO optimizers call
    (Megatron's ``mpu``). It deliberately has no ``get_sequence_parallel_*`` /
    ``initialize_sequence_parallel`` methods: those select DeepSpeed-Ulysses code paths, which are
    a different scheme from Megatron sequence parallelism."""

    def __init__(self, groups: ParallelGroups):
        self.groups = groups

    # tensor (model) parallel
    def get_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.groups.tp_size

    def get_model_parallel_group(self):
        return self.groups.tp_group

    def get_model_parallel_src_rank(self) -> int:
        return self.groups.tp_ranks[0]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank

    # data parallel (including context-parallel peers: they hold the same shard and sum gradients)
    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_cp_ranks.index(self.groups.rank)

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_size * self.groups.cp_size

    def get_data_parallel_group(self):
        return self.groups.dp_cp_group

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.groups.dp_cp_ranks)


__all__ = ["ParallelGroups", "MPU", "build_groups", "rank_layout"]
