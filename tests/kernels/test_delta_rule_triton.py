"""Triton chunked delta rule (kernels/delta_rule/chunk.py) against the sequential reference:
outputs, final state and every input gradient. Without CUDA these run under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes are tiny; the ``gpu`` tests
repeat the checks at training-like sizes."""
import pytest
import torch
import torch.nn.functional as F

import kernels.delta_rule.chunk as dr_chunk
from kernels.delta_rule import BACKENDS, delta_rule, delta_rule_reference, delta_rule_triton

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

D64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, H, T, dk, dv, dtype, seed=0, with_state=False, n_states=None, channel_beta=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, dk, generator=g, dtype=D64)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=D64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=D64)
    beta = torch.rand(*((B, H, T, dv) if channel_beta else (B, H, T)), generator=g, dtype=D64)
    S0 = torch.randn(n_states or B, H, dk, dv, generator=g, dtype=D64) if with_state else None
    ins = [q, k, v, beta]
    return [t.to(dtype=dtype, device=DEV) for t in ins], (None if S0 is None else S0.to(DEV))


def _run(fn, ins, S0, wo, wS):
    """o, S and the gradients of Σ o∘wo + Σ S∘wS with respect to q, k, v, β (and S0)."""
    leaves = [t.clone().requires_grad_(True) for t in ins]
    s0 = None if S0 is None else S0.clone().requires_grad_(True)
    o, S = fn(*leaves, s0)
    ((o.to(D64) * wo).sum() + (S.to(D64) * wS).sum()).backward()
    return [o.detach(), S.detach()] + [t.grad for t in leaves] + ([] if s0 is None else [s0.grad])


def _compare(B, H, T, dk, dv, chunk, dtype, with_state, atol, rtol=0.0, channel_beta=False):
    ins, S0 = _inputs(B, H, T, dk, dv, dtype, with_state=with_state, channel_beta=channel_beta)
    g = torch.Generator().manual_seed(9)
    # o comes out in the input dtype, so the kernel's backward receives ∂/∂o = wo rounded to that
    # dtype; the reference must get the same upstream gradient (a bf16-rounded wo differs by
    # 2^-9 relative, which dk, a sum of large cancelling terms, would amplify to O(1) errors)
    wo = torch.randn(B, H, T, dv, generator=g, dtype=D64).to(dtype).to(D64).to(DEV)
    wS = torch.randn(B, H, dk, dv, generator=g, dtype=D64).to(DEV)
    # the reference sees exactly the (possibly rounded) inputs the kernel sees, in float64
    ref = _run(lambda *a: delta_rule_reference(*a, output_final_state=True),
               [t.to(D64) for t in ins], S0, wo, wS)
    tri = _run(lambda q, k, v, b, s: delta_rule_triton(q, k, v, b, s, True, chunk_size=chunk),
               ins, None if S0 is None else S0.float(), wo, wS)
    assert tri[0].dtype == dtype and tri[1].dtype == torch.float32
    names = ["o", "S_T", "dq", "dk", "dv", "dbeta", "dS0"]
    for n, a, b in zip(names, ref, tri):
        assert b.dtype == (torch.float32 if n in ("S_T", "dS0") else dtype), n
        torch.testing.assert_close(b.to(D64), a, atol=atol, rtol=rtol, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("B,H,T,dk,dv,chunk,with_state", [
    (1, 1, 20, 8, 8, 16, True),      # ragged second chunk
    (2, 2, 37, 5, 12, 16, False),    # batch and heads, padded d_k and d_v, three chunks
    (1, 2, 16, 16, 16, 4, True),     # chunk_size below 16 is rounded up: one full chunk
])
def test_float32_matches_reference(B, H, T, dk, dv, chunk, with_state):
    """float32 kernel (TF32×3 products on a GPU, float32 under the interpreter; float32
    accumulation) vs the float64 reference on the same inputs: triangular solves and sums of ≤ 40 O(1) terms keep errors near 1e-5 (dk and dβ reach
    ~50, with errors ~1e-5 there), so 1e-4 absolute plus 1e-4 relative."""
    _compare(B, H, T, dk, dv, chunk, torch.float32, with_state, atol=1e-4, rtol=1e-4)


def test_several_dv_blocks(monkeypatch):
    """d_v split over programs (state tile [d_k, 16], d_v = 40 → three blocks, the last ragged):
    the d_v blocks are independent in the forward and summed over in the backward."""
    monkeypatch.setattr(dr_chunk, "BV_MAX", 16)
    _compare(1, 1, 21, 6, 40, 16, torch.float32, True, atol=1e-4, rtol=1e-4)


def test_state_kernels_read_back_dk_blocks(monkeypatch):
    """``_fwd_state`` and ``_bwd_state`` sum their products over d_k in blocks of rows of the
    stored state (d_k = 40 in blocks of 16 → three, the last ragged), with an initial and a final
    state and a ragged last chunk: the values match the reference like the one-block case."""
    monkeypatch.setattr(dr_chunk, "BKS_MAX", 16)
    assert dr_chunk.launch_meta(40, 24, torch.float32)["BKS"] == 16
    _compare(2, 1, 37, 40, 24, 16, torch.float32, True, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stage_dl", [False, True])
def test_chunk_64_with_dk_blocks(monkeypatch, stage_dl):
    """Kernel chunk 64 (bf16's) over a full chunk and a ragged one, with the state kernels' and
    ``_bwd_dqk``'s d_k in blocks of 16 (d_k = 40: three, the last ragged; ``_bwd_dqk`` one program
    per block) and, as on sm_80, ``_bwd_dqk``'s d_v and ``_bwd_wy``'s d_k in blocks of 16 with dL
    staged through memory (STAGE_DL): float32 within the tolerances above."""
    meta = dr_chunk.launch_meta
    sm80 = dict(stage_dl=True, BK_bwd_wy=16, BV_dqk=16) if stage_dl else {}
    monkeypatch.setattr(dr_chunk, "launch_meta", lambda DK, DV, dtype, arch=90: dict(
        meta(DK, DV, dtype, arch), C=64, BKS=16, BK_dqk=16, **sm80))
    _compare(1, 2, 70, 40, 12, 64, torch.float32, True, atol=1e-4, rtol=1e-4)

@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 5e-2, 2e-2)])
def test_launch_config_of_each_gpu_family(monkeypatch, arch, dtype, atol, rtol):
    """The launch config ``launch_meta`` picks for sm_80 and for sm_90 (kernel chunk capped at 64,
    or 16, d_v blocks of 16 for float32 on sm_80, the tiles the compile gate checks), run
    under the interpreter with chunk_size 64 over two chunks and a ragged third: each matches
    the reference with the tolerances of the tests above."""
    monkeypatch.setattr(dr_chunk, "device_arch", lambda device: arch)
    mt = dr_chunk.launch_meta(16, 16, dtype, arch)
    assert mt["C"] == {(80, torch.float32): 16, (90, torch.float32): 16,
                       (80, torch.bfloat16): 64, (90, torch.bfloat16): 64}[arch, dtype]
    _compare(1, 1, 2 * mt["C"] + 5, 16, 20, 64, dtype, True, atol=atol, rtol=rtol)


def test_device_arch_without_gpu():
    """CPU tensors (the interpreter) take the sm_90 launch configs."""
    from kernels._triton_utils import INTERPRET_ARCH, device_arch
    assert INTERPRET_ARCH == 90 and device_arch("cpu") == 90 and device_arch(None) in (80, 90)


@pytest.mark.parametrize("capability,family", [((8, 0), 80), ((8, 6), 80), ((8, 9), 80), ((9, 0), 90),
                                               ((10, 0), 90)])
def test_device_arch_by_capability(monkeypatch, capability, family):
    """A CUDA device's compute capability picks the launch-config family: Ampere and Ada take
    the sm_80 configs, Hopper and newer the sm_90 ones."""
    import kernels._triton_utils as tu
    monkeypatch.setattr(tu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tu, "_capability", lambda index: capability)
    assert tu.device_arch(torch.device("cuda", 0)) == family


def test_float64_is_exact():
    """float64 inputs run in float64: the chunked form differs from the sequential one by
    rounding only, 1e-10 on O(1) values."""
    ins, S0 = _inputs(2, 1, 23, 7, 9, D64, seed=3, with_state=True)
    g = torch.Generator().manual_seed(4)
    wo, wS = torch.randn(2, 1, 23, 9, generator=g, dtype=D64), torch.randn(2, 1, 7, 9, generator=g, dtype=D64)
    ref = _run(lambda *a: delta_rule_reference(*a, output_final_state=True), ins, S0, wo, wS)
    tri = _run(lambda *a: delta_rule(*a, output_final_state=True, backend="triton", chunk_size=16),
               ins, S0, wo, wS)
    for a, b in zip(ref, tri):
        assert b.dtype == D64
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


def test_bfloat16_inputs():
    """bf16 inputs, float32 accumulation (bf16 operands for Q Kᵀ and K Kᵀ, TF32 for the rest on a GPU;
    bf16 operand rounding emulated under the interpreter): outputs and input gradients
    are rounded to bf16 (relative error 2^-8 ≈ 4e-3; dk and dβ reach ~40 and are off by up to
    ~0.25 there), so 5e-2 absolute plus 2e-2 relative."""
    _compare(2, 1, 27, 8, 8, 16, torch.bfloat16, True, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 5e-2, 2e-2)])
def test_per_channel_beta_matches_reference(dtype, atol, rtol):
    """β [B, H, T, d_v] (one write strength per value channel): output, final state and every
    gradient (dβ is [B, H, T, d_v]) against the reference, with the tolerances of the scalar
    case (the kernel runs d_v scalar-β problems of width 1; the same products and sums)."""
    _compare(1, 2, 21, 6, 5, 16, dtype, True, atol=atol, rtol=rtol, channel_beta=True)


def test_per_channel_beta_varlen():
    """Per-channel β with cu_seqlens: each packed sequence equals the reference run alone from
    its own initial state (float64, so 1e-10)."""
    lens = [7, 0, 12]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32, device=DEV)
    (q, k, v, b), S0 = _inputs(1, 1, 19, 4, 3, D64, seed=8, with_state=True, n_states=3, channel_beta=True)
    o, S = delta_rule_triton(q, k, v, b, S0, True, chunk_size=16, cu_seqlens=cu)
    for i in range(len(lens)):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i, S_i = delta_rule_reference(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], b[:, :, a:e], S0[i:i + 1], True)
        torch.testing.assert_close(o[:, :, a:e], o_i, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(S[i:i + 1], S_i, atol=1e-10, rtol=1e-10)


def test_no_final_state_and_no_grad_for_state():
    """output_final_state=False returns None and the same o; gradients flow without dht."""
    ins, _ = _inputs(1, 1, 18, 4, 4, torch.float32, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in ins]
    o, S = delta_rule_triton(*leaves, chunk_size=16)
    assert S is None
    o.sum().backward()
    leaves_r = [t.to(D64).requires_grad_(True) for t in ins]
    o_r, _ = delta_rule_reference(*leaves_r)
    o_r.sum().backward()
    torch.testing.assert_close(o.to(D64), o_r, atol=1e-4, rtol=1e-4)  # float32, as above
    for a, b in zip(leaves_r, leaves):
        torch.testing.assert_close(b.grad.to(D64), a.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dv,bv_max", [(5, None), (40, 16)])
def test_varlen_matches_separate_sequences(monkeypatch, dv, bv_max):
    """cu_seqlens: one packed row of sequences of lengths 5, 0, 17, 18 equals the reference run
    on each sequence alone with its own initial state (float64, so 1e-10), in every gradient
    too; the empty sequence passes its initial state through unchanged. With d_v = 40 in blocks
    of 16 the chunk-parallel kernels (``_fwd_o``, ``_bwd_dv_local``: chunks × heads × d_v
    blocks) map each packed chunk to its sequence and d_v block."""
    if bv_max is not None:
        monkeypatch.setattr(dr_chunk, "BV_MAX", bv_max)
        assert dr_chunk.launch_meta(6, dv, D64)["BV"] == bv_max
    lens = [5, 0, 17, 18]
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, T, 6, dv, D64, seed=6, with_state=True, n_states=len(lens))
    g = torch.Generator().manual_seed(7)
    wo = torch.randn(1, 2, T, dv, generator=g, dtype=D64).to(DEV)
    wS = torch.randn(len(lens), 2, 6, dv, generator=g, dtype=D64).to(DEV)

    def per_sequence(q, k, v, b, s0):
        outs, states = [], []
        for i in range(len(lens)):
            a, e = int(cu[i]), int(cu[i + 1])
            o_i, S_i = delta_rule_reference(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], b[:, :, a:e],
                                            s0[i:i + 1], True)
            outs.append(o_i)
            states.append(S_i)
        return torch.cat(outs, 2), torch.cat(states, 0)

    ref = _run(per_sequence, ins, S0, wo, wS)
    tri = _run(lambda q, k, v, b, s: delta_rule_triton(q, k, v, b, s, True, chunk_size=16, cu_seqlens=cu),
               ins, S0, wo, wS)
    for a, b in zip(ref, tri):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(tri[1][1], S0[1])


def _packed(lens, dv, seed):
    """A packed row of sequences of ``lens`` (float64, H = 2, d_k = 6), its offsets, initial states
    and upstream weights; and the reference run on each sequence alone (o, S and gradients)."""
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, T, 6, dv, D64, seed=seed, with_state=True, n_states=len(lens))
    g = torch.Generator().manual_seed(seed + 1)
    wo = torch.randn(1, 2, T, dv, generator=g, dtype=D64).to(DEV)
    wS = torch.randn(len(lens), 2, 6, dv, generator=g, dtype=D64).to(DEV)

    def per_sequence(q, k, v, b, s0):
        outs, states = [], []
        for i in range(len(lens)):
            a, e = int(cu[i]), int(cu[i + 1])
            o_i, S_i = delta_rule_reference(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], b[:, :, a:e],
                                            s0[i:i + 1], True)
            outs.append(o_i)
            states.append(S_i)
        return torch.cat(outs, 2), torch.cat(states, 0)

    return cu, ins, S0, wo, wS, _run(per_sequence, ins, S0, wo, wS)


@pytest.mark.parametrize("lens", [[0, 1, 15, 0, 33, 16, 0], [0, 0], [3]])
def test_varlen_empty_and_odd_length_sequences(lens):
    """Empty sequences first, between and last, lengths 1, 15, 33 (ragged last chunks) and 16 (one
    full chunk) at chunk 16: ⌊T / C⌋ + N chunk slots with spare ones (sequence −1) that every
    chunk-gridded kernel leaves alone; also a batch of only empty sequences (T = 0) and a single
    short one. Each sequence equals the reference run alone from its own initial state, in o, the
    final state and every gradient (float64, so 1e-10); an empty sequence passes its state
    through."""
    cu, ins, S0, wo, wS, ref = _packed(lens, 5, seed=11)
    N, NC, _, idx = dr_chunk._layout(1, sum(lens), 16, cu)
    assert NC == sum(lens) // 16 + len(lens)
    assert int((idx[:, 0] < 0).sum()) == NC - sum((n + 15) // 16 for n in lens)
    tri = _run(lambda q, k, v, b, s: delta_rule_triton(q, k, v, b, s, True, chunk_size=16, cu_seqlens=cu),
               ins, S0, wo, wS)
    for n, a, b in zip(["o", "S_T", "dq", "dk", "dv", "dbeta", "dS0"], ref, tri):
        if a is None:   # T = 0: the reference's graph never reaches the (empty) inputs
            assert b.numel() == 0, n
            continue
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10, msg=lambda s: f"{n}: {s}")
    for i, n in enumerate(lens):
        if n == 0:
            torch.testing.assert_close(tri[1][i], S0[i])


@pytest.mark.parametrize("C", [16, 32, 64])
def test_varlen_layout_matches_the_chunk_enumeration(C):
    """``_layout``'s device tables against the chunks enumerated in Python: slot j < Σ ⌈T_i / C⌉
    holds (sequence, chunk) of the j-th chunk in order, the rest (sequence −1, chunk 0); each
    sequence's first slot is the count of chunks before it."""
    lens = [0, 1, C - 1, C, C + 1, 0, 3 * C, 7, 0]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N, NC, offs, idx = dr_chunk._layout(1, sum(lens), C, cu)
    want = [(s, c) for s, n in enumerate(lens) for c in range(-(-n // C))]
    assert (N, NC) == (len(lens), sum(lens) // C + len(lens))
    assert idx.dtype == offs.dtype == torch.int32 and idx.shape == (NC, 2)
    assert idx.tolist() == [list(p) for p in want] + [[-1, 0]] * (NC - len(want))
    firsts = torch.tensor([-(-n // C) for n in lens]).cumsum(0) - torch.tensor([-(-n // C) for n in lens])
    assert offs.tolist() == firsts.tolist()


def test_varlen_launch_reads_one_flag_back(monkeypatch):
    """The packed launch, forward and backward, reads nothing of the offsets back to the host but
    the one flag of their check: ``tolist``, ``item`` and ``int()`` of a tensor fail, ``bool()``
    is counted. An offset that does not rise from 0 to T is refused, naming the rule."""
    cu, ins, S0, wo, wS, ref = _packed([5, 0, 17, 18], 4, seed=12)
    bools = []
    real_bool = torch.Tensor.__bool__

    def forbidden(name):
        def f(self, *a, **kw):
            raise AssertionError(f"host read of a tensor: Tensor.{name}")
        return f

    def counted_bool(self):
        bools.append(tuple(self.shape))
        return real_bool(self)

    for name in ("tolist", "item", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    monkeypatch.setattr(torch.Tensor, "__bool__", counted_bool)
    tri = _run(lambda q, k, v, b, s: delta_rule_triton(q, k, v, b, s, True, chunk_size=16, cu_seqlens=cu),
               ins, S0, wo, wS)
    monkeypatch.undo()
    assert bools == [()], bools
    for a, b in zip(ref, tri):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)
    for bad in ([0, 5, 5, 3, 40], [1, 5, 5, 22, 40], [0, 5, 5, 22, 39]):
        with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 40"):
            delta_rule_triton(*ins, S0, cu_seqlens=torch.tensor(bad, dtype=torch.int32, device=DEV))


def test_bad_arguments_are_refused():
    ins, _ = _inputs(2, 1, 8, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="packed batch"):
        delta_rule_triton(*ins, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="initial_state"):
        delta_rule_triton(*ins, initial_state=torch.zeros(1, 1, 4, 4))
    q, k, v, b = ins
    with pytest.raises(ValueError, match=r"beta must be \[B, H, T\]"):
        delta_rule_triton(q, k, v, b[..., None].expand(2, 1, 8, 3))
    with pytest.raises(ValueError, match="q and k"):
        delta_rule_triton(q[..., :3], k, v, b)
    with pytest.raises(ValueError, match="share one dtype"):
        delta_rule_triton(q, k, v.double(), b)


def test_mixer_triton_equals_torch():
    """DeltaNet with kernel_backend="triton" vs "torch": same outputs and parameter gradients
    (float64, both chunked forms of the same recurrence: 1e-9 on O(1) values)."""
    from tests.model.mixer_checks import make_mixer

    assert "triton" in BACKENDS
    m, _ = make_mixer("deltanet", deltanet={"chunk_size": 16})
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
@pytest.mark.parametrize("B,H,T,d,chunk", [(2, 4, 1000, 64, 64), (1, 2, 777, 128, 64), (2, 2, 300, 32, 32)])
def test_gpu_float32_matches_reference(B, H, T, d, chunk):
    """float32 with TF32×3 products (about float32 accuracy) over up to 1000 steps of O(1) values: 2e-3 (the sequential
    reference accumulates its own float64 rounding only; the kernel's is ~1e-6 per step)."""
    _compare(B, H, T, d, d, chunk, torch.float32, True, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_gpu_bfloat16_inputs():
    """bf16 inputs over 512 steps: 1e-1 absolute plus 5e-2 relative on values up to O(10)
    (dk and dβ reach ~400 here). The H100 run that failed (dk off by up to 1.0) fed the kernel
    a bf16-rounded ∂/∂o and the reference the unrounded one; ``_compare`` now gives both the same
    (run under the interpreter at this shape, dk's worst error fell from 3.6× to 0.15× the
    tolerance with float32 products, and to 1.2× with products whose operands are rounded to
    TF32 as on the GPU's tensor cores)."""
    _compare(2, 2, 512, 64, 64, 64, torch.bfloat16, True, atol=1e-1, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_varlen():
    """Varlen at GPU sizes, float32: each sequence equals running the kernel on it alone."""
    lens = [100, 1, 513, 64, 200]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ins, S0 = _inputs(1, 2, sum(lens), 64, 64, torch.float32, with_state=True, n_states=len(lens))
    o, S = delta_rule_triton(*ins, S0.float(), True, cu_seqlens=cu)
    for i in range(len(lens)):
        a, e = int(cu[i]), int(cu[i + 1])
        o_i, S_i = delta_rule_triton(*[t[:, :, a:e] for t in ins], S0[i:i + 1].float(), True)
        torch.testing.assert_close(o[:, :, a:e], o_i, atol=1e-5, rtol=1e-5)  # same kernel: rounding order only
        torch.testing.assert_close(S[i:i + 1], S_i, atol=1e-5, rtol=1e-5)
