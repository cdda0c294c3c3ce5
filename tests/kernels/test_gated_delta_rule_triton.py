"""Triton chunked gated delta rule (kernels/gated_delta_rule/chunk.py) against the sequential
reference: outputs, final state and every input gradient (q, k, v, g, β, initial state). Without
CUDA these run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
shapes are tiny; the ``gpu`` tests repeat the checks at training-like sizes."""
import pytest
import torch
import torch.nn.functional as F

import kernels.gated_delta_rule.chunk as gdr_chunk
from kernels.gated_delta_rule import BACKENDS, gated_delta_rule, gated_delta_rule_reference, gated_delta_rule_triton

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

D64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


def _inputs(B, H, T, dk, dv, dtype, seed=0, with_state=False, n_states=None, g_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, dk, generator=gen, dtype=D64)
    k = F.normalize(torch.randn(B, H, T, dk, generator=gen, dtype=D64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=gen, dtype=D64)
    g = -g_scale * torch.rand(B, H, T, generator=gen, dtype=D64)
    beta = torch.rand(B, H, T, generator=gen, dtype=D64)
    S0 = torch.randn(n_states or B, H, dk, dv, generator=gen, dtype=D64) if with_state else None
    ins = [t.to(dtype=dtype, device=DEV) for t in (q, k, v)] + [g.float().to(DEV), beta.to(dtype=dtype, device=DEV)]
    return ins, (None if S0 is None else S0.to(DEV))


def _run(fn, ins, S0, wo, wS):
    """o, S and the gradients of Σ o∘wo + Σ S∘wS with respect to q, k, v, g, β (and S0)."""
    leaves = [t.clone().requires_grad_(True) for t in ins]
    s0 = None if S0 is None else S0.clone().requires_grad_(True)
    o, S = fn(*leaves, s0)
    ((o.to(D64) * wo).sum() + (S.to(D64) * wS).sum()).backward()
    return [o.detach(), S.detach()] + [t.grad for t in leaves] + ([] if s0 is None else [s0.grad])


def _compare(B, H, T, dk, dv, chunk, dtype, with_state, atol, rtol=0.0, g_scale=1.0):
    ins, S0 = _inputs(B, H, T, dk, dv, dtype, with_state=with_state, g_scale=g_scale)
    gen = torch.Generator().manual_seed(9)
    # o comes out in the input dtype: the reference gets the same (rounded) upstream gradient
    wo = torch.randn(B, H, T, dv, generator=gen, dtype=D64).to(dtype).to(D64).to(DEV)
    wS = torch.randn(B, H, dk, dv, generator=gen, dtype=D64).to(DEV)
    ref = _run(lambda *a: gated_delta_rule_reference(*a, output_final_state=True),
               [t.to(D64) for t in ins], S0, wo, wS)
    tri = _run(lambda q, k, v, g, b, s: gated_delta_rule_triton(q, k, v, g, b, s, True, chunk_size=chunk),
               ins, None if S0 is None else S0.float(), wo, wS)
    acc = D64 if dtype == D64 else torch.float32
    assert tri[0].dtype == dtype and tri[1].dtype == acc
    for n, a, b in zip(NAMES, ref, tri):
        torch.testing.assert_close(b.to(D64), a, atol=atol, rtol=rtol, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("B,H,T,dk,dv,chunk,with_state", [
    (1, 1, 20, 8, 8, 16, True),      # ragged second chunk
    (2, 2, 37, 5, 12, 16, False),    # batch and heads, padded d_k and d_v, three chunks
])
def test_float32_matches_reference(B, H, T, dk, dv, chunk, with_state):
    """float32 kernel (float32 under the interpreter, TF32×3 products on a GPU; float32
    accumulation) vs the float64 reference on the same inputs: sums of ≤ 40 O(1) terms and the
    triangular solves keep errors near 1e-5 (dk, dg and dβ reach ~20), so 1e-4 absolute plus 1e-4
    relative, as the delta rule's kernel."""
    _compare(B, H, T, dk, dv, chunk, torch.float32, with_state, atol=1e-4, rtol=1e-4)


def test_float64_is_exact():
    """float64 inputs run in float64: the chunked form differs from the sequential one by
    rounding only, 1e-10 on O(1) values."""
    ins, S0 = _inputs(2, 1, 23, 7, 9, D64, seed=3, with_state=True)
    ins[3] = ins[3].double()
    gen = torch.Generator().manual_seed(4)
    wo, wS = torch.randn(2, 1, 23, 9, generator=gen, dtype=D64), torch.randn(2, 1, 7, 9, generator=gen, dtype=D64)
    ref = _run(lambda *a: gated_delta_rule_reference(*a, output_final_state=True), ins, S0, wo, wS)
    tri = _run(lambda *a: gated_delta_rule(*a, output_final_state=True, backend="triton", chunk_size=16),
               ins, S0, wo, wS)
    for n, a, b in zip(NAMES, ref, tri):
        assert b.dtype == D64, n
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 5e-2, 2e-2)])
def test_launch_config_of_each_gpu_family(monkeypatch, arch, dtype, atol, rtol):
    """The launch config the delta rule's ``launch_meta`` picks for sm_80 and sm_90 (kernel chunk
    64 for bf16, which runs the 4 × 4-block inverse with decays between blocks; 16 for float32), run under the interpreter with chunk_size 64 over two chunks and a
    ragged third: each matches the reference (bf16: inputs and outputs rounded to bf16, relative
    error 2^-8 on values up to ~20, so 5e-2 absolute plus 2e-2 relative)."""
    monkeypatch.setattr(gdr_chunk, "device_arch", lambda device: arch)
    mt = gdr_chunk.launch_meta(16, 16, dtype, arch)
    assert mt["C"] == {(80, torch.float32): 16, (90, torch.float32): 16,
                       (80, torch.bfloat16): 64, (90, torch.bfloat16): 64}[arch, dtype]
    _compare(1, 1, 2 * mt["C"] + 5, 16, 20, 64, dtype, True, atol=atol, rtol=rtol)


def test_strong_decay_stays_finite():
    """g down to −30 per token (α ≈ 1e-13): every exponent inside a chunk is ≤ 0, so nothing
    overflows; float64 against the reference, 1e-10."""
    ins, S0 = _inputs(1, 1, 21, 4, 3, D64, seed=5, with_state=True, g_scale=30.0)
    ins[3] = ins[3].double()
    gen = torch.Generator().manual_seed(6)
    wo, wS = torch.randn(1, 1, 21, 3, generator=gen, dtype=D64), torch.randn(1, 1, 4, 3, generator=gen, dtype=D64)
    ref = _run(lambda *a: gated_delta_rule_reference(*a, output_final_state=True), ins, S0, wo, wS)
    tri = _run(lambda *a: gated_delta_rule_triton(*a, output_final_state=True, chunk_size=16), ins, S0, wo, wS)
    for n, a, b in zip(NAMES, ref, tri):
        assert torch.isfinite(b).all(), n
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s: f"{n}: {s}")


def test_several_dv_and_dk_blocks(monkeypatch):
    """d_v split over programs (blocks of 16, d_v = 40: three, the last ragged) and the state
    kernels' d_k read back in blocks of 16 (d_k = 40): float32, tolerances as above."""
    meta = gdr_chunk.launch_meta
    monkeypatch.setattr(gdr_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(
        meta(DK, DV, dtype, arch), BV=16, BKS=16, BV_bwd_wy=16))
    _compare(2, 1, 37, 40, 40, 16, torch.float32, True, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stage_dl", [False, True])
def test_chunk_64_with_dqk_in_dk_blocks(monkeypatch, stage_dl):
    """Kernel chunk 64 (bf16's) over a full chunk and a ragged one, with ``_bwd_dqk`` split over
    d_k (d_k = 40 in blocks of 16: three programs per chunk, the last ragged, each storing its part
    of the scalar decay's dγ for ``_bwd_wy`` to sum) and, as on sm_80, ``_bwd_dqk``'s d_v and
    ``_bwd_wy``'s d_k in blocks of 16 with dL staged through memory (STAGE_DL): float32,
    tolerances as above."""
    meta = gdr_chunk.launch_meta
    sm80 = dict(stage_dl=True, BK_bwd_wy=16, BV_dqk=16) if stage_dl else {}
    monkeypatch.setattr(gdr_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(
        meta(DK, DV, dtype, arch), C=64, BK_dqk=16, **sm80))
    _compare(1, 2, 70, 40, 12, 64, torch.float32, True, atol=1e-4, rtol=1e-4)


def test_varlen_at_chunk_64(monkeypatch):
    """cu_seqlens with the kernel chunk 64: sequences of 70 (a full chunk and a ragged one), 0, 5
    and 64 (one full chunk) equal the reference per sequence (float64, 1e-10)."""
    meta = gdr_chunk.launch_meta
    monkeypatch.setattr(gdr_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(meta(DK, DV, dtype, arch), C=64))
    cu, ins, S0, wo, wS, ref = _packed([70, 0, 5, 64], 5, seed=13)
    tri = _run(lambda q, k, v, g, b, s: gated_delta_rule_triton(q, k, v, g, b, s, True, chunk_size=64,
                                                                 cu_seqlens=cu), ins, S0, wo, wS)
    for n, a, b in zip(NAMES, ref, tri):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s: f"{n}: {s}")

def _packed(lens, dv, seed):
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, T, 6, dv, D64, seed=seed, with_state=True, n_states=len(lens))
    ins[3] = ins[3].double()
    gen = torch.Generator().manual_seed(seed + 1)
    wo = torch.randn(1, 2, T, dv, generator=gen, dtype=D64).to(DEV)
    wS = torch.randn(len(lens), 2, 6, dv, generator=gen, dtype=D64).to(DEV)

    def per_sequence(q, k, v, g, b, s0):
        outs, states = [], []
        for i in range(len(lens)):
            a, e = int(cu[i]), int(cu[i + 1])
            o_i, S_i = gated_delta_rule_reference(*(t[:, :, a:e] for t in (q, k, v, g, b)), s0[i:i + 1], True)
            outs.append(o_i)
            states.append(S_i)
        return torch.cat(outs, 2), torch.cat(states, 0)

    return cu, ins, S0, wo, wS, _run(per_sequence, ins, S0, wo, wS)


@pytest.mark.parametrize("lens", [[5, 0, 17, 18], [0, 1, 15, 0, 33, 16, 0]])
def test_varlen_matches_separate_sequences(lens):
    """cu_seqlens: one packed row of sequences (empty ones first, between and last; lengths 1, 15,
    33 with ragged last chunks and 16, one full chunk) equals the reference run on each sequence
    alone from its own initial state, in o, the final states and every gradient (float64, 1e-10);
    an empty sequence passes its state through."""
    cu, ins, S0, wo, wS, ref = _packed(lens, 5, seed=11)
    tri = _run(lambda q, k, v, g, b, s: gated_delta_rule_triton(q, k, v, g, b, s, True, chunk_size=16,
                                                                 cu_seqlens=cu), ins, S0, wo, wS)
    for n, a, b in zip(NAMES, ref, tri):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s: f"{n}: {s}")
    for i, n in enumerate(lens):
        if n == 0:
            torch.testing.assert_close(tri[1][i], S0[i])


def test_no_final_state():
    """output_final_state=False returns None; gradients flow without dht (float32, as above)."""
    ins, _ = _inputs(1, 1, 18, 4, 4, torch.float32, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in ins]
    o, S = gated_delta_rule_triton(*leaves, chunk_size=16)
    assert S is None
    o.sum().backward()
    leaves_r = [t.to(D64).requires_grad_(True) for t in ins]
    o_r, _ = gated_delta_rule_reference(*leaves_r)
    o_r.sum().backward()
    torch.testing.assert_close(o.to(D64), o_r, atol=1e-4, rtol=1e-4)
    for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], leaves_r, leaves):
        torch.testing.assert_close(b.grad.to(D64), a.grad, atol=1e-4, rtol=1e-4, msg=lambda s: f"{n}: {s}")


def test_bad_arguments_are_refused():
    ins, _ = _inputs(2, 1, 8, 4, 4, torch.float32)
    q, k, v, g, b = ins
    with pytest.raises(ValueError, match="packed batch"):
        gated_delta_rule_triton(*ins, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_triton(*ins, initial_state=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match=r"g \(the log decay\) must be \[B, H, T\]"):
        gated_delta_rule_triton(q, k, v, g[..., :7], b)
    with pytest.raises(ValueError, match="share one dtype"):
        gated_delta_rule_triton(q, k, v.double(), g, b)
    big = torch.zeros(1, 1, 4, 129)
    with pytest.raises(ValueError, match=r"d_k = 129 \(q, k\)"):
        gated_delta_rule_triton(big, big, big[..., :4], torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match=r"d_v = 257 \(v\)"):
        gated_delta_rule_triton(big[..., :4], big[..., :4], torch.zeros(1, 1, 4, 257), torch.zeros(1, 1, 4),
                                torch.zeros(1, 1, 4))
    single = [t[:1] for t in ins]
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 8"):
        gated_delta_rule_triton(*single, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="g is the log decay and must be <= 0"):
        gated_delta_rule(q, k, v, -g, b, backend="triton")


def test_mixer_triton_equals_torch():
    """Gated DeltaNet with kernel_backend="triton" vs "torch": same outputs, final state and
    parameter gradients (float64, two chunked forms of one recurrence: 1e-9 on O(1) values)."""
    from tests.model.mixer_checks import make_mixer

    assert "triton" in BACKENDS
    m, _ = make_mixer("gated_deltanet", gated_deltanet={"chunk_size": 16})
    torch.manual_seed(1)
    x = torch.randn(2, 19, m.d_model, dtype=D64, requires_grad=True)
    w = torch.randn(2, 19, m.d_model, dtype=D64)
    res = []
    for be in ("torch", "triton"):
        m.kernel_backend = be
        m.zero_grad()
        x.grad = None
        y, st = m.chunked(x, output_state=True)
        ((y * w).sum() + st.S.sum()).backward()
        res.append([y.detach(), st.S.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,dk,dv,chunk", [(2, 4, 1000, 64, 64, 64), (1, 2, 777, 128, 256, 64)])
def test_gpu_float32_matches_reference(B, H, T, dk, dv, chunk):
    """float32 with TF32×3 products over up to 1000 steps of O(1) values: 2e-3."""
    _compare(B, H, T, dk, dv, chunk, torch.float32, True, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_gpu_bfloat16_inputs():
    """bf16 inputs over 512 steps: 1e-1 absolute plus 5e-2 relative, as the delta rule's."""
    _compare(2, 2, 512, 64, 64, 64, torch.bfloat16, True, atol=1e-1, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_varlen():
    """Varlen at GPU sizes, float32: each sequence equals running the kernel on it alone."""
    lens = [100, 1, 513, 64, 200]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, sum(lens), 64, 128, torch.float32, with_state=True, n_states=len(lens))
    o, S = gated_delta_rule_triton(*ins, S0.float(), True, cu_seqlens=cu)
    for i in range(len(lens)):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i, S_i = gated_delta_rule_triton(*[t[:, :, a:e] for t in ins], S0[i:i + 1].float(), True)
        torch.testing.assert_close(o[:, :, a:e], o_i, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S[i:i + 1], S_i, atol=1e-5, rtol=1e-5)
