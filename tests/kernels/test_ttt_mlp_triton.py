"""The Triton TTT-MLP kernels (kernels/ttt/mlp_chunk.py) against the specification
(kernels/ttt/reference.py): output, final state and the gradient of every input, including
``initial_state``. On CPU it runs under the Triton interpreter (tests/conftest.py), where tl.dot
needs blocks ≥ 16; the hidden width is streamed in tiles of 16 there, so m = 32 (4d at d = 8, 2d at
d = 16; the mixer test's hidden width likewise) runs 2 tiles and m = 24 a padded second tile: b = 16
and d ∈ {8, 16}, H = 2, T ≤ 40. The interpreter's cost grows with the tiles, the mini-batches and
the programs, one per (batch row, head) after another, so B = 2 only where the batch axis is swept
(the float64 shapes at d = b = 16, per-sequence weights) and B = 1 elsewhere."""
import pytest
import torch

from kernels.ttt import ttt_mlp
from kernels.ttt.mlp_chunk import ttt_mlp_triton
from tests.kernels.ttt_checks import run_chained

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

B, H = 2, 2
WEIGHTS = ["W1", "b1", "W2", "b2"]


def _inputs(T, d, b, m=None, dtype=torch.float64, seed=0, device="cpu", batch=B):
    """m = 32 unless given (two hidden tiles under the interpreter), 4d on CUDA."""
    if m is None:
        m = 4 * d if str(device).startswith("cuda") else 32
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        x = scale * torch.randn(*s, generator=g, dtype=torch.float64)
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k, v = r(batch, H, T, d), r(batch, H, T, d), r(batch, H, T, d)
    eta = (0.5 * torch.rand(batch, H, T, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype).requires_grad_()
    tau = (1.0 / torch.arange(1, b + 1, dtype=torch.float64) + 0.1 * torch.randn(b, generator=g, dtype=torch.float64)
           ).to(device=device, dtype=dtype).requires_grad_()
    lw = (1 + 0.1 * torch.randn(H, d, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype).requires_grad_()
    lb = r(H, d, scale=0.1)
    # scales that keep GELU's pre-activations O(1), so its curvature (GELU'') matters
    W1, b1 = r(H, d, m, scale=0.5), r(H, 1, m, scale=0.2)
    W2, b2 = r(H, m, d, scale=0.3), r(H, 1, d, scale=0.1)
    return [q, k, v, eta, tau, lw, lb, W1, b1, W2, b2]


def _prefix_state(args, b, n):
    """The state after n fresh tokens (pos = n, inside a mini-batch), as leaves that require grad."""
    d, m = args[0].shape[-1], args[7].shape[-1]
    pre = _inputs(n, d, b, m, dtype=args[0].dtype, seed=1, device=args[0].device, batch=args[0].shape[0])[:4]
    fixed = [a.detach() for a in args[4:]]
    with torch.no_grad():
        _, st = ttt_mlp(*[a.detach() for a in pre], *fixed, mini_batch_size=b, output_final_state=True,
                        backend="torch")
    return {k: (v.clone().requires_grad_() if torch.is_tensor(v) else v) for k, v in st.items()}


def _state_names(initial_state):
    return [] if initial_state is None else ["state." + k for k, v in initial_state.items() if torch.is_tensor(v)]


def _run(backend, args, b, w_out, initial_state=None):
    """Output, final state and the gradients of every input of loss = Σ out ⊙ w + Σ‖state‖²."""
    leaves = list(args) + ([] if initial_state is None else [v for v in initial_state.values() if torch.is_tensor(v)])
    for t in leaves:
        t.grad = None
    out, st = ttt_mlp(*args, mini_batch_size=b, initial_state=initial_state, output_final_state=True,
                      backend=backend)
    loss = (out.float() * w_out).sum() + sum((v.float() ** 2).sum() for v in st.values() if torch.is_tensor(v))
    loss.backward()
    grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return out.detach(), {k: (v.detach() if torch.is_tensor(v) else v) for k, v in st.items()}, grads


NAMES = ["XQ", "XK", "XV", "eta", "token_idx", "ln_weight", "ln_bias", "W1", "b1", "W2", "b2"]


def _compare(got, ref, T, b, atol, rtol, pos0=0, state_names=()):
    """Tolerances are relative to each tensor's largest entry (grads of τ sum over B·H·T terms and
    are ~100× larger than those of XQ)."""
    def close(a, c, what):
        scale = c.abs().max().item() + 1e-30
        torch.testing.assert_close(a.double(), c.double(), atol=atol * scale, rtol=rtol,
                                   msg=lambda s: f"{what}: {s}")

    close(got[0], ref[0], "out")
    assert got[1]["pos"] == ref[1]["pos"] == (pos0 + T) % b
    assert set(got[1]) == set(ref[1]) == {"pos", *WEIGHTS, *("grad_" + k for k in WEIGHTS)}
    for k in ref[1]:
        if k != "pos":
            close(got[1][k], ref[1][k], "state " + k)
    names = NAMES + list(state_names)
    assert len(got[2]) == len(ref[2]) == len(names)
    # with an initial_state the weight arguments are replaced by it and get no gradient
    unused = set(WEIGHTS) if state_names else set()
    for name, g1, g0 in zip(names, got[2], ref[2]):
        if name in unused:
            assert g0.abs().max() == 0 and g1.abs().max() == 0, f"grad {name} of a replaced weight"
            continue
        assert g0.abs().max() > 0, f"grad {name} is zero in the reference: the test would not see it"
        close(g1, g0, "grad " + name)


# (T, d, b, m, prefix), B = 2 at d = b = 16 (1 for the padded shapes): T = 32 (kernel only, two
# full mini-batches, ending on a boundary), 29 after a 5-token prefix (a head of 11 tokens, then 18:
# a full mini-batch and a partial one of 2: the head, full and partial launches with the batch
# axis); d = 8 pads the d-tiles to 16, m = 24 pads the hidden tiles to 32, b ∈ {4, 8} pads the rows
# to 16 (b = 4: 7 tokens, a full mini-batch and a partial one of 3). From a fresh state, a full
# mini-batch and a partial one at d = b = 16: test_partial_last_mini_batch_runs_in_kernels (and
# the float32 and bfloat16 tests); a head only: test_head_runs_in_the_kernels (B = 1)
SHAPES = [(32, 16, 16, None, 0), (29, 16, 16, None, 5),
          (20, 8, 16, 24, 0), (7, 8, 4, None, 0), (19, 8, 8, None, 3)]


@pytest.mark.parametrize("T,d,b,m,prefix", SHAPES)
def test_float64_matches_reference(T, d, b, m, prefix, monkeypatch):
    """float64 throughout (the kernel computes in float64 for float64 inputs): only rounding
    differs from the autograd spec, so 1e-10 relative to each tensor's scale. All in the kernels
    (the PyTorch dual form raises)."""
    batch = B if (d, b) == (16, 16) else 1
    args = _inputs(T, d, b, m, batch=batch)
    st = _prefix_state(args, b, prefix) if prefix else None
    w = torch.randn(batch, H, T, d, dtype=torch.float64)
    ref = _run("reference", args, b, w, st)
    _no_torch_form(monkeypatch)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-10, rtol=1e-10, pos0=prefix, state_names=_state_names(st))


@pytest.mark.parametrize("T,prefix", [(21, 0), (29, 5)])
def test_float32_matches_reference(T, prefix):
    """float32 inputs, float32 kernel vs float32 spec: different summation orders over d, m and
    b, LayerNorm's 1/σ amplification and two chained layers give ~1e-6 relative differences;
    2e-4 leaves headroom while a wrong term (O(1) relative) still fails. B = 1; T = 21: a full
    mini-batch and a partial one of 5; 29 after a 5-token prefix: a head of 11, 16, then 2."""
    b, d = 16, 16
    args = _inputs(T, d, b, dtype=torch.float32, batch=1)
    st = _prefix_state(args, b, prefix) if prefix else None
    w = torch.randn(1, H, T, d)
    ref = _run("reference", args, b, w, st)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=2e-4, rtol=2e-4, pos0=prefix, state_names=_state_names(st))


def test_bfloat16_matches_reference():
    """bfloat16 inputs, float32 inside both: the output and the input gradients are rounded to
    bfloat16 (8 mantissa bits, 2^-8 ≈ 4e-3 relative), and the backward consumes a bfloat16 output
    gradient rounded differently on each side; 3e-2 of each tensor's scale covers that. B = 1,
    T = 21: a full mini-batch and a partial one of 5."""
    b, d, T = 16, 16, 21
    args = _inputs(T, d, b, dtype=torch.bfloat16, batch=1)
    w = torch.randn(1, H, T, d)
    ref = _run("reference", args, b, w)
    got = _run("triton", args, b, w)
    assert got[0].dtype == torch.bfloat16 and all(got[1][k].dtype == torch.float32 for k in WEIGHTS)
    _compare(got, ref, T, b, atol=3e-2, rtol=3e-2)


def _no_torch_form(monkeypatch):
    """Make the PyTorch dual form unusable: mlp_chunk.py does not import it, and it raises where
    it is defined and exported. A test that passes after this ran everything in the kernels."""
    import kernels.ttt
    from kernels.ttt import mlp_chunk, torch_chunk

    def refuse(*a, **k):
        raise AssertionError("the PyTorch dual form ran")
    assert not hasattr(mlp_chunk, "ttt_mlp_chunk")
    monkeypatch.setattr(torch_chunk, "ttt_mlp_chunk", refuse)
    monkeypatch.setattr(kernels.ttt, "ttt_mlp_chunk", refuse)


@pytest.mark.parametrize("T", [40, 7])
def test_partial_last_mini_batch_runs_in_kernels(T, monkeypatch):
    """T = 40 = 2 full mini-batches of 16 and 8 rows, T = 7 < b (B = 1): the trailing partial mini-batch
    runs in the kernels (rows ≥ 8 resp. 7 masked), with no PyTorch fallback. Its final state is
    its start weights, its gradient sums and pos = T mod b; output, state and the gradient of
    every input (the loss includes Σ‖state‖², so the state's W and grad_* both send gradients
    back) match the specification to 1e-10 (float64)."""
    b, d = 16, 16
    args = _inputs(T, d, b, batch=1)
    w = torch.randn(1, H, T, d, dtype=torch.float64)
    ref = _run("reference", args, b, w)
    _no_torch_form(monkeypatch)
    got = _run("triton", args, b, w)
    assert got[1]["pos"] == T % b
    _compare(got, ref, T, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T,grad_of", [(24, "grad_"), (24, "weights"), (7, "grad_")])
def test_partial_last_mini_batch_state_gradients(T, grad_of, monkeypatch):
    """The gradient from the final state alone, through either its gradient sums grad_* or its
    weights (the partial mini-batch's start weights), with no output gradient: the carry's two
    paths for a partial last mini-batch, each on its own (T = 24: after a full mini-batch; B = 1).
    float64: 1e-10 of each tensor's scale."""
    b, d = 16, 8
    args = _inputs(T, d, b, m=24, batch=1)
    keys = [("grad_" if grad_of == "grad_" else "") + k for k in WEIGHTS]

    def grads(backend):
        out, st = ttt_mlp(*args, mini_batch_size=b, output_final_state=True, backend=backend)
        g = torch.Generator().manual_seed(7)
        loss = sum((st[k] * torch.randn(st[k].shape, generator=g, dtype=st[k].dtype)).sum() for k in keys)
        return torch.autograd.grad(loss, args, allow_unused=True)

    ref = grads("reference")
    _no_torch_form(monkeypatch)
    got = grads("triton")
    for name, a, c in zip(NAMES, got, ref):
        if c is None or c.abs().max() == 0:
            assert a is None or a.abs().max() == 0, f"grad {name} should be zero"
            continue
        torch.testing.assert_close(a, c, atol=1e-10 * c.abs().max().item(), rtol=1e-10, msg=lambda s: f"grad {name}: {s}")


@pytest.mark.parametrize("T", [40, 7])
def test_partial_last_mini_batch_no_grad_windows(T, monkeypatch):
    """Without autograd the forward runs in windows of 2 mini-batches under the interpreter: at
    T = 40 (b = 16) the partial mini-batch is the last window's second; T = 7 is one partial
    window. Output and final state equal the PyTorch dual form's (B = 1). float64: 1e-12."""
    b, d = 16, 16
    args = [a.detach() for a in _inputs(T, d, b, batch=1)]
    o_t, s_t = ttt_mlp(*args, mini_batch_size=b, output_final_state=True, backend="torch")
    _no_torch_form(monkeypatch)
    with torch.no_grad():
        o_k, s_k = ttt_mlp(*args, mini_batch_size=b, output_final_state=True, backend="triton")
    torch.testing.assert_close(o_k, o_t, atol=1e-12, rtol=0)
    assert s_k["pos"] == s_t["pos"] == T % b
    for k in s_t:
        if k != "pos":
            torch.testing.assert_close(s_k[k], s_t[k], atol=1e-12, rtol=0, msg=lambda s: f"state {k}: {s}")


# (p, T) at b = 16: a head only (T < b − p, and p = b − 1 with T = 1), a head completing its
# mini-batch and one full one after it, a head + a full mini-batch + a partial tail, a head of 15
# rows + a partial tail (a head of 11 + a full + a partial one, with B = 2: the float64 shapes)
@pytest.mark.parametrize("p,T", [(1, 4), (5, 27), (15, 1), (15, 20), (1, 18)])
def test_head_runs_in_the_kernels(p, T, monkeypatch):
    """A call from a state begun mid-mini-batch (pos = p > 0, carried sums G ≠ 0): the head runs
    in the kernels (the PyTorch dual form raises here), and the output, the final state and every
    gradient, the eight tensors of ``initial_state`` included, equal the specification (B = 1;
    the head with B = 2: the float64 shapes with a prefix). float64: 1e-10 of each tensor's scale."""
    b, d = 16, 16
    args = _inputs(T, d, b, batch=1)
    st = _prefix_state(args, b, p)
    assert st["pos"] == p and st["grad_W1"].abs().max() > 0 and st["grad_W2"].abs().max() > 0
    w = torch.randn(1, H, T, d, dtype=torch.float64)
    ref = _run("reference", args, b, w, st)
    _no_torch_form(monkeypatch)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-10, rtol=1e-10, pos0=p, state_names=_state_names(st))


def test_decode_style_chaining_equals_one_call(monkeypatch):
    """A sequence cut at arbitrary points (inside mini-batches, on a boundary, one token long),
    each piece continued from the previous piece's final state in the kernels, gives the output,
    final state and input gradients of one call over the whole sequence (B = 1): of the
    specification's, which one call of the kernels equals (test_float64_matches_reference,
    test_partial_last_mini_batch_runs_in_kernels). float64: 1e-10."""
    # pieces: 3 fresh tokens, a head inside the mini-batch, a head completing it, one token from
    # the boundary, a head of 15 crossing into the last mini-batch and 4 rows of it
    b, d, T, cuts = 16, 16, 36, (3, 7, 16, 17)
    args = _inputs(T, d, b, batch=1)
    w = torch.randn(1, H, T, d, dtype=torch.float64)
    one = _run("reference", args, b, w)
    _no_torch_form(monkeypatch)
    chained = run_chained(ttt_mlp, args, b, w, cuts)
    _compare(chained, one, T, b, atol=1e-10, rtol=1e-10)


def test_no_grad_forward_and_weights_with_batch_axis():
    """Without autograd the forward (state pass and output kernel) matches the reference; per-sequence
    weights [B, H, …] are accepted and get per-sequence gradients. float64: 1e-12."""
    b, d, T = 16, 8, 32
    args = _inputs(T, d, b)
    g = torch.Generator().manual_seed(5)
    ws = [(a.detach() + 0.1 * torch.randn(B, *a.shape, generator=g, dtype=torch.float64)).requires_grad_()
          for a in args[7:]]
    full = args[:7] + ws
    with torch.no_grad():
        o_ng, s_ng = ttt_mlp(*full, mini_batch_size=b, output_final_state=True, backend="triton")
        o_t, s_t = ttt_mlp(*full, mini_batch_size=b, output_final_state=True, backend="torch")
    torch.testing.assert_close(o_ng, o_t, atol=1e-12, rtol=0)
    for k in WEIGHTS:
        torch.testing.assert_close(s_ng[k], s_t[k], atol=1e-12, rtol=0)
    out, _ = ttt_mlp(*full, mini_batch_size=b, backend="triton")
    gk = torch.autograd.grad(out.sum(), ws)
    out_t, _ = ttt_mlp(*full, mini_batch_size=b, backend="torch")
    gt = torch.autograd.grad(out_t.sum(), ws)
    for a, x, y in zip(ws, gk, gt):
        assert x.shape == a.shape and a.shape[0] == B
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


def test_forward_column_blocks():
    """The forward kernels sum their [b, d] products over column blocks (16 wide under the
    interpreter): d = 24 runs two, the second padded, with b = 8 (padded rows) and m = 32 (two
    hidden tiles). Without autograd the forward runs in windows of 2 mini-batches there: T = 24
    is 3 mini-batches, two windows, the last one short. Output and final state equal the PyTorch
    dual form (B = 1). float64: 1e-12."""
    b, d, T = 8, 24, 24
    args = [a.detach() for a in _inputs(T, d, b, m=32, batch=1)]
    with torch.no_grad():
        o_k, s_k = ttt_mlp(*args, mini_batch_size=b, output_final_state=True, backend="triton")
        o_t, s_t = ttt_mlp(*args, mini_batch_size=b, output_final_state=True, backend="torch")
    torch.testing.assert_close(o_k, o_t, atol=1e-12, rtol=0)
    for k in WEIGHTS:
        torch.testing.assert_close(s_k[k], s_t[k], atol=1e-12, rtol=0)


def test_weights_and_state_left_untouched():
    """The kernels update the inner weights and accumulate their gradients in place, in buffers of
    their own: the weight arguments, an initial_state at a mini-batch boundary (handed to the kernel
    as is) and the incoming gradients of the final state are unchanged after forward and backward.
    m = 24: two hidden tiles under the interpreter, the second padded; B = 1."""
    b, d, T = 16, 8, 32
    args = _inputs(T, d, b, m=24, batch=1)
    st = {k: v.detach().clone().requires_grad_() for k, v in _prefix_state(args, b, b).items() if torch.is_tensor(v)}
    st["pos"] = 0
    before = [a.detach().clone() for a in args] + [v.detach().clone() for k, v in st.items() if k != "pos"]
    out, fin = ttt_mlp(*args, mini_batch_size=b, initial_state=st, output_final_state=True, backend="triton")
    gW = [torch.randn_like(fin[k]) for k in WEIGHTS]
    gW_before = [g.clone() for g in gW]
    torch.autograd.backward([out.sum()] + [fin[k] for k in WEIGHTS], [None] + gW)
    after = [a.detach() for a in args] + [v.detach() for k, v in st.items() if k != "pos"]
    for x, y in zip(before + gW_before, after + gW):
        assert torch.equal(x, y)
    assert all(st[k].grad.abs().max() > 0 for k in WEIGHTS)


def test_launch_config_per_gpu_family(monkeypatch):
    """The TTT-MLP launch configs that the wrapper takes on a GPU are the ones the compile gate
    compiles (kernels/ttt/compile_cases.py): the per-mini-batch backward's column block per GPU family (16
    only for 3×TF32 on sm_80) and its head variant's column block and warps, the other kernels'
    the same on both; packed batches ("varlen")
    have packed variants of the two serial kernels only (state pass and carry, column blocks of
    16), the output and per-mini-batch backward kernels run as they are."""
    from kernels.ttt import chunk, compile_cases as gate, mlp_chunk

    monkeypatch.setattr(mlp_chunk, "is_interpreting", lambda: False)
    monkeypatch.setattr(chunk, "is_interpreting", lambda: False)     # compile_cases.py lists TTT-Linear too
    assert mlp_chunk._mlp_col_block(128, "tf32x3", "bwd_mb", arch=80) == 16
    assert mlp_chunk._mlp_col_block(128, "tf32x3", "bwd_mb", arch=90) == 32
    assert mlp_chunk._mlp_col_block(128, "bf16", "bwd_mb", arch=80) == 32
    assert mlp_chunk._mlp_col_block(16, "tf32x3") == 16
    assert mlp_chunk._mlp_col_block(128, "bf16", packed=True) == 16
    assert mlp_chunk._mlp_col_block(128, "tf32x3", "bwd", arch=80, packed=True) == 16
    kw8 = {"num_warps": 8, "num_stages": 1}
    assert mlp_chunk._mlp_carry_opts(kw8, 128, "bf16", packed=True) == {"num_warps": 8, "num_stages": 2}
    assert mlp_chunk._mlp_carry_opts(kw8, 128, "bf16") == kw8
    assert mlp_chunk._mlp_carry_opts(kw8, 64, "bf16", packed=True) == {"num_warps": 8, "num_stages": 2}
    assert mlp_chunk._mlp_carry_opts(kw8, 128, "tf32x3", packed=True) == kw8
    assert mlp_chunk._mlp_head_bwd_cfg(128, "bf16", arch=90) == (16, {"num_warps": 4, "num_stages": 1})
    assert mlp_chunk._mlp_head_bwd_cfg(128, "bf16", arch=80) == (32, {"num_warps": 8, "num_stages": 1})
    assert mlp_chunk._mlp_head_bwd_cfg(64, "tf32x3", arch=90) == (32, {"num_warps": 8, "num_stages": 1})
    cases = [c for c in gate.compile_cases() if c.kernel.startswith("_ttt_mlp_")]
    assert {c.kernel for c in cases} == {"_ttt_mlp_fwd_kernel", "_ttt_mlp_out_kernel", "_ttt_mlp_bwd_mb_kernel",
                                         "_ttt_mlp_bwd_kernel"}
    assert {c.kernel for c in cases if c.constexprs.get("VARLEN")} == {"_ttt_mlp_fwd_kernel", "_ttt_mlp_bwd_kernel"}
    for c in cases:
        prec, BD = c.constexprs["PREC"], c.constexprs["BD"]
        BD_, BM, BT, kw = mlp_chunk._mlp_launch_cfg(c.constexprs["D"], c.constexprs["M"], c.constexprs["MB"],
                                                     packed=c.constexprs.get("VARLEN", False))
        if c.kernel == "_ttt_mlp_bwd_mb_kernel":
            (arch,) = c.archs
            assert c.config.endswith(f"sm_{arch}")
            head = c.constexprs["HEAD"]
            assert head == (" head " in c.config)
            if head:    # the head variant's own column block and warps
                BK, kw = mlp_chunk._mlp_head_bwd_cfg(BD, prec, arch)
                assert c.constexprs["BK"] == BK
            else:
                assert c.constexprs["BK"] == mlp_chunk._mlp_col_block(BD, prec, "bwd_mb", arch=arch)
        else:
            packed = c.constexprs.get("VARLEN", False)
            assert packed == c.config.endswith("varlen")
            assert not packed or c.kernel in ("_ttt_mlp_fwd_kernel", "_ttt_mlp_bwd_kernel")
            assert c.constexprs["BK"] == mlp_chunk._mlp_col_block(BD, prec, packed=packed)
        assert (BD, c.constexprs["BM"], c.constexprs["BT"]) == (BD_, BM, BT)
        if c.kernel == "_ttt_mlp_bwd_kernel":   # the carry's own options (packed bf16: num_stages 2)
            kw = mlp_chunk._mlp_carry_opts(kw, BD, prec, c.constexprs.get("VARLEN", False))
        assert (c.num_warps, c.num_stages) == (kw["num_warps"], kw["num_stages"])


def test_rejects_unsupported_mini_batch():
    args = _inputs(4, 8, 128)
    with pytest.raises(ValueError, match="mini_batch_size"):
        ttt_mlp_triton(*args, mini_batch_size=128)


@pytest.mark.parametrize("ttt", [{"mini_batch_size": 16},
                                 {"mini_batch_size": 4, "share_qk": True, "use_gate": True}])
def test_mixer_triton_equals_torch(ttt):
    """TTTMLP (head dim 16, hidden 32: ``mlp_expansion`` 2, two hidden tiles under the
    interpreter) with kernel_backend="triton" == "torch": output, every parameter gradient and a
    continued segment (state stopping inside a mini-batch). float64 (the model's exactness
    dtype), so 1e-10."""
    from tests.model.mixer_checks import make_mixer
    m, _ = make_mixer("ttt_mlp", d_model=32, n_heads=2, ttt=dict(ttt, mlp_expansion=2))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the symmetric init points so that every gradient path is used
        for n in ("learnable_token_idx", "ttt_norm_weight", "ttt_norm_bias", "b1", "b2", "learnable_ttt_lr_bias"):
            p = getattr(m, n)
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        m.W1.mul_(10.0)
        m.W2.mul_(10.0)
    # b = 16: 21 tokens (a full mini-batch, then 5), then 19 from pos 5 (a head of 11, then 8); b = 4:
    # 9 tokens (two full mini-batches, then 1), then 7 from pos 1 (a head of 3, a full one)
    T1, T2 = (21, 19) if ttt["mini_batch_size"] == 16 else (9, 7)
    # one sequence: the mixer feeds both backends the same [B, H, T, d] inputs (the kernels' batch
    # axis: the float64 shapes)
    x1 = torch.randn(1, T1, 32, generator=g, dtype=torch.float64)
    x2 = torch.randn(1, T2, 32, generator=g, dtype=torch.float64)

    def go(backend):
        m.kernel_backend = backend
        m.zero_grad()
        y1, st = m.chunked(x1, None, output_state=True)
        y2, _ = m.chunked(x2, st, output_state=False)  # starts inside a mini-batch
        ((y1 * y1).sum() + (y2 ** 3).sum()).backward()
        return torch.cat([y1, y2], 1).detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    y_t, g_t = go("torch")
    y_k, g_k = go("triton")
    torch.testing.assert_close(y_k, y_t, atol=1e-10, rtol=0)
    for n in g_t:
        torch.testing.assert_close(g_k[n], g_t[n], atol=1e-10, rtol=1e-10, msg=lambda s: f"grad {n}: {s}")


# ---- GPU: the sizes the model uses ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("d", [64, 48])
@pytest.mark.parametrize("prefix", [0, 7])
def test_gpu_float32_matches_float64_dual_form(b, d, prefix):
    """float32 kernel on CUDA vs the PyTorch dual form in float64 (itself equal to the spec, see
    test_ttt_ops.py) at T = 5b + 3, hidden width 4d: float32 rounding through 5 sequential
    mini-batches of a two-layer inner model; 1e-3 of each tensor's scale."""
    T = 5 * b + 3
    args = _inputs(T, d, b, dtype=torch.float32, device="cuda")
    args64 = [a.detach().double().requires_grad_() for a in args]
    st = _prefix_state(args, b, prefix) if prefix else None
    st64 = None if st is None else {k: (v.detach().double().requires_grad_() if torch.is_tensor(v) else v)
                                    for k, v in st.items()}
    w = torch.randn(B, H, T, d, device="cuda")
    ref = _run("torch", args64, b, w.double(), st64)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-3, rtol=1e-3, pos0=prefix, state_names=_state_names(st))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [16, 64])
def test_gpu_bfloat16_matches_float64_dual_form(b):
    """bfloat16 inputs on CUDA (float32 inside) vs the float64 dual form on the same rounded
    inputs: outputs and gradients rounded to bfloat16; 3e-2 of each tensor's scale."""
    d, T = 64, 4 * b + 5
    args = _inputs(T, d, b, dtype=torch.bfloat16, device="cuda")
    args64 = [a.detach().double().requires_grad_() for a in args]
    w = torch.randn(B, H, T, d, device="cuda")
    ref = _run("torch", args64, b, w.double())
    got = _run("triton", args, b, w)
    _compare(got, ref, T, b, atol=3e-2, rtol=3e-2)
