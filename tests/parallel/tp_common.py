"""Shared by the tensor-parallel tests (run inside their gloo workers): one TP LM against the
single-process LM it was split from, in float64."""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def tp_lm_vs_single(cfg, groups, sp: bool, close: Callable, *, T: int = 6, n_masked: int = 2,
                    data_seed: int = 0, perturb: bool = True, checkpointing: bool = False,
                    state_split: Optional[Callable] = None, nonzero_grads: bool = True,
                    decode: bool = True) -> None:
    """TP model = single-process model: the gathered weights are the single-rank ones, and the loss,
    every parameter gradient (gathered), the full logits and greedy decoding (a 5-token prefill,
    then step() per token on the local heads' state) agree.

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
    tpm = parallelize_tp(copy.deepcopy(ref), groups, sequence_parallel=sp)
    tpm.activation_checkpointing = checkpointing  # the collectives are replayed in the recomputation
    B = 2
    gen = torch.Generator().manual_seed(100 + data_seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    labels[0, :n_masked] = -100

    sd, full_sd = ref.state_dict(), gather_full_state_dict(tpm)
    assert sd.keys() == full_sd.keys()
    for k in sd:
        assert torch.equal(sd[k], full_sd[k]), f"{k}: the TP weights must be slices of the single-rank ones"
    if state_split is not None:
        for i, (blk, rblk) in enumerate(zip(tpm.layers, ref.layers)):
            sts = dict(blk.mixer.init_state(B).named_tensors())
            for k, v in rblk.mixer.init_state(B).named_tensors():
                if state_split(rblk, k, v):
                    assert sts[k].shape[1] * p == v.shape[1] and sts[k].shape[2:] == v.shape[2:], (i, k, sts[k].shape)

    # the single-rank LM's own loss goes through .float(); take it in float64 here
    logits = ref(ids).logits
    want = F.cross_entropy(logits.view(-1, cfg.vocab_size), labels.view(-1), ignore_index=-100)
    want.backward()
    tpm.train()
    out = tpm(ids, labels=labels)
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
        close(tpm(ids).logits, logits.detach(), "gathered logits")
        if decode:
            prompt = ids[:, :5]  # 5 tokens: not a multiple of p, no sequence split; then step()
            close(tpm.generate(prompt, 3, temperature=0), ref.generate(prompt, 3, temperature=0).to(torch.long),
                  "greedy generation")
