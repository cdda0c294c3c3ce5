"""The GPU campaign's warm-up, proved without a GPU.

The warm-up records the compile of every launch the later steps make (record mode of
``kernels/_launch_cache.py``: the launch is skipped) and compiles the records into the Triton
cache. Here, on CPU:

* record mode runs the benchmark code paths with a stand-in CUDA driver (target sm_90; launches
  are recorded, so nothing runs), and the same code paths run for real under the Triton
  interpreter with a hook on every launch: each (kernel, constexprs, pointer dtypes) the
  interpreter launches must be among the records — skipping the kernels does not change which
  launches a program makes;
* a record compiled by the warm-up's worker lands in the Triton cache under the hash the launch
  looks up;
* with pinning on, an autotuned kernel of ours records one config, not one per candidate;
* the warm-up's record pass walks the same items as the later steps.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_campaign", ROOT / "benchmarks" / "gpu_campaign.py")
gc = importlib.util.module_from_spec(spec)
sys.modules["gpu_campaign"] = gc
spec.loader.exec_module(gc)

#: tiny sizes of the benchmark code paths: B, T, H, D (T over one chunk of every op, not a multiple of 16
#: for the scans' tails would change nothing the check is about)
SIZE = (1, 64, 1, 16)

_FAKE_DRIVER = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {root!r})
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

class StandIn:            # what JITFunction.run asks of a driver before it compiles
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def is_active(self): return True

driver.set_active(StandIn())
"""

_INTERPRETER_HOOK = """
import inspect, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {root!r})
import torch
from triton.runtime.interpreter import InterpretedFunction
NAMES = {{torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1"}}
launches = []
_run = InterpretedFunction.run

def run(self, *args, grid, warmup, **kwargs):
    fn = self.fn
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **{{k: v for k, v in kwargs.items() if k in sig.parameters}})
    bound.apply_defaults()
    cx, ptr = {{}}, {{}}
    for name, p in sig.parameters.items():
        v = bound.arguments.get(name)
        if "constexpr" in str(p.annotation):
            cx[name] = str(v)
        elif isinstance(v, torch.Tensor):
            ptr[name] = NAMES[v.dtype]
    launches.append({{"kernel": fn.__module__ + ":" + fn.__qualname__, "constexprs": cx, "pointers": ptr}})
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)

InterpretedFunction.run = run
"""

#: record mode making the interpreter's launch choices (emulated precisions, small tiles: the
#: ops ask ``is_interpreting()``), so that its records can be compared with the interpreter's launches
_INTERPRETER_CHOICES = """
import importlib, pkgutil
import kernels
for m in pkgutil.walk_packages(kernels.__path__, "kernels."):
    if not m.name.endswith(("compile_report", ".compile_cases")):
        importlib.import_module(m.name)
for name, mod in list(sys.modules.items()):
    if name.startswith("kernels.") and hasattr(mod, "is_interpreting"):
        mod.is_interpreting = lambda: True
"""

_BENCH_PATHS = """
import torch
spec = __import__("importlib.util").util.spec_from_file_location("kb", {root!r} + "/benchmarks/kernels.py")
kb = __import__("importlib.util").util.module_from_spec(spec)
sys.modules["kb"] = kb
spec.loader.exec_module(kb)
B, T, H, D = {size}
for op in {ops}:
    kb._record_pass(kb.REGISTRY[op](B, T, H, D, torch.float32, "cpu"))
"""


def _run_script(code: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    full = dict(os.environ, OMP_NUM_THREADS="1", **dict({"PYTHONPATH": str(ROOT)}, **env))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _record(ops, path: Path, pin: bool = True, interpreter_choices: bool = False) -> list:
    from kernels import _launch_cache

    code = (_FAKE_DRIVER.format(root=str(ROOT)) + (_INTERPRETER_CHOICES if interpreter_choices else "")
            + _BENCH_PATHS.format(root=str(ROOT), size=SIZE, ops=list(ops)))
    _run_script(code, gc.record_env(path, pin=pin))
    return _launch_cache.read_records(str(path))


def _declared_constexprs(kernel: str) -> tuple:
    """(names of the kernel's ``tl.constexpr`` parameters, names an @triton.autotune config sets:
    the pinned config on a GPU and the interpreter's single config may differ in those)."""
    import inspect

    module, qual = kernel.split(":")
    obj = getattr(importlib.import_module(module), qual)
    tuned = set()
    while not inspect.isfunction(obj):
        for c in getattr(obj, "configs", None) or []:
            tuned |= set(c.kwargs)
        obj = obj.fn
    declared = {n for n, p in inspect.signature(obj).parameters.items() if "constexpr" in str(p.annotation)}
    return declared, tuned


def _project_record(rec: dict, declared: set, tuned: set) -> tuple:
    from kernels._launch_cache import decode

    sig = decode(rec["signature"])
    names = list(sig)
    cx = {names[k[0]]: str(decode(v)) for k, v in rec["constexprs"] if len(k) == 1}
    cx = {n: v for n, v in cx.items() if n in declared and n not in tuned}
    ptr = {n: t[1:] for n, t in sig.items() if isinstance(t, str) and t.startswith("*")}
    return rec["kernel"], tuple(sorted(cx.items())), tuple(sorted(ptr.items()))


def _folders_with_triton_kernels() -> set:
    """The kernels/ op folders whose modules define Triton kernels (``@triton.jit``)."""
    out = set()
    for d in sorted((ROOT / "kernels").iterdir()):
        if d.is_dir() and any("@triton.jit" in f.read_text() for f in d.rglob("*.py")):
            out.add(d.name)
    assert out, "no kernels/ folder defines a Triton kernel"
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    ops = sorted(gc.discover_ops()[0])
    return ops, _record(ops, tmp_path_factory.mktemp("rec") / "launches.jsonl")


@pytest.mark.slow   # records or compiles the launches of every op
def test_record_mode_covers_every_interpreted_launch(records, tmp_path):
    """Every launch the benchmark code paths make under the interpreter — kernel, constexprs and
    pointer dtypes — is among the launches record mode collects from the same code paths when it
    makes the interpreter's choices; with the GPU's choices (what the warm-up compiles) it records
    the same kernels with the same pointer dtypes."""
    ops, gpu_recs = records
    recs = _record(ops, tmp_path / "interpreter_choices.jsonl", interpreter_choices=True)
    assert {r["kernel"].split(".")[1] for r in recs} >= _folders_with_triton_kernels()
    out = tmp_path / "interpreted.json"
    code = (_INTERPRETER_HOOK.format(root=str(ROOT)) + _BENCH_PATHS.format(root=str(ROOT), size=SIZE, ops=ops)
            + f"\nopen({str(out)!r}, 'w').write(json.dumps(launches))\n")
    _run_script(code, {"TRITON_INTERPRET": "1"})
    launched = json.loads(out.read_text())
    assert len(launched) >= len(ops) * 2          # a forward and a backward kernel per op at least
    projected = set()
    meta = {}
    for r in recs:
        meta.setdefault(r["kernel"], _declared_constexprs(r["kernel"]))
        projected.add(_project_record(r, *meta[r["kernel"]]))
    missing = []
    for ln in launched:
        if ln["kernel"] not in meta:
            missing.append(f"{ln['kernel']} (never recorded)")
            continue
        declared, tuned = meta[ln["kernel"]]
        key = (ln["kernel"], tuple(sorted((n, v) for n, v in ln["constexprs"].items() if n not in tuned)),
               tuple(sorted(ln["pointers"].items())))
        if key not in projected:
            missing.append(str(key))
    assert not missing, "launched under the interpreter but not recorded:\n" + "\n".join(missing[:10])
    kinds = lambda rs: {(r[0], r[2]) for r in rs}
    gpu = {_project_record(r, *meta.setdefault(r["kernel"], _declared_constexprs(r["kernel"]))) for r in gpu_recs}
    assert kinds(gpu) == kinds(projected)


@pytest.mark.slow   # records or compiles the launches of every op
def test_compiled_record_is_found_by_the_launch(records, tmp_path):
    """The warm-up worker's compile of a record lands under the cache hash the launch looks up;
    a record changed after the fact is reported as another cache key."""
    _, recs = records
    rec = next(r for r in recs if r["kernel"] == "kernels.linear_scan.chunk:_bwd_kernel")
    bad = json.loads(json.dumps(rec))
    bad["hash"] = "0" * 64
    code = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from kernels import _launch_cache as lc
        rec, bad = json.loads({json.dumps(json.dumps(rec))}), json.loads({json.dumps(json.dumps(bad))})
        before = lc.cached(rec)
        res = lc.compile_record(rec)
        print(json.dumps({{"before": before, "res": res, "after": lc.cached(rec),
                           "bad": lc.compile_record(bad)["hash_ok"]}}))
    """)
    p = _run_script(code, {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": "0"})
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["res"]["status"] == "ok", got
    assert got["before"] is False and got["after"] is True
    assert got["res"]["hash_ok"] is True and got["bad"] is False


@pytest.mark.slow   # records or compiles the launches of every op
def test_pinning_turns_autotuning_off_for_our_kernels(records, tmp_path):
    """linear_scan's kernels are autotuned; pinned, each records exactly one config."""
    _, recs = records
    per = lambda rs: {k: sum(r["kernel"] == k for r in rs) for k in {r["kernel"] for r in rs}}
    pinned = per([r for r in recs if ".linear_scan." in r["kernel"]])
    assert pinned and all(n == 1 for n in pinned.values()), pinned
    free = per(_record(["linear_scan"], tmp_path / "free.jsonl", pin=False))
    assert any(n > 1 for n in free.values()), free     # unpinned, the autotuner would compile every candidate


def test_warmup_walks_every_later_step(monkeypatch):
    from types import SimpleNamespace

    a = SimpleNamespace(compile_archs=["transformer", "ttt_linear"], profile_archs=["transformer", "ttt_linear", "hybrid"],
                        record_jobs=4, seq_len_kernels=8192)
    items = gc.record_items(["tests", "kernels", "train", "profile"], a)
    cmds = [c for _, c in items]
    for op in gc.discover_ops()[0]:
        timed = gc.kernel_cmd(op, 8192, 12, 64, 10, Path("x.json"))
        assert any(c[:len(timed) - 6] == timed[:-6] and "--record-pass" in c for c in cmds), op
    for p, T, comp in gc.train_items("train", a) + gc.train_items("profile", a):
        timed = gc.train_cmd(p, T, None)
        rec = gc.train_cmd(p, T, None, record=True)
        assert rec in cmds, p.path                            # the compiled variant calls the same ops
        assert [x for x in rec if x not in ("1", "0")] == [x for x in timed if x not in ("8", "2")], p.path
    tests = [c for label, c in items if label == "gpu test tier"]
    assert tests and all(f in tests[0] for f in gc.gpu_test_files())
    assert len({tuple(c) for c in cmds}) == len(cmds)      # the profile's presets are recorded once


@pytest.mark.slow   # records or compiles the launches of every op
def test_warmup_step_records_compiles_and_reports(monkeypatch, tmp_path):
    """The warm-up step end to end on CPU: a record item (the stand-in driver in place of a GPU) and
    a record item that crashes; the recorded launches compiled by worker processes into the Triton
    cache; the report names the slowest compiles and the crash; a second warm-up finds everything
    cached. Then ``compiled_since`` sees no kernel compiled after it."""
    from types import SimpleNamespace

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # the campaign's 90 s per record process is a GPU machine's; a loaded 2-core CPU may need more
    monkeypatch.setitem(gc.ITEM_LIMITS, "record", 600.0)
    code = _FAKE_DRIVER.format(root=str(ROOT)) + _BENCH_PATHS.format(root=str(ROOT), size=SIZE, ops=["linear_scan"])
    items = [("linear_scan", [sys.executable, "-c", code]),
             ("broken", [sys.executable, "-c", "raise SystemExit('RuntimeError: no such preset')"])]
    a = SimpleNamespace(out=tmp_path, jobs=2, record_jobs=2)

    def warm():
        title, cols = gc.STEP_TITLES["warmup"]
        s = gc.Step("warmup", title, list(cols), budget=600.0).start(600.0)
        gc.step_warmup(s, a, items, lambda *_: None)
        return s

    s = warm()
    d = s.data
    assert d["recorded"] == 2 and d["compiled"] == 2 and not d["errors"] and not d["hash_mismatch"], d
    assert [x["name"] for x in d["slowest"]] and all(x["name"] in ("_fwd_kernel", "_bwd_kernel") for x in d["slowest"])
    rows = {r[0]: r[1] for r in s.rows}
    assert rows["distinct specializations recorded"] == "2"
    assert any(k.startswith("slow compile: _fwd_kernel w") for k in rows)
    assert rows["record pass `broken`: exit 1"] == "RuntimeError: no such preset"
    warm_end = __import__("time").time()
    assert json.loads((tmp_path / "warmup.json").read_text())["results"][0]["status"] == "ok"
    again = warm().data
    assert again["already_cached"] == 2 and again["compiled"] == 0
    assert gc.compiled_since(warm_end, cache) == {"ours": [], "inductor": []}
    assert set(gc.compiled_since(0.0, cache)["ours"]) == {"_fwd_kernel", "_bwd_kernel"}


def test_record_mode_leaves_no_autotune_results_on_disk(tmp_path):
    """An autotuned kernel that caches its results on disk (as flash-linear-attention's do) records
    every candidate config in record mode and writes no stand-in result for the timed run to find."""
    (tmp_path / "tuned_mod.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)],
                         key=["n"], cache_results=True)
        @triton.jit
        def scale(x, y, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y + i, 2 * tl.load(x + i, mask=i < n), mask=i < n)
    """))
    code = _FAKE_DRIVER.format(root=str(ROOT)) + textwrap.dedent(f"""
        sys.path.insert(0, {str(tmp_path)!r})
        import kernels._triton_utils
        import torch, tuned_mod
        x = torch.randn(100)
        tuned_mod.scale[(4,)](x, torch.empty_like(x), 100)
    """)
    cache = tmp_path / "cache"
    _run_script(code, dict(gc.record_env(tmp_path / "rec.jsonl"), TRITON_CACHE_DIR=str(cache)))
    from kernels import _launch_cache

    recs = _launch_cache.read_records(str(tmp_path / "rec.jsonl"))
    assert sorted(r["num_warps"] for r in recs) == [1, 2]
    written = [p.name for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert not written, written
