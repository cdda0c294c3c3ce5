"""The Triton TTT-Linear kernel (kernels/ttt/chunk.py) against the specification
(kernels/ttt/reference.py): output, final state and the gradient of every input, including
``initial_state``. On CPU it runs under the Triton interpreter (tests/conftest.py), where tl.dot
needs blocks ≥ 16: b = 16 and d ∈ {8 (padded), 16}, H = 2. The interpreter runs one program per
(batch row, head) after another, so B = 2 only where the batch axis is swept (the float64 shapes
at d = b = 16, per-sequence weights) and B = 1 elsewhere."""
import pytest
import torch

from kernels.ttt import ttt_linear
from kernels.ttt.chunk import ttt_linear_triton
from tests.kernels.ttt_checks import run_chained

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

B, H = 2, 2


def _inputs(T, d, b, dtype=torch.float64, seed=0, device="cpu", batch=B):
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
    W1, b1 = r(H, d, d, scale=0.3), r(H, 1, d, scale=0.1)
    return [q, k, v, eta, tau, lw, lb, W1, b1]


def _prefix_state(args, b, n):
    """The state after n fresh tokens (pos = n, inside a mini-batch), as leaves that require grad."""
    pre = _inputs(n, args[0].shape[-1], b, dtype=args[0].dtype, seed=1, device=args[0].device,
                  batch=args[0].shape[0])[:4]
    fixed = [a.detach() for a in args[4:]]
    with torch.no_grad():
        _, st = ttt_linear(*[a.detach() for a in pre], *fixed, mini_batch_size=b, output_final_state=True,
                           backend="torch")
    return {k: (v.clone().requires_grad_() if torch.is_tensor(v) else v) for k, v in st.items()}


def _run(backend, args, b, w_out, initial_state=None):
    """Output, final state and the gradients of every input of loss = Σ out ⊙ w + Σ‖state‖²."""
    leaves = list(args) + ([] if initial_state is None else [v for v in initial_state.values() if torch.is_tensor(v)])
    for t in leaves:
        t.grad = None
    out, st = ttt_linear(*args, mini_batch_size=b, initial_state=initial_state, output_final_state=True,
                         backend=backend)
    loss = (out.float() * w_out).sum() + sum((v.float() ** 2).sum() for v in st.values() if torch.is_tensor(v))
    loss.backward()
    grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return out.detach(), {k: (v.detach() if torch.is_tensor(v) else v) for k, v in st.items()}, grads


NAMES = ["XQ", "XK", "XV", "eta", "token_idx", "ln_weight", "ln_bias", "W1", "b1",
         "state.W1", "state.b1", "state.grad_W1", "state.grad_b1"]


def _compare(got, ref, T, b, atol, rtol, pos0=0):
    """Tolerances are relative to each tensor's largest entry (grads of τ sum over B·H·T terms and
    are ~100× larger than those of XQ)."""
    def close(a, c, what):
        scale = c.abs().max().item() + 1e-30
        torch.testing.assert_close(a.double(), c.double(), atol=atol * scale, rtol=rtol,
                                   msg=lambda s: f"{what}: {s}")

    close(got[0], ref[0], "out")
    assert got[1]["pos"] == ref[1]["pos"] == (pos0 + T) % b
    for k in ref[1]:
        if k != "pos":
            close(got[1][k], ref[1][k], "state " + k)
    assert len(got[2]) == len(ref[2])
    for name, g1, g0 in zip(NAMES, got[2], ref[2]):
        close(g1, g0, "grad " + name)


# (T, d, b, prefix), B = 2 at d = b = 16 (1 for the padded and multi-tile shapes): T = 32 (kernel
# only), 21 (kernel + partial tail), 29 after a 5-token prefix (head of 11 tokens, kernel over 16,
# tail of 2), 9 after a prefix (no full mini-batch);
# d = 8 and b ∈ {4, 8} exercise the padding of the tiles to 16; the kernels keep W1 and dW1 in two
# global slots, alternating per mini-batch: 1, 2 and 3 (13 tokens at b = 4) kernel mini-batches;
# d = 32 and 24 (padded) walk two 16-column tiles of the weights (``_launch_cfg``'s BC under the
# interpreter; d = 24 with b = 8: two full mini-batches and 3 rows); b = 32, 24 (padded to 32) and
# 64 walk a mini-batch in row blocks of 16 (``_LINEAR_RB``), the second block of b = 24 half
# padding (b = 32, 24: a full mini-batch and a partial one of 6 resp. 2 rows)
SHAPES = [(32, 16, 16, 0), (21, 16, 16, 0), (29, 16, 16, 5), (9, 16, 16, 5), (20, 8, 16, 0),
          (11, 8, 4, 0), (19, 16, 8, 3), (13, 8, 4, 0), (32, 32, 16, 0), (19, 24, 8, 0),
          (38, 16, 32, 0), (26, 8, 24, 0), (64, 32, 64, 0)]


@pytest.mark.parametrize("T,d,b,prefix", SHAPES)
def test_float64_matches_reference(T, d, b, prefix):
    """float64 throughout (the kernel computes in float64 for float64 inputs): only rounding
    differs from the autograd spec, so 1e-10 relative to each tensor's scale."""
    batch = B if (d, b) == (16, 16) else 1
    args = _inputs(T, d, b, batch=batch)
    st = _prefix_state(args, b, prefix) if prefix else None
    w = torch.randn(batch, H, T, d, dtype=torch.float64)
    ref = _run("reference", args, b, w, st)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-10, rtol=1e-10, pos0=prefix)


@pytest.mark.parametrize("T,d,b", [(21, 16, 16), (9, 16, 16), (26, 8, 24), (38, 16, 32)])
def test_partial_last_mini_batch_runs_in_the_kernel(T, d, b, monkeypatch):
    """From a mini-batch boundary everything runs in the kernels (B = 1), a trailing partial
    mini-batch included (T = 21: 1 full + 5 rows; T = 9 < b: only a partial one; b = 24: 1 full + 2
    rows; b = 32: 1 full + 6 rows): the PyTorch dual form is not called (it raises here), and the
    output, the mid-mini-batch final state (start weights, Σ η ∇ℓ, pos) and every gradient, those
    through the final state's sums included, equal the specification. float64: 1e-10."""
    from kernels.ttt import torch_chunk

    def no_torch(*a, **k):
        raise AssertionError("the PyTorch dual form ran")

    args = _inputs(T, d, b, batch=1)
    w = torch.randn(1, H, T, d, dtype=torch.float64)
    ref = _run("reference", args, b, w)
    monkeypatch.setattr(torch_chunk, "scan_mini_batches", no_torch)
    got = _run("triton", args, b, w)
    assert got[1]["pos"] == T % b != 0
    assert got[1]["grad_W1"].abs().max() > 0
    _compare(got, ref, T, b, atol=1e-10, rtol=1e-10)


def _no_torch_form(monkeypatch):
    """Make every PyTorch form of ``torch_chunk`` (dual and primal, ``scan_mini_batches`` under
    both) raise from here on."""
    from kernels.ttt import torch_chunk

    def no_torch(*a, **k):
        raise AssertionError("the PyTorch form ran")

    monkeypatch.setattr(torch_chunk, "scan_mini_batches", no_torch)


# (b, d, p, T): the head is h = b − p tokens; T < h (head only, ending mid-mini-batch: p + T < b;
# at p = b − 1 the one head token completes it), T = h + b (head + a full mini-batch), T = h + b + 3
# (head + full + a partial tail); b = 24 is padded to 32 rows (two row blocks, the second half
# padding), d = 8 to 16 columns
HEAD_SHAPES = [(b, d, p, T) for b, d in ((16, 16), (24, 8)) for p in (1, 5, b - 1)
               for T in (max(1, b - p - 2), 2 * b - p, 2 * b - p + 3)]


@pytest.mark.parametrize("b,d,p,T", HEAD_SHAPES)
def test_head_runs_in_the_kernel(b, d, p, T, monkeypatch):
    """A call from a state begun mid-mini-batch (pos = p > 0, carried sums G ≠ 0): the head runs
    in the kernels (the PyTorch forms raise here), and the output, the final state and every
    gradient, the four tensors of ``initial_state`` included, equal the specification (B = 1; the
    head with B = 2: the float64 shapes with a prefix). float64: 1e-10 of each tensor's scale."""
    args = _inputs(T, d, b, batch=1)
    st = _prefix_state(args, b, p)
    assert st["pos"] == p and st["grad_W1"].abs().max() > 0
    w = torch.randn(1, H, T, d, dtype=torch.float64)
    ref = _run("reference", args, b, w, st)
    _no_torch_form(monkeypatch)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-10, rtol=1e-10, pos0=p)


@pytest.mark.parametrize("b,d,T,cuts", [(16, 16, 50, (3, 7, 20, 21, 38)), (24, 8, 61, (1, 2, 25, 47, 48))])
def test_decode_style_chaining_equals_one_call(b, d, T, cuts, monkeypatch):
    """A sequence cut at arbitrary points (inside mini-batches, on a boundary, one token long),
    each piece continued from the previous piece's final state, gives the output, final state and
    input gradients of one call over the whole sequence, all in the kernels (B = 1). float64:
    1e-10."""
    _no_torch_form(monkeypatch)
    args = _inputs(T, d, b, batch=1)
    w = torch.randn(1, H, T, d, dtype=torch.float64)
    one = _run("triton", args, b, w)
    chained = run_chained(ttt_linear, args, b, w, cuts)
    _compare(chained, one, T, b, atol=1e-10, rtol=1e-10)


def test_head_compiles_like_eager():
    """torch.compile (fullgraph, aot_eager) of a call from a state at pos 3 (a head launch, a full
    mini-batch, a partial tail: the custom op twice, the head's Z̄ offset and end state in
    between): no graph break, and outputs and every gradient equal eager exactly (B = 1)."""
    b, d, T, p = 8, 16, 15, 3              # 5 head tokens, 8, then 2 (final pos 2)
    args = [a.detach() for a in _inputs(T, d, b, batch=1)]
    st = {k: v.detach() for k, v in _prefix_state(args, b, p).items() if torch.is_tensor(v)}
    keys = sorted(st)

    def fn(*xs):
        state = dict(zip(keys, xs[9:]), pos=p)
        out, fin = ttt_linear(*xs[:9], mini_batch_size=b, initial_state=state, output_final_state=True,
                              backend="triton")
        return (out,) + tuple(fin[k] for k in keys)

    results = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in args + [st[k] for k in keys]]
        outs = f(*leaves)
        grads = torch.autograd.grad(sum((o * o).sum() for o in outs), leaves, allow_unused=True)
        results.append((list(outs), list(grads)))
    for a, c in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        assert (a is None and c is None) or torch.equal(a, c)
    outs, grads = results[0]
    assert outs[0].shape == (1, H, T, d) and outs[1 + keys.index("grad_W1")].abs().max() > 0
    assert grads[9 + keys.index("grad_W1")].abs().max() > 0     # ∂ of the carried sums reached


@pytest.mark.parametrize("T,prefix", [(21, 0), (29, 5)])
def test_float32_matches_reference(T, prefix):
    """float32 inputs, float32 kernel vs float32 spec: different summation orders over d and b
    plus LayerNorm's 1/σ amplification give ~1e-6 relative differences; 1e-4 leaves headroom
    while a wrong term (O(1) relative) still fails. B = 1; T = 21: a full mini-batch and a partial
    one of 5; 29 after a 5-token prefix: a head of 11, 16, then 2."""
    b, d = 16, 16
    args = _inputs(T, d, b, dtype=torch.float32, batch=1)
    st = _prefix_state(args, b, prefix) if prefix else None
    w = torch.randn(1, H, T, d)
    ref = _run("reference", args, b, w, st)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-4, rtol=1e-4, pos0=prefix)


@pytest.mark.parametrize("prefix", [0, 5])
def test_bfloat16_matches_reference(prefix):
    """bfloat16 inputs, float32 inside both: the output and the input gradients are rounded to
    bfloat16 (8 mantissa bits, 2^-8 ≈ 4e-3 relative), and the backward consumes a bfloat16 output
    gradient rounded differently on each side; 3e-2 of each tensor's scale covers that. prefix = 5:
    from a float32 state at pos 5 (the head in the kernels, its carried sums in float32). B = 1,
    T = 29: a full mini-batch and 13 rows, from pos 5 a head of 11, a full one and 2 rows."""
    b, d, T = 16, 16, 29
    args = _inputs(T, d, b, dtype=torch.bfloat16, batch=1)
    st = _prefix_state(args, b, prefix) if prefix else None
    w = torch.randn(1, H, T, d)
    ref = _run("reference", args, b, w, st)
    got = _run("triton", args, b, w, st)
    assert got[0].dtype == torch.bfloat16 and got[1]["W1"].dtype == torch.float32
    _compare(got, ref, T, b, atol=3e-2, rtol=3e-2, pos0=prefix)


@pytest.mark.parametrize("T", [80, 85])
def test_no_grad_forward_and_weights_with_batch_axis(T):
    """Without autograd the forward equals the PyTorch dual form: it runs in windows of 2
    mini-batches under the interpreter (``_linear_window``), the state carried from window to
    window, so T = 80 (5 mini-batches) is three windows, the last one short, and the stored start
    weights hold 2 mini-batches, not 5 (T = 85: the last window ends in a partial mini-batch, whose
    sums the final state holds). Per-sequence W1, b1 [B, H, …] are accepted and get per-sequence
    gradients. float64: 1e-12."""
    from kernels.ttt import chunk
    b, d = 16, 16
    args = _inputs(T, d, b)
    W1 = (args[7].detach() + 0.1 * torch.randn(B, H, d, d, dtype=torch.float64)).requires_grad_()
    b1 = (args[8].detach() + 0.1 * torch.randn(B, H, 1, d, dtype=torch.float64)).requires_grad_()
    full = args[:7] + [W1, b1]
    stored = []
    real = chunk._linear_fwd_op

    def spy(*a):
        res = real(*a)
        stored.append(tuple(res[5].shape))     # WS, the stored start weights
        return res

    with torch.no_grad():
        chunk._linear_fwd_op = spy
        try:
            o_ng, s_ng = ttt_linear(*full, mini_batch_size=b, output_final_state=True, backend="triton")
        finally:
            chunk._linear_fwd_op = real
        o_t, s_t = ttt_linear(*full, mini_batch_size=b, output_final_state=True, backend="torch")
    assert stored == [(B, H, 2, d, d)]
    torch.testing.assert_close(o_ng, o_t, atol=1e-12, rtol=0)
    torch.testing.assert_close(s_ng["W1"], s_t["W1"], atol=1e-12, rtol=0)
    torch.testing.assert_close(s_ng["b1"], s_t["b1"], atol=1e-12, rtol=0)
    torch.testing.assert_close(s_ng["grad_W1"], s_t["grad_W1"], atol=1e-12, rtol=0)
    torch.testing.assert_close(s_ng["grad_b1"], s_t["grad_b1"], atol=1e-12, rtol=0)
    assert s_ng["pos"] == s_t["pos"] == T % b
    out, _ = ttt_linear(*full, mini_batch_size=b, backend="triton")
    gW, gb = torch.autograd.grad(out.sum(), [W1, b1])
    out_t, _ = ttt_linear(*full, mini_batch_size=b, backend="torch")
    gW_t, gb_t = torch.autograd.grad(out_t.sum(), [W1, b1])
    assert gW.shape == (B, H, d, d)
    torch.testing.assert_close(gW, gW_t, atol=1e-12, rtol=0)
    torch.testing.assert_close(gb, gb_t, atol=1e-12, rtol=0)


def test_launch_config_per_gpu_family(monkeypatch):
    """The TTT-Linear launch configs that the wrappers take on a GPU and the compile gate compiles
    (kernels/ttt/compile_cases.py): per GPU family and kernel, padded tiles, one stage; an unknown kernel
    name is refused."""
    from kernels.ttt import chunk

    monkeypatch.setattr(chunk, "is_interpreting", lambda: False)
    for arch in (80, 90):
        for kern in chunk._LINEAR_KERNELS:
            for half in (True, False):
                BD, BT, kw = chunk._launch_cfg(96, 16, kern, half=half, arch=arch)
                assert (BD, BT, kw["num_stages"]) == (128, 16, 1)
                assert kw["num_warps"] == chunk._LINEAR_WARPS.get((arch, kern, half, 128, 16), 8)
    assert chunk._launch_cfg(64, 16, "state", half=True, arch=80)[2]["num_warps"] == 4
    with pytest.raises(ValueError, match="unknown TTT-Linear kernel"):
        chunk._launch_cfg(64, 16, "bwd_state")


def test_rejects_unsupported_mini_batch():
    args = _inputs(4, 16, 128)
    with pytest.raises(ValueError, match="mini_batch_size"):
        ttt_linear_triton(*args, mini_batch_size=128)


@pytest.mark.parametrize("ttt", [{"mini_batch_size": 16},
                                 {"mini_batch_size": 4, "share_qk": True, "use_gate": True}])
def test_mixer_triton_equals_torch(ttt):
    """TTTLinear with kernel_backend="triton" == "torch": output, every parameter gradient and
    a continued segment (state stopping inside a mini-batch). float64 (the model's exactness
    dtype), so 1e-10."""
    from tests.model.mixer_checks import make_mixer
    m, _ = make_mixer("ttt_linear", d_model=32, n_heads=2, ttt=dict(ttt))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # move the symmetric init points so that every gradient path is used
        for n in ("learnable_token_idx", "ttt_norm_weight", "ttt_norm_bias", "b1", "learnable_ttt_lr_bias"):
            p = getattr(m, n)
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        m.W1.mul_(10.0)
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
@pytest.mark.parametrize("b", [16, 32, 64])
@pytest.mark.parametrize("d", [64, 48])
@pytest.mark.parametrize("prefix", [0, 7])
def test_gpu_float32_matches_float64_dual_form(b, d, prefix):
    """float32 kernel on CUDA vs the PyTorch dual form in float64 (itself equal to the spec, see
    test_ttt_ops.py) at T = 5b + 3: float32 rounding through 5 sequential mini-batches; 1e-3 of
    each tensor's scale."""
    T = 5 * b + 3
    args = _inputs(T, d, b, dtype=torch.float32, device="cuda")
    args64 = [a.detach().double().requires_grad_() for a in args]
    st = _prefix_state(args, b, prefix) if prefix else None
    st64 = None if st is None else {k: (v.detach().double().requires_grad_() if torch.is_tensor(v) else v)
                                    for k, v in st.items()}
    w = torch.randn(B, H, T, d, device="cuda")
    ref = _run("torch", args64, b, w.double(), st64)
    got = _run("triton", args, b, w, st)
    _compare(got, ref, T, b, atol=1e-3, rtol=1e-3, pos0=prefix)


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
