r"""Compile every Triton kernel a program will launch before it runs, in parallel, into one
Triton cache: the GPU campaign's warm-up (``benchmarks/gpu_campaign.py``).

Two switches. Importing a kernel never records: the recorder is installed only by a process that
asks for it, with :func:`install_recorder` (or :func:`install_recorder_from_env`, which the GPU
campaign's record processes run at start-up through ``benchmarks/launch_recording/``), and
:func:`remove_recorder` takes it out again. Pinning is read from the environment when
``kernels._triton_utils`` is imported (every kernel module imports it).

Recording (``TTT_LM_RECORD_LAUNCHES=<file>`` for the campaign's processes) — record, do not run.
Every ``@triton.jit`` launch (ours and any
other package's, e.g. flash-linear-attention's) that would compile appends one JSON line to
``<file>`` — the kernel (module and name), its signature, constexprs, specialization attributes
(pointer alignment, integer divisibility), compile options and target, and the hash of the Triton
cache entry its compile would write — and returns without compiling or launching. The program
runs on with unwritten outputs: a record pass only walks the code paths. An ``@triton.autotune``
kernel records each config it would benchmark (the benchmark itself is skipped, and nothing is
written to Triton's autotune cache on disk).

``TTT_LM_PIN_LAUNCH_CONFIGS=1`` — no autotuning for the kernels of ``kernels/``: an autotuned
kernel runs the first config its pruner keeps for the GPU family (the configs the compile gate
declares per family in ``kernels/<op>/compile_cases.py``), without benchmarking; other packages' autotuners
are left alone.

:func:`compile_record` compiles one recorded line with ``triton.compile`` for its target — the call
a launch makes — into ``TRITON_CACHE_DIR``; it needs no GPU, and it checks that the cache entry it
wrote has the hash the launch will look up (``hash_ok``), so a later launch of that kernel finds it
compiled. Written for Triton 3.x (checked with 3.6 and 3.9): it replaces the private
``JITFunction._do_compile`` while recording, and refuses a Triton whose method has another
signature.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import os
import time
from typing import Any, Dict, Optional

RECORD_ENV = "TTT_LM_RECORD_LAUNCHES"
PIN_ENV = "TTT_LM_PIN_LAUNCH_CONFIGS"
#: a label the recording process gives its records (the GPU campaign: "timed" or "tests")
LABEL_ENV = "TTT_LM_RECORD_LABEL"
_DO_COMPILE_ARGS = ["self", "key", "signature", "device", "constexprs", "options", "attrs", "warmup"]
_installed: Dict[str, Any] = {}


def recorder_path() -> Optional[str]:
    """The file this process records its launches to, or None when the recorder is not installed
    (launches compile and run)."""
    return _installed.get("record")


# ---- exact JSON for the values a compile takes -------------------------------------------------
def encode(v):
    """JSON of a signature / constexpr / attribute / option value that decodes to an equal value of
    the same type (tuples stay tuples, ``tl.dtype`` and ``tl.constexpr`` keep their class): the
    Triton cache key is built from their ``str``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"__tuple": [encode(x) for x in v]}
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, dict):
        return {"__dict": [[encode(k), encode(x)] for k, x in v.items()]}
    cls = type(v).__name__
    if cls == "dtype" and hasattr(v, "name"):
        return {"__dtype": v.name}
    if cls == "constexpr":
        return {"__constexpr": encode(v.value)}
    if cls == "JITFunction":
        return {"__jit": f"{v.fn.__module__}:{v.fn.__qualname__}"}
    raise TypeError(f"kernels._launch_cache: cannot record a value of type {cls}: {v!r}")


def decode(v):
    if isinstance(v, list):
        return [decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "__tuple" in v:
        return tuple(decode(x) for x in v["__tuple"])
    if "__dict" in v:
        return {decode(k): decode(x) for k, x in v["__dict"]}
    if "__dtype" in v:
        import triton.language as tl
        return tl.dtype(v["__dtype"])
    if "__constexpr" in v:
        import triton.language as tl
        return tl.constexpr(decode(v["__constexpr"]))
    if "__jit" in v:
        return _resolve(v["__jit"])
    raise ValueError(f"kernels._launch_cache: unknown encoded value {v!r}")


def _resolve(name: str):
    """The JITFunction ``module:qualname`` (unwrapping an Autotuner / Heuristics)."""
    module, qual = name.split(":", 1)
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "cache_key") or not hasattr(obj, "arg_names"):
        obj = obj.fn
    return obj


def _cache_hash(src, backend, options_dict: dict, env_vars=None) -> str:
    """The directory name ``triton.compile`` gives ``src`` in the Triton cache."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key

    opts = backend.parse_options(dict(options_dict, **src.parse_options()))
    env = get_cache_invalidating_env_vars() if env_vars is None else env_vars
    return hashlib.sha256(get_cache_key(src, backend, opts, env).encode("utf-8")).hexdigest()


# ---- recording ---------------------------------------------------------------------------------
def _record_line(path: str, rec: dict) -> None:
    data = (json.dumps(rec) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)          # one write per line: lines from parallel processes do not interleave
    finally:
        os.close(fd)


def install_recorder(path: str) -> None:
    """Launches of every ``@triton.jit`` kernel in this process append their compile to ``path``
    instead of compiling and running (see the module docstring)."""
    if _installed.get("record") == path:
        return
    from triton.compiler import ASTSource
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    orig = _installed.get("do_compile", JITFunction._do_compile)
    if list(inspect.signature(orig).parameters) != _DO_COMPILE_ARGS:
        raise RuntimeError(f"kernels._launch_cache: this Triton's JITFunction._do_compile takes "
                           f"{list(inspect.signature(orig).parameters)}, not {_DO_COMPILE_ARGS}; "
                           f"launch recording supports Triton 3.x as of 3.6-3.9")
    _installed["do_compile"] = orig

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel_cache, _, target, backend, _ = self.device_caches[device]
        name = f"{self.fn.__module__}:{self.fn.__qualname__}"
        try:
            src = ASTSource(self, signature, constexprs, attrs)
            rec = {"kernel": name, "name": self.fn.__name__, "signature": encode(dict(signature)),
                   "constexprs": [[list(k), encode(v)] for k, v in constexprs.items()],
                   "attrs": [[list(k), encode(v)] for k, v in attrs.items()],
                   "options": encode(dict(options.__dict__)), "target": encode(dict(target.__dict__)),
                   "num_warps": options.num_warps, "num_stages": options.num_stages,
                   "hash": _cache_hash(src, backend, dict(options.__dict__)),
                   "source": os.environ.get(LABEL_ENV, "")}
        except Exception as e:  # a launch we cannot describe is compiled where it runs; say which
            rec = {"kernel": name, "name": self.fn.__name__, "hash": None,
                   "error": f"{type(e).__name__}: {e}"[:300]}
        _record_line(path, rec)
        return None

    def _bench(self, *args, config, **meta):
        # record the config's launch once; the timing itself would measure nothing
        current = dict(meta, **config.all_kwargs())
        self.fn.run(*args, **current)
        return [0.0, 0.0, 0.0]

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        # the recorded "timings" are not timings: never let them into Triton's autotune cache on
        # disk (flash-linear-attention turns it on), where the timed run would take them as results
        bench_fn()
        return False

    _installed.setdefault("bench", autotuner.Autotuner._bench)
    JITFunction._do_compile = _do_compile
    autotuner.Autotuner._bench = _installed["record_bench"] = _bench
    if hasattr(autotuner.Autotuner, "check_disk_cache"):
        _installed.setdefault("check_disk_cache", autotuner.Autotuner.check_disk_cache)
        autotuner.Autotuner.check_disk_cache = check_disk_cache
    _installed["record"] = path


def remove_recorder() -> None:
    """Undo :func:`install_recorder`: launches compile and run again (no-op when not installed)."""
    if "record" not in _installed:
        return
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    if autotuner.Autotuner._bench is not _installed["record_bench"]:
        raise RuntimeError("kernels._launch_cache: the autotuner's benchmark was replaced after the recorder "
                           "was installed (install_pinning?); the recorder cannot be removed from this process")
    JITFunction._do_compile = _installed.pop("do_compile")
    autotuner.Autotuner._bench = _installed.pop("bench")
    if "check_disk_cache" in _installed:
        autotuner.Autotuner.check_disk_cache = _installed.pop("check_disk_cache")
    del _installed["record"], _installed["record_bench"]


def install_recorder_from_env() -> None:
    """Install the recorder for ``$TTT_LM_RECORD_LAUNCHES`` (a no-op when it is unset): the
    start-up of the GPU campaign's record processes (``benchmarks/launch_recording/``)."""
    if os.environ.get(RECORD_ENV):
        install_recorder(os.environ[RECORD_ENV])


def _ours(tuner) -> bool:
    fn = tuner.fn
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__module__", "").startswith("kernels.")


def install_pinning() -> None:
    """The autotuned kernels of ``kernels/`` run the first config their pruner keeps, unbenchmarked."""
    if _installed.get("pin"):
        return
    from triton.runtime import autotuner

    prune, bench = autotuner.Autotuner.prune_configs, autotuner.Autotuner._bench

    def prune_configs(self, kwargs):
        kept = prune(self, kwargs)
        return kept[:1] if _ours(self) else kept

    def _bench(self, *args, config, **meta):
        if _ours(self):
            return [0.0, 0.0, 0.0]     # one config left: nothing to compare (its launch follows)
        return bench(self, *args, config=config, **meta)

    autotuner.Autotuner.prune_configs = prune_configs
    autotuner.Autotuner._bench = _bench
    _installed["pin"] = True


def install_pinning_from_env() -> None:
    """Apply ``TTT_LM_PIN_LAUNCH_CONFIGS`` (no-op when unset or 0)."""
    if os.environ.get(PIN_ENV, "0") not in ("", "0"):
        install_pinning()


# ---- capturing without a GPU ---------------------------------------------------------------------
#: SMs of the GPU a capture stands in for, per launch family (H100 SXM, A100): the grids sized to
#: fill the GPU (``num_sms``) are those of these parts
CAPTURE_SMS = {90: 132, 80: 108}
_capture: Dict[str, Any] = {"arch": None}


def capture_arch() -> Optional[int]:
    """The launch family (90 or 80) a capture stands in for, or None outside :func:`capture`."""
    return _capture["arch"]


class _StandInDriver:
    """What ``JITFunction.run`` asks of a driver before it compiles: a device (the arch number, so
    that each family gets its own binder and kernel cache), a stream and the target."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.arch, 32)

    def is_active(self):
        return True


@contextlib.contextmanager
def capture(path: str, arch: int):
    """Within the block, every ``@triton.jit`` launch is recorded to ``path`` (as in record mode)
    as the launch would compile on a GPU of family ``arch`` (90: sm_90, 80: sm_80), and run
    nowhere: a stand-in driver answers for the GPU, the kernels of ``kernels/`` take tensors on
    the ``meta`` device (``triton_available``), their launch configs are the family's
    (``device_arch``), and ``num_sms`` is that of the family's part (``CAPTURE_SMS``). A program
    whose tensors are all on ``meta`` then walks every code path of a real step, computing
    nothing: the compile gate's captured cases (``ttt_lm/launch_capture.py``). Pointer alignment is
    a meta tensor's byte offset into its storage, as on a GPU, whose allocations are aligned."""
    if arch not in CAPTURE_SMS:
        raise ValueError(f"capture: arch must be one of {sorted(CAPTURE_SMS)}, got {arch!r}")
    if _capture["arch"] is not None:
        raise RuntimeError("capture: already capturing")
    from triton.runtime.driver import driver

    prev_driver, prev_record = driver._active, _installed.get("record")
    ops = _our_custom_ops()
    fakes = {n: d._abstract_fn for n, d in ops.items()}
    # an autotuner that chose a config in this process launches only that one: start each capture
    # from empty choices, so that it records every config a GPU could pick whatever ran before
    tuners = _our_autotuners()
    choices = {id(t): t.cache for t in tuners}
    for t in tuners:
        t.cache = {}
    install_recorder(path)
    driver.set_active(_StandInDriver(arch))
    _capture["arch"] = arch
    for d in ops.values():      # on meta tensors a custom op runs its fake; run the real one
        d._abstract_fn = d._init_fn
    try:
        yield
    finally:
        for t in tuners:
            t.cache = choices[id(t)]
        for n, d in ops.items():
            d._abstract_fn = fakes[n]
        _capture["arch"] = None
        driver._active = prev_driver
        if prev_record is None:
            remove_recorder()
        else:
            install_recorder(prev_record)


def _our_autotuners() -> list:
    """The ``@triton.autotune`` kernels of the imported ``kernels/`` modules."""
    import sys

    from triton.runtime.autotuner import Autotuner

    seen, out = set(), []
    for name, mod in list(sys.modules.items()):
        if name.startswith("kernels.") and mod is not None:
            for v in vars(mod).values():
                for _ in range(4):      # Heuristics over an Autotuner over a JITFunction, …
                    if isinstance(v, Autotuner) or inspect.isfunction(v) or not hasattr(v, "fn"):
                        break
                    v = v.fn
                if isinstance(v, Autotuner) and id(v) not in seen and hasattr(v, "cache"):
                    seen.add(id(v))
                    out.append(v)
    return out


def _our_custom_ops() -> Dict[str, Any]:
    """The ``torch.library.custom_op`` definitions of ``kernels/`` ("kernels::…"), every op module
    imported first. Their real function runs on meta tensors during a capture in place of the fake
    (shape-only) one, so that the Triton launches inside are made (and recorded)."""
    import pkgutil

    import kernels
    from torch._library import custom_ops

    for m in pkgutil.walk_packages(kernels.__path__, "kernels."):
        if not m.name.rsplit(".", 1)[-1].startswith("_") and not m.name.endswith(("gate", "compile_report")):
            importlib.import_module(m.name)
    defs = getattr(custom_ops, "OPDEFS", None)
    if defs is None:
        raise RuntimeError("capture: this torch has no torch._library.custom_ops.OPDEFS (checked with 2.13)")
    ours = {n: d for n, d in defs.items() if n.startswith("kernels::")}
    for n, d in ours.items():
        if not (hasattr(d, "_abstract_fn") and hasattr(d, "_init_fn")):
            raise RuntimeError(f"capture: custom op {n} has no _abstract_fn/_init_fn in this torch")
    return ours


# ---- compiling a record ------------------------------------------------------------------------
def compile_record(rec: dict) -> dict:
    """Compile one recorded launch into ``TRITON_CACHE_DIR`` (no GPU needed). Returns name, hash,
    seconds, status ("ok" / "error"), error, and ``hash_ok``: whether the compile's cache entry is
    the one the recorded launch will look up."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    out = {"kernel": rec["kernel"], "name": rec["name"], "hash": rec["hash"], "status": "ok", "error": None,
           "num_warps": rec.get("num_warps"), "num_stages": rec.get("num_stages")}
    t0 = time.perf_counter()
    try:
        fn = _resolve(rec["kernel"])
        target = GPUTarget(**decode(rec["target"]))
        signature = decode(rec["signature"])
        constexprs = {tuple(k): decode(v) for k, v in rec["constexprs"]}
        attrs = {tuple(k): decode(v) for k, v in rec["attrs"]}
        options = decode(rec["options"])
        src = ASTSource(fn, signature, constexprs, attrs)
        out["hash_ok"] = _cache_hash(src, make_backend(target), options) == rec["hash"]
        triton.compile(src, target=target, options=options)
    except Exception as e:  # a compile error is a result: reported per kernel
        out.update(status="error", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def worker_init() -> None:
    """A compile worker process compiles, it never interprets."""
    os.environ["TRITON_INTERPRET"] = "0"


def read_records(path: str) -> list:
    """The distinct records of a record file (by cache hash), in first-seen order."""
    seen, out = set(), []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue    # a line cut short by a killed process
            if rec.get("hash") is None:
                continue    # a launch record mode could not describe (its "error" says why)
            if rec["hash"] not in seen:
                seen.add(rec["hash"])
                out.append(rec)
    return out


def cached(rec: dict) -> bool:
    """Whether the Triton cache (``TRITON_CACHE_DIR``) already holds the compile of ``rec``: the
    lookup ``triton.compile`` makes before compiling."""
    from triton.runtime.cache import get_cache_manager

    group = get_cache_manager(rec["hash"]).get_group(f"{rec['name'][:150]}.json")
    return bool(group) and f"{rec['name'][:150]}.json" in group
