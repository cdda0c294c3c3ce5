"""The LM as the trainer runs it with ``parallel.context_parallel`` = c > 1: every rank of a
context-parallel (CP) group is given the same full rows and computes only its contiguous slice of
them (``split_lengths``: rank r holds tokens [start_r, start_r + T_r)) with
``ttt_lm.parallel.cp.context_parallel_forward``.

It is an ``LM`` (same parameters, names and initialization from the same seed), so DeepSpeed's
engine calls it as it calls the LM — ZeRO's hooks and the checkpoints' state dicts are unchanged
and ``ttt_lm.train.export`` reads its checkpoints as any other.

Loss and gradients. The returned loss of CP rank r is its summed cross-entropy × c / (valid labels
in the whole rows), so the mean over the c ranks is the rows' mean cross-entropy L. Backward on
every rank, through the library's collectives, leaves on rank r its share of ∇(Σ_r loss_r) =
c ∇L; DeepSpeed averages gradients over its data-parallel group, which is dp × c ranks
(``groups.mpu()``), giving (1/dp) Σ_d ∇L_d: the gradient of the global batch's mean loss, as with
c = 1.

Gradient order (ZeRO-2). ZeRO-2 packs gradients into its reduction buckets in the order each rank's
backward accumulates them, and the CP ranks' graphs differ (the state sends and receives, the
parameters that reach a slice only through the passed state), so left alone the ranks would reduce
different buckets against each other. The forward therefore runs the model on gated copies of its
parameters: a chain of identity autograd Functions, one per parameter, each of whose backward waits
for the next one's, so every parameter's gradient is accumulated at the end of the backward pass,
in reverse parameter order, on every rank alike (and unused parameters get an exact zero).
ZeRO-3. DeepSpeed's ZeRO-3 gathers and releases each module's parameters by hooks around its
forward and backward: collectives over all dp × c ranks that the CP ranks would reach at different
times (rank 1 waits for rank 0's state while rank 0 waits in the gather of the next block's
parameters), and the gated copies would be taken of released (empty) parameters. So under CP the
trainer removes those hooks (``ttt_lm.train.engine``) and this forward gathers every parameter
itself, at its start, in one collective that every rank makes at the same point
(``deepspeed.zero.GatheredParameters``); they stay whole through the backward (whose gradients
ZeRO-3's own gradient hooks reduce-scatter, in the gates' fixed order) and are partitioned again
by ``release_parameters`` (the trainer calls it after each backward; a forward without autograd
releases them at its end). Between steps and in the checkpoints each rank holds its shard; during
a step every rank holds all the parameters, as with ZeRO-1/2.

CP × TP. ``ttt_lm.parallel.tp_model.parallelize_tp`` converts this model's layers in place (it
keeps the class): each rank then holds its TP slice, the mixers run their local heads, the states,
summaries and keys/values exchanged between CP peers (ranks with the same TP index,
``ttt_lm.parallel.groups``) are those heads', and the loss is the vocab-parallel cross-entropy.
Without sequence parallelism (refused with CP).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ttt_lm.model.config import ModelConfig
from ttt_lm.model.lm import LM, LMOutput
from ttt_lm.parallel.cp import context_parallel_forward, split_lengths


class _Gate(torch.autograd.Function):
    """(token, p) → (token', p) unchanged; backward returns p's gradient (zero where none) only once
    token' has its gradient, which comes from the next gate's backward: a chain that accumulates
    the parameters' gradients one after another in a fixed order."""

    @staticmethod
    def forward(ctx, token, p):
        return token.view_as(token), p.view_as(p)

    @staticmethod
    def backward(ctx, g_token, g_p):
        return g_token, g_p


def _gated(params):
    """The gated copies of ``params`` (a list of (name, parameter)) and the chain's last token."""
    token = torch.zeros((), dtype=torch.float32, device=params[0][1].device, requires_grad=True)
    out = {}
    for name, p in params:
        token, out[name] = _Gate.apply(token, p)
    return out, token


class ContextParallelLM(LM):
    #: ``parallelize_tp`` converts its layers in place and keeps this forward (CP × TP)
    runs_tp_layers = True

    def __init__(self, cfg: ModelConfig, cp_group, pipeline_chunks: int = 1):
        super().__init__(cfg)
        self.cp_group = cp_group
        self.pipeline_chunks = pipeline_chunks   # row groups of the state-passing pipeline
        self._gated_call = False                 # inside the forward on gated parameters
        self._zero3 = None                       # ZeRO-3: the gathering of every parameter, while held
        self.cp_rank, self.cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)

    def release_parameters(self) -> None:
        """ZeRO-3: partition the parameters again after the backward (each rank keeps its shard);
        nothing otherwise. Every rank calls it at the same point (it makes no collective)."""
        if self._zero3 is not None:
            z, self._zero3 = self._zero3, None
            z.__exit__(None, None, None)

    def local_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part of [B, T] rows."""
        lengths = split_lengths(t.shape[1], self.cp_size)
        start = sum(lengths[: self.cp_rank])
        return t[:, start:start + lengths[self.cp_rank]]

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, states=None,
                output_states: bool = False, position_ids: Optional[torch.Tensor] = None) -> LMOutput:
        """input_ids, labels, position_ids: the full rows [B, T] (the same on every CP rank;
        position_ids reach the RG-LRU as segment positions and, with
        ``model.reset_at_doc_boundaries``, give the documents every layer restarts at). Returns this rank's logits [B, T_r]
        and its loss share (see the module docstring)."""
        if states is not None or output_states:
            raise ValueError("the context-parallel LM runs whole rows from the start: no states")
        if self._zero3 is None and any(hasattr(p, "ds_id") for p in self.parameters()):
            # ZeRO-3: every parameter gathered once, up front, in one collective every rank makes at
            # the same point, and kept until ``release_parameters`` after the backward (module docstring)
            import deepspeed
            self._zero3 = deepspeed.zero.GatheredParameters(list(self.parameters()))
            self._zero3.__enter__()
            if not torch.is_grad_enabled():  # no backward follows: release after this forward
                try:
                    return self.forward(input_ids, labels, position_ids=position_ids)
                finally:
                    self.release_parameters()
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if not self._gated_call and labels is not None and torch.is_grad_enabled() and params:
            # every parameter's gradient accumulated last, in one order on every rank (module docstring)
            gated, token = _gated(params)
            self._gated_call = True
            try:
                out = torch.func.functional_call(self, gated, (input_ids,),
                                                 {"labels": labels, "position_ids": position_ids}, tie_weights=True)
            finally:
                self._gated_call = False
            return LMOutput(logits=out.logits, loss=out.loss + token.to(out.loss.dtype) * 0.0)
        loss, logits = context_parallel_forward(
            self, self.local_slice(input_ids), None if labels is None else self.local_slice(labels), self.cp_group,
            None if position_ids is None else self.local_slice(position_ids), self.pipeline_chunks)
        if loss is not None:
            loss = loss.reshape(())  # the library's loss has shape [1]; LM's is a scalar
        return LMOutput(logits=logits, loss=loss)


__all__ = ["ContextParallelLM"]
