import dataclasses

import pytest
import torch

from tests.model.mixer_checks import (check_causal, check_chunked_vs_reference, check_decode,
                                      check_gradcheck, make_mixer, tiny_cfg)
from ttt_lm.model.backend import Backend
from ttt_lm.model.lm import LM
from ttt_lm.model.mixers.attention import LocalAttention
from ttt_lm.model.mixers.titans import TitansMAC, TitansMAG, TitansMAL, TitansMemory

CASES = [
    ("titans", {"titans": {"chunk_size": 4}}),
    ("titans", {"titans": {"chunk_size": 1, "conv_width": 0}}),
    ("titans", {"titans": {"memory": "mlp", "chunk_size": 3}}),
    ("titans_mag", {"titans": {"chunk_size": 4, "window": 3}}),
    # MAC: segments of 4 with chunks of 3 (segment and chunk boundaries apart), and the MLP memory
    # without persistent tokens with segments of 5
    ("titans_mac", {"titans": {"chunk_size": 3, "segment_len": 4, "persistent_tokens": 2}}),
    ("titans_mac", {"titans": {"memory": "mlp", "chunk_size": 2, "segment_len": 5, "persistent_tokens": 0},
                    "attention": {"num_kv_heads": 1}}),
    ("titans_mal", {"titans": {"chunk_size": 4, "window": 3, "persistent_tokens": 2}}),
    ("titans_mal", {"titans": {"memory": "mlp", "chunk_size": 3, "window": 5, "persistent_tokens": 3}}),
]


@pytest.mark.parametrize("kind,kw", CASES)
@pytest.mark.parametrize("T", [1, 7])
def test_chunked_matches_reference(kind, kw, T):
    """For the MLP memory this also holds the closed-form gradients of the chunked form equal to
    torch.func.grad in the reference."""
    m, _ = make_mixer(kind, **kw)
    check_chunked_vs_reference(m, T)


@pytest.mark.parametrize("kind,kw", CASES)
def test_decode_and_segments(kind, kw):
    """T = 11 with chunks of 3 or 4: decode and the cut at 5 both start inside a chunk."""
    m, _ = make_mixer(kind, **kw)
    check_decode(m, 11)


@pytest.mark.parametrize("kind,kw", CASES)
def test_causal(kind, kw):
    m, _ = make_mixer(kind, **kw)
    check_causal(m, 12)


@pytest.mark.parametrize("kind,kw", [CASES[0], CASES[2]])
def test_gradcheck(kind, kw):
    m, _ = make_mixer(kind, d_model=16, **kw)
    check_gradcheck(m, T=4)


def _fd_check(m, names, T=6, n_entries=3, eps=1e-6):
    """Backprop gradient of a fixed outer loss w.r.t. a few entries of each named weight vs the
    central difference (float64; central-difference error O(eps²) ≈ 1e-12 plus rounding
    ≈ 1e-16/eps = 1e-10 on O(1) losses, so 1e-7 absolute + 1e-6 relative is safe)."""
    torch.manual_seed(5)
    x = torch.randn(2, T, m.d_model, dtype=torch.float64)
    w = torch.randn(2, T, m.d_model, dtype=torch.float64)
    params = dict(m.named_parameters())

    def loss():
        return (m(x)[0] * w).sum()

    m.zero_grad()
    loss().backward()
    g = torch.Generator().manual_seed(0)
    for n in names:
        p = params[n]
        assert p.grad is not None and p.grad.abs().max() > 1e-8, f"outer loss does not reach {n}"
        for _ in range(n_entries):
            idx = tuple(int(torch.randint(0, s, (1,), generator=g)) for s in p.shape)
            with torch.no_grad():
                old = p[idx].item()
                p[idx] = old + eps
                lp = loss().item()
                p[idx] = old - eps
                lm = loss().item()
                p[idx] = old
            fd = (lp - lm) / (2 * eps)
            assert abs(p.grad[idx].item() - fd) <= 1e-7 + 1e-6 * abs(fd), (n, idx, p.grad[idx].item(), fd)


@pytest.mark.parametrize("memory", ["linear", "mlp"])
def test_outer_loss_trains_projections_through_memory_updates(memory):
    """k and v enter only the inner loss, and θ, η, α only the memory updates, so their
    projections get a gradient only through the inner update (the seed-001 bug leaves them
    without one); the gradients equal finite differences."""
    m, _ = make_mixer("titans", d_model=16, titans={"memory": memory, "chunk_size": 2})
    names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "theta_proj.weight", "eta_proj.weight",
             "alpha_proj.weight", "theta_proj.bias", "M_init.0"] + (["mem_norm_weight"] if memory == "mlp" else [])
    _fd_check(m, names)


def test_memory_recalls_a_stored_pair():
    """A functional check of the memory itself: after writing (k, v) pairs with the linear memory
    and no forgetting, querying a stored key returns (close to) its value — the test that the
    inner loop learns, not only that shapes line up."""
    from kernels.titans import titans_linear
    torch.manual_seed(0)
    d, n = 16, 4
    keys = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0][:n]  # orthonormal keys
    vals = torch.randn(n, d, dtype=torch.float64)
    reps = 10
    k = keys.repeat(reps, 1)[None, None]
    v = vals.repeat(reps, 1)[None, None]
    T = k.shape[2]
    theta = torch.full((1, 1, T), 0.4, dtype=torch.float64)
    log_eta = torch.full((1, 1, T), -2.0, dtype=torch.float64)
    log_keep = torch.zeros(1, 1, T, dtype=torch.float64)
    _, (M, _, _) = titans_linear(k, k, v, theta, log_eta, log_keep, output_final_state=True, chunk_size=4)
    # each visit of a key shrinks its error by about |1 − 2θ| = 0.2 (plus a small momentum
    # term); after 10 visits the error is ~1e-4 on O(1) values
    torch.testing.assert_close(keys @ M[0, 0], vals, atol=1e-3, rtol=0)


def test_gate_init():
    m, cfg = make_mixer("titans")
    x = torch.zeros(1, 3, cfg.d_model, dtype=torch.float64)
    inp, _ = m.inputs(x)
    theta, log_eta, log_keep = inp["theta"], inp["log_eta"], inp["log_keep"]
    torch.testing.assert_close(theta, torch.full_like(theta, m.theta_init))
    torch.testing.assert_close(log_eta.exp(), torch.full_like(theta, m.eta_init))
    torch.testing.assert_close(1 - log_keep.exp(), torch.full_like(theta, m.alpha_init))


def test_mag_uses_titans_window():
    m, cfg = make_mixer("titans_mag", titans={"window": 5}, attention={"window": 100})
    assert isinstance(m.attn, LocalAttention) and m.attn.window == 5


def test_flops_per_token():
    cfg = tiny_cfg("titans_mag", titans={"window": 8})
    lin = TitansMemory.flops_per_token(cfg, 64)
    assert lin > 0
    cfg.titans.memory = "mlp"
    assert TitansMemory.flops_per_token(cfg, 64) > lin
    cfg.attention.window = 1000  # MAG counts its own window, not attention.window
    expect = TitansMemory.flops_per_token(cfg, 64) + 4.0 * cfg.n_heads * cfg.hd * (8 * 9 / 2 + 56 * 8) / 64
    assert TitansMAG.flops_per_token(cfg, 64) == pytest.approx(expect)


@pytest.mark.parametrize("pattern", [["titans"], ["titans_mag"]])
def test_lm_decode_matches_forward(pattern):
    """A Titans LM (MLP memory): token-by-token decode logits equal the training forward's."""
    torch.manual_seed(0)
    cfg = tiny_cfg(pattern[0], n_layers=1, titans={"memory": "mlp", "chunk_size": 3, "window": 4})
    lm = LM(cfg).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        logits = lm(ids).logits
        states = lm.init_states(2, dtype=torch.float64)
        steps = []
        for t in range(ids.shape[1]):
            lt, states = lm.step(ids[:, t], states)
            steps.append(lt)
    torch.testing.assert_close(torch.stack(steps, 1), logits, atol=1e-10, rtol=0)


def test_mac_attention_stays_in_its_segment_and_memory_carries_across():
    """MAC (segments of 4): with the memory frozen (θ = 0: no surprise, α = 0: no forgetting) a
    token of segment 2 does not see segment 0 at all, since attention covers only the persistent
    tokens, the retrieved memory and its own segment; with the memory learning, segment 0 reaches
    segment 2 through M^{(1)}, M^{(2)}."""
    m, _ = make_mixer("titans_mac", titans={"chunk_size": 2, "segment_len": 4, "persistent_tokens": 2})
    torch.manual_seed(11)
    x = torch.randn(1, 12, m.d_model, dtype=torch.float64)
    x2 = x.clone()
    x2[:, :4] += torch.randn_like(x2[:, :4])
    with torch.no_grad():
        y1, y2 = m(x)[0], m(x2)[0]
        assert (y1[:, 8:] - y2[:, 8:]).abs().max() > 1e-6
        m.memory.theta_proj.bias.fill_(-1e4)
        m.memory.alpha_proj.bias.fill_(-1e4)
        y1, y2 = m(x)[0], m(x2)[0]
    torch.testing.assert_close(y1[:, 4:], y2[:, 4:], atol=1e-12, rtol=0)
    assert (y1[:, :4] - y2[:, :4]).abs().max() > 1e-6


def test_mac_output_is_the_gate_with_no_projection_after_it():
    """Eq. 25, o = y ⊗ M*(y): the output is RMSNorm(y) ⊙ σ(RMSNorm(m)) of the op's (y, m), and the
    attention's W_O is the one projection (no W_O after the gate, with which MAC did not learn
    induction). y is the attention's output, W_O^attn applied: the gate's inputs have d_model."""
    m, _ = make_mixer("titans_mac", titans={"chunk_size": 2, "segment_len": 4, "persistent_tokens": 2})
    assert not hasattr(m, "o_proj")
    assert [n for n, _ in m.named_children() if n.endswith("proj")] == []
    torch.manual_seed(3)
    x = torch.randn(2, 6, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        inp, _ = m.inputs(x)
        (y, mm), _ = m.op(inp, backend=m.op_backend(x))
        assert y.shape == mm.shape == x.shape
        torch.testing.assert_close(m(x)[0], m.attn_norm(y) * torch.sigmoid(m.mem_norm(mm)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["titans_mac", "titans_mal"])
def test_persistent_tokens_are_trained(kind):
    """The outer loss reaches the persistent memory tokens (and every other parameter)."""
    m, _ = make_mixer(kind, titans={"chunk_size": 2, "segment_len": 3, "window": 4, "persistent_tokens": 2})
    x = torch.randn(2, 7, m.d_model, dtype=torch.float64)
    m(x)[0].pow(2).sum().backward()
    assert m.persistent.grad.abs().max() > 1e-8
    none = [n for n, p in m.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert not none, f"no gradient reaches {none}"


def test_mal_is_memory_then_window_attention_over_persistent_and_input():
    """MAL: o = SW-Attn(M([p ‖ x])) at the positions of x (Eqs. 29–31), from its sub-layers."""
    m, _ = make_mixer("titans_mal", titans={"chunk_size": 3, "window": 4, "persistent_tokens": 3})
    x = torch.randn(2, 9, m.d_model, dtype=torch.float64)
    with torch.no_grad():
        xt = torch.cat([m.persistent.expand(2, -1, -1), x], 1)
        o = m.attn(m.memory(xt)[0])[0][:, 3:]
        torch.testing.assert_close(m(x)[0], o, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind,key,bad", [("titans_mac", "segment_len", 0), ("titans_mac", "persistent_tokens", -1),
                                          ("titans_mal", "persistent_tokens", -1)])
def test_mac_mal_config_checked(kind, key, bad):
    with pytest.raises(ValueError, match=f"model.titans.{key}"):
        make_mixer(kind, titans={key: bad})


@pytest.mark.parametrize("kw", [CASES[0][1]["titans"], CASES[1][1]["titans"], CASES[2][1]["titans"]])
def test_memory_stages_compose_to_the_forms(kw):
    """inputs → op → output, from a carried state, equal each form of the memory layer (the forms
    are written with the stages: exact), and the carry plus the op's final state is the form's
    state. ``op``'s backend "reference" is the sequential form."""
    m, _ = make_mixer("titans", titans=kw)
    g = torch.Generator().manual_seed(0)
    x0, x = (torch.randn(2, T, m.d_model, generator=g, dtype=torch.float64) for T in (5, 6))
    _, st = m.chunked(x0, output_state=True)
    for form, backend in ((m.reference, "reference"), (m.chunked, m.op_backend(x))):
        inp, carry = m.inputs(x, st, True)
        assert carry.pos == st.pos + 6 and carry.M == ()
        y, (M, S, Mh) = m.op(inp, (st.M, st.S, st.Mh), True, backend)
        want, want_st = form(x, st, True)
        torch.testing.assert_close(m.output(y, x), want, atol=0, rtol=0)
        for a, b in zip(M + S + Mh, want_st.M + want_st.S + want_st.Mh):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    # from no state: the op starts at M_init
    inp, _ = m.inputs(x)
    y, _ = m.op(inp, backend="reference")
    torch.testing.assert_close(m.output(y, x), m.reference(x)[0], atol=0, rtol=0)
    assert not hasattr(m, "_inputs") and not hasattr(m, "_out")   # one copy: the public stages


def _combined_forms(m, x):
    """(form, inputs' keyword arguments, op backend) for the reference and chunked forms of a
    combined Titans mixer."""
    if isinstance(m, TitansMAC):
        return ((m.reference, {"sequential": True}, Backend.REFERENCE),
                (m.chunked, {"sequential": False}, m.attention_backend(x.device, x.dtype)))
    return ((m.reference, {}, Backend.REFERENCE), (m.chunked, {}, m.memory.resolve_backend(x.device, x.dtype)))


def _op_state(m, st):
    if st is None:
        return None
    return {TitansMAG: lambda: (st.attn, st.mem), TitansMAL: lambda: (st.mem, st.attn),
            TitansMAC: lambda: (st.mem, st.R, st.seg)}[type(m)]()


@pytest.mark.parametrize("kind,kw", [c for c in CASES if c[0] != "titans"])
def test_combined_stages_compose_to_the_forms(kind, kw):
    """MAG, MAL, MAC: inputs → op → output, from no state and from a carried one, equal each form
    exactly (the forms are written with the stages), and the carry plus the op's final state is the
    form's state."""
    m, _ = make_mixer(kind, **kw)
    g = torch.Generator().manual_seed(0)
    x0, x = (torch.randn(2, T, m.d_model, generator=g, dtype=torch.float64) for T in (5, 6))
    _, st0 = m.chunked(x0, output_state=True)
    for st in (None, st0):
        for form, kwargs, backend in _combined_forms(m, x):
            inp, carry = m.inputs(x, st, True, **kwargs)
            assert carry.pos == (0 if st is None else st.pos) + 6
            y, fin = m.op(inp, _op_state(m, st), True, backend)
            want, want_st = form(x, st, True)
            torch.testing.assert_close(m.output(y, x), want, atol=0, rtol=0)
            got_st = dataclasses.replace(carry, **dict(zip(
                {TitansMAG: ("attn", "mem"), TitansMAL: ("mem", "attn"), TitansMAC: ("mem", "R", "seg")}[type(m)],
                fin)))
            assert got_st.pos == want_st.pos
            a, b = got_st.tensors(), want_st.tensors()
            assert len(a) == len(b) > 0
            for u, v in zip(a, b):
                torch.testing.assert_close(u, v, atol=0, rtol=0)
    assert not hasattr(m, "_combine") and not hasattr(m, "_split")   # one copy: the public stages


@pytest.mark.parametrize("backend", ["flash", "flex"])
def test_mac_refuses_attention_backends_it_cannot_run(backend):
    """attention.backend that cannot run MAC's segment mask is refused by the resolver, naming the
    op, the request and MAC's reason, never a silent fallback."""
    m, _ = make_mixer("titans_mac", titans=CASES[4][1]["titans"], attention={"backend": backend})
    x = torch.randn(2, 5, m.d_model, dtype=torch.float64)
    msg = f"attention: backend '{backend}' was requested but is unavailable: titans_mac"
    with pytest.raises(ValueError, match=msg):
        m.chunked(x)
    with pytest.raises(ValueError, match=msg):
        m.attention_backend(x.device, x.dtype)


@pytest.mark.parametrize("backend,runs", [("auto", Backend.SDPA), ("sdpa", Backend.SDPA), ("math", Backend.MATH)])
@pytest.mark.parametrize("case", [4, 5])
def test_mac_attention_backends_match_reference(backend, runs, case):
    """Under each attention.backend MAC can run, its chunked form equals the reference (explicit
    softmax, sequential LMM), the resolver having picked the named backend."""
    kind, kw = CASES[case]
    kw = {**kw, "attention": {**kw.get("attention", {}), "backend": backend}}
    m, _ = make_mixer(kind, **kw)
    x = torch.randn(2, 11, m.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert m.attention_backend(x.device, x.dtype) == runs
    y, st = m.chunked(x, output_state=True)
    want, want_st = m.reference(x, output_state=True)
    torch.testing.assert_close(y, want, atol=1e-9, rtol=0)
    for u, v in zip(st.tensors(), want_st.tensors()):
        torch.testing.assert_close(u, v, atol=1e-9, rtol=0)


def _lmm_at_125m_shape():
    """One LMM layer with the 125M presets' shape (width 768, 12 heads of 64, chunk 16), the LM's init."""
    from ttt_lm.model.layers import init_weights
    torch.manual_seed(0)
    cfg = tiny_cfg("titans", d_model=768, n_heads=12, titans={"memory": "mlp", "chunk_size": 16})
    m = TitansMemory(cfg, 0)
    init_weights(m, cfg.init_std, 12)
    m.reset_parameters()
    return m.float(), cfg


@pytest.mark.parametrize("gates", ["init", "limits"])
def test_mlp_memory_stays_finite_over_long_sequences(gates):
    """The MLP memory at the 125M shape over 512 tokens (32 chunks of 16). With the paper's plain
    M(k) = GELU(k W₁) W₂ and summed loss the weights reached 10¹⁴ within 6 chunks and NaN at token
    96 at this shape; here the read is normalized and the weights stay bounded: near their init
    scale at the init gates (W₁ starts at ‖W₁‖ ≈ √(d·d_h) ≈ 90 and forgetting shrinks it), and
    growing at most linearly with the gates at their limits (θ ≈ 1, η ≈ 0.9997, α ≈ 10⁻⁴:
    momentum integrates bounded steps; measured ≈ 10³ at 512 tokens), so 10⁵ is a loose bound
    either way while the old blow-up passes it in a few chunks."""
    m, cfg = _lmm_at_125m_shape()
    if gates == "limits":
        with torch.no_grad():
            m.theta_proj.bias.fill_(8.0)
            m.eta_proj.bias.fill_(8.0)
            m.alpha_proj.bias.fill_(-9.0)
    x = torch.randn(1, 512, cfg.d_model)
    with torch.no_grad():
        y, st = m(x, m.init_state(1), True)
    assert torch.isfinite(y).all()
    for W in st.M:
        assert torch.isfinite(W).all()
        assert W.norm(dim=(-1, -2)).max() < 1e5


def test_mlp_memory_read_is_bounded_and_w2_step_orthogonal():
    """The two facts the stability argument rests on (float64): the read
    M(q) = q + γ ⊙ RMSNorm(GELU(q W₁) W₂) is bounded by ‖q‖ + √d·max|γ| whatever the weights'
    scale, and the inner gradient w.r.t. W₂ is orthogonal to W₂ (⟨W₂, aᵀδ⟩ = ⟨z, δ⟩ = 0)."""
    m, cfg = make_mixer("titans", titans={"memory": "mlp", "chunk_size": 2})
    d = m.hd
    torch.manual_seed(3)
    with torch.no_grad():
        m.mem_norm_weight.uniform_(0.5, 2.0)
    q = torch.nn.functional.normalize(torch.randn(2, m.n_heads, 5, d, dtype=torch.float64), dim=-1)
    for scale in (1.0, 1e3, 1e6):
        W1, W2 = (scale * W.unsqueeze(0).expand(2, *W.shape) for W in m.M_init)
        y = m.mlp_read(q, W1, W2)
        assert torch.isfinite(y).all()
        assert y.norm(dim=-1).max() <= 1 + d ** 0.5 * m.mem_norm_weight.abs().max() + 1e-9
    # one token through the chunked form (chunk 1: the anchor is the initial memory): the W₂ part
    # of M₁ − M₀ = −θ ∇W₂ (S₀ = 0, no forgetting) is orthogonal to W₂. Exactly so without the
    # norm's ε (with it, ⟨z, δ⟩ = r ⟨z, γ ⊙ e⟩ · ε/(mean z² + ε), about 1e-7 relative here)
    m.mem_eps = 0.0
    k = torch.nn.functional.normalize(torch.randn(2, m.n_heads, 1, d, dtype=torch.float64), dim=-1)
    v = torch.randn(2, m.n_heads, 1, d, dtype=torch.float64)
    M0 = [W.unsqueeze(0).expand(2, *W.shape) for W in m.M_init]
    ones, zeros = torch.ones(2, m.n_heads, 1, dtype=torch.float64), torch.zeros(2, m.n_heads, 1, dtype=torch.float64)
    _, M1, _, _ = m._mlp_chunked(k, k, v, 0.5 * ones, zeros, zeros, M0, [torch.zeros_like(W) for W in M0], M0, 0)
    step2 = M1[1] - M0[1]
    assert step2.abs().max() > 1e-6
    inner = (step2 * M0[1]).sum(dim=(-1, -2))
    assert inner.abs().max() < 1e-10 * (step2.norm() * M0[1].norm())


def test_titans_triton_kernel_covers_the_linear_memory_only():
    """The Titans kernel covers the linear memory; the MLP memory runs torch under auto and
    fails loudly under triton, from kernel_backends and from the chunked form on any device."""
    from tests.model.mixer_checks import short_config
    lin = short_config("titans")
    lin.titans.memory = "linear"
    assert LM(lin).kernel_backends("cuda") == {"titans": "triton"}
    mlp = dataclasses.replace(short_config("titans"))
    mlp.titans.memory = "mlp"
    assert LM(mlp).kernel_backends("cuda") == {"titans": "torch"}
    m = LM(dataclasses.replace(mlp, kernel_backend="triton"))
    with pytest.raises(ValueError, match=r"layer kind 'titans' \(layer 0\).*linear memory"):
        m.kernel_backends("cuda")
    with pytest.raises(ValueError, match="linear memory"):
        m(torch.zeros(1, 8, dtype=torch.long))


def test_kernel_mixer_errors_name_the_config_key_and_the_reason():
    m, _ = make_mixer("titans", titans={"memory": "mlp"})
    m.kernel_backend = "triton"
    with pytest.raises(ValueError, match=r"model.kernel_backend=triton: TitansMemory has no Triton kernel: "
                                         r"titans: backend 'triton' was requested but is unavailable: .*linear memory"):
        m.resolve_backend("cuda")
    m.kernel_backend = "auto"
    assert m.resolve_backend("cuda") is Backend.TORCH
