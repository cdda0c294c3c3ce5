"""The GPU campaign's launch recorder (``kernels/_launch_cache.py``) is installed only where it is
asked for: importing a kernel with ``TTT_LM_RECORD_LAUNCHES`` in the environment records nothing,
``triton_available`` answers for the device, and a Triton launch that cannot run says so instead
of returning unwritten outputs. The campaign's record processes (``gpu_campaign.record_env``)
install it at start-up, and so do the Python processes they start."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
if "gpu_campaign" in sys.modules:
    gc = sys.modules["gpu_campaign"]
else:
    spec = importlib.util.spec_from_file_location("gpu_campaign", ROOT / "benchmarks" / "gpu_campaign.py")
    gc = importlib.util.module_from_spec(spec)
    sys.modules["gpu_campaign"] = gc
    spec.loader.exec_module(gc)

#: what a process reports about the recorder: the file it records to, whether Triton's compile is
#: replaced, what triton_available says, and what a Triton launch on CPU tensors does (with a
#: stand-in CUDA driver, as tests/benchmarks/test_launch_warmup.py records without a GPU)
PROBE = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

class StandIn:            # what JITFunction.run asks of a driver before it compiles: a GPU's target, no GPU
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def is_active(self): return True

driver.set_active(StandIn())
from triton.runtime.jit import JITFunction
import kernels.linear_scan.chunk                     # a kernel module: compiles nothing, records nothing
from kernels import _launch_cache, _triton_utils as tu
from kernels.linear_scan import linear_scan
out = {"recorder": _launch_cache.recorder_path(),
       "compile_replaced": JITFunction._do_compile.__module__ == "kernels._launch_cache",
       "available_cpu": tu.triton_available("cpu"), "available": tu.triton_available(torch.device("cpu"))}
try:
    linear_scan(torch.randn(1, 40, 8).clamp(max=0), torch.randn(1, 40, 8), backend="triton")
    out["launch"] = "returned"
except RuntimeError as e:
    out["launch"] = str(e)
if len(sys.argv) > 1:                                # and a child Python process (as pytest-xdist starts)
    import subprocess
    out["child"] = json.loads(subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True,
                                             check=True).stdout)
print(json.dumps(out))
"""

CHILD = ("import json; from kernels import _launch_cache, _triton_utils as tu; "
         "print(json.dumps({'recorder': _launch_cache.recorder_path(), 'available_cpu': tu.triton_available('cpu')}))")


def _probe(env: dict, child: bool = False) -> dict:
    full = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **dict({"PYTHONPATH": str(ROOT)}, **env))
    full.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", PROBE] + ([CHILD] if child else []), cwd=ROOT, env=full,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_importing_a_kernel_with_the_variable_set_records_nothing(tmp_path):
    rec = tmp_path / "rec.jsonl"
    got = _probe({"TTT_LM_RECORD_LAUNCHES": str(rec)})
    assert got["recorder"] is None and not got["compile_replaced"], got
    assert got["available_cpu"] is False and got["available"] is False, got   # no GPU, no interpreter here
    assert "cannot run on cpu" in got["launch"], got                          # refused, not skipped
    assert not rec.exists(), rec.read_text()


@pytest.mark.slow   # two processes that import torch and triton, one launching under the recorder
def test_the_campaigns_record_processes_record(tmp_path):
    rec = tmp_path / "rec.jsonl"
    got = _probe(gc.record_env(rec), child=True)
    assert got["recorder"] == str(rec) and got["compile_replaced"], got
    assert got["available_cpu"] is True and got["launch"] == "returned", got  # recorded, not run
    kernels = {json.loads(line)["kernel"] for line in rec.read_text().splitlines()}
    assert kernels and all(k.startswith("kernels.linear_scan.") for k in kernels), kernels
    assert got["child"] == {"recorder": str(rec), "available_cpu": True}, got


def test_remove_recorder_restores_triton(tmp_path):
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    from kernels import _launch_cache
    from kernels import _triton_utils as tu

    before = (JITFunction._do_compile, autotuner.Autotuner._bench,
              getattr(autotuner.Autotuner, "check_disk_cache", None), tu.triton_available("cuda"))
    assert _launch_cache.recorder_path() is None
    _launch_cache.install_recorder(str(tmp_path / "rec.jsonl"))
    try:
        assert _launch_cache.recorder_path() == str(tmp_path / "rec.jsonl")
        assert JITFunction._do_compile is not before[0] and tu.triton_available("cuda") is True
    finally:
        _launch_cache.remove_recorder()
    after = (JITFunction._do_compile, autotuner.Autotuner._bench,
             getattr(autotuner.Autotuner, "check_disk_cache", None), tu.triton_available("cuda"))
    assert after == before and _launch_cache.recorder_path() is None
