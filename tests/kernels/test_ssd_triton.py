"""Triton chunked SSD (kernels/ssd/chunk.py: the delta-rule family's kernels with the delta term
off) against the sequential reference: y, final state and every input gradient (x, dt, A, B, C,
D, z, dt_bias, initial state). Without CUDA these run under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes are tiny; the ``gpu`` tests repeat the
checks at the mamba2 presets' head sizes. The tests that take over ~10 s here are marked slow."""
import pytest
import torch

import kernels.ssd.chunk as ssd_chunk
from kernels.ssd import BACKENDS, ssd, ssd_reference, ssd_triton

D64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ["y", "S_T", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dS0"]


def _inputs(b, T, h, p, g, n, dtype, seed=0, with_state=False, n_states=None, a_scale=1.0, dt_scale=1.0,
            D_hdim=False, with_z=True):
    """x, dt, A, B, C, D, z, dt_bias, S0 (dt raw, for softplus(dt + dt_bias)); x, B, C, z in
    ``dtype``, the rest in float64 (the op reads them in the accumulation dtype)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=D64)   # noqa: E731
    x, B, C = r(b, T, h, p), r(b, T, g, n) / n ** 0.5, r(b, T, g, n)
    z = r(b, T, h, p) if with_z else None
    dt = dt_scale * (r(b, T, h) - 1.0)
    A = -a_scale * (0.5 + torch.rand(h, generator=gen, dtype=D64))
    D = r(h, p) if D_hdim else r(h)
    dt_bias = 0.3 * r(h)
    S0 = r(n_states or b, h, p, n) if with_state else None
    ins = [t if t is None else t.to(dtype) for t in (x,)] + [dt, A] + [t.to(dtype) for t in (B, C)] + \
        [D, None if z is None else z.to(dtype), dt_bias]
    return [t if t is None else t.to(DEV) for t in ins], (None if S0 is None else S0.to(DEV))


def _run(fn, ins, S0, wy, wS):
    """y, S and the gradients of Σ y∘wy + Σ S∘wS with respect to every input (and S0)."""
    leaves = [None if t is None else t.clone().requires_grad_(True) for t in ins]
    s0 = None if S0 is None else S0.clone().requires_grad_(True)
    y, S = fn(*leaves, s0)
    ((y.to(D64) * wy).sum() + (S.to(D64) * wS).sum()).backward()
    return [y.detach(), S.detach()] + [None if t is None else t.grad for t in leaves] + \
        ([] if s0 is None else [s0.grad])


def _compare(b, T, h, p, g, n, chunk, dtype, with_state, rtol, cu=None, **kw):
    """Every output and gradient of the Triton form against the reference's in float64, each
    within ``rtol`` of the reference's largest entry."""
    N = b if cu is None else len(cu) - 1
    ins, S0 = _inputs(b, T, h, p, g, n, dtype, with_state=with_state, n_states=N, **kw)
    gen = torch.Generator().manual_seed(9)
    # y comes out in the input dtype: the reference gets the same (rounded) upstream gradient
    wy = torch.randn(b, T, h, p, generator=gen, dtype=D64).to(dtype).to(D64).to(DEV)
    wS = torch.randn(N, h, p, n, generator=gen, dtype=D64).to(DEV)
    cut = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    ref = _run(lambda *a: ssd_reference(*a[:8], dt_softplus=True, initial_state=a[8], output_final_state=True,
                                        cu_seqlens=cut),
               [None if t is None else t.to(D64) for t in ins], S0, wy, wS)
    tri = _run(lambda *a: ssd_triton(*a[:8], dt_softplus=True, initial_state=a[8], output_final_state=True,
                                     chunk_size=chunk, cu_seqlens=cut),
               ins, S0, wy, wS)
    acc = D64 if dtype == D64 else torch.float32
    assert tri[0].dtype == dtype and tri[1].dtype == acc
    for name, a, c in zip(NAMES, ref, tri):
        assert (a is None) == (c is None), name
        if a is None:
            continue
        assert torch.isfinite(c).all(), name
        err = (c.to(D64) - a).abs().max() / a.abs().max().clamp_min(1e-30)
        assert err <= rtol, f"{name}: relative error {float(err):.3g} > {rtol}"
    return ref, tri


def test_backends_list_triton():
    assert "triton" in BACKENDS


@pytest.mark.parametrize("b,T,h,p,g,n,chunk,with_state", [
    (1, 20, 2, 8, 1, 16, 16, True),     # ragged second chunk, one group
    pytest.param(2, 37, 4, 12, 2, 5, 16, False, marks=pytest.mark.slow),   # batch, two groups, padded n, p
])
def test_float32_matches_reference(b, T, h, p, g, n, chunk, with_state):
    _compare(b, T, h, p, g, n, chunk, torch.float32, with_state, rtol=2e-5)


def test_float64_is_exact():
    """float64 through the same kernels (IEEE products): the chunked form to rounding, per-channel D."""
    _compare(1, 35, 2, 8, 2, 16, 16, D64, True, rtol=1e-10, D_hdim=True)


def test_float64_chunk_64_with_dqk_in_dk_blocks(monkeypatch):
    """Kernel chunk 64 (bf16's on sm_90) over a full chunk and a ragged one, with ``_bwd_dqk``
    split over the state size (n = 40 in blocks of 16: three programs per chunk, the last ragged,
    each storing its part of dγ for ``_bwd_beta`` to sum): float64, 1e-10."""
    meta = ssd_chunk.launch_meta
    monkeypatch.setattr(ssd_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(
        meta(DK, DV, dtype, arch), C=64, BK_dqk=16))
    _compare(1, 70, 2, 8, 1, 40, 64, D64, True, rtol=1e-10)

def test_bfloat16_inputs():
    """bf16 x, B, C, z (products of bf16 inputs on the tensor cores, TF32 for the float32
    intermediates, y rounded to bf16 before D x): 3e-2 of the largest entry."""
    _compare(1, 40, 2, 16, 1, 16, 32, torch.bfloat16, True, rtol=3e-2)


def test_strong_decay_stays_finite():
    """Δ A = −70 per token (Δ = 1, A = −70: a chunk of 16 sums to −1120, far past e^{−88}): every
    exponent the kernels take is a difference of cumulative log decays, ≤ 0, so nothing overflows;
    y, the state and every gradient match the reference (float32 tolerance)."""
    ins, S0 = _inputs(1, 33, 2, 8, 1, 16, torch.float32, with_state=True)
    x, dt, A, B, C, D, z, dt_bias = ins
    dt = torch.ones_like(dt)
    A = torch.full_like(A, -70.0)
    ins = [x, dt, A, B, C, D, z, None]
    gen = torch.Generator().manual_seed(9)
    wy = torch.randn(1, 33, 2, 8, generator=gen, dtype=D64).to(DEV)
    wS = torch.randn(1, 2, 8, 16, generator=gen, dtype=D64).to(DEV)
    ref = _run(lambda *a: ssd_reference(*a[:8], initial_state=a[8], output_final_state=True),
               [None if t is None else t.to(D64) for t in ins], S0, wy, wS)
    tri = _run(lambda *a: ssd_triton(*a[:8], initial_state=a[8], output_final_state=True, chunk_size=16),
               ins, S0, wy, wS)
    for name, a, c in zip(NAMES, ref, tri):
        if a is None:
            assert c is None, name
            continue
        assert torch.isfinite(c).all(), name
        # dA is e^{−70}-small (it flows only through the decays): an absolute tolerance on O(1) values
        torch.testing.assert_close(c.to(D64), a, atol=2e-5 * max(float(a.abs().max()), 1.0), rtol=2e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("lens", [[5, 0, 17, 18], [0, 1, 15, 0, 33]])
def test_varlen_matches_separate_sequences(lens):
    """cu_seqlens (one launch per kernel, empty sequences included) equals one call per sequence,
    outputs, final states and gradients; with initial states, two groups."""
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    T, N = cu[-1], len(lens)
    ins, S0 = _inputs(1, T, 4, 8, 2, 16, torch.float32, with_state=True, n_states=N)
    gen = torch.Generator().manual_seed(3)
    wy = torch.randn(1, T, 4, 8, generator=gen, dtype=D64).to(DEV)
    wS = torch.randn(N, 4, 8, 16, generator=gen, dtype=D64).to(DEV)
    cut = torch.tensor(cu, dtype=torch.int32, device=DEV)
    packed = _run(lambda *a: ssd_triton(*a[:8], dt_softplus=True, initial_state=a[8], output_final_state=True,
                                        chunk_size=16, cu_seqlens=cut), ins, S0, wy, wS)

    def per_seq(x, dt, A, B, C, D, z, dt_bias, s0):
        ys, ss = [], []
        for i, (a, e) in enumerate(zip(cu, cu[1:])):
            y, s = ssd_triton(x[:, a:e], dt[:, a:e], A, B[:, a:e], C[:, a:e], D, z[:, a:e], dt_bias, True,
                              s0[i:i + 1], True, chunk_size=16)
            ys.append(y)
            ss.append(s)
        return torch.cat(ys, 1), torch.cat(ss, 0)
    sep = _run(per_seq, ins, S0, wy, wS)
    for name, a, c in zip(NAMES, sep, packed):
        torch.testing.assert_close(c, a, atol=2e-5, rtol=2e-5, msg=lambda s: f"{name}: {s}")
    # and the reference's own packed form
    ref = ssd_reference(*(None if t is None else t.to(D64) for t in ins), True, S0, True, cut)
    torch.testing.assert_close(packed[0].to(D64), ref[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(packed[1].to(D64), ref[1], atol=2e-5, rtol=2e-5)


def test_no_state_no_softplus_no_gate():
    """Plain Δ = dt (no bias, no softplus), no D, no z, no states: y only."""
    ins, _ = _inputs(2, 21, 2, 8, 1, 8, torch.float32, with_z=False)
    x, dt, A, B, C = ins[:5]
    dt = torch.nn.functional.softplus(dt)
    y, S = ssd(x, dt, A, B, C, backend="triton", chunk_size=16)
    y_r, _ = ssd_reference(*(t.to(D64) for t in (x, dt, A, B, C)))
    assert S is None
    torch.testing.assert_close(y.to(D64), y_r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", [80, 90])
def test_launch_config_of_each_gpu_family(arch):
    """Each family's config (its kernel chunk, tiles, warps) gives the same results; the chunk is
    capped (mamba2's chunk_size 256 runs at the config's C)."""
    mt = ssd_chunk.launch_meta(128, 64, torch.bfloat16, arch)
    assert mt["C"] <= 64 and mt["warps_beta"] == 4
    ins, S0 = _inputs(1, 24, 2, 8, 1, 16, torch.float32, with_state=True)
    ref = ssd_reference(*(t.to(D64) for t in ins), True, S0, True)
    y, S = ssd_chunk.core.run("ssd_triton", ssd_chunk._fwd_op, ssd_chunk.launch_meta, arch,
                              *_core_args(ins, S0), True, 256, None)
    y = y.transpose(1, 2) + ins[0] * ins[5][:, None]
    y = y * torch.nn.functional.silu(ins[6])
    torch.testing.assert_close(y.to(D64), ref[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(S.transpose(-1, -2).to(D64), ref[1], atol=2e-5, rtol=2e-5)


def _core_args(ins, S0):
    """The family's (q, k, v, g, beta, initial_state) for ``_inputs``' SSD inputs (one group)."""
    x, dt, A, B, C, D, z, dt_bias = ins
    delta = torch.nn.functional.softplus(dt + dt_bias).float()
    h = x.shape[2]
    heads = lambda t: t.transpose(1, 2).repeat_interleave(h // t.shape[2], 1).contiguous()   # noqa: E731
    return (heads(C), heads(B), x.transpose(1, 2).contiguous(), (delta * A).transpose(1, 2).contiguous(),
            delta.transpose(1, 2).contiguous(), S0.transpose(-1, -2).contiguous().float())


def test_empty_sequence():
    ins, S0 = _inputs(1, 0, 2, 8, 1, 8, torch.float32, with_state=True)
    y, S = ssd_triton(*ins, True, S0, True)
    assert y.shape == (1, 0, 2, 8)
    torch.testing.assert_close(S, S0.float())


def test_bad_arguments_are_refused():
    ins, S0 = _inputs(1, 8, 2, 8, 1, 16, torch.float32)
    x, dt, A, B, C, D, z, dt_bias = ins
    with pytest.raises(ValueError, match="state size n"):
        big = torch.randn(1, 8, 1, 129, device=DEV)
        ssd_triton(x, dt, A, big, big)
    with pytest.raises(ValueError, match="head dim p"):
        ssd_triton(torch.randn(1, 8, 2, 257, device=DEV), dt, A, B, C)
    with pytest.raises(ValueError, match="divisible by the number of groups"):
        g3 = torch.randn(1, 8, 3, 16, device=DEV)
        ssd_triton(x, dt, A, g3, g3)
    with pytest.raises(ValueError, match="dt must be"):
        ssd_triton(x, dt[:, :4], A, B, C)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        ssd_triton(x, dt, A, B, C, chunk_size=48)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        ssd_triton(x, dt, A, B, C, cu_seqlens=torch.tensor([0, 5, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="A must be <= 0"):
        ssd(x, dt.abs(), -A, B, C, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        ssd(x, dt.abs(), A, B, C, backend="tritonn")


@pytest.mark.slow
def test_mixer_triton_equals_torch():
    """The mamba2 mixer with kernel_backend="triton" vs "torch": same outputs, final state and
    parameter gradients (float64: two chunked forms of one recurrence)."""
    from tests.model.mixer_checks import make_mixer

    m, _ = make_mixer("mamba2", mamba2={"chunk_size": 16})
    torch.manual_seed(1)
    x = torch.randn(2, 19, m.d_model, dtype=D64, requires_grad=True)
    w = torch.randn(2, 19, m.d_model, dtype=D64)
    res = []
    for be in ("torch", "triton"):
        m.kernel_backend = be
        m.zero_grad()
        x.grad = None
        y, st = m.chunked(x, output_state=True)
        ((y * w).sum() + st.ssm.sum()).backward()
        res.append([y.detach(), st.ssm.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("b,T,h,p,g,n,chunk", [(2, 1000, 4, 64, 1, 128, 256), (1, 777, 8, 64, 2, 128, 64)])
def test_gpu_float32_matches_reference(b, T, h, p, g, n, chunk):
    _compare(b, T, h, p, g, n, chunk, torch.float32, True, rtol=2e-5)


@pytest.mark.gpu
def test_gpu_bfloat16_inputs():
    _compare(2, 1000, 4, 64, 1, 128, 256, torch.bfloat16, True, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_varlen():
    _compare(1, 900, 4, 64, 2, 128, 256, torch.float32, True, rtol=2e-5, cu=[0, 100, 100, 517, 900])


@pytest.mark.parametrize("packed", [False, True])
def test_custom_op_passes_opcheck(packed):
    """``kernels::ssd_fwd`` (no delta term: empty Tm and W outputs) passes torch.library.opcheck:
    its fake shapes, its schema and its autograd registration (the backward op through it)."""
    ins, S0 = _inputs(1, 20, 2, 8, 1, 16, D64, with_state=True, n_states=2 if packed else 1)
    q, k, v, g, beta, h0 = _core_args(ins, S0)
    g, beta, h0 = g.double(), beta.double(), h0.double()
    cu = torch.tensor([0, 5, 20], dtype=torch.int32, device=DEV) if packed else None
    args = (q, k, v, g, beta, h0, cu, 16, 90, True)
    out = ssd_chunk._fwd_op(*args)
    assert out[2].numel() == 0 and out[3].numel() == 0     # Tm, W: not formed without the delta term
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    # packed: the chunk-state buffer's spare slots (⌊T / C⌋ + N bound the chunks) are never written,
    # so its values differ from run to run and the eager-vs-traced comparison is left out there
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") + (() if packed else
                                                                               ("test_aot_dispatch_dynamic",))
    torch.library.opcheck(ssd_chunk._fwd_op, (*leaves, cu, 16, 90, True), test_utils=utils)
