"""kernels.lact: the LaCT op against the official code's numbers, its two backends against each
other, streaming, and its entry checks.

Golden numbers: ``tests/kernels/data/lact_golden.pt`` holds inputs and the outputs of the official
``block_causal_lact_swiglu`` / ``prenorm_block_causal_lact_swiglu`` (a1600012888/LaCT at commit
1f84d47, ``lact_llm/lact_model/ttt_operation.py``) run on CPU with torch 2.13 and
TORCHDYNAMO_DISABLE=1 (so its ``torch.compile`` and CUDA autocast decorators are inert): the
output, the final fast weights (the weights its last three bmm's read, recorded by wrapping
``torch.bmm``) and the gradient of every input under the loss Σ o ⊙ R + Σ_i w_i^final ⊙ R_i
(R, R_i fixed random tensors, seed 123), in float64 and float32, for B = H = 2, d_k = d_v = 8,
d_h = 12, chunk 16 and T ∈ {50, 48, 40, 12}: plain, momentum, Muon with and without momentum,
the prenorm variant, and T ≤ chunk (no write). "fp64"/"fp32" results ran the Newton–Schulz steps
in the state's dtype (``Tensor.bfloat16`` made the identity during the call); "fp32_bf16ns" ran
them in bfloat16 as shipped. The official layout is [B·H, T, d] with b major.

Tolerances (relative to the largest magnitude of the expected tensor): float64 1e-9 (the two
codes order their sums differently, nothing else), float32 1e-4, bfloat16 Newton–Schulz 5e-2
(bfloat16 has an 8-bit mantissa; the two codes round different intermediate products).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.lact import BACKENDS, block_causal_lact_swiglu

GOLDEN = Path(__file__).parent / "data" / "lact_golden.pt"
ARGS = ("q", "k", "v", "lr0", "lr1", "lr2", "w0", "w1", "w2", "momentum")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def golden():
    return torch.load(GOLDEN, weights_only=False)


def ours(case, g, dtype, backend, muon_dtype=None):
    """Our op on a golden case; returns (o, final state, grads by argument name) in the official layout."""
    B, H = g["B"], g["H"]
    inp = {}
    for n, t in case["inputs"].items():
        t = t.to(dtype)
        t = t.view(B, H, *t.shape[1:])
        inp[n] = t.clone().requires_grad_(True)
    mom = inp["momentum"] if case["momentum"] else None
    o, st = block_causal_lact_swiglu(inp["q"], inp["k"], inp["v"], inp["lr0"], inp["lr1"], inp["lr2"],
                                     inp["w0"], inp["w1"], inp["w2"], chunk_size=case["C"],
                                     use_muon=case["use_muon"], momentum=mom, prenorm=case["prenorm"],
                                     muon_dtype=muon_dtype, output_final_state=True, backend=backend)
    gen = torch.Generator().manual_seed(123)
    N = B * H
    o_flat = o.reshape(N, *o.shape[2:])
    loss = (o_flat * torch.randn(o_flat.shape, generator=gen, dtype=o.dtype)).sum()
    for w in ("w0", "w1", "w2"):
        wf = st[w].reshape(N, *st[w].shape[2:])
        loss = loss + (wf * torch.randn(wf.shape, generator=gen, dtype=wf.dtype)).sum()
    names = [n for n in inp if case["momentum"] or n != "momentum"]
    grads = torch.autograd.grad(loss, [inp[n] for n in names], allow_unused=True)
    grads = {n: (torch.zeros_like(inp[n]) if gr is None else gr).reshape(N, *inp[n].shape[2:])
             for n, gr in zip(names, grads)}
    return o_flat.detach(), {w: st[w].reshape(N, *st[w].shape[2:]).detach() for w in ("w0", "w1", "w2")}, grads


def _compare(res, o, W, grads, tol):
    assert rel(o, res["o"]) <= tol, ("o", rel(o, res["o"]))
    for w in ("w0", "w1", "w2"):
        assert rel(W[w], res[w]) <= tol, (w, rel(W[w], res[w]))
    assert set(grads) == set(res["grads"])
    for n, gr in res["grads"].items():
        if gr.abs().max() == 0:    # T ≤ chunk: k, v, lr's never reach the output
            assert grads[n].abs().max() == 0, n
            continue
        assert rel(grads[n], gr) <= tol, (n, rel(grads[n], gr))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_matches_official(golden, backend, dtype, tol):
    key = "fp64" if dtype == torch.float64 else "fp32"
    for case in golden["cases"]:
        o, W, grads = ours(case, golden, dtype, backend, muon_dtype=None)
        _compare(case["results"][key], o, W, grads, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_official_bf16_newton_schulz(golden, backend):
    cases = [c for c in golden["cases"] if c["use_muon"]]
    assert cases
    for case in cases:
        o, W, grads = ours(case, golden, torch.float32, backend, muon_dtype=torch.bfloat16)
        _compare(case["results"]["fp32_bf16ns"], o, W, grads, 5e-2)


def test_golden_cases_cover_the_schedule(golden):
    """The fixture exercises every switch and both edge cases of the last chunk."""
    cs = golden["cases"]
    assert any(c["T"] % c["C"] == 0 and c["T"] > c["C"] for c in cs)   # a full last chunk, not written
    assert any(c["T"] <= c["C"] for c in cs)                           # no write at all
    assert any(c["use_muon"] and c["momentum"] for c in cs) and any(c["use_muon"] and not c["momentum"] for c in cs)
    assert any(c["prenorm"] for c in cs)


# ---- streaming ---------------------------------------------------------------------------------

def _rand(B=2, H=3, T=37, dk=6, dv=5, dh=7, shared=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype)
    lead = (H,) if shared else (B, H)
    d = {"q": torch.nn.functional.normalize(r(B, H, T, dk), dim=-1),
         "k": torch.nn.functional.normalize(r(B, H, T, dk), dim=-1), "v": r(B, H, T, dv),
         "lr0": torch.nn.functional.softplus(r(B, H, T) - 1), "lr1": torch.nn.functional.softplus(r(B, H, T) - 1),
         "lr2": torch.nn.functional.softplus(r(B, H, T) - 1), "momentum": torch.sigmoid(r(B, H, T)),
         "w0": r(*lead, dh, dk) / dk ** 0.5, "w1": r(*lead, dv, dh) / dh ** 0.5, "w2": r(*lead, dh, dk) / dk ** 0.5}
    return d


def _call(d, sl=slice(None), **kw):
    mom = d["momentum"][:, :, sl] if kw.pop("use_momentum", True) else None
    return block_causal_lact_swiglu(*(d[n][:, :, sl] for n in ("q", "k", "v", "lr0", "lr1", "lr2")),
                                    d["w0"], d["w1"], d["w2"], momentum=mom, **kw)


SETTINGS = [dict(), dict(use_muon=True, muon_dtype=None), dict(prenorm=True), dict(use_momentum=False)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_two_calls_equal_one(backend, setting):
    """Split anywhere (inside a chunk, at a chunk boundary, right after one), the state passed:
    outputs and final state equal one call, float64 to 1e-12."""
    kw = dict(SETTINGS[setting], chunk_size=8, backend=backend)
    d = _rand()
    o, st = _call(d, output_final_state=True, **kw)
    for cut in (3, 8, 9, 16, 30):
        o1, s1 = _call(d, slice(0, cut), output_final_state=True, **kw)
        o2, s2 = _call(d, slice(cut, None), initial_state=s1, output_final_state=True, **kw)
        assert rel(torch.cat([o1, o2], 2), o) <= 1e-12, cut
        assert set(s2) == set(st)
        for key in st:
            assert s2[key].shape == st[key].shape, key
            assert rel(s2[key], st[key]) <= 1e-12 if st[key].numel() else True, (cut, key)


def test_decode_token_by_token():
    """One token per call (the decode step) equals one call; a full open chunk is written when
    the next token arrives, not before."""
    d = _rand(T=20)
    kw = dict(chunk_size=4, use_muon=True, muon_dtype=None, backend="torch")
    o, st = _call(d, output_final_state=True, **kw)
    s = None
    outs = []
    for t in range(20):
        ot, s_new = _call(d, slice(t, t + 1), initial_state=s, output_final_state=True, **kw)
        if t % 4 == 0 and t > 0:   # the token after a full chunk: the chunk was written before it was read
            assert not torch.equal(s_new["w0"], s["w0"])
        elif s is not None:
            assert torch.equal(s_new["w0"], s["w0"])
        assert s_new["k"].shape[2] == t % 4 + 1
        outs.append(ot)
        s = s_new
    assert rel(torch.cat(outs, 2), o) <= 1e-12
    for key in st:
        assert rel(s[key], st[key]) <= 1e-12, key


def test_two_calls_gradients_equal_one():
    """Autograd through the passed state: the gradients of every input equal one call's."""
    d = _rand(T=21)
    kw = dict(chunk_size=5, backend="torch")
    leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
    o, _ = _call(leaves, **kw)
    w = torch.randn_like(o)
    g1 = torch.autograd.grad((o * w).sum(), list(leaves.values()))
    o1, s1 = _call(leaves, slice(0, 12), output_final_state=True, **kw)
    o2, _ = _call(leaves, slice(12, None), initial_state=s1, **kw)
    g2 = torch.autograd.grad((torch.cat([o1, o2], 2) * w).sum(), list(leaves.values()))
    for n, a, b in zip(leaves, g1, g2):
        assert rel(b, a) <= 1e-12, n


# ---- the two backends ----------------------------------------------------------------------------

@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("shared", [True, False])
def test_torch_equals_reference(setting, shared):
    """Forward, final state and every input's gradient, float64, shared ([H, ...]) and per-row
    ([B, H, ...]) weights, d_k ≠ d_v ≠ d_h."""
    d = _rand(shared=shared, T=29)
    res = {}
    for backend in BACKENDS:
        leaves = {n: t.clone().requires_grad_(True) for n, t in d.items()}
        o, st = _call(leaves, output_final_state=True, chunk_size=8, backend=backend, **SETTINGS[setting])
        g = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() + sum(
            (st[w] * torch.randn(st[w].shape, generator=g, dtype=o.dtype)).sum() for w in ("w0", "w1", "w2"))
        used = [n for n in leaves if n != "momentum" or SETTINGS[setting].get("use_momentum", True)]
        res[backend] = (o, st, torch.autograd.grad(loss, [leaves[n] for n in used]))
    (o_a, s_a, g_a), (o_b, s_b, g_b) = res["torch"], res["reference"]
    assert rel(o_a, o_b) <= 1e-12
    for key in s_b:
        assert rel(s_a[key], s_b[key]) <= 1e-12, key
    for a, b in zip(g_a, g_b):
        assert rel(a, b) <= 1e-11


def test_bf16_inputs_run_in_float32_state():
    """Half inputs: the output in v's dtype, the state in float32, close to the float32 run."""
    d = _rand(dtype=torch.float32)
    o32, s32 = _call(d, chunk_size=8, output_final_state=True)
    db = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in d.items()}
    ob, sb = _call(db, chunk_size=8, output_final_state=True)
    assert ob.dtype == torch.bfloat16 and sb["w0"].dtype == torch.float32
    assert rel(ob, o32) <= 3e-2


def test_writes_change_the_output():
    """The schedule is not a no-op: with the learning rates zeroed the later chunks read the
    initial weights, and the output differs."""
    d = _rand()
    o, _ = _call(d, chunk_size=8)
    d0 = dict(d, lr0=d["lr0"] * 0, lr1=d["lr1"] * 0, lr2=d["lr2"] * 0)
    o0, _ = _call(d0, chunk_size=8, use_momentum=False)
    assert torch.equal(o[:, :, :8], o0[:, :, :8])       # the first chunk reads the initial weights
    assert rel(o[:, :, 8:], o0[:, :, 8:]) > 1e-3


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_ops_dispatched_grow_with_chunks_not_tokens():
    """The batched form's forward+backward dispatches the same number of ops for the same number
    of chunks, whatever the chunk length, and more for more chunks."""
    counts = {}
    for T, C in ((64, 16), (256, 64), (128, 16)):
        d = {n: t.requires_grad_(True) for n, t in _rand(T=T, dtype=torch.float32).items()}
        with _Count() as c:
            o, _ = _call(d, chunk_size=C, use_muon=True)
            o.sum().backward()
        counts[(T, C)] = c.n
    assert counts[(64, 16)] == counts[(256, 64)]
    assert counts[(128, 16)] > counts[(64, 16)]


class _Alloc(TorchDispatchMode):
    """Sums the elements of every tensor an op returns in fresh memory (views and in-place results
    excluded) and counts the ops that build a gradient by padding with zeros (the backward of
    indexing: ``x[:, a:b]`` backpropagates a zero tensor of x's full size holding the slice's grad)."""
    PAD = {"slice_backward", "select_backward", "as_strided_backward", "zeros", "zeros_like", "new_zeros",
           "zero_", "fill_"}

    def __init__(self):
        super().__init__()
        self.elements = 0
        self.pads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.pads += name in self.PAD
        if not any(r.alias_info is not None for r in func._schema.returns):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.elements += sum(t.numel() for t in outs if isinstance(t, torch.Tensor))
        return out


# every switch of the chunk loop: momentum + Muon on square heads (the batched Newton–Schulz of
# all three updates), prenorm, packed documents (resets every other chunk)
ALLOC_SETTINGS = [dict(use_muon=True, muon_dtype=None, dims=(6, 6, 6)), dict(prenorm=True, use_momentum=False),
                  dict(resets=True)]


@pytest.mark.parametrize("setting", range(len(ALLOC_SETTINGS)))
def test_memory_allocated_grows_linearly_with_chunks(setting):
    """Forward and backward each allocate the same number of elements per written chunk at 2, 4
    and 8 chunks (chunk 8, T = 16, 32, 64: E(n) = a + b·n exactly, so E(8) − E(4) = 2 (E(4) − E(2))),
    and the backward pads no gradient with zeros per chunk. A chunk loop that indexes a full-length
    tensor (``k[:, :, c*C:(c+1)*C]``) or a chunk's [G | H] product allocates in backward a zero
    tensor of the indexed tensor's full size per chunk: the first check fails for the former
    (its elements grow as T²), the second for both."""
    kw = dict(ALLOC_SETTINGS[setting])
    dk, dv, dh = kw.pop("dims", (6, 5, 7))
    use_resets = kw.pop("resets", False)
    C = 8
    fwd, bwd, pads = {}, {}, {}
    for n in (2, 4, 8):
        d = {k: t.requires_grad_(True) for k, t in _rand(T=n * C, dk=dk, dv=dv, dh=dh, dtype=torch.float32).items()}
        if use_resets:
            kw["resets"] = (torch.arange(n) % 2 == 1).expand(2, n).contiguous()
        with _Alloc() as f:
            o, _ = _call(d, chunk_size=C, **kw)
            loss = o.sum()
        with _Alloc() as b:
            loss.backward()
        fwd[n], bwd[n], pads[n] = f.elements, b.elements, b.pads
    assert fwd[2] < fwd[4] < fwd[8] and bwd[2] < bwd[4] < bwd[8]   # the counts see the chunks at all
    assert fwd[8] - fwd[4] == 2 * (fwd[4] - fwd[2]), fwd
    assert bwd[8] - bwd[4] == 2 * (bwd[4] - bwd[2]), bwd
    assert pads[2] == pads[4] == pads[8], pads


# ---- bad input -----------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    d = _rand(shared=False)

    def call(**over):
        a = dict(d)
        kw = {k: over.pop(k) for k in list(over) if k not in a}
        a.update(over)
        return block_causal_lact_swiglu(a["q"], a["k"], a["v"], a["lr0"], a["lr1"], a["lr2"], a["w0"], a["w1"],
                                        a["w2"], momentum=a["momentum"], **kw)
    for kw, word in [(dict(chunk_size=0), "chunk_size"), (dict(chunk_size=-4), "chunk_size"),
                     (dict(chunk_size=2.0), "chunk_size"),
                     (dict(k=d["k"][..., :-1]), "q and k"), (dict(v=d["v"][:, :, :-1]), "v must be"),
                     (dict(lr1=d["lr1"][..., None]), "lr1"), (dict(lr0=d["lr0"][:, :, :-1]), "lr0"),
                     (dict(momentum=d["momentum"][:, :1]), "momentum"),
                     (dict(w0=d["w0"][:, :1]), "w0's leading dims"), (dict(w1=d["w1"][..., :-1]), "w1 must be"),
                     (dict(w2=d["w2"][..., :-1, :]), "w0 and w2"), (dict(backend="cuda"), "backend"),
                     (dict(muon_dtype="bf16"), "muon_dtype"),
                     (dict(q=d["q"][:, :, :0], k=d["k"][:, :, :0], v=d["v"][:, :, :0]), "T = 0")]:
        with pytest.raises(ValueError, match="block_causal_lact_swiglu") as e:
            call(**kw)
        assert word in str(e.value), (kw.keys(), str(e.value))
    _, st = call(output_final_state=True, chunk_size=8)
    with pytest.raises(ValueError, match="momentum buffers"):
        block_causal_lact_swiglu(d["q"], d["k"], d["v"], d["lr0"], d["lr1"], d["lr2"], None, None, None,
                                 chunk_size=8, initial_state=st)
    with pytest.raises(ValueError, match="chunk_size"):
        call(initial_state=st, chunk_size=4)   # open chunk longer than the chunk
    with pytest.raises(ValueError, match="prenorm"):
        call(initial_state=st, chunk_size=8, prenorm=True)


@pytest.mark.slow   # torch.compile of the whole schedule
def test_torch_backend_compiles_in_one_graph():
    """torch.compile(fullgraph=True) traces the batched form with no graph break (no per-token
    Python, no host sync); the compiled output equals eager exactly (aot_eager: the same kernels) and
    the gradients to float32 rounding (the traced backward may sum contributions in another order)."""
    d = {n: t.requires_grad_(True) for n, t in _rand(T=21, dtype=torch.float32).items()}

    def fn(q, k, v, lr0, lr1, lr2, w0, w1, w2, momentum):
        return block_causal_lact_swiglu(q, k, v, lr0, lr1, lr2, w0, w1, w2, chunk_size=8, momentum=momentum,
                                        use_muon=True, output_final_state=True)
    args = [d[n] for n in ARGS]
    o, st = fn(*args)
    ge = torch.autograd.grad(o.sum() + st["w0"].sum(), args)
    torch._dynamo.reset()
    oc, stc = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    gc = torch.autograd.grad(oc.sum() + stc["w0"].sum(), args)
    assert torch.equal(o, oc) and torch.equal(st["w0"], stc["w0"])
    for a, b in zip(ge, gc):
        assert rel(b, a) <= 1e-5
