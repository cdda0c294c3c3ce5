"""Shared by the tensor-parallel tests (run inside their gloo workers): one TP LM against the
single-process LM it was split from, in float64."""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def packed_positions(B: int, T: int) -> torch.Tensor:
    """position_ids [B, T] of packed rows as the loader makes them: 0 at each document's first token,
    several documents per row (row b's documents are 3 + 2b, 2 + 2b, … tokens long, then one-token
    ones, the last one cut by the row's end), every row starting with a document."""
    rows = []
    for b in range(B):
        row, n = [], 3 + 2 * b
        while len(row) < T:
            row += list(range(max(n, 1)))
            n -= 1
        rows.append(row[:T])
    return torch.tensor(rows)


def decay_flags(model) -> dict:
    """Parameter name → whether AdamW decays it (the trainer's ``param_groups``)."""
    from ttt_lm.train.optim import param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g["weight_decay"] > 0 for g in param_groups(model, 0.1) for p in g["params"]}


def tp_lm_vs_single(cfg, groups, sp: bool, close: Callable, *, T: int = 6, n_masked: int = 2,
                    data_seed: int = 0, perturb: bool = True, checkpointing: bool = False,
                    state_split: Optional[Callable] = None, nonzero_grads: bool = True,
                    decode: bool = True, positions: bool = True) -> None:
    """TP model = single-process model: the gathered weights are the single-rank ones, every
    parameter is in the same weight-decay group, and the loss, every parameter gradient
    (gathered), the full logits and greedy decoding (a 5-token prefill, then step() per token on
    the local heads' state) agree. ``positions``: both models get the ``position_ids`` of packed
    rows (``packed_positions``: the RG-LRU's segment positions, and document resets with
    ``cfg.reset_at_doc_boundaries``), as the trainer passes the loader's.

    ``perturb`` moves the parameters away from their structured init (zero biases, unit gains…) so
    that no slice is all zeros or ones; ``state_split(block, name, tensor)`` says which of a
    single-rank block's decode-state tensors the TP block holds split by p along dim 1 (their
    shapes are checked); ``nonzero_grads`` refuses a zero reference gradient (it would check
    nothing); ``data_seed`` picks the batch (each data-parallel replica its own)."""
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.tp_model import gather_full_state_dict, gather_tp_tensor, parallelize_tp
    p = torch.distributed.get_world_size(groups.tp_group)
    torch.manual_seed(0)
    ref = LM(cfg).double()
    if perturb:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(7)
            for prm in ref.parameters():
                prm.add_(0.05 * torch.randn(prm.shape, generator=gen, dtype=prm.dtype))
    one = copy.deepcopy(ref)
    for p_ref, p_one in zip(ref.parameters(), one.parameters()):
        p_one.__dict__.update(p_ref.__dict__)  # deepcopy drops a parameter's flags (_no_weight_decay)
    tpm = parallelize_tp(one, groups, sequence_parallel=sp)
    tpm.activation_checkpointing = checkpointing  # the collectives are replayed in the recomputation
    B = 2
    gen = torch.Generator().manual_seed(100 + data_seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels[0, :n_masked] = -100
    pos = packed_positions(B, T) if positions else None

    sd, full_sd = ref.state_dict(), gather_full_state_dict(tpm)
    assert sd.keys() == full_sd.keys()
    for k in sd:
        assert torch.equal(sd[k], full_sd[k]), f"{k}: the TP weights must be slices of the single-rank ones"
    # a slice decayed under TP and not in one process (or the reverse) makes the runs drift from step 2 on
    assert decay_flags(tpm) == decay_flags(ref), "TP and single-process weight-decay groups differ: " + str(
        {n: (v, decay_flags(ref).get(n)) for n, v in decay_flags(tpm).items() if decay_flags(ref).get(n) != v})
    if state_split is not None:
        for i, (blk, rblk) in enumerate(zip(tpm.layers, ref.layers)):
            sts = dict(blk.mixer.init_state(B).named_tensors())
            for k, v in rblk.mixer.init_state(B).named_tensors():
                if state_split(rblk, k, v):
                    assert sts[k].shape[1] * p == v.shape[1] and sts[k].shape[2:] == v.shape[2:], (i, k, sts[k].shape)

    # the single-rank LM's own loss goes through .float(); take it in float64 here
    logits = ref(ids, position_ids=pos).logits
    want = F.cross_entropy(logits.view(-1, cfg.vocab_size), labels.view(-1), ignore_index=-100)
    want.backward()
    tpm.train()
    out = tpm(ids, labels=labels, position_ids=pos)
    close(out.loss, want.detach(), f"loss sp={sp}")
    assert out.logits is None  # training: full logits are not formed
    out.loss.backward()
    refp = dict(ref.named_parameters())
    for name, prm in tpm.named_parameters():
        gfull = gather_tp_tensor(prm.grad, getattr(prm, "partition_dim", None), groups.tp_group,
                                 getattr(prm, "partition_stride", 1))
        if nonzero_grads:
            assert refp[name].grad.abs().max() > 0, f"{name}: a zero gradient would check nothing"
        close(gfull, refp[name].grad, f"grad {name} sp={sp}")
    with torch.no_grad():
        close(tpm(ids, position_ids=pos).logits, logits.detach(), "gathered logits")
        if decode:
            prompt = ids[:, :5]  # 5 tokens: not a multiple of p, no sequence split; then step()
            close(tpm.generate(prompt, 3, temperature=0), ref.generate(prompt, 3, temperature=0).to(torch.long),
                  "greedy generation")
