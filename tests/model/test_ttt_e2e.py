"""TTT-E2E (ttt_lm.model.e2e) against the independent reference of the official semantics
(tests/model/e2e_reference.py): per-chunk losses, logits, the fast weights of every inner step,
the inner gradient's norm and the outer gradient of every parameter, float64 within 1e-10 and
float32 within 2e-5 (of max(1, the reference's largest entry)); with windows that are not a
multiple of the inner batch and a partial last chunk. Each mutation of the reference (a
first-order inner step, rotate-half RoPE, parallel MLPs, a token-weighted mean, a detached cache)
differs from the model by far more than the tolerance.

Tolerances: float64 runs the same math in another order (per-sequence loops, absolute-position
RoPE, explicit sums), so they agree to rounding (~1e-14); 1e-10 leaves margin for the second-order
chains. float32 accumulates ~1e-6 relative rounding through two backward passes; 2e-5 is the bound
the goal states.
"""
from __future__ import annotations

import pytest
import torch

from tests.model.e2e_reference import Mutations, reference
from ttt_lm.model.config import ModelConfig
from ttt_lm.model.e2e import E2ELM, rope_interleaved
from ttt_lm.model.lm import LM

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def e2e_config(S=2, L=3, b=4, w=6, clip=1e3, lr=1.0, n_heads=2, **kw) -> ModelConfig:
    cfg = ModelConfig(vocab_size=37, d_model=16, n_layers=L, n_heads=n_heads, d_ff=24, init_std=0.2, **kw)
    e = cfg.ttt_e2e
    e.enabled, e.suffix_len, e.inner_batch, e.window, e.inner_clip, e.inner_lr = True, S, b, w, clip, lr
    e.rope_theta = 100.0           # short sequences: a small θ makes every frequency turn
    e.ilr_init, e.ilr_warmup_steps = 0.1, 4
    return cfg


def batch(cfg, B=2, T=14, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.25] = -100      # masked targets (the official BOS mask)
    return ids, labels


def build(cfg, dtype, seed=0):
    torch.manual_seed(seed)
    return LM(cfg).to(dtype).train()


def model_side(m, ids, labels):
    params = [p for _, p in m.named_parameters()]
    tr = m.run(ids, labels, keep_logits=True, keep_fast=True)
    grads = torch.autograd.grad(tr.loss, params)
    return tr, grads


def ref_side(m, ids, labels, mut=None):
    names = [n for n, _ in m.named_parameters()]
    params = [p for _, p in m.named_parameters()]
    out = reference(dict(zip(names, params)), m.cfg, ids, labels, rho=m.rho(), mut=mut)
    grads = torch.autograd.grad(out.loss, params)
    return out, grads


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def errors(m, ids, labels, mut=None):
    tr, g_model = model_side(m, ids, labels)
    ref, g_ref = ref_side(m, ids, labels, mut)
    S, B = m.e2e.suffix_len, ids.shape[0]
    err = {"loss": rel(tr.loss, ref.loss), "losses": rel(tr.losses, ref.losses), "logits": rel(tr.logits, ref.logits)}
    if tr.grad_norms is not None:
        err["grad_norms"] = rel(tr.grad_norms, ref.grad_norms)
        err["fast"] = max(rel(tr.fast[i][j][k][bi], ref.fast[bi][i][3 * j + k])
                          for i in range(len(tr.fast)) for j in range(S) for k in range(3) for bi in range(B))
    names = [n for n, _ in m.named_parameters()]
    err["grad"] = max(rel(a, b) for a, b in zip(g_model, g_ref))
    err["worst_param"] = max(zip((rel(a, b) for a, b in zip(g_model, g_ref)), names))[1]
    return err, tr


def worst(err):
    return max(v for k, v in err.items() if k != "worst_param")


CASES = [  # (S, b, w, T): window not a multiple of b, shorter than b, partial chunk, T a multiple of b
    (2, 4, 6, 14), (2, 4, 3, 12), (1, 4, 9, 13), (3, 5, 7, 15)]


@pytest.mark.parametrize("S,b,w,T", CASES)
@pytest.mark.parametrize("clip", [1e3, 1e-2], ids=["no_clip", "clips"])
@pytest.mark.parametrize("remat", [True, False], ids=["remat", "no_remat"])
def test_matches_reference_float64(S, b, w, T, clip, remat):
    cfg = e2e_config(S=S, L=S + 1, b=b, w=w, clip=clip)
    cfg.ttt_e2e.remat = remat
    m = build(cfg, torch.float64)
    m.set_train_step(2)                       # ρ = 0.1 + 0.9·2/4 = 0.55
    assert abs(m.rho() - 0.55) < 1e-12
    ids, labels = batch(cfg, T=T)
    err, tr = errors(m, ids, labels)
    assert worst(err) <= TOL[torch.float64], err
    # the clip branch this case means to exercise ran
    assert bool((tr.grad_norms > clip).all()) if clip < 1 else bool((tr.grad_norms < clip).all())
    assert len(tr.losses) == -(-T // b)


@pytest.mark.parametrize("S,b,w,T", CASES[:2])
def test_matches_reference_float32(S, b, w, T):
    cfg = e2e_config(S=S, L=S + 1, b=b, w=w, clip=1.0)
    m = build(cfg, torch.float32)
    ids, labels = batch(cfg, T=T)
    err, _ = errors(m, ids, labels)
    assert worst(err) <= TOL[torch.float32], err


MUTATIONS = ["first_order", "rotate_half", "parallel_mlps", "token_mean", "detach_cache"]


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutations_fail_the_comparison(name):
    cfg = e2e_config(S=2, L=3, b=4, w=6, clip=1e3)
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg, T=14)
    err, _ = errors(m, ids, labels, Mutations(**{name: True}))
    assert worst(err) > 1e3 * TOL[torch.float64], (name, err)
    faithful, _ = errors(m, ids, labels)
    assert worst(faithful) <= TOL[torch.float64]


def test_first_order_and_detached_cache_change_only_the_outer_gradient():
    cfg = e2e_config()
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg)
    for name in ("first_order", "detach_cache"):
        err, _ = errors(m, ids, labels, Mutations(**{name: True}))
        assert err["losses"] <= 1e-10 and err["logits"] <= 1e-10, (name, err)
        assert err["grad"] > 1e-7, (name, err)


def test_interleaved_rope_pairs():
    x = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5])
    y = rope_interleaved(x, pos, 10.0)
    a = pos.double() * 10.0 ** (-2.0 / 4)                      # pair (x_2, x_3), i = 1
    assert torch.allclose(y[..., 2], x[..., 2] * a.cos() - x[..., 3] * a.sin())
    assert torch.allclose(y[..., 3], x[..., 2] * a.sin() + x[..., 3] * a.cos())
    assert torch.allclose(y[..., 0], x[..., 0] * pos.double().cos() - x[..., 1] * pos.double().sin())


# ---- the partial-chunk rule ---------------------------------------------------------------------
@pytest.mark.parametrize("r", [1, 3, 4, 5, 9, 13])
def test_logits_of_a_prefix_do_not_depend_on_later_tokens(r):
    cfg = e2e_config(S=2, L=3, b=4, w=6)
    m = build(cfg, torch.float64).eval()
    ids, _ = batch(cfg, T=14)
    with torch.no_grad():
        full = m(ids).logits
        cut = m(ids[:, :r]).logits
    assert cut.shape[1] == r
    assert float((full[:, :r] - cut).abs().max()) < 1e-12
    # the later logits do depend on the earlier tokens' updates (the test could fail)
    if r >= 5:
        other = ids.clone()
        other[:, 0] = (other[:, 0] + 1) % cfg.vocab_size
        with torch.no_grad():
            moved = m(other).logits
        assert float((moved[:, 4:] - full[:, 4:]).abs().max()) > 1e-6


def test_partial_chunk_weight():
    """The last chunk of r < b tokens counts r/b in the chunk mean."""
    cfg = e2e_config(S=1, L=2, b=4, w=6)
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg, T=10)
    with torch.no_grad():
        tr = m.run(ids, labels)
    assert tr.weights == [1.0, 1.0, 0.5]
    want = ((tr.losses[0] + tr.losses[1] + 0.5 * tr.losses[2]) / 2.5).mean()
    assert float((tr.loss - want).abs()) < 1e-12


def test_batch_is_the_mean_over_sequences_each_with_its_own_fast_weights():
    cfg = e2e_config()
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg, B=3)
    with torch.no_grad():
        whole = m.run(ids, labels).loss
        each = [m.run(ids[i:i + 1], labels[i:i + 1]).loss for i in range(3)]
    assert float((whole - torch.stack(each).mean()).abs()) < 1e-12


def test_eval_uses_rho_one_and_no_grad_mode_runs_the_inner_loop():
    cfg = e2e_config()
    m = build(cfg, torch.float64)
    m.set_train_step(1)
    assert abs(m.rho() - (0.1 + 0.9 / 4)) < 1e-12
    ids, labels = batch(cfg)
    with torch.no_grad():
        train_loss = m.run(ids, labels).loss
        m.eval()
        assert m.rho() == 1.0
        eval_loss = m(ids, labels=labels).loss
    m.train()
    m.ilr_mult = 1.0
    full = m.run(ids, labels).loss
    assert float((eval_loss - full).abs()) < 1e-12 and float((train_loss - full).abs()) > 1e-9
    m.set_train_step(10)
    assert m.rho() == 1.0


def test_inner_updates_change_the_loss():
    """Without the inner step (η → tiny) the later chunks' losses change: the fast weights are used."""
    cfg = e2e_config()
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg)
    with torch.no_grad():
        a = m.run(ids, labels).losses
        m.e2e.inner_lr = 1e-12
        b = m.run(ids, labels).losses
    assert float((a[0] - b[0]).abs().max()) < 1e-12
    assert float((a[1:] - b[1:]).abs().max()) > 1e-6


# ---- build, init, refusals ----------------------------------------------------------------------
def test_lm_builds_the_e2e_model_and_its_init():
    cfg = e2e_config(S=1, L=2)
    cfg.init_std = 0.02
    cfg.d_model, cfg.d_ff = 64, 256
    m = LM(cfg)
    assert isinstance(m, E2ELM) and isinstance(m, LM) and m.supports_decode
    assert m.lm_head.weight is m.embed.weight
    assert not any(n.endswith("bias") for n, _ in m.named_parameters())
    for n, p in m.named_parameters():
        if p.ndim == 2 and p.numel() >= 4096:
            assert abs(float(p.std()) - 0.02) < 0.002 and abs(float(p.mean())) < 0.002, n
        elif p.ndim == 1:
            assert bool((p == 1).all()), n
    assert [n for n, _ in m.layers[1].named_parameters() if n.startswith("prime.")] == \
        ["prime.w1", "prime.w3", "prime.w2"]
    assert not hasattr(m.layers[0], "prime")


def test_loss_without_ttt_blocks_is_the_token_mean():
    cfg = e2e_config(S=0, L=2)
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg)
    loss = m(ids, labels=labels).loss
    logits = m(ids).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert float((loss - want).abs()) < 1e-10


@pytest.mark.parametrize("key,value,match", [
    ("window", 0, "model.ttt_e2e.window must be >= 1, got 0"),
    ("window", -3, "model.ttt_e2e.window must be >= 1, got -3"),
    ("inner_batch", 0, "model.ttt_e2e.inner_batch must be >= 1, got 0"),
    ("suffix_len", 5, "model.ttt_e2e.suffix_len=5 exceeds model.n_layers=3"),
    ("suffix_attention", "flash", "suffix_attention='flash'.*no double backward"),
    ("suffix_attention", "flex", "suffix_attention='flex'.*no double backward"),
    ("suffix_attention", "nope", "suffix_attention must be one of"),
    ("prefix_attention", "flash", "prefix_attention must be one of"),
    ("inner_clip", 0.0, "model.ttt_e2e.inner_clip must be > 0, got 0.0"),
])
def test_bad_settings_are_refused(key, value, match):
    cfg = e2e_config()
    setattr(cfg.ttt_e2e, key, value)
    with pytest.raises(ValueError, match=match):
        LM(cfg)


def test_training_config_refusals():
    from ttt_lm.config import load_config
    with pytest.raises(ValueError, match="inner_batch=96 must divide data.seq_len=256"):
        load_config("configs/tiny_ttt_e2e.yaml", ["model.ttt_e2e.inner_batch=96"])
    with pytest.raises(ValueError, match="parallel.sequence_parallel=true is not built for TTT-E2E"):
        load_config("configs/tiny_ttt_e2e.yaml", ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"])
    load_config("configs/tiny_ttt_e2e_swa.yaml", ["model.ttt_e2e.inner_batch=96"])   # no TTT blocks: no chunks


def test_not_built_parts_refuse_naming_the_model():
    m = build(e2e_config(), torch.float32)
    with pytest.raises(NotImplementedError, match="TTT-E2E .* not built yet"):
        m.compile_blocks()
    from ttt_lm.parallel.cp_model import ContextParallelLM  # noqa: F401  (a subclass of LM)

    class Sub(LM):
        pass
    with pytest.raises(ValueError, match="Sub does not run TTT-E2E"):
        Sub(m.cfg)


def test_remat_keeps_the_outer_gradient():
    cfg = e2e_config()
    m = build(cfg, torch.float64)
    ids, labels = batch(cfg)
    params = list(m.parameters())
    g1 = torch.autograd.grad(m(ids, labels=labels).loss, params)
    m.e2e.remat = False
    g0 = torch.autograd.grad(m(ids, labels=labels).loss, params)
    assert max(float((a - b).abs().max()) for a, b in zip(g0, g1)) < 1e-12


def test_flops_per_token_counts_the_e2e_blocks_and_the_inner_step():
    from ttt_lm.model.flops import flops_per_token, matmul_params
    cfg = e2e_config(S=1, L=2, b=4, w=6)
    T = 12
    f = flops_per_token(cfg, T)
    D, F_, V, H, hd = 16, 24, 37, 2, 8
    seen = (6 * 7 / 2 + (T - 6) * 6) / T
    attn = 4.0 * H * hd * seen
    assert matmul_params(cfg) == (4 * D * D + 3 * D * F_) + (4 * D * D + 6 * D * F_) + V * D
    assert f["forward"] == 2.0 * matmul_params(cfg) + 2 * attn
    assert f["train"] == 3.0 * (f["forward"] + 2.0 * (2.0 * (4 * D * D + 6 * D * F_ + V * D) + attn))
    cfg.ttt_e2e.suffix_len = 0
    assert flops_per_token(cfg, T)["train"] == 3.0 * flops_per_token(cfg, T)["forward"]


def test_bfloat16_keeps_fast_weights_and_the_loss_in_float32():
    """Under bf16 parameters (DeepSpeed's bf16 mode) the fast weights and the inner and outer losses
    stay float32, as the official state_dtype; the loss is within 1e-3 of the float32 model's."""
    cfg = e2e_config()
    cfg.init_std = 0.02
    m = build(cfg, torch.bfloat16)
    ids, labels = batch(cfg)
    tr = m.run(ids, labels, keep_fast=True)
    tr.loss.backward()
    assert tr.loss.dtype == torch.float32 and tr.fast[1][0][0].dtype == torch.float32
    assert all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    ref = build(cfg, torch.float32)
    ref.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    with torch.no_grad():
        assert abs(float(ref.run(ids, labels).loss) - float(tr.loss)) < 1e-3
