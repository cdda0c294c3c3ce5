import os

# Triton kernels run under the interpreter on machines without CUDA. This must be set before
# triton is imported anywhere.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# setuptools replaces the standard library's distutils when it is first imported, and asserts that
# the replacement worked (_distutils_hack). torch.compile's C++ backend imports it late, from a
# test process that may by then hold the standard library's distutils, which fails that assertion
# (BackendCompilerFailed) depending on which tests ran before in the process: import it first.
import setuptools  # noqa: E402,F401

import pytest  # noqa: E402


#: the tiers other than unit; a test without any of these markers is in the unit tier
OTHER_TIERS = ("dist", "slurm", "gpu", "aot")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(m) is not None for m in OTHER_TIERS):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("gpu") and not _HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


_CONFIG = []


def pytest_configure(config):
    _CONFIG.append(config)


def pytest_runtest_logreport(report):
    """With TTT_LM_INSTANT_FAILURES=1 (set by ``benchmarks/gpu_campaign.py``), a failing test's
    error line is printed as soon as it fails, as ``E   <test id>: <error>``, not only in the summary
    at the end: a file stopped at its time limit still says why its earlier tests failed."""
    if not (report.failed and os.environ.get("TTT_LM_INSTANT_FAILURES") == "1" and _CONFIG):
        return
    text = str(report.longrepr).splitlines()
    lines = [ln[1:].strip() for ln in text if ln.startswith("E ")] or text[-1:] or ["(no message)"]
    tr = _CONFIG[-1].pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"E   {report.nodeid}: {lines[0]}")


_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_dist_env():
    """In-process training runs export RANK/WORLD_SIZE/MASTER_* (as torch.distributed needs); put
    them back after each test so a later test's subprocesses do not inherit a stale rendezvous."""
    saved = {k: os.environ.get(k) for k in _DIST_VARS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
