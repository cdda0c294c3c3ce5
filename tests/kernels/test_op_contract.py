"""An op folder's contract (``kernels.contract.OpContract``): what its Triton backend covers,
declared once in the folder and read by the model's backend resolver. The rules on a contract of
this file's own; every op folder exports one."""
import importlib
import pkgutil
import types
from pathlib import Path

import pytest
import torch

from kernels.contract import FLOAT_DTYPES, OpContract, Requirement, backends_listed

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


_Op = types.ModuleType("kernels.some_op")
_Op.BACKENDS = ("torch", "reference", "triton")


def _contract(**kw):
    return OpContract("kernels.some_op", backends_listed(_Op), max_dims={"d_k": 128, "d_v": 256},
                      requires=(Requirement("mode", lambda m: m == "a", "only mode a, not {name}={value!r}"),), **kw)


def test_a_covered_call_has_no_reason():
    assert _contract().triton_unavailable(torch.bfloat16, d_k=128, d_v=256, mode="a") is None


def test_the_reasons_name_the_limit_and_the_callers_label(monkeypatch):
    c = _contract()
    assert c.triton_unavailable(d_k=129, d_v=64, mode="a") == \
        "its Triton kernel takes d_k ≤ 128 and d_v ≤ 256; this layer has d_k = 129, d_v = 64"
    assert c.triton_unavailable(d_k=64, d_v=64, mode="b", labels={"mode": "cfg.mode"}) == \
        "only mode a, not cfg.mode='b'"
    assert "torch.int32" in c.triton_unavailable(torch.int32, d_k=64, d_v=64, mode="a")
    # not built comes first, read when asked (the BACKENDS tuple as it is now)
    monkeypatch.setattr(_Op, "BACKENDS", ("torch", "reference"))
    assert c.triton_unavailable(d_k=999, d_v=64, mode="b") == "kernels.some_op has only ['torch', 'reference']"


def test_varlen_and_initial_states_are_refused_only_where_the_kernels_lack_them():
    c = _contract(varlen=False, initial_state=False)
    args = dict(d_k=64, d_v=64, mode="a")
    assert c.triton_unavailable(**args) is None
    assert "cu_seqlens" in c.triton_unavailable(varlen=True, **args)
    assert "initial state" in c.triton_unavailable(initial_state=True, **args)
    assert _contract().triton_unavailable(varlen=True, initial_state=True, **args) is None


def test_a_call_missing_an_argument_the_contract_reads_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"\['d_v', 'mode'\]"):
        _contract().triton_unavailable(d_k=64)


def test_every_op_folder_exports_its_contract():
    """Each package under kernels/ has at least one OpContract at its top level, named by its
    own folder, taking every floating dtype its kernels read or fewer."""
    ops = [m.name for m in pkgutil.iter_modules([str(KERNELS)]) if m.ispkg]
    assert len(ops) >= 5
    for op in ops:
        mod = importlib.import_module(f"kernels.{op}")
        contracts = [v for v in vars(mod).values() if isinstance(v, OpContract)]
        assert contracts, f"kernels.{op} exports no OpContract"
        for c in contracts:
            assert c.op.startswith(f"kernels.{op}"), (op, c.op)
            assert set(c.dtypes) <= set(FLOAT_DTYPES)
            why = c.built()
            assert why is None or isinstance(why, str) and why
