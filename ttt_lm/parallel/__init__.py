"""Parallelism beyond data parallel: process groups (``groups``), Megatron tensor/sequence
parallel layers (``tensor_parallel``), the conversion of an LM to its TP form (``tp_model``),
context parallelism (``cp``) and the LM the trainer runs with it (``cp_model``)."""
from ttt_lm.parallel.groups import MPU, ParallelGroups, build_groups, rank_layout
from ttt_lm.parallel.tp_model import TP_READY_KINDS, TPLM, gather_full_state_dict, parallelize_tp

__all__ = ["MPU", "ParallelGroups", "build_groups", "rank_layout", "TP_READY_KINDS", "TPLM",
           "gather_full_state_dict", "parallelize_tp"]
