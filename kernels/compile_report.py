r"""Ahead-of-time compile gate: every Triton kernel under ``kernels/``, compiled for an NVIDIA
target without a GPU, and what ptxas says about it.

    python -m kernels.compile_report --arch 90 --json out.json        # H100 (sm_90)
    python -m kernels.compile_report --arch 80 --arch 90              # both, table only
    python -m kernels.compile_report --list                           # the cases, no compiling

Each op declares the launch configurations it really uses in its own folder: a module
``kernels/<op>/compile_cases.py`` with a function ``compile_cases() -> list[Case]`` built with
:func:`case` (one kernel, its argument types, its constexprs, ``num_warps``/``num_stages``) or
:func:`autotune_cases` (every config of an ``@triton.autotune`` kernel that its pruner can keep).
The report imports every such module; it never names a kernel itself, so a kernel is added or
fixed without touching this file. Beside these sweeps, every launch the presets' training and
decode steps make (``kernels/captured_launches.json``, written by ``python -m
ttt_lm.launch_capture`` without a GPU) is a case of its own, compiled exactly as the launch
specializes it (:func:`captured_cases`). It also scans the sources for ``@triton.jit`` kernels that are
launched (``kernel[grid](...)``) and lists each one no ``compile_cases.py`` covers as a failure.

Every case is compiled with ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` — the same
pipeline a launch runs, down to the ptxas that ships in the triton wheel — with pointer arguments
marked 16-byte aligned as a launch with ``torch`` tensors marks them. From ptxas' ``-v`` log and
the PTX it reports

* registers per thread, spilled bytes (stores / loads) and the stack frame;
* shared memory (Triton's allocation, what the launcher checks against the device);
* tensor-core instructions in the PTX: ``wgmma.mma_async`` (Hopper warp-group MMA) and
  ``mma.sync`` (the Ampere MMA, also run by the tensor cores of sm_90; Triton chooses it on
  sm_90 when a product has fewer than 64 rows per warp group);
* the compile time.

and checks: it compiles; 0 spilled bytes; shared memory within the device's opt-in limit per
block (232448 B on sm_90, 166912 B on sm_80); at least one tensor-core instruction in every
kernel declared ``matmul=True`` (one that calls ``tl.dot``).

Compiles run in parallel (``--jobs``, default 2) in long-lived worker subprocesses; a case that
does not finish within ``--timeout`` seconds has its worker killed (and replaced) and is reported
as a timeout. Results kept in the repository (``kernels/compile_gate_results.json``, written with
``--save-results``) are read first, by the same key, so a checkout whose kernels are unchanged
compiles nothing. Results are also cached under
``$TTT_LM_AOT_CACHE`` (default ``~/.cache/ttt-lm/compile_report``) keyed by the kernel's source
(Triton's ``cache_key``, which covers the ``@triton.jit`` functions it calls), the case, the target
and the Triton version: an unchanged kernel is not compiled again. Timeouts are not cached. Cases
with the same key (the same compile, e.g. a head dim passed as a runtime argument) are compiled
once per run and share the row.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import queue
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

#: opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_LIMIT = {90: 232448, 80: 166912}
ARCHS = (90, 80)
KERNELS_DIR = Path(__file__).resolve().parent
_SCALAR_TYPES = {"i32", "i64", "fp32", "fp64", "u32", "u64", "i1"}


@dataclasses.dataclass
class Case:
    """One launch configuration of one kernel. ``signature`` maps every argument, in order, to a
    Triton type (``*bf16`` for a pointer to bfloat16, ``i32``, ``fp32``) or ``constexpr``;
    ``constexprs`` holds the constexpr values."""
    op: str
    module: str
    kernel: str
    config: str
    signature: Dict[str, str]
    constexprs: Dict[str, Any]
    num_warps: int
    num_stages: int
    matmul: bool
    archs: Sequence[int] = ARCHS
    #: a captured launch (``kernels/captured_launches.json``): compiled exactly as recorded, with
    #: its specialization attributes and options, for its one arch
    record: Optional[dict] = None

    @property
    def id(self) -> str:
        return f"{self.kernel}[{self.config}]"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["archs"] = list(self.archs)
        d["constexprs"] = {k: _encode(v) for k, v in self.constexprs.items()}
        if self.record is not None:
            d["constexprs"] = {}      # the record holds them (encoded as a launch records them)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Case":
        d = dict(d)
        d["archs"] = tuple(d["archs"])
        d["constexprs"] = {k: _decode(v) for k, v in d["constexprs"].items()}
        return cls(**d)


#: the launches the presets' steps make, captured without a GPU (``python -m ttt_lm.launch_capture``)
CAPTURE_FILE = KERNELS_DIR / "captured_launches.json"


def _calls_dot(fn, seen=None) -> bool:
    """Whether the kernel ``fn`` (a Python function) or a ``@triton.jit`` function it calls says
    ``tl.dot``."""
    seen = set() if seen is None else seen
    if fn in seen:
        return False
    seen.add(fn)
    src = inspect.getsource(fn)
    if "tl.dot(" in src:
        return True
    for node in ast.walk(ast.parse(inspect.cleandoc("\n" + src) if src.startswith((" ", "\t")) else src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            g = fn.__globals__.get(node.func.id)
            if g is not None and hasattr(g, "fn"):
                try:
                    if _calls_dot(_pyfunc(g), seen):
                        return True
                except TypeError:
                    continue
    return False


def captured_cases(path: Path = CAPTURE_FILE, matmul: Optional[Mapping[tuple, bool]] = None) -> List[Case]:
    """One case per captured launch of ``path``: its kernel, for the arch it was captured at,
    compiled with the recorded signature, constexprs, specialization attributes (alignment,
    divisibility) and options. Named "captured <first preset:step> <digest>". ``matmul``:
    (module, kernel) → whether the kernel calls ``tl.dot``, as its op's ``compile_cases.py`` declares it
    (else: whether its source says ``tl.dot``)."""
    if not path.exists():
        return []
    from kernels._launch_cache import decode

    out = []
    for r in json.loads(path.read_text())["launches"]:
        module, qual = r["kernel"].split(":", 1)
        sig = decode(r["signature"])
        digest = hashlib.sha256(json.dumps([r[f] for f in ("signature", "constexprs", "attrs", "options")],
                                           sort_keys=True).encode()).hexdigest()[:8]
        op = module.split(".")[1] if module.startswith("kernels.") else module
        mm = (matmul or {}).get((module, qual))
        if mm is None:
            mm = _calls_dot(_pyfunc(getattr(importlib.import_module(module), qual)))
        out.append(Case(op, module, qual, f"captured {r['where'][0]} {digest}", dict(sig), {},
                        int(r["num_warps"]), int(r["num_stages"]), mm, (int(r["arch"]),), record=r))
    return out


def _encode(v):
    """JSON for a constexpr value: numbers, strings, None, or a ``tl.dtype`` (as its name)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if type(v).__name__ == "dtype" and hasattr(v, "name"):
        return {"tl.dtype": v.name}
    raise TypeError(f"compile_report: cannot pass constexpr value {v!r} to the compile worker")


def _decode(v):
    if isinstance(v, dict) and "tl.dtype" in v:
        import triton.language as tl
        return tl.dtype(v["tl.dtype"])
    return v


def _pyfunc(kernel):
    """The Python function under a JITFunction, Autotuner, Heuristics or InterpretedFunction."""
    f = kernel
    while not inspect.isfunction(f):
        if not hasattr(f, "fn"):
            raise TypeError(f"compile_report: {kernel!r} is not a Triton kernel")
        f = f.fn
    return f


def arg_names(kernel) -> List[str]:
    """The argument names of a kernel, in order."""
    return list(inspect.signature(_pyfunc(kernel)).parameters)


def case(kernel, config: str, *, constexprs: Mapping[str, Any], scalars: Mapping[str, str],
         pointers: Mapping[str, str] | None = None, pointer_default: str = "fp32", num_warps: int = 4,
         num_stages: int = 1, matmul: bool = True, archs: Sequence[int] = ARCHS) -> Case:
    """A :class:`Case` for ``kernel``. Every argument is a constexpr (``constexprs``), a scalar
    (``scalars``: name → ``i32`` / ``fp32`` / …) or a pointer (element type from ``pointers``,
    else ``pointer_default``: ``bf16``, ``fp32``, …; ``pointers`` may name arguments of other
    kernels, so one mapping serves a family; ``scalars`` likewise). A pointer argument passed as ``None`` is a
    constexpr ``None``. ``matmul``: the kernel calls ``tl.dot``, so the gate expects tensor-core
    instructions."""
    fn = _pyfunc(kernel)
    names = list(inspect.signature(fn).parameters)
    pointers = dict(pointers or {})
    unknown = set(constexprs) - set(names)
    if unknown:
        raise ValueError(f"compile_report: {fn.__name__} has no argument(s) {sorted(unknown)}")
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in scalars:
            if scalars[n] not in _SCALAR_TYPES:
                raise ValueError(f"compile_report: {fn.__name__}.{n}: scalar type {scalars[n]!r} not in "
                                 f"{sorted(_SCALAR_TYPES)}")
            sig[n] = scalars[n]
        else:
            sig[n] = "*" + pointers.get(n, pointer_default)
    op = fn.__module__.split(".")[1] if fn.__module__.startswith("kernels.") else fn.__module__
    return Case(op, fn.__module__, fn.__name__, config, sig, dict(constexprs), int(num_warps), int(num_stages),
                bool(matmul), tuple(archs))


def cases_from_launches(launches: Iterable[Mapping[str, Any]]) -> List[Case]:
    """Cases from launch descriptions (dicts with kernel, config, signature — every non-constexpr
    argument mapped to a Triton type, ``*`` before a pointer's element type — constexprs, num_warps,
    num_stages, and optionally archs: the targets a launch config is chosen for, when an op picks
    its config by GPU family), the form an op's ``launch_configs()`` returns."""
    out = []
    for c in launches:
        scalars = {n: t for n, t in c["signature"].items() if not t.startswith("*")}
        pointers = {n: t[1:] for n, t in c["signature"].items() if t.startswith("*")}
        out.append(case(c["kernel"], c["config"], constexprs=c["constexprs"], scalars=scalars,
                        pointers=pointers, num_warps=c["num_warps"], num_stages=c["num_stages"],
                        archs=tuple(c.get("archs", ARCHS))))
    return out


def autotune_cases(kernel, config: str, *, constexprs: Mapping[str, Any], **kw) -> List[Case]:
    """One case per config of an ``@triton.autotune`` kernel that its ``early_config_prune`` keeps
    for these call-time ``constexprs`` (the configs a GPU can pick for this call)."""
    configs = list(kernel.configs)
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None:
        configs = prune(configs, getattr(kernel, "nargs", None), **dict(constexprs))
    out = []
    for c in configs:
        meta = {**dict(constexprs), **c.kwargs}
        tag = " ".join(f"{k}={v}" for k, v in c.kwargs.items())
        out.append(case(kernel, f"{config} {tag} w{c.num_warps} s{c.num_stages}".strip(), constexprs=meta,
                        num_warps=c.num_warps, num_stages=c.num_stages, **kw))
    return out


# ---- discovery -----------------------------------------------------------------------------------
def gate_modules() -> List[str]:
    """``kernels.<op>.compile_cases`` for every op folder that has one."""
    return sorted(f"kernels.{m.name}.compile_cases" for m in pkgutil.iter_modules([str(KERNELS_DIR)])
                  if m.ispkg and (KERNELS_DIR / m.name / "compile_cases.py").exists())


def discover() -> List[Case]:
    """Every gate's cases, each under the op whose ``compile_cases.py`` declares it (``--op`` selects by it):
    ops that share kernels (the delta-rule family's ``kernels/delta_rule/core.py``) each declare
    their own launches of them."""
    cases: List[Case] = []
    for mod in gate_modules():
        op = mod.split(".")[1]
        cases.extend(dataclasses.replace(c, op=op) for c in importlib.import_module(mod).compile_cases())
    cases.extend(captured_cases(matmul={(c.module, c.kernel): c.matmul for c in cases}))
    seen = set()
    for c in cases:
        if (c.module, c.id) in seen:
            raise ValueError(f"compile_report: case {c.module}.{c.id} declared twice")
        seen.add((c.module, c.id))
    return cases


def _is_jit(dec) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "jit" or (
        isinstance(target, ast.Name) and target.id == "jit")


def launched_kernels() -> List[tuple]:
    """(module, name) of every module-level ``@triton.jit`` function under ``kernels/`` that some
    file launches as ``name[grid](...)`` — the kernels, as opposed to the helpers they call."""
    jits, launched = {}, set()
    for path in sorted(KERNELS_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        mod = ".".join(("kernels",) + path.relative_to(KERNELS_DIR).with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                jits[node.name] = mod
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                v = node.func.value
                name = v.id if isinstance(v, ast.Name) else (v.attr if isinstance(v, ast.Attribute) else None)
                if name:
                    launched.add(name)
    return sorted((m, n) for n, m in jits.items() if n in launched)


# ---- compiling one case --------------------------------------------------------------------------
_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _kernel_object(c: Case):
    obj = getattr(importlib.import_module(c.module), c.kernel)
    while not hasattr(obj, "cache_key") or not hasattr(obj, "arg_names"):  # Autotuner / Heuristics
        obj = obj.fn
    return obj


def cache_key(c: Case, arch: int) -> str:
    import triton
    fn = _kernel_object(c)
    if c.record is not None:
        blob = json.dumps([fn.cache_key, [c.record[f] for f in ("signature", "constexprs", "attrs", "options",
                                                              "target")], arch, triton.__version__], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]
    blob = json.dumps([fn.cache_key, c.signature, {k: repr(v) for k, v in c.constexprs.items()},
                       c.num_warps, c.num_stages, arch, triton.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def compile_one(c: Case, arch: int) -> dict:
    """Compile ``c`` for sm_``arch`` in this process (which must not be interpreting)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_object(c)
    names = list(fn.arg_names)
    options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    if c.record is not None:
        from kernels._launch_cache import decode
        r = c.record
        src = ASTSource(fn, decode(r["signature"]), {tuple(k): decode(v) for k, v in r["constexprs"]},
                        {tuple(k): decode(v) for k, v in r["attrs"]})
        options = decode(r["options"])
        if decode(r["target"])["arch"] != arch:
            raise ValueError(f"compile_report: {c.id} was captured for sm_{decode(r['target'])['arch']}, not sm_{arch}")
    else:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if c.signature[n].startswith("*")}
        src = ASTSource(fn, dict(c.signature), {n: c.constexprs[n] for n in names if n in c.constexprs}, attrs)
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True       # the ptxas log below exists only on a real compile
    log = io.StringIO()
    t0 = time.perf_counter()
    row = {"status": "ok", "error": None}
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # a compile error is a result of the gate, reported per case
        row.update(status="error", error=f"{type(e).__name__}: {str(e).strip()[:2000]}")
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    text = log.getvalue()
    regs, spill = _RE_REGS.search(text), _RE_SPILL.search(text)
    if regs is None or spill is None:
        row.update(status="error", error=f"no ptxas -v report in the compile log: {text[-500:]!r}")
        return row
    ptx = k.asm["ptx"]
    row.update(registers=int(regs.group(1)), stack=int(spill.group(1)), spill_stores=int(spill.group(2)),
               spill_loads=int(spill.group(3)), shared=int(k.metadata.shared),
               wgmma=len(re.findall(r"\bwgmma\.mma_async\.", ptx)), mma=len(re.findall(r"\bmma\.sync\.", ptx)))
    return row


def checks(c: Case, arch: int, row: dict) -> Dict[str, Optional[bool]]:
    ok = row.get("status") == "ok"
    return {
        "compiles": ok,
        "no_spills": ok and row["spill_stores"] == 0 and row["spill_loads"] == 0,
        "shared_fits": ok and row["shared"] <= SMEM_LIMIT[arch],
        "tensor_cores": (ok and row["wgmma"] + row["mma"] > 0) if c.matmul else None,
    }


# ---- running many ---------------------------------------------------------------------------------
def _cache_dir() -> Path:
    d = os.environ.get("TTT_LM_AOT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ttt-lm",
                                                           "compile_report")
    return Path(d)


class _Worker:
    """A long-lived ``--worker`` subprocess (importing torch and triton once, not per case) that
    compiles the cases sent to it one per line; killed and replaced when a case times out."""

    def __init__(self):
        self.p = None

    def _start(self):
        env = dict(os.environ, TRITON_INTERPRET="0")
        self.err = tempfile.TemporaryFile(mode="w+")   # a file, not a pipe: nobody reads it until the end
        self.p = subprocess.Popen([sys.executable, "-m", "kernels.compile_report", "--worker"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  text=True, env=env, cwd=str(KERNELS_DIR.parent))

    def compile(self, c: Case, arch: int, timeout: float) -> dict:
        if self.p is None or self.p.poll() is not None:
            self._start()
        t0 = time.perf_counter()
        self.p.stdin.write(json.dumps({"case": c.to_json(), "arch": arch}) + "\n")
        self.p.stdin.flush()
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if ready else ""
        if not line:
            timed_out = not ready
            if timed_out:
                self.p.kill()
            self.close()
            err = self.stderr_tail
            if timed_out:
                return {"status": "timeout", "error": f"did not finish compiling in {timeout:.0f} s",
                        "compile_s": round(time.perf_counter() - t0, 1)}
            return {"status": "error", "error": f"compile worker died: {err}",
                    "compile_s": round(time.perf_counter() - t0, 1)}
        return json.loads(line)

    stderr_tail = ""

    def close(self):
        if self.p is not None:
            self.p.stdin.close()
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
            self.err.seek(0)
            self.stderr_tail = self.err.read()[-2000:]
            self.err.close()
            self.p = None


def run(cases: Iterable[Case], archs: Sequence[int], jobs: int = 2, timeout: float = 300.0,
        use_cache: bool = True, progress=None, timeouts: Optional[Mapping[str, float]] = None) -> List[dict]:
    """Compile every (case, arch) and return one row per pair (cached rows are not compiled).
    ``timeouts`` maps "sm_<arch> kernel[config]" to a per-case limit replacing ``timeout``."""
    timeouts = dict(timeouts or {})
    todo = [(c, a) for c in cases for a in archs if a in c.archs]
    cache = _cache_dir()
    kept = read_results() if use_cache else {}
    rows: List[Optional[dict]] = [None] * len(todo)
    keys: List[str] = []
    # cases that compile the same kernel source with the same arguments, constexprs, options and
    # target (e.g. a head dim that is a runtime argument, not a constexpr) are compiled once
    pending: Dict[str, List[int]] = {}
    for i, (c, a) in enumerate(todo):
        key = cache_key(c, a)
        keys.append(key)
        f = cache / f"{key}.json"
        if key in kept:
            rows[i] = {**kept[key], "cached": True}
        elif use_cache and f.exists():
            rows[i] = {**json.loads(f.read_text()), "cached": True}
        else:
            pending.setdefault(key, []).append(i)
    workers = queue.Queue()
    for _ in range(max(1, jobs)):
        workers.put(_Worker())

    def one(i):
        w = workers.get()
        try:
            c, a = todo[i]
            return w.compile(c, a, timeouts.get(f"sm_{a} {c.id}", timeout))
        finally:
            workers.put(w)

    with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        futs = {ex.submit(one, same[0]): (same, key) for key, same in pending.items()}
        for fut in cf.as_completed(futs):
            same, key = futs[fut]
            r = fut.result()
            if r["status"] != "timeout":
                cache.mkdir(parents=True, exist_ok=True)
                tmp = cache / f"{key}.json.tmp{os.getpid()}"
                tmp.write_text(json.dumps(r))
                tmp.replace(cache / f"{key}.json")
            first = todo[same[0]][0].id
            for i in same:
                rows[i] = {**r, "cached": False} if i == same[0] else {**r, "cached": False, "same_as": first}
            if progress:
                c, a = todo[same[0]]
                also = f" (also {len(same) - 1} identical case{'s' * (len(same) > 2)})" if len(same) > 1 else ""
                progress(f"sm_{a} {c.id}: {r['status']} ({r.get('compile_s', 0)} s){also}")
    while not workers.empty():
        workers.get().close()
    out = []
    for (c, a), r, key in zip(todo, rows, keys):
        row = {"op": c.op, "kernel": c.kernel, "config": c.config, "arch": a, "num_warps": c.num_warps,
               "num_stages": c.num_stages, "matmul": c.matmul, **r, "key": key}
        row["checks"] = checks(c, a, r)
        row["passed"] = all(v is not False for v in row["checks"].values())
        out.append(row)
    return out


#: the gate's results kept in the repository, by content key (``cache_key``: the kernel's source
#: with the functions it calls, the case, the target, the Triton version): a checkout whose
#: kernels are unchanged compiles nothing; a case whose key is not here is compiled (and checked)
RESULTS_FILE = KERNELS_DIR / "compile_gate_results.json"
#: the row fields kept (what the checks and the table read)
_KEPT = ("status", "error", "compile_s", "registers", "stack", "spill_stores", "spill_loads", "shared",
         "wgmma", "mma")


def read_results(path: Optional[Path] = None) -> Dict[str, dict]:
    """key → result row of the kept results (empty when the file is absent or unreadable: then
    everything compiles)."""
    path = RESULTS_FILE if path is None else path
    try:
        return json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return {}


def save_results(rows: Sequence[dict], path: Optional[Path] = None, prune: bool = True) -> int:
    """Keep the compiled results of ``rows`` in ``path`` (timeouts are not results); ``prune``:
    drop the keys of cases that no longer exist (a full run), else merge. Returns the count."""
    import triton

    path = RESULTS_FILE if path is None else path
    old = {} if prune else read_results(path)
    new = {r["key"]: {k: r[k] for k in _KEPT if k in r} for r in rows if r.get("status") != "timeout"}
    res = dict(sorted({**old, **new}.items()))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"triton": triton.__version__, "results": res}, indent=0, sort_keys=True) + "\n")
    tmp.replace(path)
    return len(res)


def uncovered(cases: Sequence[Case]) -> List[tuple]:
    """Launched kernels that no ``compile_cases.py`` declares a case for."""
    have = {(c.module, c.kernel) for c in cases}
    return [k for k in launched_kernels() if k not in have]


def format_table(rows: Sequence[dict]) -> str:
    hdr = ("arch", "kernel", "config", "regs", "spill st/ld", "shared B", "wgmma", "mma", "compile s", "result")
    lines = []
    for r in rows:
        ok = r["status"] == "ok"
        failed = [k for k, v in r["checks"].items() if v is False]
        lines.append((f"sm_{r['arch']}", r["kernel"], r["config"],
                      str(r["registers"]) if ok else "-",
                      f"{r['spill_stores']}/{r['spill_loads']}" if ok else "-",
                      str(r["shared"]) if ok else "-",
                      str(r["wgmma"]) if ok else "-", str(r["mma"]) if ok else "-",
                      f"{r.get('compile_s', 0):.1f}" + ("*" if r.get("cached") else "=" if r.get("same_as") else ""),
                      "pass" if r["passed"] else ("FAIL: " + ", ".join(failed) +
                                                  (f" ({r['status']})" if not ok else ""))))
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(hdr)]
    fmt = " | ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*hdr), "-+-".join("-" * w for w in widths)] + [fmt.format(*l) for l in lines])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.compile_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append", choices=sorted(SMEM_LIMIT),
                    help="compute capability to compile for (repeatable; default: 90 and 80)")
    ap.add_argument("--json", help="write the rows (and uncovered kernels) here")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per compile before it is killed")
    ap.add_argument("--timeouts", help="JSON file mapping 'sm_<arch> kernel[config]' to its own timeout")
    ap.add_argument("--no-cache", action="store_true", help="compile every case again")
    ap.add_argument("-k", dest="match", help="only cases whose 'kernel[config]' contains this text")
    ap.add_argument("--op", action="append", help="only the cases of this op folder (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the cases as JSON and compile nothing")
    ap.add_argument("--save-results", action="store_true",
                    help=f"keep the results in {RESULTS_FILE.relative_to(KERNELS_DIR.parent)} (pruned of "
                         f"cases that are gone when every case ran)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        for line in sys.stdin:
            req = json.loads(line)
            row = compile_one(Case.from_json(req["case"]), req["arch"])
            sys.stdout.write(json.dumps(row) + "\n")
            sys.stdout.flush()
        return 0
    cases = discover()
    if a.match:
        cases = [c for c in cases if a.match in c.id]
    if a.op:
        cases = [c for c in cases if c.op in a.op]
    missing = uncovered(discover())
    if a.list:
        print(json.dumps({"cases": [c.to_json() for c in cases], "uncovered": [list(k) for k in missing]}))
        return 0
    archs = a.arch or list(ARCHS)
    t0 = time.perf_counter()
    timeouts = json.loads(Path(a.timeouts).read_text()) if a.timeouts else None
    rows = run(cases, archs, a.jobs, a.timeout, not a.no_cache, progress=lambda s: print(s, file=sys.stderr),
               timeouts=timeouts)
    wall = time.perf_counter() - t0
    print(format_table(rows))
    for m, n in missing:
        print(f"UNCOVERED: {m}.{n} is launched but no kernels/*/compile_cases.py declares a case for it")
    npass = sum(r["passed"] for r in rows)
    print(f"{npass}/{len(rows)} pass; {len(missing)} kernels without cases; {wall:.0f} s "
          f"(* = cached result, = the result of an identical case above)")
    if a.save_results:
        n = save_results(rows, prune=not (a.match or a.op or a.arch))
        print(f"{n} results kept in {RESULTS_FILE}")
    if a.json:
        Path(a.json).write_text(json.dumps({"archs": archs, "rows": rows, "uncovered": [list(k) for k in missing],
                                            "wall_s": round(wall, 1)}, indent=1))
    return 0 if npass == len(rows) and not missing else 1


if __name__ == "__main__":
    # compiling needs real @triton.jit functions, not the interpreter's: decide before any kernel import
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(main())
