"""TTT-Linear and TTT-MLP over packed documents on the Triton backend: the packed rows are flattened
to one row and every document runs in one call of the op's packed kernels (``cu_seqlens``), with
the share_qk convolutions, the block's pre-conv and RoPE restarted at document starts; outputs
and every gradient equal those of the PyTorch dual form with documents (which
tests/model/test_packed_docs.py holds equal to each document alone).

The Triton kernels run under the interpreter on CPU (tests/conftest.py), where tl.dot needs
16-wide blocks: head_dim 16 (the kernels pad a mini-batch's rows to 16 themselves, so b = 4 runs).
float32; the tolerance, 2e-4 of each tensor's largest entry, covers the different summation order
of the kernels and the dual form: measured ≤ 1.5e-6 on the logits and ≤ 6.3e-5 on the gradients,
the largest learnable_token_idx's (a sum over every token that partly cancels)."""
import warnings

import pytest
import torch

import kernels.ttt.chunk as linear_chunk
import kernels.ttt.mlp_chunk as mlp_chunk
from ttt_lm.model import LM, ModelConfig
from ttt_lm.model.docs import DocLayout
from ttt_lm.model.mixers.base import Mixer

V = 53
B_MB = 4
# two rows of 12 tokens: documents shorter than the conv width (4) and than a mini-batch (4),
# others across a mini-batch boundary
ROW_LENS = [[5, 1, 6], [3, 7, 2]]
TOL = 2e-4
PACKED = {"ttt_linear": (linear_chunk, "ttt_linear_triton_packed", "ttt_linear_triton"),
          "ttt_mlp": (mlp_chunk, "ttt_mlp_triton_packed", "ttt_mlp_triton")}


def tiny(kind, backbone: bool, heads: int = 1) -> LM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16 * heads, n_heads=heads, n_layers=1, layer_pattern=[kind],
                      reset_at_doc_boundaries=True)
    cfg.ttt.mini_batch_size = B_MB
    cfg.ttt.mlp_expansion = 1
    cfg.ttt.pre_conv = cfg.ttt.share_qk = cfg.ttt.use_gate = backbone
    m = LM(cfg)
    with torch.no_grad():   # a visible inner update and a non-trivial τ schedule
        for mod in m.modules():
            if isinstance(mod, Mixer):
                mod.learnable_ttt_lr_bias.fill_(2.0)
                mod.learnable_token_idx.copy_(0.1 * torch.randn(B_MB))
    return m


def packed_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (len(ROW_LENS), sum(ROW_LENS[0])), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ROW_LENS])
    return ids, pos


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def set_backend(m: LM, backend: str) -> None:
    for mod in m.modules():
        if isinstance(mod, Mixer):
            mod.kernel_backend = backend


def run(m: LM, ids, pos):
    """Packed logits and every parameter's gradient of a fixed random functional of them."""
    m.zero_grad(set_to_none=True)
    logits = m(ids, position_ids=pos).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("kind,backbone,heads", [("ttt_linear", True, 1), ("ttt_mlp", True, 1), ("ttt_linear", False, 2)])
def test_triton_packed_equals_torch_with_docs_in_one_call(kind, backbone, heads, monkeypatch):
    """One call of the packed op per layer forward, with the batch's cu_seqlens over [1, B·T];
    neither the padded view nor the per-row kernel is used; logits and every parameter's gradient
    (the embedding's: the gradient of the mixer's inputs) equal the PyTorch form with documents.
    ``backbone``: share_qk convs, the block's pre-conv and the output gate, all restarted at
    document starts. ``heads`` = 2: the flattening keeps every head's tokens in document order."""
    m = tiny(kind, backbone, heads)
    ids, pos = packed_batch()
    set_backend(m, "torch")
    want, g_want = run(m, ids, pos)
    with torch.no_grad():
        plain = m(ids).logits   # the same rows as one document each

    mod, packed_name, plain_name = PACKED[kind]
    calls = []
    real = getattr(mod, packed_name)

    def spy(XQ, *a):
        calls.append((tuple(XQ.shape), a[-1].clone()))
        return real(XQ, *a)

    def refuse(*a, **k):
        raise AssertionError("padded view or per-row kernel used")
    monkeypatch.setattr(mod, packed_name, spy)
    monkeypatch.setattr(mod, plain_name, refuse)
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(refuse))
    monkeypatch.setattr(DocLayout, "pad", refuse)
    set_backend(m, "triton")
    got, g_got = run(m, ids, pos)

    B, T = ids.shape
    assert len(calls) == m.cfg.n_layers, f"{len(calls)} packed op calls for {m.cfg.n_layers} layer(s)"
    shape, cu = calls[0]
    assert shape == (1, m.cfg.n_heads, B * T, m.cfg.hd)
    lens = [n for row in ROW_LENS for n in row]
    assert cu.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert rel(got, want) <= TOL, f"logits rel err {rel(got, want):.2e}"
    assert set(g_got) == set(g_want)
    for n in g_want:
        assert rel(g_got[n], g_want[n]) <= TOL, f"grad of {n}: rel err {rel(g_got[n], g_want[n]):.2e}"
    # the documents restart: the rows read as one document each differ after the first document
    assert (plain[:, 5:] - want[:, 5:]).abs().max() > 1e-4


def test_packed_launch_beyond_int32_offsets_falls_back_to_padded_view(monkeypatch):
    """Where one packed launch would pass the kernels' int32 offsets the mixer says so in a warning
    and runs the padded view (one document per row, the per-row kernel), with the same result."""
    import ttt_lm.model.mixers.ttt as ttt_mod

    m = tiny("ttt_linear", False)
    ids, pos = packed_batch()
    set_backend(m, "torch")
    with torch.no_grad():
        want = m(ids, position_ids=pos).logits
    padded = []
    real = Mixer.run_padded

    def spy(*a, **k):
        padded.append(1)
        return real(*a, **k)
    monkeypatch.setattr(ttt_mod, "triton_packed_limit", lambda *a: "N·H·T·d too large")
    monkeypatch.setattr(Mixer, "run_padded", staticmethod(spy))
    monkeypatch.setattr(linear_chunk, "ttt_linear_triton_packed",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("packed launch")))
    set_backend(m, "triton")
    with pytest.warns(UserWarning, match="padded view.*N·H·T·d too large"), torch.no_grad():
        got = m(ids, position_ids=pos).logits
    assert padded == [1]
    assert rel(got, want) <= TOL


def test_packed_limit_is_the_kernels_own():
    """``triton_packed_limit`` is the check the packed kernels raise: None for a small batch, the
    reason for one past 2^31 offsets (no tensors needed)."""
    from kernels.ttt import triton_packed_limit
    assert triton_packed_limit("linear", 2, 48, 16, 10, 4, 16) is None
    assert triton_packed_limit("mlp", 2, 48, 16, 10, 4, 64) is None
    assert "2^31" in triton_packed_limit("linear", 16, 2 ** 16, 64, 2 ** 10, 16, 64)
    assert "2^31" in triton_packed_limit("mlp", 16, 2 ** 16, 64, 2 ** 14, 16, 256)


def test_inputs_refuse_doc_offset_with_a_carried_state():
    m = tiny("ttt_linear", True)
    mixer = m.layers[0].mixer
    x = torch.randn(1, 6, m.cfg.d_model)
    with pytest.raises(ValueError, match="doc_offset.*carried state"):
        mixer.inputs(x, mixer.init_state(1), doc_offset=torch.arange(6)[None])
