"""The GPU campaign: one command that uses a short GPU window fully, and whose output alone says
what to fix next. See docs/gpu_campaign.md for how to run it in a window and how to record it.

    python benchmarks/gpu_campaign.py prepare                  # here, before sending the tree: the commit
    python benchmarks/gpu_campaign.py run [--out DIR]          # `make gpu-bench`: ≤ 9 min on an H100
    python benchmarks/gpu_campaign.py more [--out DIR]         # `make gpu-bench-more`: ≤ 6 min
    python benchmarks/gpu_campaign.py record --from DIR        # DIR's results into benchmarks/RESULTS.md

``run`` prints the device and software line, then runs its steps in order, each within its own
budget (seconds it did not use pass to the next step; the whole stays within ``--budget``):

1. ``warmup`` — every Triton kernel specialization the later steps launch, compiled before
   anything is timed: the later steps' code runs once in record mode (``kernels/_launch_cache.py``:
   each launch records its compile and is skipped), and the recorded compiles run in parallel worker
   processes into one ``TRITON_CACHE_DIR``. Reports the total and the five slowest compiles.
   Autotuning is off for our kernels on every step (``TTT_LM_PIN_LAUNCH_CONFIGS=1``: each runs the
   first config its pruner keeps for the GPU family, among those the compile gate declares).
2. ``tests`` — the ``gpu`` test tier, in parallel (pytest-xdist; without it, one process per file),
   each failure with its error line.
3. ``kernels`` — ``benchmarks/kernels.py`` at T = 8k, B·T = 64k, H = 12, D = 64, bf16: forward and
   forward+backward of every registered op's forms (Triton, PyTorch, flash-linear-attention where it
   imports) and causal flash SDPA, with GB/s or TFLOP/s. One process per op.
4. ``train`` — ``benchmarks/throughput.py``: tokens/s, MFU and peak memory of every architecture's
   125M-class preset (configs whose ``_base_`` names sizes/125m.yaml) at seq_len 2048 in bf16, and
   with ``model.compile=true`` for the ``--compile-archs``. One process per preset.
5. ``profile`` — the ten CUDA kernels taking the most time in one training step of the
   ``--profile-archs`` 125M presets (torch.profiler).

``more`` runs ``warmup``, ``kernels128`` (H = 16, D = 128), ``train350`` (350M-class presets at 2048)
``train8k`` (the 125M-class presets at seq_len 8192, the transformer as the baseline) and ``e2e``
(``benchmarks/ttt_e2e_step.py``: time and peak memory per token of a TTT-E2E 125M training step,
second-order backward included, against its sliding-window baseline at the preset's 8k).

An item that crashes or runs past its limit is a row with its error, and the campaign goes on; an
item that no budget was left for is a row marked "not run (... budget spent)". After the last
step the campaign lists every kernel compiled after the warm-up (what the warm-up missed).
Writes ``campaign.md``, ``campaign.json``, ``warmup.json`` and ``logs.txt`` into ``--out``
(default ``benchmarks/gpu_results/<date>-<command>/``). No CUDA device: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable
COMMIT_FILE = ROOT / "benchmarks" / ".campaign_commit"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS_MARKER = "## GPU campaign (`benchmarks/gpu_campaign.py`, `make gpu-bench`)\n"

#: (step, seconds) of each command; a step's unused seconds pass to the next
PLANS: Dict[str, List[Tuple[str, float]]] = {
    "run": [("warmup", 140.0), ("tests", 60.0), ("kernels", 70.0), ("train", 200.0), ("profile", 40.0)],
    "more": [("warmup", 60.0), ("kernels128", 60.0), ("train350", 90.0), ("train8k", 70.0), ("e2e", 70.0)],
}
BUDGETS = {"run": 510.0, "more": 350.0}
#: seconds an item may take at most, per step
ITEM_LIMITS = {"record": 90.0, "tests": 600.0, "kernels": 45.0, "kernels128": 45.0, "train": 45.0,
               "train_compile": 75.0, "train350": 45.0, "train8k": 45.0, "profile": 40.0,
               "e2e": 45.0}
#: an item is not started with fewer seconds left in its step
MIN_START = 8.0
TOKENS_PER_STEP = 16384


# ---- what the campaign runs: discovered, never listed by hand --------------------------------------
@dataclass(frozen=True)
class Preset:
    path: str            # relative to ROOT
    arch: str            # the arch/<name>.yaml it builds on (else its file stem)
    size: str            # "125m" / "350m": the sizes/<size>.yaml it builds on

    @property
    def recurrent(self) -> bool:
        return self.arch != "transformer"


def discover_presets(size: str, root: Path = ROOT) -> List[Preset]:
    """The presets under configs/ (top level) built on ``sizes/<size>.yaml``: every architecture's
    preset of that size class, whatever its file name says (mamba_130m, titans_mac_170m)."""
    out = []
    for p in sorted((root / "configs").glob("*.yaml")):
        m = re.search(r"^_base_:\s*\[([^\]]*)\]", p.read_text(), re.M)
        if not m:
            continue
        bases = [b.strip().strip("'\"") for b in m.group(1).split(",")]
        if f"sizes/{size}.yaml" not in bases:
            continue
        arch = next((Path(b).stem for b in bases if b.startswith("arch/")), p.stem)
        out.append(Preset(str(p.relative_to(root)), arch, size))
    return out


def _kernels_module():
    name = "_campaign_kernels_bench"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "kernels.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def discover_ops() -> Tuple[List[str], List[str]]:
    """(the ops benchmarks/kernels.py registers, the kernels/ op folders none of them covers)."""
    kb = _kernels_module()
    return list(kb.REGISTRY), kb.folders_without_bench()


def gpu_test_files(root: Path = ROOT) -> List[str]:
    return [str(f.relative_to(root)) for f in sorted((root / "tests").rglob("test_*.py"))
            if "pytest.mark.gpu" in f.read_text()]


# ---- provenance -----------------------------------------------------------------------------------
def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.check_output(["git", *args], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return None


def prepare(path: Path = COMMIT_FILE) -> str:
    """Write the commit of this checkout (and whether its tree differs from it) into ``path``,
    which travels with the tree (name it in the device call's ``carry``): the device's copy of the
    tree is not a git checkout of it."""
    sha = _git("rev-parse", "HEAD")
    if not sha:
        sys.exit("gpu_campaign prepare: not a git checkout here; nothing to write")
    dirty = [ln for ln in (_git("status", "--porcelain", "--untracked-files=no") or "").splitlines() if ln.strip()]
    text = sha + (f" + uncommitted changes to {len(dirty)} file(s)" if dirty else "")
    path.write_text(json.dumps({"commit": text, "written": datetime.datetime.now(datetime.timezone.utc)
                                .strftime("%Y-%m-%d %H:%M UTC")}) + "\n")
    print(f"gpu_campaign prepare: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {text}")
    return text


WHEELS_FILE = ROOT / "benchmarks" / "gpu_wheels.txt"
WHEEL_DIR = ROOT / ".whl"
#: the device image's Python and platform (docs/gpu_campaign.md)
WHEEL_PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                  "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def wheel_requirements(path: Path = WHEELS_FILE) -> List[str]:
    return [ln.split("#")[0].strip() for ln in path.read_text().splitlines() if ln.split("#")[0].strip()]


def download_wheels(dest: Path = WHEEL_DIR) -> None:
    """The wheels of benchmarks/gpu_wheels.txt, for the device's Python, into ``dest`` (carried
    with the tree; the device has no package index). A wheel of another version of one of these
    packages already in ``dest`` is removed: two versions stop the install there."""
    reqs = wheel_requirements()
    dest.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *WHEEL_PLATFORM,
           "-d", str(dest), *reqs]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"gpu_campaign prepare: pip download failed: {' '.join(cmd)}")
    want = {re.split(r"[=<>]", r)[0].lower().replace("-", "_"): r.split("==")[-1] for r in reqs}
    for w in dest.glob("*.whl"):
        name, version = w.name.split("-")[:2]
        if name.lower() in want and version != want[name.lower()]:
            w.unlink()
    print(f"gpu_campaign prepare: {dest.name}/: " + ", ".join(sorted(w.name for w in dest.glob('*.whl'))))


def read_commit(path: Path = COMMIT_FILE) -> str:
    """The commit ``prepare`` wrote (read first: a copied tree's git metadata can name another
    commit), else this checkout's HEAD, marked as such."""
    if path.exists():
        try:
            return json.loads(path.read_text())["commit"]
        except (ValueError, KeyError):
            return f"unreadable {path.name}: {path.read_text()[:80]!r}"
    sha = _git("rev-parse", "HEAD")
    return f"{sha} (git HEAD of the tree that ran; no {path.name}: run `make gpu-bench-prepare` before sending)" \
        if sha else f"unknown (no {path.name}: run `make gpu-bench-prepare` before sending)"


def device_info() -> Dict[str, str]:
    import torch
    import triton

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "triton": triton.__version__, "python": platform.python_version(),
            "sms": str(torch.cuda.get_device_properties(0).multi_processor_count),
            "memory_GiB": f"{torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.0f}"}
    try:
        info["driver"] = subprocess.check_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                                 text=True, timeout=20).strip().splitlines()[0]
    except Exception:
        info["driver"] = "unknown (nvidia-smi did not answer)"
    try:
        from importlib.metadata import version
        info["fla"] = version("flash-linear-attention")
    except Exception:
        info["fla"] = "not installed"
    info["xdist"] = "yes" if importlib.util.find_spec("xdist") else "no"
    info["cpus"] = str(os.cpu_count())
    return info


def device_line(info: Dict[str, str], commit: str) -> str:
    return (f"{info['gpu']} ({info['sms']} SMs, {info['memory_GiB']} GiB), driver {info['driver']}, CUDA {info['cuda']}, "
            f"torch {info['torch']}, Triton {info['triton']}, Python {info['python']}, "
            f"flash-linear-attention {info['fla']}, {info['cpus']} CPUs; commit {commit}")


# ---- running items within budgets ------------------------------------------------------------------
@dataclass
class ItemResult:
    rc: int
    out: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.rc == 124


def run_cmd(cmd: List[str], timeout: float, env: Optional[Dict[str, str]] = None) -> ItemResult:
    """(exit status, stdout+stderr, seconds); status 124 when the time limit ended it (the whole
    process group is killed: pytest-xdist workers and compile workers too)."""
    t0 = time.perf_counter()
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", start_new_session=True)
    try:
        out, _ = p.communicate(timeout=max(1.0, timeout))
        return ItemResult(p.returncode, out, time.perf_counter() - t0)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
        out, _ = p.communicate()
        return ItemResult(124, out or "", time.perf_counter() - t0)


def last_error(out: str) -> str:
    """The line of ``out`` that says what went wrong: the last ``XxxError: ...`` line, else the last line."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^(?:[a-z_]\w*\.)*[A-Z]\w*: ", ln)
            and not re.match(r"^(?:[a-z_]\w*\.)*\w*Warning: ", ln)]
    return (errs or lines or ["(no output)"])[-1][:300]


class Clock:
    """The campaign's time: a total budget, and each step's allowance (its own seconds plus what the
    steps before it left unused, within what the total has left)."""

    def __init__(self, total: float, now: Callable[[], float] = time.perf_counter):
        self.total, self.now, self.t0, self.carry = total, now, now(), 0.0

    def left(self) -> float:
        return self.total - (self.now() - self.t0)

    def allowance(self, own: float) -> float:
        return max(0.0, min(own + self.carry, self.left()))

    def settle(self, allowance: float, used: float) -> None:
        self.carry = max(0.0, allowance - used)


@dataclass
class Step:
    name: str
    title: str
    columns: List[str]
    budget: float = 0.0
    allowance: float = 0.0
    rows: List[List[str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    commands: List[str] = field(default_factory=list)
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    t0: float = 0.0
    now: Callable[[], float] = time.perf_counter

    def start(self, allowance: float) -> "Step":
        self.allowance, self.t0 = allowance, self.now()
        return self

    def left(self) -> float:
        return self.allowance - (self.now() - self.t0)

    def can_start(self, need: float = MIN_START) -> bool:
        return self.left() >= need

    def skip_row(self, first: str, why: str = "step budget spent") -> None:
        self.rows.append([first, f"not run ({why})"] + [""] * (len(self.columns) - 2))

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "title", "columns", "budget", "allowance", "rows", "notes",
                                             "commands", "seconds", "data")}


def md_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    esc = lambda s: str(s).replace("|", "/").replace("\n", " ")
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows])


def render_step(s: Step) -> str:
    head = [f"### {s.title}", "",
            f"Budget {s.budget:.0f} s, allowed {s.allowance:.0f} s, took {s.seconds:.0f} s."]
    if s.commands:
        head.append("Commands: " + "; ".join(f"`{c}`" for c in s.commands[:2])
                    + (f" … ({len(s.commands)} in all, one per item)" if len(s.commands) > 2 else ""))
    return "\n".join(head + [""] + md_table(s.columns, s.rows) + ([""] + s.notes if s.notes else [])) + "\n"


# ---- step: warm-up ---------------------------------------------------------------------------------
def _summary(rec: dict) -> str:
    """A compile's kernel and its main constexprs, short."""
    from kernels._launch_cache import decode

    cx = []
    for _, v in rec.get("constexprs", []):
        v = decode(v)
        if isinstance(v, (int, str)) and not isinstance(v, bool):
            cx.append(str(v))
    return f"{rec['name']} w{rec.get('num_warps')} s{rec.get('num_stages')}" + (f" [{','.join(cx[:6])}]" if cx else "")


#: put first on PYTHONPATH of a record process: its sitecustomize installs the launch recorder at start-up
RECORD_SITE = ROOT / "benchmarks" / "launch_recording"


def record_env(rec_file: Path, pin: bool = True) -> Dict[str, str]:
    """The environment (added to os.environ) of a command whose Triton launches are recorded to
    ``rec_file`` instead of compiled and run: the recorder is installed at start-up by
    ``benchmarks/launch_recording/sitecustomize.py`` in the process and in the Python processes it
    starts; importing a kernel alone never records. The interpreter is off: what is recorded is a
    GPU's compile (and Triton is imported at start-up, before the program could switch it)."""
    path = [str(RECORD_SITE), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"TTT_LM_RECORD_LAUNCHES": str(rec_file), "TTT_LM_PIN_LAUNCH_CONFIGS": "1" if pin else "0",
            "PYTHONPATH": os.pathsep.join(path), "TRITON_INTERPRET": "0"}


def step_warmup(step: Step, a, record_items: List[Tuple[str, List[str]]], log) -> None:
    """Record the later steps' launches (``record_items``: (label, command) run with
    TTT_LM_RECORD_LAUNCHES) and compile each distinct one as soon as it is recorded."""
    from kernels import _launch_cache

    rec_file = a.out / "launches.jsonl"
    if rec_file.exists():
        rec_file.unlink()
    env = record_env(rec_file)
    jobs = a.jobs or max(2, (os.cpu_count() or 4) - 2)
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_launch_cache.worker_init)
    submitted: Dict[str, dict] = {}
    queue: List[dict] = []
    futures: Dict[cf.Future, dict] = {}
    done: List[dict] = []
    already = 0

    def priority(rec):
        """The timed steps' kernels of ours first, then other packages' (flash-linear-attention's
        autotune candidates), then what only the gpu tests launch (they compile in parallel there too)."""
        return (rec.get("source") == "tests", not rec["kernel"].startswith("kernels."))

    broken = []

    def poll(submit: bool = True):
        nonlocal already
        for rec in _launch_cache.read_records(str(rec_file)):
            if rec["hash"] in submitted:
                continue
            submitted[rec["hash"]] = rec
            if _launch_cache.cached(rec):
                already += 1
            else:
                queue.append(rec)
        queue.sort(key=priority)
        while submit and not broken and queue and sum(not f.done() for f in futures) < jobs:
            try:
                fut = pool.submit(_launch_cache.compile_record, queue[0])
            except Exception as e:  # noqa: BLE001 - a worker died: the pool takes no more work
                broken.append(f"{type(e).__name__}: {e}")
                break
            futures[fut] = queue.pop(0)

    record_rows = []
    tp = cf.ThreadPoolExecutor(max_workers=a.record_jobs)

    def record(item):
        label, cmd = item
        step.commands.append(" ".join(cmd[1:]))
        r = run_cmd(cmd, min(ITEM_LIMITS["record"], max(1.0, step.left() - 5)),
                    dict(env, TTT_LM_RECORD_LABEL="tests" if label == "gpu test tier" else "timed"))
        log(f"record {label}", cmd, r)
        return label, r

    pending = {tp.submit(record, it): it[0] for it in record_items}
    while pending or (queue and not broken) or any(not f.done() for f in futures):
        for f in [f for f in pending if f.done()]:
            label, r = f.result()
            del pending[f]
            if r.rc != 0:
                record_rows.append((label, "exit 124 (time limit)" if r.timed_out else f"exit {r.rc}",
                                    last_error(r.out)))
        poll()
        if step.left() < 2:
            break
        time.sleep(0.3)
    not_started = [label for f, label in pending.items() if f.cancel()]
    tp.shutdown(wait=True)
    for f, label in pending.items():        # record processes still running when the time was up
        if not f.cancelled():
            r = f.result()[1]
            if r.rc != 0:
                record_rows.append((label, "exit 124 (time limit)" if r.timed_out else f"exit {r.rc}",
                                    last_error(r.out)))
    poll(submit=False)
    waited_out = [f for f in futures if not f.done()] + [None] * len(queue)
    for f, rec in futures.items():
        if f.done():
            try:
                done.append(f.result())
            except Exception as e:  # noqa: BLE001 - the worker died under this compile
                done.append({"kernel": rec["kernel"], "name": rec["name"], "hash": rec["hash"], "status": "error",
                             "error": f"compile worker died: {type(e).__name__}: {e}"[:300], "seconds": 0.0})
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in workers:       # a compile still running must not share the CPUs with the timed steps
        p.kill()
    errors = [d for d in done if d["status"] != "ok"]
    mism = [d for d in done if d["status"] == "ok" and not d.get("hash_ok", True)]
    slow = sorted(done, key=lambda d: -d["seconds"])[:5]
    step.data = {"recorded": len(submitted), "already_cached": already, "compiled": len(done) - len(errors),
                 "errors": errors, "hash_mismatch": [d["kernel"] for d in mism],
                 "not_finished": [futures[f]["kernel"] for f in waited_out if f is not None]
                 + [r["kernel"] for r in queue], "jobs": jobs,
                 "compile_seconds_sum": round(sum(d["seconds"] for d in done), 1),
                 "slowest": [{**d, "summary": _summary(submitted[d["hash"]])} for d in slow]}
    (a.out / "warmup.json").write_text(json.dumps({"records": list(submitted.values()), "results": done}, indent=0))
    step.rows.append(["distinct specializations recorded", str(len(submitted))])
    step.rows.append(["already in the Triton cache", str(already)])
    step.rows.append([f"compiled ({jobs} workers)", f"{len(done) - len(errors)} in {step.now() - step.t0:.0f} s wall, "
                      f"{step.data['compile_seconds_sum']:.0f} s summed"])
    for d in slow:
        step.rows.append([f"slow compile: {_summary(submitted[d['hash']])}", f"{d['seconds']:.1f} s"])
    for d in errors:
        step.rows.append([f"compile error: {_summary(submitted[d['hash']])}", d["error"]])
    if mism:
        step.rows.append(["compiled under another cache key (a launch will compile again)",
                          ", ".join(sorted({d['name'] for d in mism}))])
    if waited_out:
        names = sorted({futures[f]["name"] for f in waited_out if f is not None} | {r["name"] for r in queue})
        step.rows.append([f"not compiled in the warm-up ({len(waited_out)}; step budget spent: they compile "
                          f"where they are launched)", ", ".join(names)[:300]])
    if broken:
        step.rows.append(["compile pool stopped (a worker died)", broken[0][:300]])
    for label, status, err in record_rows:
        step.rows.append([f"record pass `{label}`: {status}", err])
    for label in not_started:
        step.skip_row(f"record pass `{label}`")


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def compiled_since(t: float, cache: Optional[Path] = None) -> Dict[str, List[str]]:
    """Kernels whose Triton cache entry was written after the time ``t`` (seconds since the epoch):
    {"ours": [...], "inductor": [...]} (torch.compile's generated kernels are named triton_*)."""
    cache = cache or triton_cache_dir()
    out = {"ours": [], "inductor": []}
    if not cache.is_dir():
        return out
    for d in cache.iterdir():
        try:
            if not d.is_dir() or d.stat().st_mtime < t:
                continue
            for f in d.iterdir():
                if f.suffix == ".json" and not f.name.startswith("__grp__") and f.stat().st_mtime >= t:
                    name = f.stem
                    out["inductor" if name.startswith("triton_") else "ours"].append(name)
        except OSError:
            continue
    return {k: sorted(v) for k, v in out.items()}


# ---- step: gpu test tier ---------------------------------------------------------------------------
_OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b\s+(\S+::\S+)|(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)")
_INSTANT = re.compile(r"^E\s+(\S+::\S+): (.*)$", re.M)
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::\S+?)(?: - (.*))?$", re.M)


def parse_pytest(out: str) -> Dict[str, dict]:
    """test id → {"outcome", "error"} from ``pytest -v -rfE`` output (plain or pytest-xdist)."""
    tests: Dict[str, dict] = {}
    for m in _OUTCOME.finditer(out):
        outcome, tid = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        tests.setdefault(tid, {"outcome": outcome, "error": ""})["outcome"] = outcome
    for tid, err in _INSTANT.findall(out):
        tests.setdefault(tid, {"outcome": "FAILED", "error": ""})["error"] = err.strip()
    for outcome, tid, err in _SUMMARY.findall(out):
        t = tests.setdefault(tid, {"outcome": outcome, "error": ""})
        t["outcome"] = outcome
        if err and not t["error"]:
            t["error"] = err.strip()
    return tests


def step_tests(step: Step, a, files: List[str], log) -> None:
    base = ["-m", "gpu", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout"):
        base += ["--timeout", str(int(a.test_timeout))]
    env = {"TTT_LM_INSTANT_FAILURES": "1", "TTT_LM_PIN_LAUNCH_CONFIGS": "1"}
    if not files:
        step.rows.append(["(no test file marks pytest.mark.gpu)", "", "", "", "", ""])
        return
    outs: List[Tuple[List[str], ItemResult]] = []
    if importlib.util.find_spec("xdist"):
        cmd = [PY, "-m", "pytest", *files, *base, "-n", str(a.test_workers)]
        step.commands.append(" ".join(cmd[1:]))
        r = run_cmd(cmd, max(1.0, step.left() - 3), env)
        log("tests", cmd, r)
        outs.append((files, r))
    else:   # no pytest-xdist: one process per file, all at once
        step.notes.append("pytest-xdist is not installed: one pytest process per file, in parallel.")
        with cf.ThreadPoolExecutor(max_workers=len(files)) as tp:
            def one(f):
                cmd = [PY, "-m", "pytest", f, *base]
                step.commands.append(" ".join(cmd[1:]))
                r = run_cmd(cmd, max(1.0, step.left() - 3), env)
                log(f"tests {f}", cmd, r)
                return [f], r
            outs = list(tp.map(one, files))
    for fs, r in outs:
        tests = parse_pytest(r.out)
        for f in fs:
            mine = {t: v for t, v in tests.items() if t.split("::")[0] == f}
            count = lambda o: sum(v["outcome"] == o for v in mine.values())
            bad = [f"`{t.split('::', 1)[1]}`: {v['error'] or v['outcome']}" for t, v in mine.items()
                   if v["outcome"] in ("FAILED", "ERROR")]
            note = "; ".join(bad)
            if r.timed_out:
                note = (note + "; " if note else "") + f"stopped at the step's limit after {r.seconds:.0f} s " \
                                                        f"(tests without a result did not finish)"
            elif r.rc not in (0, 1) and not mine:
                note = f"pytest exit {r.rc}: {last_error(r.out)}"
            step.rows.append([f"`{f}`", str(count("PASSED")), str(count("FAILED")), str(count("ERROR")),
                              str(count("SKIPPED")), note])
        step.data.setdefault("tests", {}).update(tests)


# ---- steps: kernels, training, profile --------------------------------------------------------------
KERNEL_COLUMNS = ["op", "T", "B", "form", "fwd ms", "fwd+bwd ms", "fwd peak MiB", "fwd+bwd peak MiB", "fwd rate",
                  "fwd+bwd rate"]


def kernel_cmd(op: str, T: int, H: int, D: int, reps: int, json_out: Path, record: bool = False) -> List[str]:
    cmd = [PY, "benchmarks/kernels.py", "--ops", op, "--seq-lens", str(T), "--tokens", "65536", "--heads", str(H),
           "--head-dim", str(D)]
    return cmd + (["--record-pass"] if record else ["--reps", str(reps), "--warmup", "3", "--json", str(json_out)])


def step_kernels(step: Step, a, H: int, D: int, log) -> None:
    ops, uncovered = discover_ops()
    for op in ["sdpa"] + ops:
        if not step.can_start():
            step.skip_row(op)
            continue
        jf = a.out / "items" / f"{step.name}_{op}.json"
        jf.parent.mkdir(parents=True, exist_ok=True)
        if jf.exists():
            jf.unlink()
        cmd = kernel_cmd(op, a.seq_len_kernels, H, D, a.reps, jf)
        step.commands.append(" ".join(cmd[1:]))
        r = run_cmd(cmd, min(ITEM_LIMITS[step.name], step.left()), {"TTT_LM_PIN_LAUNCH_CONFIGS": "1"})
        log(f"{step.name} {op}", cmd, r)
        rows = [json.loads(ln) for ln in jf.read_text().splitlines() if ln.strip()] if jf.exists() else []
        for row in rows:
            step.rows.append([row.get(c, "") for c in ("op", "T", "B", "form", "fwd_ms", "fwd_bwd_ms", "fwd_mib",
                                                          "fwd_bwd_mib", "fwd_rate", "fwd_bwd_rate")])
        if r.rc != 0:
            why = "stopped at its time limit" if r.timed_out else f"exit {r.rc}"
            step.rows.append([op, "", "", f"{why} after {r.seconds:.0f} s: {last_error(r.out)}"] + [""] * 6)
    for folder in uncovered:
        step.rows.append([f"kernels/{folder}", "", "", "no benchmark registered in benchmarks/kernels.py"] + [""] * 6)


TRAIN_COLUMNS = ["preset", "compile", "params M", "batch", "tokens/s", "× transformer", "MFU", "peak GiB",
                 "warm-up s", "note"]


def train_cmd(p: Preset, seq_len: int, json_out: Optional[Path], compile_: bool = False, steps: int = 8,
              warmup: int = 2, profile: int = 0, record: bool = False) -> List[str]:
    mb = max(1, TOKENS_PER_STEP // seq_len)
    cmd = [PY, "benchmarks/throughput.py", p.path, "--steps", str(1 if record else steps),
           "--warmup", str(0 if record else warmup), "--set", "train.precision=bf16", "--set", f"data.seq_len={seq_len}",
           "--set", f"model.max_seq_len={max(seq_len, 2048)}", "--set", f"train.micro_batch_size={mb}"]
    if compile_ and not record:
        cmd += ["--set", "model.compile=true"]
    if profile and not record:
        cmd += ["--profile-top", str(profile)]
    if json_out is not None and not record:
        cmd += ["--json", str(json_out)]
    return cmd


def train_items(name: str, a) -> List[Tuple[Preset, int, bool]]:
    """(preset, seq_len, compile) of a training step, in order: the transformer first (the other
    rows give their tokens/s as a multiple of its)."""
    first = lambda ps: sorted(ps, key=lambda p: p.arch != "transformer")
    if name == "train":
        ps = first(discover_presets("125m"))
        items = [(p, 2048, False) for p in ps]
        items += [(p, 2048, True) for p in ps if p.arch in a.compile_archs]
        return items
    if name == "train350":
        return [(p, 2048, False) for p in first(discover_presets("350m"))]
    if name == "train8k":
        return [(p, 8192, False) for p in first(discover_presets("125m"))]
    if name == "profile":
        return [(p, 2048, False) for p in first(discover_presets("125m")) if p.arch in a.profile_archs]
    raise ValueError(name)


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def step_train(step: Step, a, log) -> None:
    base_tps: Dict[int, float] = {}
    for p, T, comp in train_items(step.name, a):
        label = p.path + (" (compile)" if comp else "")
        if not step.can_start():
            step.rows.append([p.path, "yes" if comp else "no", "not run (step budget spent)"] + [""] * 7)
            continue
        jf = a.out / "items" / f"{step.name}_{Path(p.path).stem}{'_compile' if comp else ''}.json"
        jf.parent.mkdir(parents=True, exist_ok=True)
        if jf.exists():
            jf.unlink()
        cmd = train_cmd(p, T, jf, comp)
        step.commands.append(" ".join(cmd[1:]))
        limit = ITEM_LIMITS["train_compile" if comp else step.name]
        r = run_cmd(cmd, min(limit, step.left()), {"TTT_LM_PIN_LAUNCH_CONFIGS": "1"})
        log(f"{step.name} {label}", cmd, r)
        res = json.loads(jf.read_text()) if jf.exists() else None
        if r.rc != 0 or not res:
            why = "stopped at its time limit" if r.timed_out else f"exit {r.rc}"
            step.rows.append([p.path, "yes" if comp else "no", f"{why} after {r.seconds:.0f} s: {last_error(r.out)}"]
                             + [""] * 7)
            continue
        row = res["rows"][0]
        if p.arch == "transformer" and not comp:
            base_tps[T] = row["tokens_per_s"]
        ratio = row["tokens_per_s"] / base_tps[T] if base_tps.get(T) else None
        step.rows.append([p.path, "yes" if comp else "no", _fmt(row["params_M"], ".1f"), row["batch"],
                          _fmt(row["tokens_per_s"], ".0f"), _fmt(ratio, ".2f") if ratio else "-",
                          _fmt(row["mfu"], ".1%"), _fmt(row.get("peak_GiB", "-"), ".1f"),
                          _fmt(row.get("warmup_s", "-"), ".1f"), ""])
        step.data.setdefault("results", []).append({**row, "compile": comp, "seq_len": T})


PROFILE_COLUMNS = ["preset", "#", "CUDA kernel", "calls", "ms in the step", "% of CUDA time"]


def step_profile(step: Step, a, log) -> None:
    for p, T, _ in train_items("profile", a):
        if not step.can_start():
            step.rows.append([p.path, "", "not run (step budget spent)", "", "", ""])
            continue
        jf = a.out / "items" / f"profile_{Path(p.path).stem}.json"
        jf.parent.mkdir(parents=True, exist_ok=True)
        if jf.exists():
            jf.unlink()
        cmd = train_cmd(p, T, jf, steps=1, warmup=2, profile=10)
        step.commands.append(" ".join(cmd[1:]))
        r = run_cmd(cmd, min(ITEM_LIMITS["profile"], step.left()), {"TTT_LM_PIN_LAUNCH_CONFIGS": "1"})
        log(f"profile {p.path}", cmd, r)
        res = json.loads(jf.read_text()) if jf.exists() else None
        prof = (res or {}).get("rows", [{}])[0].get("profile")
        if r.rc != 0 or not prof:
            why = "stopped at its time limit" if r.timed_out else f"exit {r.rc}"
            step.rows.append([p.path, "", f"{why} after {r.seconds:.0f} s: {last_error(r.out)}", "", "", ""])
            continue
        for i, k in enumerate(prof["kernels"], 1):
            step.rows.append([p.path if i == 1 else "", str(i), k["name"][:80], str(k["calls"]),
                              f"{k['ms']:.2f}", f"{k['pct']:.1f}"])
        step.rows.append([p.path, "", f"(all CUDA kernels of the step: {prof['total_ms']:.1f} ms)", "", "", ""])
        step.data.setdefault("profiles", {})[p.path] = prof


# ---- TTT-E2E's training step against its sliding-window baseline ------------------------------------
E2E_SIZE = "125m"
E2E_COLUMNS = ["preset", "baseline", "T × batch", "µs/token", "baseline µs/token", "time ratio", "peak GiB",
               "baseline peak GiB", "memory ratio"]


def e2e_pairs(size: str = E2E_SIZE, root: Path = ROOT) -> List[Tuple[str, str]]:
    """(TTT-E2E preset, its sliding-window baseline) of a size, as configs/ names them:
    ``ttt_e2e_swa_<size>.yaml`` beside ``ttt_e2e_<size>.yaml``. TTT-E2E launches no Triton kernel
    (its ops are torch's; kernels/captured_launches.json lists none for it), so the warm-up has
    nothing to compile for this step."""
    out = []
    for base in sorted((root / "configs").glob(f"*_swa_{size}.yaml")):
        e2e = base.with_name(base.name.replace(f"_swa_{size}", f"_{size}"))
        if e2e.exists():
            out.append((e2e.stem, base.stem))
    return out


def e2e_cmd(preset: str, json_out: Path, steps: int = 3) -> List[str]:
    """One preset's step at its own data.seq_len (the training length), batch 1, bf16 autocast."""
    return [PY, "benchmarks/ttt_e2e_step.py", "--one", preset, "--device", "cuda", "--batch", "1",
            "--steps", str(steps), "--json", str(json_out)]


def step_e2e(step: Step, a, log) -> None:
    for e2e, base in e2e_pairs():
        res: Dict[str, dict] = {}
        why = ""
        for p in (e2e, base):
            if not step.can_start():
                why = why or "not run (step budget spent)"
                continue
            jf = a.out / "items" / f"e2e_{p}.json"
            jf.parent.mkdir(parents=True, exist_ok=True)
            if jf.exists():
                jf.unlink()
            cmd = e2e_cmd(p, jf)
            step.commands.append(" ".join(cmd[1:]))
            r = run_cmd(cmd, min(ITEM_LIMITS["e2e"], step.left()))
            log(f"e2e {p}", cmd, r)
            if r.rc != 0 or not jf.exists():
                stop = "stopped at its time limit" if r.timed_out else f"exit {r.rc}"
                why = why or f"{p}: {stop} after {r.seconds:.0f} s: {last_error(r.out)}"
                continue
            res[p] = json.loads(jf.read_text())
        if why:
            step.rows.append([e2e, base, why] + [""] * 6)
            continue
        r, b = res[e2e], res[base]
        step.rows.append([e2e, base, f"{r['seq_len']} × {r['batch']}", f"{r['us_per_token']:.1f}",
                          f"{b['us_per_token']:.1f}", f"{r['us_per_token'] / b['us_per_token']:.2f}",
                          f"{r['mem_bytes'] / 2**30:.2f}", f"{b['mem_bytes'] / 2**30:.2f}",
                          f"{r['mem_bytes'] / max(b['mem_bytes'], 1):.2f}"])
        step.data.setdefault("results", []).append({"e2e": r, "baseline": b})


STEP_TITLES = {
    "warmup": ("Compile warm-up (every Triton specialization the later steps launch)", ["what", "result"]),
    "tests": ("`gpu` test tier", ["file", "passed", "failed", "errors", "skipped", "failures (error line)"]),
    "kernels": ("Kernels, bf16, T = 8192, H = 12, D = 64, B·T = 65536", KERNEL_COLUMNS),
    "kernels128": ("Kernels, bf16, T = 8192, H = 16, D = 128, B·T = 65536", KERNEL_COLUMNS),
    "train": ("Training, 125M-class presets, seq_len 2048, bf16, 16,384 tokens per step", TRAIN_COLUMNS),
    "train350": ("Training, 350M-class presets, seq_len 2048, bf16, 16,384 tokens per step", TRAIN_COLUMNS),
    "train8k": ("Training, 125M-class presets, seq_len 8192, bf16, 16,384 tokens per step", TRAIN_COLUMNS),
    "profile": ("Profile: the ten CUDA kernels taking the most time in one training step", PROFILE_COLUMNS),
    "e2e": ("TTT-E2E training step (forward + second-order backward, no optimizer) against its sliding-window "
            "baseline, bf16 autocast, the preset's seq_len, batch 1", E2E_COLUMNS),
}


def record_items(steps: Sequence[str], a) -> List[Tuple[str, List[str]]]:
    """The record-mode commands that walk every later step's launches: the same scripts and
    arguments as the timed items (kernels: each op's non-PyTorch forms, forward and backward;
    training: one step of each preset, uncompiled — a compiled block calls the same ops; the gpu
    test tier)."""
    items: List[Tuple[str, List[str]]] = []
    for name in steps:
        if name == "tests":
            files = gpu_test_files()
            if files:
                extra = ["-n", str(min(a.record_jobs, len(files)))] if importlib.util.find_spec("xdist") else []
                items.append(("gpu test tier", [PY, "-m", "pytest", *files, "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                                "--tb=no", *extra]))
        elif name in ("kernels", "kernels128"):
            H, D = (12, 64) if name == "kernels" else (16, 128)
            for op in discover_ops()[0]:
                items.append((f"{name} {op}", kernel_cmd(op, a.seq_len_kernels, H, D, 1, Path(), record=True)))
        elif name in ("train", "train350", "train8k", "profile"):
            for p, T, comp in train_items(name, a):
                if not comp:
                    items.append((f"{name} {p.path}", train_cmd(p, T, None, record=True)))
    seen, out = set(), []
    for label, cmd in items:        # the profile walks the training step's launches again: once is enough
        if tuple(cmd) not in seen:
            seen.add(tuple(cmd))
            out.append((label, cmd))
    return out


# ---- the campaign --------------------------------------------------------------------------------
def run_campaign(a, command: str) -> int:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001 - torch missing or broken is the same answer
        has_cuda, why = False, f" ({type(e).__name__}: {e})"
    else:
        why = ""
    if not has_cuda:
        print(f"gpu_campaign {command}: no CUDA device here{why}; this campaign measures a GPU", flush=True)
        return 2
    t_start = time.time()
    date = datetime.date.today().isoformat()
    a.out = (a.out or ROOT / "benchmarks" / "gpu_results" / f"{date}-{command}").resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(triton_cache_dir()))
    commit = read_commit()
    info = device_info()
    argv = " ".join(shlex.quote(x) for x in sys.argv[1:])
    cache = triton_cache_dir()
    cache_state = "not empty at the start" if cache.is_dir() and any(cache.iterdir()) else "empty at the start"
    head = [f"## GPU campaign `{command}`, {date}", "",
            f"- Device: {device_line(info, commit)}",
            f"- Commit: {commit}",
            f"- Command: `python benchmarks/gpu_campaign.py {argv}` (total budget {a.budget:.0f} s)",
            f"- Triton cache: `{cache}` ({cache_state})", ""]
    print("\n".join(head), flush=True)
    log_f = open(a.out / "logs.txt", "w")

    def log(label, cmd, r: ItemResult):
        log_f.write(f"\n===== {label}: exit {r.rc}, {r.seconds:.1f} s\n$ {' '.join(cmd)}\n{r.out}\n")
        log_f.flush()
        print(f"  [{time.time() - t_start:5.0f} s] {label}: exit {r.rc}, {r.seconds:.1f} s", flush=True)

    plan = [(n, b) for n, b in PLANS[command] if not a.steps or n in a.steps]
    clock = Clock(a.budget)
    steps: List[Step] = []
    warm_end = None

    def write(final: bool) -> str:
        """campaign.json and campaign.md as they stand (after each step, and at the end)."""
        total = time.time() - t_start
        after, note = {}, ""
        if final and warm_end is not None:
            after = compiled_since(warm_end)
            note = (f"Compiled after the warm-up: {len(after['ours'])} Triton kernel(s) of ours or of other "
                    f"packages" + (f" ({', '.join(sorted(set(after['ours'])))[:600]})" if after["ours"] else "")
                    + f"; {len(after['inductor'])} generated by torch.compile.")
        left = [n for n, _ in plan[len(steps):]]
        result = {"command": command, "argv": argv, "date": date, "device": info,
                  "device_line": device_line(info, commit), "commit": commit, "budget": a.budget,
                  "seconds": round(total, 1), "head": head, "steps": [s.to_json() for s in steps],
                  "compiled_after_warmup": after, "complete": final}
        md = "\n".join(head) + "\n" + "\n".join(render_step(s) for s in steps)
        if note:
            md += "\n" + note + "\n"
        md += (f"\nThe campaign took {total:.0f} s.\n" if final else
               f"\nStill to run after {total:.0f} s: {', '.join(left)} (the campaign was stopped here if this "
               f"line is the last).\n")
        (a.out / "campaign.json").write_text(json.dumps(result, indent=1, default=str))
        (a.out / "campaign.md").write_text(md)
        return md
    for name, own in plan:
        title, cols = STEP_TITLES[name]
        if name in ("kernels", "kernels128"):
            title = title.replace("T = 8192", f"T = {a.seq_len_kernels}")
        s = Step(name, title, list(cols), budget=own)
        allowance = clock.allowance(own)
        s.start(allowance)
        print(f"\n[{time.time() - t_start:5.0f} s] step {name}: {allowance:.0f} s allowed", flush=True)
        try:
            if allowance < MIN_START:
                s.notes.append("Not run: the campaign's total budget was spent.")
            elif name == "warmup":
                step_warmup(s, a, record_items([n for n, _ in plan if n != "warmup"], a), log)
                warm_end = time.time()
            elif name == "tests":
                step_tests(s, a, gpu_test_files(), log)
            elif name == "kernels":
                step_kernels(s, a, 12, 64, log)
            elif name == "kernels128":
                step_kernels(s, a, 16, 128, log)
            elif name in ("train", "train350", "train8k"):
                step_train(s, a, log)
            elif name == "profile":
                step_profile(s, a, log)
            elif name == "e2e":
                step_e2e(s, a, log)
        except Exception as e:  # noqa: BLE001 - a broken step is a result; the campaign goes on
            import traceback
            s.rows.append([f"step {name} crashed", f"{type(e).__name__}: {e}"] + [""] * (len(s.columns) - 2))
            log_f.write(f"\n===== step {name} crashed\n{traceback.format_exc()}\n")
        s.seconds = s.now() - s.t0
        clock.settle(allowance, s.seconds)
        steps.append(s)
        print(f"[{time.time() - t_start:5.0f} s] step {name} done in {s.seconds:.0f} s", flush=True)
        write(final=False)       # what is done so far survives a campaign killed from outside
    md = write(final=True)
    log_f.close()
    shutil.rmtree(a.out / "items", ignore_errors=True)
    print("\n" + md, flush=True)
    print(f"gpu_campaign {command}: results in {a.out} (campaign.md, campaign.json, warmup.json, logs.txt); "
          f"record them here with: make gpu-bench-record FROM=<that folder>", flush=True)
    return 0


def record(src: Path, results_md: Path = RESULTS_MD, dest_root: Optional[Path] = None) -> Path:
    """Copy ``src``'s campaign.md / campaign.json (and warmup.json, logs.txt) to
    benchmarks/gpu_results/<date>-<command>/ and put the Markdown into RESULTS.md under the GPU
    campaign heading, in place of the earlier campaign of the same command (RESULTS.md keeps the
    latest of each; older ones stay in git history and their folders), the latest command first.
    Refuses a campaign already there or older than the one there. Returns the folder written."""
    src = Path(src)
    cj = src / "campaign.json"
    if not cj.exists():
        sys.exit(f"gpu_campaign record: no campaign.json in {src} (the --out folder of `run` or `more`)")
    res = json.loads(cj.read_text())
    for k in ("date", "command", "device_line", "commit", "argv"):
        if k not in res:
            sys.exit(f"gpu_campaign record: {cj} has no {k!r}; not a campaign result")
    dest = (dest_root or ROOT / "benchmarks" / "gpu_results") / f"{res['date']}-{res['command']}"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("campaign.md", "campaign.json", "warmup.json", "logs.txt"):
        if (src / name).exists() and (src / name).resolve() != (dest / name).resolve():
            shutil.copyfile(src / name, dest / name)
    md = (src / "campaign.md").read_text() if (src / "campaign.md").exists() else ""
    if not md.strip():
        sys.exit(f"gpu_campaign record: {src / 'campaign.md'} is missing or empty")
    body = md.replace(f"## GPU campaign `{res['command']}`", f"### GPU campaign `{res['command']}`", 1)
    body = re.sub(r"^### ", "#### ", body, flags=re.M).replace("#### GPU campaign", "### GPU campaign", 1)
    rel = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    body += f"\nFull results: `{rel}/` (campaign.json, warmup.json, logs.txt).\n"
    text = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    if RESULTS_MARKER not in text:
        text = text.rstrip("\n") + "\n\n" + RESULTS_MARKER + "\n"
    stamp = f"<!-- campaign {res['date']} {res['command']} {res['commit']} -->"
    if stamp in text:
        sys.exit(f"gpu_campaign record: this campaign ({res['date']}, {res['command']}, {res['commit']}) is already "
                 f"in {results_md}")
    for m in re.finditer(rf"^<!-- campaign (\S+) {re.escape(res['command'])} .* -->\n", text, flags=re.M):
        if m.group(1) > res["date"]:
            sys.exit(f"gpu_campaign record: {results_md} holds a later `{res['command']}` campaign ({m.group(1)}) "
                     f"than this one ({res['date']}); it keeps the latest of each")
        end = re.compile(r"^(?:<!-- campaign |## |### (?!GPU campaign))", re.M).search(text, m.end())
        text = text[:m.start()].rstrip("\n") + "\n" + (text[end.start():] if end else "")
        break
    i = text.index(RESULTS_MARKER) + len(RESULTS_MARKER)
    results_md.write_text(text[:i] + "\n" + stamp + "\n" + body + text[i:])
    print(f"gpu_campaign record: {res['command']} of {res['date']} (commit {res['commit']}) into {results_md}; "
          f"files in {dest}")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["prepare", "run", "more", "record"])
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/gpu_results/<date>-<command>)")
    ap.add_argument("--from", dest="src", type=Path, default=None, help="record: the --out folder of a campaign")
    ap.add_argument("--wheels", action="store_true", help="prepare: also download benchmarks/gpu_wheels.txt into .whl/")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole command (run 510, more 350)")
    ap.add_argument("--steps", nargs="*", default=None, help="only these steps of the command's plan")
    ap.add_argument("--jobs", type=int, default=0, help="warm-up compile workers (default: CPUs − 2)")
    ap.add_argument("--record-jobs", type=int, default=4, help="record-mode processes at a time")
    ap.add_argument("--test-workers", type=int, default=8, help="pytest-xdist workers for the gpu tier")
    ap.add_argument("--test-timeout", type=float, default=120.0, help="seconds per test (pytest-timeout)")
    ap.add_argument("--seq-len-kernels", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compile-archs", nargs="*", default=["transformer", "ttt_linear"],
                    help="architectures also trained with model.compile=true")
    ap.add_argument("--profile-archs", nargs="*", default=["transformer", "ttt_linear", "hybrid"])
    a = ap.parse_args(argv)
    if a.command == "prepare":
        prepare()
        if a.wheels:
            download_wheels()
        return 0
    if a.command == "record":
        if a.src is None:
            ap.error("record needs --from DIR")
        record(a.src)
        return 0
    if a.budget is None:
        a.budget = BUDGETS[a.command]
    return run_campaign(a, a.command)


if __name__ == "__main__":
    sys.exit(main())
