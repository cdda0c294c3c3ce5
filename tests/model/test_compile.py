"""model.compile: every block torch.compile-d in place, the Triton ops captured as custom-op nodes.

The losses of a few AdamW steps with and without compile are compared. Tolerance 1e-5 absolute on
losses of about 4: aot_eager runs the same aten ops as eager (its results differ only where a
graph break or a decomposition reorders a float32 reduction, ~1e-7 measured); a relative error of
2.5e-6 is well below any real divergence (a wrong gradient moves the third step's loss by 1e-3 or
more at lr 1e-2). aot_eager is the test backend because inductor's C++ codegen takes minutes for a
hybrid on a 2-core CPU; inductor is the default (``model.compile_backend``) and is exercised on the
attention block below. Each Triton op is compiled once per test: the graphs come from a recording
aot_eager backend (what torch._dynamo.explain would report, without a second trace and run).
"""
import contextlib

import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.delta_rule import delta_rule
from kernels.delta_rule.chunk import delta_rule_triton
from kernels.gated_delta_rule import gated_delta_rule
from kernels.gated_delta_rule.chunk import gated_delta_rule_triton
from kernels.linear_scan import linear_scan
from kernels.linear_scan.chunk import linear_scan_triton
from kernels.selective_scan import selective_scan
from kernels.selective_scan.chunk import selective_scan_triton
from kernels.titans import titans_linear
from kernels.titans.chunk import titans_linear_triton
from kernels.ttt import ttt_linear, ttt_mlp
from kernels.ttt.chunk import ttt_linear_triton
from kernels.ttt.mlp_chunk import ttt_mlp_triton
from tests.model.mixer_checks import preset_config, short_config
from ttt_lm.config import ConfigError, load_config
from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.registry import builtin_kinds, kinds_with, mixer_class

# slow: torch.compile of blocks and of the Triton ops run under the interpreter
pytestmark = pytest.mark.slow

TOL = 1e-5


#: the sections' tiny sizes (``short_config``): chunks, mini-batches and windows of 8 tokens
N = 8


def tiny(pattern, kernel_backend="auto", d_model: int = 32, n_heads: int = 2, preset=None) -> LM:
    """The LM of the layer kinds ``pattern`` (or of the preset ``preset``) at d_model ``d_model``,
    every section at its tiny sizes of ``N`` tokens."""
    torch.manual_seed(0)
    kw = dict(vocab_size=64, d_model=d_model, n_heads=n_heads, d_ff=2 * d_model, kernel_backend=kernel_backend)
    return LM(preset_config(preset, N, **kw) if preset is not None else short_config(pattern, N, **kw))


#: the global-attention kind (the inductor test's block)
GLOBAL = kinds_with(lambda c: c.global_attention, builtin_kinds())[0]


def losses(model: LM, steps: int = 3, T: int = 16, B: int = 2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (B, T + 1), generator=g)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("preset", ["tiny_hybrid", "tiny_griffin"])
def test_compiled_hybrid_trains_like_eager(preset):
    """The blocks of two hybrid presets (their PyTorch forms, the CPU path): global attention with
    TTT-Linear, and the RG-LRU with local attention."""
    eager = losses(tiny(None, preset=preset), T=32)
    model = tiny(None, preset=preset)
    names = [n for n, _ in model.named_parameters()]
    model.compile_blocks("aot_eager")
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints load either way
    compiled = losses(model, T=32)
    # graphs were captured, not skipped: at least one per kind of block
    assert counters["stats"]["unique_graphs"] >= len(set(model.cfg.layer_kinds())), counters["stats"]
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < TOL, (eager, compiled)


def _linear_scan_case(g):   # T = 12: a full tile of 8 and a partial one
    la = -torch.rand(2, 12, 8, generator=g, dtype=torch.float64)
    b = torch.randn(2, 12, 8, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, 8, generator=g, dtype=torch.float64)
    return (lambda la, b, h0: linear_scan(la, b, h0, True, backend="triton", chunk_size=8)), (la, b, h0)


def _delta_rule_case(g):
    q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 2, 20, generator=g, dtype=torch.float64)
    h0 = torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64)
    return (lambda q, k, v, beta, h0: delta_rule(q, k, v, beta, h0, True, backend="triton", chunk_size=16)), \
        (q, k, v, beta, h0)


def _gated_delta_rule_case(g):
    q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64)
    lg = -torch.rand(1, 2, 20, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 2, 20, generator=g, dtype=torch.float64)
    h0 = torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64)
    return (lambda q, k, v, lg, beta, h0: gated_delta_rule(q, k, v, lg, beta, h0, True, backend="triton",
                                                           chunk_size=16)), (q, k, v, lg, beta, h0)


def _titans_case(g):
    q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64)
    theta = 0.5 * torch.rand(1, 2, 12, generator=g, dtype=torch.float64)
    log_eta, log_keep = (torch.nn.functional.logsigmoid(torch.randn(1, 2, 12, generator=g, dtype=torch.float64) + 2)
                         for _ in range(2))
    M, S, Mh = (0.3 * torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64) for _ in range(3))

    def fn(q, k, v, theta, log_eta, log_keep, M, S, Mh):   # T = 12: a full chunk and a partial one
        y, fin = titans_linear(q, k, v, theta, log_eta, log_keep, (M, S, Mh), True, backend="triton",
                               chunk_size=8)
        return (y, *fin)
    return fn, (q, k, v, theta, log_eta, log_keep, M, S, Mh)


def _ttt_inputs(g, mlp: bool, T: int = 20, H: int = 2):
    B, d, bsz = 1, 8, 8

    def r(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)
    ins = [r(B, H, T, d), r(B, H, T, d), r(B, H, T, d), 0.5 * torch.rand(B, H, T, generator=g, dtype=torch.float64),
           1.0 / torch.arange(1, bsz + 1, dtype=torch.float64), 1 + r(H, d, scale=0.1), r(H, d, scale=0.1)]
    if mlp:     # hidden width m = 2d = 16 ≠ d: one hidden tile under the interpreter
        m = 2 * d
        return ins + [r(H, d, m, scale=0.3), r(H, 1, m, scale=0.1), r(H, m, d, scale=0.3),
                      r(H, 1, d, scale=0.1)]
    return ins + [r(H, d, d, scale=0.3), r(H, 1, d, scale=0.1)]


def _ttt_linear_case(g):
    def fn(*ins):   # T = 12: a full mini-batch and a partial one
        out, st = ttt_linear(*ins, mini_batch_size=8, output_final_state=True, backend="triton")
        return out, st["W1"], st["b1"]
    return fn, _ttt_inputs(g, False, T=12)


def _ttt_mlp_case(g):
    def fn(*ins):   # T = 12: a full mini-batch and a partial one
        out, st = ttt_mlp(*ins, mini_batch_size=8, output_final_state=True, backend="triton")
        return out, st["W1"], st["b1"], st["W2"], st["b2"]
    return fn, _ttt_inputs(g, True, T=12)


def _selective_scan_case(g):
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)   # noqa: E731
    A = -torch.rand(8, 4, generator=g, dtype=torch.float64) * 4 - 0.5
    # T = 12: a full tile of 8 and a partial one
    ins = (r(2, 12, 8), r(2, 12, 8), A, r(2, 12, 4), r(2, 12, 4), r(8), r(2, 12, 8), r(8), r(2, 8, 4))

    def fn(x, delta, A, B, C, D, z, delta_bias, h0):
        return selective_scan(x, delta, A, B, C, D, z, delta_bias, True, h0, True, backend="triton",
                              chunk_size=8)
    return fn, ins


# op name in the captured graph -> (function of tensors calling the public entry point, its inputs)
CUSTOM_OPS = {
    "kernels.linear_scan_fwd.default": _linear_scan_case,
    "kernels.delta_rule_fwd.default": _delta_rule_case,
    "kernels.gated_delta_rule_fwd.default": _gated_delta_rule_case,
    "kernels.titans_linear_fwd.default": _titans_case,
    "kernels.ttt_linear_fwd.default": _ttt_linear_case,
    "kernels.ttt_mlp_fwd.default": _ttt_mlp_case,
    "kernels.selective_scan_fwd.default": _selective_scan_case,
}


class _RecordKernelOps(TorchDispatchMode):
    """The kernels:: op calls (forward and backward ops) with the arguments they were given."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kernels":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _recording_aot_eager(graphs: list):
    """The aot_eager backend, keeping every graph dynamo hands it (as torch._dynamo.explain does)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    return backend


def _call_targets(graphs) -> list:
    return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("node", sorted(CUSTOM_OPS))
def test_triton_op_is_one_custom_op_node_and_passes_opcheck(node):
    """With backend=triton (the Triton interpreter on CPU) dynamo captures the op as one opaque
    custom-op node: no graph break (fullgraph), no traced Triton launch, and outputs and gradients
    equal eager. Then torch.library.opcheck on the forward and backward ops as the public entry
    point called them in that eager run: schema, fake (shape) functions against the real outputs,
    the registered autograd, and AOT dispatch."""
    fn, inputs = CUSTOM_OPS[node](torch.Generator().manual_seed(0))
    leaves = [x.clone().requires_grad_() for x in inputs]
    with _RecordKernelOps() as rec:
        eager = fn(*leaves)
        eager_g = torch.autograd.grad(sum(o.sum() for o in eager if o is not None), leaves, allow_unused=True)
    op = node.removesuffix(".default").replace(".", "::")   # kernels::<op>_fwd
    names = [f.name() for f, _, _ in rec.calls]
    assert names == [op, op.replace("_fwd", "_bwd")], names

    graphs = []
    leaves_c = [x.clone().requires_grad_() for x in inputs]
    compiled = torch.compile(fn, backend=_recording_aot_eager(graphs), fullgraph=True)(*leaves_c)
    compiled_g = torch.autograd.grad(sum(o.sum() for o in compiled if o is not None), leaves_c,
                                     allow_unused=True)
    assert len(graphs) == 1, graphs   # fullgraph: one graph, no break
    targets = _call_targets(graphs)
    assert targets.count(node) == 1, targets
    for a, c in zip(list(eager) + list(eager_g), list(compiled) + list(compiled_g)):
        assert (a is None and c is None) or torch.equal(a, c), (a, c)

    for func, args, kwargs in rec.calls:
        if func.name().endswith("_bwd"):   # the backward op has no derivative of its own
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(func, args, kwargs)


def _node(op: str) -> str:
    """The graph node of the custom op ``kernels::<name>``: ``kernels.<name>.default``."""
    return op.replace("::", ".") + ".default"


#: ops whose block takes over a minute under the Triton interpreter here (the selective scan's):
#: they are covered by test_triton_op_is_one_custom_op_node_and_passes_opcheck only
SLOW_BLOCKS = {"kernels::selective_scan_fwd"}
#: the kinds whose mixer runs a Triton op of its own (``triton_custom_op``), by the registry
KERNEL_KINDS = kinds_with(lambda c: c.triton_custom_op is not None, builtin_kinds())
BLOCKS = [k for k in KERNEL_KINDS if mixer_class(k).triton_custom_op not in SLOW_BLOCKS]


def test_declared_custom_ops_are_registered_ops():
    """Every ``triton_custom_op`` a mixer declares is a ``kernels::`` custom op that kernels/
    registers (a misspelt one would make the block test look for a node that never exists), and
    so is every op the opcheck test captures."""
    from kernels._launch_cache import _our_custom_ops
    assert BLOCKS, "no registered kind declares triton_custom_op"
    ops = set(_our_custom_ops())
    declared = {mixer_class(k).triton_custom_op for k in KERNEL_KINDS}
    assert declared <= ops, sorted(declared - ops)
    captured = {n.removesuffix(".default").replace(".", "::") for n in CUSTOM_OPS}
    assert captured <= ops, sorted(captured - ops)


def test_packed_sequences_compile_like_eager():
    """cu_seqlens: the op's fake shapes take the number of sequences from the offsets' length (and
    the delta rule's, Titans' and TTT-Linear's chunk slots as ⌊T / C⌋ + N), checked on every output
    of the forward op (``_run_packed``); compiled outputs and gradients equal eager.
    delta_rule_triton, titans_linear_triton and TTT-Linear read back one flag, the check of the
    offsets (a graph break before their op; TTT-Linear's final "pos" list is read back after it). One head (B = H = 1, N = 2): a fake shape that took the number of sequences
    from the batch or head axis would not match the real output (B ≠ H in the fake shapes is
    checked by test_triton_op_is_one_custom_op_node_and_passes_opcheck)."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 1, 20, 16, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 1, 20, 16, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 1, 20, generator=g, dtype=torch.float64)
    la = -torch.rand(1, 20, 8, generator=g, dtype=torch.float64)
    b = torch.randn(1, 20, 8, generator=g, dtype=torch.float64)
    theta = 0.5 * torch.rand(1, 1, 20, generator=g, dtype=torch.float64)
    log_eta, log_keep = (torch.nn.functional.logsigmoid(torch.randn(1, 1, 20, generator=g, dtype=torch.float64) + 2)
                         for _ in range(2))

    def titans(q, k, v, theta, log_eta, log_keep):   # chunk 8: both sequences end in a partial chunk
        y, fin = titans_linear(q, k, v, theta, log_eta, log_keep, None, True, backend="triton", chunk_size=8,
                               cu_seqlens=cu)
        return (y, *fin)
    def ttt(*ins):                                   # mini-batch 8: both sequences end in a partial one
        out, st = ttt_linear(*ins, mini_batch_size=8, output_final_state=True, backend="triton", cu_seqlens=cu)
        return out, st["W1"], st["b1"], st["grad_W1"]
    cases = [(lambda q, k, v, beta: delta_rule_triton(q, k, v, beta, None, True, 16, cu_seqlens=cu), (q, k, v, beta)),
             (lambda la, b: linear_scan(la, b, None, True, backend="triton", chunk_size=8, cu_seqlens=cu), (la, b)),
             (titans, (q, k, v, theta, log_eta, log_keep)), (ttt, _ttt_inputs(g, False, H=1)),
             (lambda q, k, v, lg, beta: gated_delta_rule_triton(q, k, v, lg, beta, None, True, 16, cu_seqlens=cu),
              (q, k, v, -theta, beta))]

    for fn, inputs in cases:
        torch._dynamo.reset()
        eager = _run_packed(fn, inputs, check_fake=True)
        compiled = _run_packed(torch.compile(fn, backend="aot_eager"), inputs)
        assert eager[1].shape[0] == 2   # one final state per sequence
        for a, c in zip(eager, compiled):
            assert torch.equal(a, c), (a - c).abs().max()
    assert torch._dynamo.explain(cases[1][0])(la, b).graph_break_count == 0


def _run_packed(fn, inputs, check_fake=False):
    """Outputs and input gradients of ``fn``. With ``check_fake``, the forward op's fake function is
    checked on the packed arguments it was called with: every output it returns (the saved chunk or
    mini-batch buffers included, which aot_eager does not compare) has the real output's shape,
    dtype and strides (``torch.library.opcheck``'s fake-tensor test)."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    with _RecordKernelOps() if check_fake else contextlib.nullcontext() as rec:
        out = fn(*leaves)
    if check_fake:
        fwd = [(f, a, k) for f, a, k in rec.calls if f.name().endswith("_fwd")]
        assert len(fwd) == 1, [f.name() for f, _, _ in rec.calls]
        torch.library.opcheck(fwd[0][0], fwd[0][1], fwd[0][2], test_utils="test_faketensor")
    return list(out) + list(torch.autograd.grad(sum(o.sum() for o in out), leaves))


def test_packed_ttt_mlp_compiles_like_eager():
    """TTT-MLP with cu_seqlens (one launch of each kernel): the op's fake shapes take the number of
    sequences from the offsets' length and the mini-batch slots as ⌊T / b⌋ + N, checked on every
    output of the forward op (``_run_packed``); compiled outputs, final states and gradients equal
    eager (the offsets' check and the final "pos" list are read back around the op). One head, as in test_packed_sequences_compile_like_eager."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)

    def fn(*ins):                                    # mini-batch 8: both sequences end in a partial one
        out, st = ttt_mlp(*ins, mini_batch_size=8, output_final_state=True, backend="triton", cu_seqlens=cu)
        return out, st["W1"], st["b2"], st["grad_W2"]
    inputs = _ttt_inputs(g, True, H=1)
    torch._dynamo.reset()
    eager = _run_packed(fn, inputs, check_fake=True)
    compiled = _run_packed(torch.compile(fn, backend="aot_eager"), inputs)
    assert eager[1].shape[0] == 2   # one final state per sequence
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c), (a - c).abs().max()


def test_entry_points_are_not_compiler_disabled():
    """Every Triton entry point is traced (the op inside it is the custom-op node), none skipped."""
    for fn in (delta_rule_triton, gated_delta_rule_triton, linear_scan_triton, selective_scan_triton, titans_linear_triton,
               ttt_linear_triton, ttt_mlp_triton):
        assert not getattr(fn, "_torchdynamo_disable", False), fn.__name__


@pytest.mark.parametrize("kind", BLOCKS)
def test_triton_op_in_a_compiled_block(kind):
    """A block whose mixer runs a Triton op (kernel_backend=triton) trains under model.compile like
    eager, the op captured as a custom-op node of the graphs the compiled training run hands its
    backend and no graph break at it; the op's fake shapes with B ≠ H are also
    test_triton_op_is_one_custom_op_node_and_passes_opcheck's (with two rows for the linear scan).
    Every block runs one row of 16 tokens and one head of width 16 (interpreted): two chunks (or
    TTT mini-batches) of ``N`` = 8; TTT-MLP's inner hidden width is its section's (4 × 16). The
    breaks allowed besides none at the op are the mixer's ``compile_graph_breaks``."""
    cls = mixer_class(kind)
    node, other_breaks = _node(cls.triton_custom_op), cls.compile_graph_breaks
    shape = dict(d_model=16, n_heads=1)
    B, T = 1, 16
    eager = losses(tiny([kind], "triton", **shape), steps=2, B=B, T=T)
    model = tiny([kind], "triton", **shape)
    assert model.kernel_backends("cpu") == {kind: "triton"}
    graphs = []
    compiled = losses(model.compile_blocks(_recording_aot_eager(graphs)), steps=2, B=B, T=T)
    targets = _call_targets(graphs)
    assert node in targets, targets
    breaks = dict(counters["graph_break"])
    assert all(other_breaks and other_breaks in reason for reason in breaks), breaks
    assert not any("disable" in k for k in breaks), breaks
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < TOL, (eager, compiled)


def test_inductor_default_on_an_attention_block():
    """The default backend generates C++ for the block (forward only here: its backward would
    double the compile time; training parity is the aot_eager test's). Logits within 1e-5: inductor
    fuses and reorders float32 reductions."""
    assert ModelConfig().compile_backend == "inductor"
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    # C++ compiled in this process: no pool of compile workers to start on a 2-core machine
    with torch.no_grad(), torch._inductor.config.patch(compile_threads=1):
        eager = tiny([GLOBAL]).eval()(ids).logits
        compiled = tiny([GLOBAL]).compile_blocks().eval()(ids).logits
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.allclose(eager, compiled, atol=TOL, rtol=0), (eager - compiled).abs().max()


def test_compile_settings_are_checked():
    with pytest.raises(ConfigError, match="model.compile_backend must be one of"):
        load_config(None, ["model.compile_backend=tensorrt"])
    with pytest.raises(ConfigError, match="model.compile=true is supported with parallel.tensor_parallel=1"):
        load_config(None, ["model.compile=true", "parallel.tensor_parallel=2"])
    on = load_config(None, ["model.compile=true"])
    assert on.model.compile is True
    # a runtime choice, like kernel_backend: a run may resume with compile switched on or off
    from ttt_lm.train.trainer import invariants
    man = {"checksum": "c", "vocab_size": 64, "tokenizer": "t"}
    assert invariants(on, man) == invariants(load_config(None, []), man)
