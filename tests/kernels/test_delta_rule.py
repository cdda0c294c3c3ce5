import pytest
import torch
import torch.nn.functional as F

from kernels.delta_rule import delta_rule, delta_rule_chunk_torch, delta_rule_reference

D64 = torch.float64


def _inputs(B=2, H=2, T=7, dk=5, dv=3, dtype=D64, seed=0, with_state=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, dk, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, dk, dv, generator=g, dtype=dtype) if with_state else None
    return q, k, v, beta, S0


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (16, 4), (9, 16), (10, 1)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_reference_fwd_and_grads(T, chunk, with_state):
    """float64: the two forms differ by rounding only; 1e-10 on O(1) values."""
    ins = _inputs(T=T, with_state=with_state)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in ins]
    g = torch.Generator().manual_seed(9)
    wo = torch.randn(2, 2, T, 3, generator=g, dtype=D64)
    wS = torch.randn(2, 2, 5, 3, generator=g, dtype=D64)
    res = []
    for fn in (lambda *a: delta_rule_reference(*a, output_final_state=True),
               lambda *a: delta_rule(*a, output_final_state=True, backend="torch", chunk_size=chunk)):
        for t in leaves:
            if t is not None:
                t.grad = None
        o, S = fn(*leaves)
        ((o * wo).sum() + (S * wS).sum()).backward()
        res.append([o.detach(), S.detach()] + [t.grad.clone() for t in leaves if t is not None])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


def test_float32_close_to_float64_reference():
    """float32 chunked form vs float64 reference: the triangular solve and sums over ≤ 16 terms
    of O(1) values keep the error around 1e-6; 1e-4 leaves headroom."""
    q, k, v, beta, S0 = _inputs(T=13, with_state=True)
    o64, S64 = delta_rule_reference(q, k, v, beta, S0, True)
    o32, S32 = delta_rule(q.float(), k.float(), v.float(), beta.float(), S0.float(), True, chunk_size=4)
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, atol=1e-4, rtol=0)
    torch.testing.assert_close(S32.double(), S64, atol=1e-4, rtol=0)


def test_bfloat16_inputs_accumulate_in_float32():
    """bf16 inputs: the state is kept in float32; outputs are rounded to bf16 (8 mantissa bits,
    relative error 2^-8 on O(1) outputs), so 5e-2 absolute."""
    q, k, v, beta, _ = _inputs(T=9)
    o_ref, _ = delta_rule_reference(q, k, v, beta)
    o, S = delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), output_final_state=True, chunk_size=4)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, atol=5e-2, rtol=0)


@pytest.mark.parametrize("cut", [3, 4, 5])
def test_segments_with_state_equal_one_pass(cut):
    q, k, v, beta, _ = _inputs(T=11)
    o, S = delta_rule(q, k, v, beta, output_final_state=True, chunk_size=4)
    o1, S1 = delta_rule(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], beta[:, :, :cut], None, True, chunk_size=4)
    o2, S2 = delta_rule(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], beta[:, :, cut:], S1, True, chunk_size=4)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o, atol=1e-12, rtol=0)
    torch.testing.assert_close(S2, S, atol=1e-12, rtol=0)


def test_delta_rule_overwrites_a_key():
    """With a unit key and β = 1 the write replaces what was stored under that key: reading the
    same key returns the newest value, not the sum that linear attention would return."""
    B, H, dk, dv = 1, 1, 4, 3
    k1 = F.normalize(torch.randn(dk, dtype=D64), dim=0)
    k = torch.stack([k1, k1])[None, None]
    v = torch.randn(1, 1, 2, dv, dtype=D64)
    beta = torch.ones(1, 1, 2, dtype=D64)
    o, _ = delta_rule(k, k, v, beta, chunk_size=2)
    torch.testing.assert_close(o[0, 0, 1], v[0, 0, 1], atol=1e-12, rtol=0)
    # β = 0 writes nothing
    o0, S = delta_rule(k, k, v, torch.zeros_like(beta), output_final_state=True)
    assert o0.abs().max() == 0 and S.abs().max() == 0


def test_unknown_backend_is_refused():
    q, k, v, beta, _ = _inputs(T=2)
    with pytest.raises(ValueError, match="backend"):
        delta_rule(q, k, v, beta, backend="cuda-magic")


def test_chunk_function_direct_call_matches():
    q, k, v, beta, S0 = _inputs(T=6, with_state=True)
    a = delta_rule_chunk_torch(q, k, v, beta, S0, True, chunk_size=5)
    b = delta_rule(q, k, v, beta, S0, True, backend="reference")
    torch.testing.assert_close(a[0], b[0], atol=1e-12, rtol=0)


def _channel_beta(B=2, H=2, T=7, dv=3, seed=11):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, H, T, dv, generator=g, dtype=D64)


def test_per_channel_beta_reference_is_one_delta_rule_per_value_channel():
    """The specification with β [B, H, T, d_v]: value channel j of the output and of the state
    equals the scalar-β rule run on v[..., j] alone with β[..., j] (the columns of S are
    independent); float64, so 1e-12. Also differs from any scalar β (the test can fail)."""
    q, k, v, _, S0 = _inputs(T=9, with_state=True)
    beta = _channel_beta(T=9)
    o, S = delta_rule_reference(q, k, v, beta, S0, True)
    for j in range(v.shape[-1]):
        o_j, S_j = delta_rule_reference(q, k, v[..., j:j + 1], beta[..., j], S0[..., j:j + 1], True)
        torch.testing.assert_close(o[..., j:j + 1], o_j, atol=1e-12, rtol=0)
        torch.testing.assert_close(S[..., j:j + 1], S_j, atol=1e-12, rtol=0)
    o_mean, _ = delta_rule_reference(q, k, v, beta.mean(-1), S0, True)
    assert (o - o_mean).abs().max() > 1e-3


@pytest.mark.parametrize("T,chunk", [(7, 4), (16, 16), (10, 1)])
def test_per_channel_beta_chunk_matches_reference_fwd_and_grads(T, chunk):
    """PyTorch chunked form with a per-channel β vs the reference: output, final state and the
    gradients of q, k, v, β and S0, float64, so 1e-10 as for the scalar case."""
    q, k, v, _, S0 = _inputs(T=T, with_state=True)
    beta = _channel_beta(T=T)
    g = torch.Generator().manual_seed(9)
    wo, wS = torch.randn(2, 2, T, 3, generator=g, dtype=D64), torch.randn(2, 2, 5, 3, generator=g, dtype=D64)
    res = []
    for be in ("reference", "torch"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, beta, S0)]
        o, S = delta_rule(*leaves, output_final_state=True, backend=be, chunk_size=chunk)
        assert o.shape == v.shape and S.shape == S0.shape
        ((o * wo).sum() + (S * wS).sum()).backward()
        res.append([o.detach(), S.detach()] + [t.grad for t in leaves])
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_bad_shapes_are_refused_with_the_reason(backend):
    q, k, v, beta, S0 = _inputs(T=5, with_state=True)
    bad = [
        (dict(beta=beta[..., :4]), r"beta must be \[B, H, T\]"),
        (dict(beta=beta[..., None].expand(2, 2, 5, 2)), r"per value channel"),
        (dict(k=k[..., :4]), "q and k must have the same shape"),
        (dict(q=q[0], k=k[0]), r"must be \[B, H, T, d\]"),
        (dict(v=v[:, :1]), "v must be"),
        (dict(initial_state=S0[..., :2]), "initial_state must be"),
        (dict(v=v.float()), "share one dtype"),
        (dict(beta=(beta > 0.5)), "floating-point"),
    ]
    base = dict(q=q, k=k, v=v, beta=beta, initial_state=S0)
    for change, msg in bad:
        args = {**base, **change}
        with pytest.raises(ValueError, match=msg):
            delta_rule(args["q"], args["k"], args["v"], args["beta"], args["initial_state"], backend=backend)
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule(q, k, v, beta, backend=backend, chunk_size=0)


def test_torch_chunk_empty_sequence():
    """T = 0: no output rows, the final state is the initial state."""
    q, k, v, beta, S0 = _inputs(T=0, with_state=True)
    o, S = delta_rule_chunk_torch(q, k, v, beta, S0, True)
    assert o.shape == (2, 2, 0, 3)
    torch.testing.assert_close(S, S0)
