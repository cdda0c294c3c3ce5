"""The LM as the trainer runs it with ``parallel.context_parallel`` = c > 1: every rank of a
context-parallel (CP) group is given the same full rows and computes only its contiguous slice of
them (``split_lengths``: rank r holds tokens [start_r, start_r + T_r)) with
``ttt_lm.parallel.context_parallel.context_parallel_forward``.

It is an ``LM`` (same parameters, names and initialization from the same seed), so DeepSpeed's
engine calls it as it calls the LM — ZeRO's hooks and the checkpoints' state dicts are unchanged
and ``ttt_lm.train.export`` reads its checkpoints as any other.

Loss and gradients. The returned loss of CP rank r is its summed cross-entropy × c / (valid labels
in the whole rows), so the mean over the c ranks is the rows' mean cross-entropy L. Backward on
every rank, through the library's collectives, leaves on rank r its share of ∇(Σ_r loss_r) =
c ∇L; DeepSpeed averages gradients over its data-parallel group, which is dp × c ranks
(``groups.mpu()``), giving (1/dp) Σ_d ∇L_d: the gradient of the global batch's mean loss, as with
c = 1.

ZeRO-1 only (``ttt_lm.train.engine.check_parallel``): ZeRO-2 packs gradients into its reduction buckets in the order
each rank's backward produces them, which differs across CP ranks (their graphs differ by the
state sends and receives), and ZeRO-3's parameter all-gathers over the CP ranks would deadlock
against the rank-to-rank state passing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ttt_lm.model.config import ModelConfig
from ttt_lm.model.lm import LM, LMOutput
from ttt_lm.parallel.context_parallel import context_parallel_forward, split_lengths


class ContextParallelLM(LM):
    def __init__(self, cfg: ModelConfig, cp_group):
        super().__init__(cfg)
        self.cp_group = cp_group
        self.cp_rank, self.cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)

    def local_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part of [B, T] rows."""
        lengths = split_lengths(t.shape[1], self.cp_size)
        start = sum(lengths[: self.cp_rank])
        return t[:, start:start + lengths[self.cp_rank]]

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, states=None,
                output_states: bool = False, position_ids: Optional[torch.Tensor] = None) -> LMOutput:
        """input_ids, labels, position_ids: the full rows [B, T] (the same on every CP rank;
        position_ids reach the RG-LRU as segment positions). Returns this rank's logits [B, T_r]
        and its loss share (see the module docstring)."""
        if states is not None or output_states:
            raise ValueError("the context-parallel LM runs whole rows from the start: no states")
        loss, logits = context_parallel_forward(
            self, self.local_slice(input_ids), None if labels is None else self.local_slice(labels), self.cp_group,
            None if position_ids is None else self.local_slice(position_ids))
        if loss is not None:
            loss = loss.reshape(())  # the library's loss has shape [1]; LM's is a scalar
        if loss is not None and torch.is_grad_enabled():
            # Parameters that this rank's slice does not reach (TTT's initial inner weights W_0,
            # b_0 reach later ranks only through the passed state) get an exact zero gradient,
            # so every rank hands every parameter to ZeRO's gradient reduction.
            loss = loss + sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        return LMOutput(logits=logits, loss=loss)


__all__ = ["ContextParallelLM"]
