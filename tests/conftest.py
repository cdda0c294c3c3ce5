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


#: seconds of test time (setup + call + teardown, summed over the processes) per tier and per
#: layer kind (and model variant), printed at the end of the run (``pytest_terminal_summary``)
_TIMES = {"tier": {}, "kind": {}}


def _kinds_in(nodeid: str, kinds) -> list:
    """The layer kinds a test id names (its file, its parameters), each the longest name at its
    place: ``test_gated_deltanet.py`` is gated_deltanet's, not deltanet's."""
    spans = []
    for k in kinds:
        start = nodeid.find(k)
        while start >= 0:
            spans.append((start, start + len(k), k))
            start = nodeid.find(k, start + 1)
    return sorted({k for a, b, k in spans if not any(a2 <= a and b <= b2 and (b2 - a2) > (b - a)
                                                     for a2, b2, _ in spans)})


def model_variants() -> tuple:
    """Every model variant (a subclass of ``LM`` that ``LM(cfg)`` builds for some configs) by the
    name of the config section that switches it on (``model.<name>.enabled``): TTT-E2E is a model,
    not a layer kind, and is ``ttt_e2e``."""
    import dataclasses

    from ttt_lm.model.config import ModelConfig
    from ttt_lm.model.lm import LM
    names = []
    for f in dataclasses.fields(ModelConfig):
        cfg = ModelConfig()
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section) and isinstance(getattr(section, "enabled", None), bool):
            setattr(cfg, f.name, dataclasses.replace(section, enabled=True))
            names += [f.name for c in LM.__subclasses__() if c.builds(cfg) and f.name not in names]
    return tuple(names)


def report_names() -> tuple:
    """The names the time report counts by: every registered layer kind and every model variant."""
    from ttt_lm.model.registry import builtin_kinds
    kinds = tuple(builtin_kinds())
    return kinds + tuple(v for v in model_variants() if v not in kinds)


def _tally(report) -> None:
    tier = next((t for t in OTHER_TIERS if t in report.keywords), "unit")
    _TIMES["tier"][tier] = _TIMES["tier"].get(tier, 0.0) + report.duration
    if "kinds" not in _TIMES:
        try:
            _TIMES["kinds"] = report_names()
        except Exception:  # pragma: no cover - the registry itself failed to import: its tests say why
            _TIMES["kinds"] = ()
    names = _kinds_in(report.nodeid, _TIMES["kinds"]) or ["(no kind named)"]
    for k in names:     # a test that names several kinds counts its time to each, in shares
        _TIMES["kind"][k] = _TIMES["kind"].get(k, 0.0) + report.duration / len(names)


def pytest_terminal_summary(terminalreporter):
    """The run's test time per tier and per layer kind (the per-kind budget of docs/testing.md)."""
    if not _TIMES["tier"]:
        return
    tr = terminalreporter
    tr.section("test time per tier and per layer kind (s, summed over processes)")
    tr.write_line("tier: " + ", ".join(f"{t} {v:.0f}" for t, v in sorted(_TIMES["tier"].items(), key=lambda x: -x[1])))
    tr.write_line("kind: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(_TIMES["kind"].items(), key=lambda x: -x[1])))


def pytest_runtest_logreport(report):
    """Counts the test's time to its tier and kinds; and with TTT_LM_INSTANT_FAILURES=1 (set by ``benchmarks/gpu_campaign.py``), a failing test's
    error line is printed as soon as it fails, as ``E   <test id>: <error>``, not only in the summary
    at the end: a file stopped at its time limit still says why its earlier tests failed."""
    _tally(report)
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
