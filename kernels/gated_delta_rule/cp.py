r"""``gated_delta_rule`` over a sequence split across ranks: the delta rule's summaries
(``kernels/delta_rule/cp.py``) with P_r = Π_t α_t (I − β_t k_t k_tᵀ), the run of [v, 0] from
[0, I] carrying the decay."""
from __future__ import annotations

from typing import Tuple

import torch

from kernels import gated_delta_rule as _gdr
from kernels.cp import Gather
from kernels.delta_rule.cp import delta_rule_docs, summary_runs


def cp_gated_delta_rule(q, k, v, g, beta, gather: Gather, rank: int, backend: str = "torch", chunk_size: int = 64,
                        docs=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` over a sequence split along T across the ranks (q, k [B, H, T_r, d_k],
    v [B, H, T_r, d_v], g, β [B, H, T_r]; the sequence starts from S = 0). Returns (o, the state
    after this rank's slice [B, H, d_k, d_v]). ``docs``: as the delta rule's (P_r = 0 on a row
    with a start in the slice)."""
    if docs is not None:
        run = lambda vv, S0: delta_rule_docs(q, k, vv, beta, S0, docs, backend, chunk_size, g)
    else:
        run = lambda vv, S0: _gdr.gated_delta_rule_trusted(q, k, vv, g, beta, S0, True, backend=backend,
                                                           chunk_size=chunk_size)
    return summary_runs(run, k, v, gather, rank)


def summary_combine(run, inp, gather: Gather, rank: int, backend, docs=None) -> torch.Tensor:
    """The op's outputs over this rank's slice (``inp``: q, k, v, g, β and ``chunk_size``)."""
    y, _ = cp_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], gather, rank, backend,
                               inp["chunk_size"], docs)
    return y


__all__ = ["cp_gated_delta_rule", "summary_combine"]
