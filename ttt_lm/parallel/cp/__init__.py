r"""Context (sequence) parallelism: the sequence is split into contiguous slices, rank r of the
context-parallel (CP) group holding tokens [start_r, start_r + T_r).

Three schemes, each exact (outputs and gradients equal one pass over the whole sequence), one
module each:

* ``summary``: linear recurrences (RG-LRU, Mamba's selective scan, the delta rules) by chunk
  summaries combined across ranks (each op's combine in its folder, ``kernels/<op>/cp.py``);
* ``pipeline``: nonlinear recurrences (TTT with its inner LayerNorm, TTT-MLP, Titans' MLP memory)
  by passing the final state from rank r to rank r + 1, pipelined over groups of batch rows;
* ``kv``: attention by exchanging keys and values.

They rest on ``comm`` (the differentiable collectives: all-gathers, the convolutions' halo,
the point-to-point sends of states) and ``docs`` (packed documents: this rank's ``SliceDocs``).
``lm`` picks each mixer's form from its declaration and runs a whole ``LM``
(``context_parallel_forward``, ``allreduce_gradients``).
"""
from ttt_lm.parallel.cp.comm import (all_gather, all_gather_varlen, gather_lengths, gather_rows, halo,
                                     split_lengths, wait_pending)
from ttt_lm.parallel.cp.docs import SliceDocs, slice_docs
from ttt_lm.parallel.cp.kv import cp_kv_exchange
from ttt_lm.parallel.cp.lm import CP_FORMS, allreduce_gradients, block_scheme, context_parallel_forward, cp_mixer
from ttt_lm.parallel.cp.pipeline import pass_state_forward
from ttt_lm.parallel.cp.summary import (cp_delta_rule, cp_gated_delta_rule, cp_kda, cp_linear_scan, cp_summary,
                                        delta_rule_docs, kda_docs, op_combine, selective_scan_docs)

__all__ = ["SliceDocs", "slice_docs", "gather_rows", "split_lengths", "gather_lengths", "all_gather", "all_gather_varlen", "halo",
           "pass_state_forward", "wait_pending", "cp_linear_scan", "cp_delta_rule", "cp_gated_delta_rule", "cp_kda", "cp_summary",
           "delta_rule_docs", "kda_docs", "selective_scan_docs",
           "cp_kv_exchange", "op_combine", "CP_FORMS", "cp_mixer", "block_scheme",
           "context_parallel_forward", "allreduce_gradients"]
