"""Triton chunked KDA (kernels/kda/chunk.py: the delta-rule family's kernels with the per-channel
decay USE_GK) against the sequential reference: outputs, final state and every input gradient
(q, k, v, g, β, initial state). Without CUDA these run under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes are tiny; the ``gpu`` tests repeat the
checks at training-like sizes.

Tolerances, relative to the largest entry of each compared tensor (``_close``): float64 1e-10
(the chunked form differs from the sequential one by rounding only); float32 2e-5 (float32
accumulation over chunks with a triangular solve; observed ≤ 4e-6); bfloat16 inputs 5e-2 absolute
plus 2e-2 relative per entry, as the gated delta rule's (the inputs and o carry 2^-8 rounding)."""
import pytest
import torch
import torch.nn.functional as F

import kernels.kda.chunk as kda_chunk
from kernels.gated_delta_rule import gated_delta_rule
from kernels.gated_delta_rule.chunk import gated_delta_rule_triton
from kernels.kda import BACKENDS, kda, kda_reference, kda_triton

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

D64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


def _inputs(B, H, T, dk, dv, dtype, seed=0, with_state=False, n_states=None, g_min=-2.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, dk, generator=gen, dtype=D64)
    k = F.normalize(torch.randn(B, H, T, dk, generator=gen, dtype=D64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=gen, dtype=D64)
    g = g_min * torch.rand(B, H, T, dk, generator=gen, dtype=D64)
    beta = torch.rand(B, H, T, generator=gen, dtype=D64)
    S0 = torch.randn(n_states or B, H, dk, dv, generator=gen, dtype=D64) if with_state else None
    gdt = D64 if dtype == D64 else torch.float32
    ins = [t.to(dtype=dtype, device=DEV) for t in (q, k, v)] + [g.to(gdt).to(DEV), beta.to(dtype=dtype, device=DEV)]
    return ins, (None if S0 is None else S0.to(DEV))


def _run(fn, ins, S0, wo, wS):
    """o, S and the gradients of Σ o∘wo + Σ S∘wS with respect to q, k, v, g, β (and S0)."""
    leaves = [t.clone().requires_grad_(True) for t in ins]
    s0 = None if S0 is None else S0.clone().requires_grad_(True)
    o, S = fn(*leaves, s0)
    ((o.to(D64) * wo).sum() + (S.to(D64) * wS).sum()).backward()
    return [o.detach(), S.detach()] + [t.grad for t in leaves] + ([] if s0 is None else [s0.grad])


def _close(names, ref, got, tol=None, atol=0.0, rtol=0.0):
    """Each tensor finite and equal to the reference: within ``tol`` times its largest entry
    (tol given), else atol + rtol·|ref| per entry."""
    for n, a, b in zip(names, ref, got):
        assert torch.isfinite(b).all(), n
        a, b = a.detach().to(D64), b.detach().to(D64)
        if tol is not None:
            atol, rtol = tol * float(a.abs().max().clamp_min(1.0)), 0.0
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol, msg=lambda s: f"{n}: {s}")


def _weights(B, H, T, dk, dv, n_states, dtype, seed=9):
    gen = torch.Generator().manual_seed(seed)
    # o comes out in the input dtype: the reference gets the same (rounded) upstream gradient
    wo = torch.randn(B, H, T, dv, generator=gen, dtype=D64).to(dtype).to(D64).to(DEV)
    wS = torch.randn(n_states or B, H, dk, dv, generator=gen, dtype=D64).to(DEV)
    return wo, wS


def _compare(B, H, T, dk, dv, chunk, dtype, with_state, seed=0, g_min=-2.0, **tols):
    ins, S0 = _inputs(B, H, T, dk, dv, dtype, seed=seed, with_state=with_state, g_min=g_min)
    wo, wS = _weights(B, H, T, dk, dv, None, dtype)
    ref = _run(lambda *a: kda_reference(*a, output_final_state=True), [t.to(D64) for t in ins], S0, wo, wS)
    acc = D64 if dtype == D64 else torch.float32
    tri = _run(lambda q, k, v, g, b, s: kda_triton(q, k, v, g, b, s, True, chunk_size=chunk),
               ins, None if S0 is None else S0.to(acc), wo, wS)
    assert tri[0].dtype == dtype and tri[1].dtype == acc
    _close(NAMES, ref, tri, **tols)


def _force_chunk(monkeypatch, C):
    """The kernel chunk C whatever the dtype (float32/float64 take 16 by default): the 4 × 4 block
    structure of C = 64 that bf16 runs with on sm_90, checked at float64 / float32 accuracy."""
    meta = kda_chunk.launch_meta
    monkeypatch.setattr(kda_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(meta(DK, DV, dtype, arch), C=C))


def test_float64_is_exact():
    """float64, kernel chunk 16: a ragged last chunk, d_k = 40 (two d_k blocks of the USE_GK
    kernels, the second padded), d_v = 12, batch and heads, initial state."""
    _compare(2, 1, 37, 40, 12, 64, D64, True, tol=1e-10)


@pytest.mark.parametrize("C", [32, 64])
def test_float64_block_structure_under_strong_decay(monkeypatch, C):
    """Kernel chunks of 32 and 64 (2 and 4 blocks of 16 rows: the products about a reference row
    between blocks, the diagonal blocks per pair) with log decays down to −20 per token (a chunk's
    cumulative decay near −640 / −1280, e^{+1280} if any exponent were positive): float64, 1e-10,
    over a full chunk and a ragged one."""
    _force_chunk(monkeypatch, C)
    _compare(1, 1, C + 9, 20, 8, 64, D64, True, seed=1, g_min=-20.0, tol=1e-10)


@pytest.mark.parametrize("stage_dl", [False, True])
def test_float64_chunk_64_with_dqk_in_dk_blocks(monkeypatch, stage_dl):
    """Kernel chunk 64 with ``_bwd_dqk`` split over d_k (d_k = 40 in blocks of 16: three programs
    per chunk, the last ragged; only the first stores dP) and, as on sm_80, ``_bwd_dqk``'s d_v and
    ``_bwd_wy``'s d_k in blocks of 16 with dL staged through memory (STAGE_DL): float64, 1e-10,
    over a full chunk and a ragged one."""
    meta = kda_chunk.launch_meta
    sm80 = dict(stage_dl=True, BK_bwd_wy=16, BV_dqk=16) if stage_dl else {}
    monkeypatch.setattr(kda_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(
        meta(DK, DV, dtype, arch), C=64, BK_dqk=16, **sm80))
    _compare(1, 1, 70, 40, 8, 64, D64, True, seed=5, tol=1e-10)

def test_float32_matches_reference():
    """float32 (float32 products under the interpreter, TF32×3 on a GPU), no initial state: 2e-5
    of each tensor's largest entry."""
    _compare(2, 1, 37, 16, 12, 16, torch.float32, False, tol=2e-5)


def test_float32_strong_decay_stays_finite_and_accurate(monkeypatch):
    """g down to −20 per token with the kernel chunk of 64: every exponent ≤ 0, so nothing
    overflows; float32 within 2e-5 of the largest entry, as without decay."""
    _force_chunk(monkeypatch, 64)
    _compare(1, 1, 70, 16, 12, 64, torch.float32, True, seed=3, g_min=-20.0, tol=2e-5)


@pytest.mark.parametrize("arch", [80, 90])
def test_bfloat16_launch_config_of_each_gpu_family(monkeypatch, arch):
    """bf16 with the launch config of sm_80 and of sm_90 (kernel chunk 64 on both), run under the
    interpreter over one full chunk and a ragged one: 5e-2 absolute plus 2e-2 relative."""
    monkeypatch.setattr(kda_chunk, "device_arch", lambda device: arch)
    C = kda_chunk.launch_meta(16, 16, torch.bfloat16, arch)["C"]
    assert C == {80: 64, 90: 64}[arch]
    _compare(1, 1, C + 5, 16, 16, 64, torch.bfloat16, True, seed=2, atol=5e-2, rtol=2e-2)


def test_channel_equal_decay_is_the_gated_delta_rule():
    """A decay equal over the channels: the USE_GK kernels equal the USE_G ones (float64, 1e-10)."""
    ins, S0 = _inputs(1, 2, 21, 8, 6, D64, seed=4, with_state=True)
    q, k, v, g, b = ins
    g1 = g[..., 0]
    o1, s1 = kda_triton(q, k, v, g1[..., None].expand_as(g).contiguous(), b, S0, True, chunk_size=16)
    o2, s2 = gated_delta_rule_triton(q, k, v, g1, b, S0, True, chunk_size=16)
    _close(["o", "S_T"], [o2, s2], [o1, s1], tol=1e-10)


def test_varlen_matches_separate_sequences():
    """cu_seqlens: one packed row of sequences (empty ones first, between and last; a single
    token; ragged last chunks, one sequence over two chunks of 16) equals each sequence run alone,
    by the reference and by ``kda_triton`` on its slice, from its own initial state: o, the final
    states and every gradient (float64, 1e-10); an empty sequence passes its state through."""
    lens = [0, 1, 17, 0, 12, 0]
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, T, 6, 5, D64, seed=11, with_state=True, n_states=len(lens))
    wo, wS = _weights(1, 2, T, 6, 5, len(lens), D64, seed=12)

    def per_sequence(fn):
        def run(q, k, v, g, b, s0):
            outs, states = [], []
            for i in range(len(lens)):
                a, e = int(cu[i]), int(cu[i + 1])
                o_i, S_i = fn(*(t[:, :, a:e] for t in (q, k, v, g, b)), s0[i:i + 1])
                outs.append(o_i)
                states.append(S_i)
            return torch.cat(outs, 2), torch.cat(states, 0)
        return run

    ref = _run(per_sequence(lambda *a: kda_reference(*a, True)), ins, S0, wo, wS)
    tri = _run(lambda q, k, v, g, b, s: kda_triton(q, k, v, g, b, s, True, chunk_size=16, cu_seqlens=cu),
               ins, S0, wo, wS)
    _close(NAMES, ref, tri, tol=1e-10)
    alone = _run(per_sequence(lambda *a: kda_triton(*(t.contiguous() for t in a), True, chunk_size=16)),
                 ins, S0, wo, wS)
    _close(NAMES, alone, tri, tol=1e-10)
    for i, n in enumerate(lens):
        if n == 0:
            torch.testing.assert_close(tri[1][i], S0[i])


def test_no_final_state_and_the_public_entries():
    """output_final_state=False returns None and gradients flow without dht; ``kda`` and
    ``gated_delta_rule`` with a per-channel g dispatch backend="triton" to these kernels (float64,
    1e-10 against the reference)."""
    assert "triton" in BACKENDS
    ins, S0 = _inputs(1, 1, 18, 4, 4, D64, seed=5, with_state=True)
    leaves = [t.clone().requires_grad_(True) for t in ins]
    o, S = kda_triton(*leaves, chunk_size=16)
    assert S is None
    o.sum().backward()
    leaves_r = [t.clone().requires_grad_(True) for t in ins]
    o_r, _ = kda_reference(*leaves_r)
    o_r.sum().backward()
    _close(["o"] + NAMES[2:7], [o_r] + [t.grad for t in leaves_r], [o] + [t.grad for t in leaves], tol=1e-10)
    ref = kda_reference(*ins, S0, True)
    _close(["o", "S_T"], ref, kda(*ins, S0, True, backend="triton"), tol=1e-10)
    _close(["o", "S_T"], ref, gated_delta_rule(*ins, S0, True, backend="triton"), tol=1e-10)


def test_bad_arguments_are_refused():
    ins, _ = _inputs(2, 1, 8, 4, 4, torch.float32)
    q, k, v, g, b = ins
    with pytest.raises(ValueError, match=r"g \(the per-channel log decay\) must be \[B, H, T, d_k\]"):
        kda_triton(q, k, v, g[..., 0], b)
    with pytest.raises(ValueError, match=r"g \(the per-channel log decay\) must be \[B, H, T, d_k\]"):
        kda_triton(q, k, v, g[..., :3], b)
    with pytest.raises(ValueError, match="packed batch"):
        kda_triton(*ins, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        kda_triton(*ins, initial_state=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="share one dtype"):
        kda_triton(q, k, v.double(), g, b)
    big = torch.zeros(1, 1, 4, 129)
    with pytest.raises(ValueError, match=r"d_k = 129 \(q, k, g\)"):
        kda_triton(big, big, big[..., :4], big, torch.zeros(1, 1, 4))
    small = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"d_v = 257 \(v\)"):
        kda_triton(small, small, torch.zeros(1, 1, 4, 257), small, torch.zeros(1, 1, 4))
    for i, n in enumerate(["q", "k", "v", "g", "beta"]):
        bad = list(ins)
        x = bad[i]   # the same shape and values in another layout: [.., d, T] transposed, every other β
        bad[i] = x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() == 4 else \
            torch.stack([x, x], -1)[..., 0]
        assert not bad[i].is_contiguous() and torch.equal(bad[i], x)
        with pytest.raises(ValueError, match=rf"kda_triton: {n} must be contiguous"):
            kda_triton(*bad)
    single = [t[:1] for t in ins]
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 8"):
        kda_triton(*single, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="g is the log decay and must be <= 0"):
        kda(q, k, v, -g + 0.1, b, backend="triton")
    with pytest.raises(ValueError, match="g is the log decay and must be <= 0"):
        gated_delta_rule(q, k, v, -g + 0.1, b, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,dk,dv", [(2, 4, 1000, 64, 64), (1, 2, 777, 128, 256)])
def test_gpu_float32_matches_reference(B, H, T, dk, dv):
    """float32 with TF32×3 products over up to 1000 steps: 2e-4 of each tensor's largest entry."""
    _compare(B, H, T, dk, dv, 64, torch.float32, True, tol=2e-4)


@pytest.mark.gpu
def test_gpu_bfloat16_strong_decay():
    """bf16 inputs over 512 steps with decays down to −20 per token: 1e-1 absolute plus 5e-2
    relative, as the gated delta rule's bf16 check."""
    _compare(2, 2, 512, 64, 64, 64, torch.bfloat16, True, g_min=-20.0, atol=1e-1, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_varlen():
    """Varlen at GPU sizes, float32: each sequence equals running the kernel on it alone."""
    lens = [100, 1, 513, 64, 200]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, sum(lens), 64, 128, torch.float32, with_state=True, n_states=len(lens))
    o, S = kda_triton(*ins, S0.float(), True, cu_seqlens=cu)
    for i in range(len(lens)):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i, S_i = kda_triton(*[t[:, :, a:e].contiguous() for t in ins], S0[i:i + 1].float(), True)
        torch.testing.assert_close(o[:, :, a:e], o_i, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S[i:i + 1], S_i, atol=1e-5, rtol=1e-5)
