"""Which implementation each layer kind runs (``LM.kernel_backends``), asked for device "cuda"
on a CPU machine: the decision needs no GPU. No silent fallback: ``kernel_backend=triton`` where
no kernel covers a layer raises, naming the layer kind. Every built-in kind (and variant) at the
tests' tiny sizes; whether a Triton kernel covers a layer as configured is its op's contract's
answer (``kernels.contract``, the op folder's ``CONTRACT``) for the arguments the mixer declares
(``Mixer.triton_unavailable``: None, or the reason)."""
import dataclasses

import pytest
import torch

from tests.model.mixer_checks import short_cases
from ttt_lm.model import LM
from ttt_lm.model.mixers.base import Mixer
from ttt_lm.model.registry import builtin_kinds, mixer_class

CASES = short_cases()
IDS = [kind if name is None else f"{kind}-{name}" for kind, name, _ in CASES]


def _model(cfg, backend="auto") -> LM:
    return LM(dataclasses.replace(cfg, kernel_backend=backend))


@pytest.mark.parametrize("kind,variant,cfg", CASES, ids=IDS)
def test_auto_picks_triton_on_cuda_where_a_kernel_covers_the_layer_and_torch_on_cpu(kind, variant, cfg):
    m = _model(cfg)
    mixer = m.layers[0].mixer
    cuda, cpu = m.kernel_backends("cuda"), m.kernel_backends("cpu")
    assert set(cuda) == set(cpu) == {kind}
    if not mixer.uses_kernel_op:                         # attention: its own backend setting
        assert cuda[kind] == cpu[kind] == "attention:auto"
        return
    assert cuda[kind] == ("triton" if mixer.triton_unavailable() is None else "torch")
    assert cpu[kind] == "torch"


def test_kernels_that_exist_are_used_on_cuda():
    """Every kind that declares a packed-document Triton entry (``varlen_triton_op``) runs its
    Triton kernel on CUDA under auto and under kernel_backend=triton."""
    kinds = [k for k in builtin_kinds() if mixer_class(k).varlen_triton_op]
    assert kinds
    cfgs = {kind: cfg for kind, name, cfg in CASES if kind in kinds}
    for kind in kinds:
        assert _model(cfgs[kind]).kernel_backends("cuda")[kind] == "triton"
        assert _model(cfgs[kind], "triton").kernel_backends("cuda")[kind] == "triton"


@pytest.mark.parametrize("kind,variant,cfg", CASES, ids=IDS)
def test_torch_forces_the_pytorch_form(kind, variant, cfg):
    m = _model(cfg, "torch")
    want = "torch" if m.layers[0].mixer.uses_kernel_op else "attention:auto"
    assert m.kernel_backends("cuda") == {kind: want}


@pytest.mark.parametrize("kind,variant,cfg", CASES, ids=IDS)
def test_triton_where_no_kernel_covers_the_layer_fails_loudly(kind, variant, cfg):
    """kernel_backend=triton: the kernel where one covers the layer; otherwise an error naming the
    layer kind, its layer and the mixer's reason, from kernel_backends and from the chunked form
    itself on any device (the CPU here)."""
    m = _model(cfg, "triton")
    mixer = m.layers[0].mixer
    if not mixer.uses_kernel_op:
        assert m.kernel_backends("cuda") == {kind: "attention:auto"}
        return
    reason = mixer.triton_unavailable()
    if reason is None:
        assert m.kernel_backends("cuda") == {kind: "triton"}
        return
    import re
    with pytest.raises(ValueError, match=rf"layer kind '{kind}' \(layer 0\).*{re.escape(reason)}"):
        m.kernel_backends("cuda")
    with pytest.raises(ValueError, match=re.escape(reason)):
        m(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("kind,variant,cfg", CASES, ids=IDS)
def test_the_refusal_reason_is_the_op_contracts(kind, variant, cfg):
    """No mixer decides Triton coverage itself: ``triton_unavailable`` is the base's, which asks
    the declared op contract with the mixer's ``contract_args`` (every argument the contract
    reads among them); a mixer that runs a Triton op of its own declares that op's contract."""
    mixer = _model(cfg).layers[0].mixer
    cls = type(mixer)
    assert cls.triton_unavailable is Mixer.triton_unavailable, f"{cls.__name__} overrides triton_unavailable"
    if cls.triton_custom_op is not None or cls.varlen_triton_op is not None:
        assert cls.op_contract is not None, f"{cls.__name__} runs a Triton op but declares no op_contract"
    if cls.op_contract is None:
        assert mixer.triton_unavailable() == "no Triton kernel for this layer kind"
        return
    c, args = cls.op_contract, mixer.contract_args()
    assert set(c.max_dims) | {r.arg for r in c.requires} <= set(args)
    assert mixer.triton_unavailable() == c.triton_unavailable(labels=cls.contract_labels, **args)
    assert mixer.triton_unavailable(torch.bfloat16) == mixer.triton_unavailable()
