"""TTT Triton launches stay within the kernels' int32 element offsets: a batch whose kernel buffers
would reach 2^31 elements runs in groups of batch rows (``kernels.ttt._in_row_groups``), with the
same output, final state and gradients as one launch; a single batch row beyond the limit is
refused with a message. The limit is lowered here so that tiny shapes cross it (Triton interpreter,
float64)."""
import pytest
import torch

import kernels.ttt as ttt
from kernels.ttt import chunk as lchunk
from kernels.ttt import mlp_chunk

# slow: Triton kernels swept under the interpreter on CPU (make test-fast leaves them out)
pytestmark = pytest.mark.slow

B, H, T, d, b = 3, 2, 13, 16, 8     # from pos 3: a head of 5 tokens, then a full mini-batch


def _inputs(kind, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return scale * torch.randn(*s, generator=g, dtype=torch.float64)

    xs = [r(B, H, T, d), r(B, H, T, d), r(B, H, T, d), 0.5 * torch.rand(B, H, T, generator=g, dtype=torch.float64),
          1.0 / torch.arange(1, b + 1, dtype=torch.float64) + 0.1 * r(b), 1 + 0.1 * r(H, d), r(H, d, scale=0.1)]
    m = 2 * d
    shapes = [(d, d), (1, d)] if kind == "linear" else [(d, m), (1, m), (m, d), (1, d)]
    weights = [r(H, *s, scale=0.3) for s in shapes]
    # a state begun mid-mini-batch (pos 3), per batch row, so the head launch is grouped too
    names = ("W1", "b1") if kind == "linear" else ("W1", "b1", "W2", "b2")
    state = {k: r(B, H, *s, scale=0.3) for k, s in zip(names, shapes)}
    state.update({"grad_" + k: r(B, H, *s, scale=0.1) for k, s in zip(names, shapes)})
    state["pos"] = 3
    return xs + weights, state


def _run(kind, args, state):
    args = [a.detach().clone().requires_grad_() for a in args]
    st = {k: (v.detach().clone().requires_grad_() if torch.is_tensor(v) else v) for k, v in state.items()}
    fn = ttt.ttt_linear if kind == "linear" else ttt.ttt_mlp
    out, fin = fn(*args, mini_batch_size=b, initial_state=st, output_final_state=True, backend="triton")
    g = torch.Generator().manual_seed(9)
    tensors = [out] + [fin[k] for k in sorted(k for k in fin if k != "pos")]
    sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in tensors).backward()
    grads = [a.grad for a in args] + [st[k].grad for k in sorted(k for k in st if k != "pos")]
    return out.detach(), {k: (v.detach() if torch.is_tensor(v) else v) for k, v in fin.items()}, grads


def _per_row(kind):
    inner = d if kind == "linear" else 2 * d
    nmb = -(-T // b) + 1
    return H * max(T * d, nmb * d * inner, nmb * 16 * max(inner, 2 * d, 128))   # b = 8 runs in 16 rows


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_large_batches_run_in_row_groups_with_the_one_launch_result(monkeypatch, kind):
    args, state = _inputs(kind)
    want = _run(kind, args, state)
    mod, name = (lchunk, "ttt_linear_triton") if kind == "linear" else (mlp_chunk, "ttt_mlp_triton")
    calls = []
    inner_fn = getattr(mod, name)

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return inner_fn(*a, **k)

    monkeypatch.setattr(mod, name, counted)
    monkeypatch.setattr(ttt, "_INT32_ELEMS", 2 * _per_row(kind) + 1)   # two batch rows per launch
    got = _run(kind, args, state)
    assert calls == [2, 1]
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    assert got[1]["pos"] == want[1]["pos"] == (3 + T) % b
    for k in want[1]:
        if k != "pos":
            torch.testing.assert_close(got[1][k], want[1][k], rtol=0, atol=1e-12, msg=f"final {k}")
    for i, (a, w) in enumerate(zip(got[2], want[2])):
        torch.testing.assert_close(a, w, rtol=0, atol=1e-12, msg=f"grad {i}")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_batch_row_beyond_int32_offsets_is_refused(monkeypatch, kind):
    args, state = _inputs(kind)
    monkeypatch.setattr(ttt, "_INT32_ELEMS", _per_row(kind))
    fn = ttt.ttt_linear if kind == "linear" else ttt.ttt_mlp
    with pytest.raises(ValueError, match=r"int32 offsets \(2\^31\)"):
        fn(*args, mini_batch_size=b, initial_state=state, output_final_state=True, backend="triton")


def test_preset_shapes_fit_one_launch_and_long_batches_are_grouped():
    """The rows-per-launch arithmetic at real shapes (no launch): the 125M presets' micro-batch
    (B = 8, H = 12, T = 2048, d = 64, b = 16) is one launch; at T = 32k with B = 8 TTT-MLP's stored
    per-mini-batch weights (8·12·2049·64·256 ≈ 3.2·10^9 elements) need groups."""
    x = torch.empty(8, 12, 2048, 64, device="meta")
    assert ttt._triton_rows_per_launch("ttt_linear", x, 16, 64) >= 8
    assert ttt._triton_rows_per_launch("ttt_mlp", x, 16, 256) >= 8
    x = torch.empty(8, 12, 32768, 64, device="meta")
    assert ttt._triton_rows_per_launch("ttt_mlp", x, 16, 256) < 8
