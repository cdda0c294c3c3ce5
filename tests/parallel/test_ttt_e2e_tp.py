"""TTT-E2E under tensor parallelism (two gloo processes on CPU) against the single-process model,
float64: the forward loss, every chunk's loss, the fast weights W^{(i)} of every inner step
(gathered from the ranks' shards), the inner gradient's global norm ‖g_i‖, the logits and the outer
gradient of every parameter (gathered), with the inner clip active; a per-rank clip norm (the
squared norms not summed over the group) must fail that comparison; decoding (prefill, greedy
generation) and ``hidden`` on the local heads' states equal the single-process ones; sequence
parallelism and a head count the group does not divide are refused.

Tolerance: the TP computation is the single-process one with the matmuls split by heads and
features and their partial products summed by all-reduces (and the clip's squared norm summed per
rank then across ranks), so the two differ in summation order only: float64 rounding, ~1e-15
relative, grown through two backward passes. 1e-10 of max(1, the reference's largest entry) leaves
margin and fails on any missing, doubled or mis-sliced term (an O(1) relative error), and on a
per-rank clip norm (the mutation differs by ~1e-2).
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed import assert_all_passed, spawn_checks

pytestmark = pytest.mark.dist

WORLD = 2
TOL = 1e-10
CLIP = 0.05          # below every chunk's ‖g_i‖ here, so every inner step is clipped


def _cfg(clip=CLIP, n_heads=4):
    from tests.model.test_ttt_e2e import e2e_config
    return e2e_config(clip=clip, n_heads=n_heads)


def _batch(cfg, B=2, T=14, seed=1):
    from tests.model.test_ttt_e2e import batch
    return batch(cfg, B, T, seed)


_GROUPS = {}


def _group():
    from ttt_lm.parallel.groups import build_groups
    if "g" not in _GROUPS:
        _GROUPS["g"] = build_groups(tp_size=WORLD)
    return _GROUPS["g"]


def _pair(cfg):
    """(the single-process model, its TP=2 conversion), both float64 in training mode at step 2."""
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.tp_model import parallelize_tp
    torch.manual_seed(0)
    ref = LM(cfg).double().train()
    tpm = parallelize_tp(copy.deepcopy(ref), _group())
    for m in (ref, tpm):
        m.set_train_step(2)
    return ref, tpm


def _diff(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _close(a, b, what):
    d = _diff(a, b)
    assert d <= TOL, f"{what}: relative difference {d:.3e} > {TOL}"


def _gather(t, dim):
    from ttt_lm.parallel.tp_model import gather_tp_tensor
    return gather_tp_tensor(t, dim, _group().tp_group)


def _fast_dims():
    return (1, 1, 2)            # w1, w3 [B, F/p, D] by rows, w2 [B, D, F/p] by columns


def _trace_and_grads(m, ids, labels):
    tr = m.run(ids, labels, keep_logits=True, keep_fast=True)
    params = [p for _, p in m.named_parameters()]
    return tr, dict(zip([n for n, _ in m.named_parameters()], torch.autograd.grad(tr.loss, params)))


# ---- checks (run inside the workers) -----------------------------------------------------------
def check_training_forward_and_outer_gradient():
    from ttt_lm.parallel.tp_model import gather_full_state_dict
    cfg = _cfg()
    ref, tpm = _pair(cfg)
    sd, full = ref.state_dict(), gather_full_state_dict(tpm)
    assert sd.keys() == full.keys()
    for k in sd:
        assert torch.equal(sd[k], full[k]), f"{k}: the TP weights must be slices of the single-rank ones"
    assert tpm.local_heads * WORLD == cfg.n_heads
    assert tpm.layers[-1].prime.w1.shape[0] * WORLD == cfg.ff
    ids, labels = _batch(cfg)
    tr_r, g_r = _trace_and_grads(ref, ids, labels)
    tr_t, g_t = _trace_and_grads(tpm, ids, labels)
    assert (tr_r.grad_norms > CLIP).all(), f"the clip must act in every step: {tr_r.grad_norms}"
    _close(tr_t.loss, tr_r.loss, "loss")
    _close(tr_t.losses, tr_r.losses, "per-chunk losses")
    _close(tr_t.grad_norms, tr_r.grad_norms, "inner gradient norms")
    _close(tr_t.logits, tr_r.logits, "logits")
    assert len(tr_t.fast) == len(tr_r.fast) == 4
    for i, (fr, ft) in enumerate(zip(tr_r.fast, tr_t.fast)):
        for j in range(cfg.ttt_e2e.suffix_len):
            for k, dim in enumerate(_fast_dims()):
                assert ft[j][k].shape[dim] * WORLD == fr[j][k].shape[dim]
                _close(_gather(ft[j][k], dim), fr[j][k], f"W^({i}) of TTT block {j}, weight {k}")
    assert g_r.keys() == g_t.keys()
    for n, p in tpm.named_parameters():
        assert g_r[n].abs().max() > 0, f"{n}: a zero gradient would check nothing"
        _close(_gather(g_t[n], getattr(p, "partition_dim", None)), g_r[n], f"outer gradient of {n}")
    # and through forward(labels=...) with its backward, as the trainer calls it (remat on)
    loss = tpm(ids, labels=labels).loss
    loss.backward()
    _close(loss.detach(), tr_r.loss.detach(), "forward loss")
    for n, p in tpm.named_parameters():
        _close(_gather(p.grad, getattr(p, "partition_dim", None)), g_r[n], f"backward gradient of {n}")


def check_per_rank_clip_norm_fails():
    """The mutation: each rank clips by the norm of its own shards (not summed over the group)."""
    cfg = _cfg()
    ref, tpm = _pair(cfg)
    tpm._sum_over_tp = lambda sq: sq
    ids, labels = _batch(cfg)
    with torch.no_grad():
        tr_r = ref.run(ids, labels, keep_fast=True)
        tr_t = tpm.run(ids, labels, keep_fast=True)
    d = max(_diff(_gather(tr_t.fast[1][j][k], dim), tr_r.fast[1][j][k])
            for j in range(cfg.ttt_e2e.suffix_len) for k, dim in enumerate(_fast_dims()))
    assert d > 1e3 * TOL, f"a per-rank clip norm must move W^(1) (relative difference {d:.3e})"
    assert _diff(tr_t.grad_norms, tr_r.grad_norms) > 1e3 * TOL


def check_decode_and_hidden():
    cfg = _cfg()
    ref, tpm = _pair(cfg)
    ref.eval(), tpm.eval()
    ids, _ = _batch(cfg, T=11)
    with torch.no_grad():
        want = ref(ids).logits
        h, st = tpm.hidden(ids, output_states=True)
        _close(tpm.lm_head(h), want, "lm_head(hidden) under TP")
        _close(h, ref.hidden(ids)[0], "hidden")
        assert st[-1].k.shape[1] * WORLD == cfg.n_heads, "the states hold the local heads' caches"
        assert st[-1].fast[0].shape[1] * WORLD == cfg.ff, "the states hold the fast weights' shards"
        _close(tpm(ids).logits, want, "logits")
        for chunk in (3, None):
            lt, _ = tpm.prefill(ids, prefill_chunk=chunk)
            _close(lt, want[:, -1], f"prefill logits (pieces of {chunk})")
        prompt = ids[:, :7]
        gen_t, gen_r = tpm.generate(prompt, 6, temperature=0), ref.generate(prompt, 6, temperature=0)
        assert torch.equal(gen_t, gen_r), (gen_t, gen_r)


def check_refusals():
    from ttt_lm.model.lm import LM
    from ttt_lm.parallel.tp_model import parallelize_tp
    try:
        parallelize_tp(LM(_cfg()), _group(), sequence_parallel=True)
    except ValueError as e:
        assert "parallel.sequence_parallel=true is not built" in str(e), str(e)
    else:
        raise AssertionError("sequence parallelism must be refused for TTT-E2E")
    m = LM(_cfg(n_heads=1))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    try:
        parallelize_tp(m, _group())
    except ValueError as e:
        assert "tensor_parallel=2 must divide model.n_heads=1" in str(e), str(e)
    else:
        raise AssertionError("a head count the group does not divide must be refused")
    assert m.tp_ctx is None and all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def check_collectives_twice_differentiable():
    """f, g and Σ under a gradient taken with create_graph=True: the second derivative of a
    function through them equals the single-process one (the collectives' backward recorded)."""
    import torch.distributed as dist
    from ttt_lm.parallel.tensor_parallel import (all_reduce_sum, copy_to_tensor_parallel_region,
                                                 reduce_from_tensor_parallel_region)
    grp, r = _group().tp_group, dist.get_rank(_group().tp_group)
    gen = torch.Generator().manual_seed(3)
    x_full = torch.randn(2, 6, generator=gen, dtype=torch.float64)      # replicated input
    w_full = torch.randn(6, 6, generator=gen, dtype=torch.float64)      # rows split by rank
    c = torch.randn(2, generator=gen, dtype=torch.float64)

    def objective(x, w, tp):
        """Σ_b c_b·‖∂s²/∂x_b‖², s_b = Σ tanh(x_b W)²: a gradient taken inside, then differentiated
        (s² makes the upstream gradient of g depend on W, so g's double backward matters)."""
        xi = copy_to_tensor_parallel_region(x, grp) if tp else x
        y = torch.tanh(xi @ w.T)
        part = y.pow(2).sum(-1)
        s = reduce_from_tensor_parallel_region(part, grp) if tp else part
        (gx,) = torch.autograd.grad(s.pow(2).sum(), x, create_graph=True)
        sq = gx.pow(2).sum(-1)
        return (c * sq).sum(), sq

    x1 = x_full.clone().requires_grad_(True)
    w1 = w_full.clone().requires_grad_(True)
    o1, sq1 = objective(x1, w1, False)
    gx1, gw1 = torch.autograd.grad(o1, (x1, w1))
    x2 = x_full.clone().requires_grad_(True)
    w2 = w_full.chunk(WORLD, 0)[r].clone().requires_grad_(True)
    o2, sq2 = objective(x2, w2, True)
    gx2, gw2 = torch.autograd.grad(o2, (x2, w2))
    _close(sq2, sq1, "inner gradient")
    _close(gx2, gx1, "second-order gradient of the replicated input")
    _close(_gather(gw2, 0), gw1, "second-order gradient of the split weight")
    # Σ: a sum that every rank's own term reads (as each rank's shard reads the clip norm): the
    # objective is Σ_r S·Σ v_r, S = Σ_r Σ v_r³; differentiated twice
    v = w_full[r].clone().requires_grad_(True)
    S = all_reduce_sum(v.pow(3).sum()[None], grp)[0]
    (gv,) = torch.autograd.grad(S * v.sum(), v, create_graph=True)
    (hv,) = torch.autograd.grad(gv.pow(2).sum(), v)
    vf = w_full[:WORLD].clone().requires_grad_(True)
    (gvf,) = torch.autograd.grad(vf.pow(3).sum() * vf.sum(), vf, create_graph=True)
    (hvf,) = torch.autograd.grad(gvf.pow(2).sum(), vf)
    _close(gv, gvf[r], "Σ: first derivative")
    _close(hv, hvf[r], "Σ: second derivative")

CHECKS = [
    ("collectives_twice_differentiable", check_collectives_twice_differentiable),
    ("training_forward_and_outer_gradient", check_training_forward_and_outer_gradient),
    ("per_rank_clip_norm_fails", check_per_rank_clip_norm_fails),
    ("decode_and_hidden", check_decode_and_hidden),
    ("refusals", check_refusals),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_checks(WORLD, __name__, tmp_path_factory.mktemp("ttt_e2e_tp"))


@pytest.mark.parametrize("check", [n for n, _ in CHECKS])
def test_ttt_e2e_tp(results, check):
    assert_all_passed(results[0], check, results[1])


def test_config_accepts_tp_and_refuses_sequence_parallelism():
    from ttt_lm.config import ConfigError, load_config
    cfg = load_config("configs/tiny_ttt_e2e.yaml", ["parallel.tensor_parallel=2"])
    assert cfg.parallel.tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true is not built for TTT-E2E"):
        load_config("configs/tiny_ttt_e2e.yaml", ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"])
