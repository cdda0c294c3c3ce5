"""Inference cost of each preset: prefill and decode time per token, the decode state's size, the
prefill's peak memory, and training forward+backward per token (the table of the TTT and LaCT
papers), one row per preset file found under ``configs/``.

Rows: the presets named by ``--presets`` (names under ``configs/``, paths, or globs; default every
``configs/tiny*.yaml``); the 125M class is ``'configs/*125m*.yaml' 'configs/*130m*.yaml'``. Each
model is built from its preset (``ttt_lm.config.load_config``, then ``LM``, which initializes the
weights as training does), seed 0, with ``model.max_seq_len`` raised to the longest length timed
(only the evals read it; global attention has no positional limit in the model itself).

Columns, batch 1, one row of random tokens:

* prefill µs/token at T (``--prefill-lens``, default 1k 4k 16k; ``--long-lens``, default 64k, for
  presets outside ``configs/tiny*``): eval mode, ``torch.no_grad()``, ``LM.prefill`` as
  ``LM.generate`` runs it: ``--prefill-piece`` tokens at a time (default ``PREFILL_CHUNK``, 2048;
  0 reads the prompt in one call) with the states carried, and the head on the last position
  only (``LM.forward`` would also form the [T, V] logits: T·V·4 bytes, 13 GB at 64k for a 50k
  vocabulary).
* peak MiB at T: the prefill's peak memory above what the built model holds, each (preset, T) in a
  fresh subprocess: on the CPU ``ru_maxrss`` after the prefill minus the RSS before it (after a
  short warm-up prefill, so lazily started thread pools are in the baseline, and with the
  high-water mark reset to the current RSS through ``/proc/self/clear_refs``; where that fails
  and the mark did not rise, the cell is an upper bound, "≤ N"); on CUDA
  ``torch.cuda.max_memory_allocated`` minus the memory allocated before it. Before a length is
  run, its memory and time are estimated from the two longest lengths measured before it (a power
  law through them, its exponent held within [1, 2]); a length whose estimate exceeds
  ``--mem-limit-gib`` (default 80 % of the memory available) or whose timed passes would take more
  than ``--max-seconds`` is skipped, and its cell says why.
* decode ms/token at context C (``--decode-contexts``, default 512 1k 4k 16k): a prefill of C
  tokens, two untimed steps (attention's KV buffer is allocated by the first), then
  ``--decode-steps`` steps of ``LM.step`` (fixed random tokens, each step's logits formed) per
  round; each round (the warm-up included) continues from the state the previous one left, so
  the timed steps lie at contexts C + 2 … C + 2 + (reps + 1)·steps.
* state KiB at C: the decode state after the prefill of C tokens, the sum of ``nbytes`` over every
  tensor of every layer's state (``MixerState.tensors``: nested states included). "kept KiB": the
  bytes of the distinct storages those tensors keep alive, at the largest context; more than the
  state where a state's tensors are views into full-length prefill tensors.
* train µs/token at T (``--train-lens``, default 1k 4k; ``--no-train`` leaves them out):
  ``model(ids, labels=ids).loss.backward()`` in train mode.
* ratios: prefill per token at the longest length measured over the shortest, decode per token at
  the largest context over the smallest, training per token at the longest length over the
  shortest. Linear-cost prefill and training, and decode at a constant cost per token, give 1.

Timing: each preset's timings run in one subprocess of their own, after one warm-up of every
item, in ``--reps`` interleaved rounds (each round times every item once, a different item first
each round); each figure is the median over the rounds. ``--dtype`` bfloat16/float16 runs under
autocast (float32 weights, as training does).

    OMP_NUM_THREADS=1 python benchmarks/inference.py                                   # every tiny preset
    OMP_NUM_THREADS=1 python benchmarks/inference.py --presets tiny tiny_gated_deltanet --out /tmp/inference.md
    python benchmarks/inference.py --presets 'configs/*125m*.yaml' 'configs/*130m*.yaml' --device cuda --dtype bfloat16
    python benchmarks/inference.py --quick --presets tiny_hawk tiny_transformer        # tiny lengths (the test)

On the shared 2-core CPU machine only the ratios within one run mean much; absolute speeds hold
only on a GPU. Figures for ``benchmarks/RESULTS.md`` give date, device, commit and command (the
header line printed above the table).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from ttt_lm.model.lm import PREFILL_CHUNK  # noqa: E402

CONFIGS = os.path.join(ROOT, "configs")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK = dict(prefill_lens=[128, 256], long_lens=[512], decode_contexts=[64, 256], decode_steps=4,
             train_lens=[64, 128], reps=1)
RESULT = "INFERENCE_BENCH_RESULT "


# ---- presets -----------------------------------------------------------------------------------
def find_presets(specs: Optional[Sequence[str]]) -> List[str]:
    """Preset files for names (``tiny_hawk``), paths or globs (``configs/*125m*.yaml``), in the
    order given, each once; default every ``configs/tiny*.yaml``."""
    if not specs:
        return sorted(glob.glob(os.path.join(CONFIGS, "tiny*.yaml")))
    out: List[str] = []
    for s in specs:
        cands = [s, os.path.join(ROOT, s), os.path.join(CONFIGS, s), os.path.join(CONFIGS, s + ".yaml")]
        hits: List[str] = []
        for c in cands:
            hits = sorted(p for p in glob.glob(c) if p.endswith(".yaml") and os.path.isfile(p))
            if hits:
                break
        if not hits:
            raise SystemExit(f"--presets: no preset file matches {s!r} (names are files under configs/)")
        out += [os.path.abspath(h) for h in hits if os.path.abspath(h) not in out]
    return out


def preset_name(path: str) -> str:
    rel = os.path.relpath(path, CONFIGS)
    return rel[:-5] if rel.endswith(".yaml") and not rel.startswith("..") else os.path.relpath(path, ROOT)


def is_tiny(path: str) -> bool:
    return os.path.basename(path).startswith("tiny")


def build(path: str, max_len: int, device: str):
    from ttt_lm.config import load_config
    from ttt_lm.model import LM
    cfg = load_config(path, [f"model.max_seq_len={max(max_len, 1)}"]).model
    torch.manual_seed(0)
    return LM(cfg).to(device).eval()


# ---- measurements (in the worker subprocesses) ---------------------------------------------------
def prefill(model, ids: torch.Tensor, piece: int = 0):
    """Read ``ids`` [1, T] as generation does (``LM.prefill``: ``piece`` tokens at a time with the
    states carried, 0: one call; the head on the last position only) and return the last
    position's logits and every layer's state."""
    return model.prefill(ids, piece if piece > 0 else None)


def state_bytes(states) -> Tuple[int, int]:
    """(sum of nbytes over every tensor of the states, bytes of the distinct storages they keep)."""
    logical, storages = 0, {}
    for st in states:
        for t in st.tensors():
            logical += t.nbytes
            s = t.untyped_storage()
            storages[(s.device.type, s.data_ptr())] = s.nbytes()
    return logical, sum(storages.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (``ru_maxrss``, VmHWM) to its current RSS (Linux's
    ``/proc/self/clear_refs``, "5"), so that the mark after the prefill is the prefill's own peak
    and not the model build's or the parent's (a child's mark starts at its parent's at fork)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _ids(vocab: int, T: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, T), generator=g).to(device)


def worker_memory(spec: dict) -> dict:
    """One prefill of spec["length"] tokens: its peak memory above the built model's, its seconds."""
    dev, T = spec["device"], spec["length"]
    model = build(spec["preset"], T, dev)
    ac = torch.autocast(torch.device(dev).type, dtype=DTYPES[spec["dtype"]], enabled=spec["dtype"] != "float32")
    ids = _ids(model.cfg.vocab_size, T, dev, 1)
    with torch.no_grad(), ac:
        prefill(model, ids[:, :min(T, 64)], spec["piece"])     # warm-up: thread pools, lazy inits
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _reset_peak_rss()
            base, max_before = _rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.perf_counter()
        _, states = prefill(model, ids, spec["piece"])
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    if dev.startswith("cuda"):
        peak, bound = torch.cuda.max_memory_allocated() - base, False
    else:
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # a high-water mark that did not rise was set before the prefill: the prefill's peak is at most this
        peak, bound = after - base, after <= max_before
    return {"peak_bytes": peak, "upper_bound": bound, "seconds": seconds}


def worker_timing(spec: dict) -> dict:
    """Every timed item of one preset in interleaved rounds; medians in seconds per token."""
    dev, reps, nsteps, piece = spec["device"], spec["reps"], spec["decode_steps"], spec["piece"]
    lens = spec["prefill_lens"] + spec["decode_contexts"] + spec["train_lens"]
    model = build(spec["preset"], max(lens + [0]) + 2 + reps * nsteps, dev)
    vocab = model.cfg.vocab_size
    ac = lambda: torch.autocast(torch.device(dev).type, dtype=DTYPES[spec["dtype"]],  # noqa: E731
                                enabled=spec["dtype"] != "float32")
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    # a model variant with blocks of its own (reads_layer_pattern False) is named by its class
    kinds = list(dict.fromkeys(model.cfg.layer_kinds())) if type(model).reads_layer_pattern else [type(model).__name__]
    out: dict = {"kinds": kinds, "params": model.num_params(),
                 "prefill": {}, "decode": {}, "state": {}, "kept": {}, "train": {}, "errors": {}}
    items = []   # (key, run once → seconds per token)

    for T in spec["prefill_lens"]:
        ids = _ids(vocab, T, dev, 1)

        def run(ids=ids):
            model.eval()
            with torch.no_grad(), ac():
                prefill(model, ids, piece)
        items.append((("prefill", T), run, T))

    decode_state: Dict[int, list] = {}
    for C in spec["decode_contexts"]:
        ids = _ids(vocab, C, dev, 2)
        toks = _ids(vocab, nsteps + 2, dev, 3)[0]
        model.eval()
        try:
            with torch.no_grad(), ac():
                _, states = prefill(model, ids, piece)
                out["state"][C], out["kept"][C] = state_bytes(states)
                for i in range(2):       # the first step allocates attention's KV buffer
                    _, states = model.step(toks[i:i + 1], states)
            decode_state[C] = states
        except RuntimeError as e:    # e.g. CUDA out of memory
            out["errors"][f"decode:{C}"] = _short(e)
            continue

        def run(C=C, toks=toks):
            model.eval()
            with torch.no_grad(), ac():
                states = decode_state[C]
                for i in range(nsteps):
                    _, states = model.step(toks[i + 2:i + 3], states)
                decode_state[C] = states
        items.append((("decode", C), run, nsteps))

    for T in spec["train_lens"]:
        ids = _ids(vocab, T, dev, 4)

        def run(ids=ids):
            model.train()
            model.zero_grad(set_to_none=True)
            with ac():
                loss = model(ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        items.append((("train", T), run, T))

    def once(run) -> float:
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - t0

    times: Dict[tuple, List[float]] = {key: [] for key, _, _ in items}
    for key, run, _ in items:           # warm-up
        try:
            once(run)
        except RuntimeError as e:
            out["errors"][f"{key[0]}:{key[1]}"] = _short(e)
    live = [it for it in items if f"{it[0][0]}:{it[0][1]}" not in out["errors"]]
    for r in range(reps):
        k = r % max(1, len(live))
        for key, run, n in live[k:] + live[:k]:   # each item leads some round
            times[key].append(once(run) / n)
    for (kind, L), ts in times.items():
        if ts:
            out[kind][L] = statistics.median(ts)
    return out


def _short(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return (type(e).__name__ + ": " + s)[:80].replace("|", "/")


# ---- the parent: subprocesses, estimates, the table ----------------------------------------------
def run_worker(kind: str, spec: dict, threads: int, timeout: Optional[float]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, json.dumps(spec), "--threads", str(threads)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"failed: over {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"failed: exit {p.returncode}: " + " ".join(tail.split())[:80].replace("|", "/")}


def estimate(points: List[Tuple[int, float]], T: int) -> Optional[float]:
    """The value at T of a power law through the two longest measured points below T, its exponent
    held within [1, 2] (at least linear, at most quadratic); None with fewer than two points."""
    pts = sorted((t, y) for t, y in points if t < T and y > 0)[-2:]
    if len(pts) < 2:
        return None
    (t1, y1), (t2, y2) = pts
    s = min(2.0, max(1.0, math.log(y2 / y1) / math.log(t2 / t1)))
    return y2 * (T / t2) ** s


def default_mem_limit(device: str) -> float:
    if device.startswith("cuda"):
        return 0.8 * torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 0.8 * int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2 ** 30


def size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2**20:.1f} MiB"


def label(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def measure_preset(path: str, a, mem_limit: float) -> dict:
    """Memory subprocesses per prefill length (longest last, with the estimates), then one timing
    subprocess. Returns cells keyed like the table's columns (numbers, or a reason string)."""
    tiny = is_tiny(path)
    lens = sorted(set(a.prefill_lens + ([] if tiny else a.long_lens)))
    mem: Dict[int, object] = {}
    pts_mem: List[Tuple[int, float]] = []
    pts_time: List[Tuple[int, float]] = []
    allowed: List[int] = []
    skip_reason: Dict[int, str] = {}
    base = {"preset": path, "device": a.device, "dtype": a.dtype, "piece": a.prefill_piece}
    for T in lens:
        m_est, t_est = estimate(pts_mem, T), estimate(pts_time, T)
        if m_est is not None and m_est > mem_limit:
            skip_reason[T] = f"skipped: est. {size(m_est)} > {size(mem_limit)}"
        elif t_est is not None and t_est * (2 + a.reps) > a.max_seconds:
            skip_reason[T] = f"skipped: est. {t_est * (2 + a.reps):.0f} s > {a.max_seconds:.0f} s"
        if T in skip_reason:
            mem[T] = skip_reason[T]
            continue
        r = run_worker("memory", dict(base, length=T), a.threads, a.max_seconds)
        if "error" in r:
            mem[T] = skip_reason[T] = r["error"]
            continue
        mem[T] = ("≤ " if r["upper_bound"] else "") + f"{r['peak_bytes'] / 2**20:.1f}"
        pts_mem.append((T, max(r["peak_bytes"], 1)))
        pts_time.append((T, r["seconds"]))
        allowed.append(T)
    # decode contexts and training lengths: the prefill estimates (training keeps more, but the
    # worker reports a failure per item rather than dying where it can)
    dec_skip: Dict[int, str] = {}
    for C in a.decode_contexts:
        bad = [skip_reason[T] for T in lens if T <= C and T in skip_reason]
        m_est = estimate(pts_mem, C) if C > max(allowed + [0]) else None
        if bad:
            dec_skip[C] = bad[0]
        elif m_est is not None and m_est > mem_limit:
            dec_skip[C] = f"skipped: est. {size(m_est)} > {size(mem_limit)}"
    spec = dict(base, prefill_lens=allowed, decode_contexts=[C for C in a.decode_contexts if C not in dec_skip],
                decode_steps=a.decode_steps, train_lens=a.train_lens if a.train else [], reps=a.reps)
    t0 = time.perf_counter()
    r = run_worker("timing", spec, a.threads, None)
    return {"path": path, "lens": lens, "mem": mem, "skip": skip_reason, "dec_skip": dec_skip, "timing": r,
            "seconds": time.perf_counter() - t0}


def _num(d: dict, k):
    """A JSON dict's entry for an int key (JSON turns keys into strings)."""
    return d.get(str(k), d.get(k))


def table(results: List[dict], a) -> Tuple[List[str], List[List[str]]]:
    lens = sorted(set(a.prefill_lens) | set(L for r in results for L in r["lens"]))
    tl = a.train_lens if a.train else []
    hdr = ["preset", "kinds", "params M"]
    hdr += [f"prefill µs/tok {label(T)}" for T in lens] + [f"peak MiB {label(T)}" for T in lens]
    hdr += [f"decode ms/tok {label(C)}" for C in a.decode_contexts]
    hdr += [f"state KiB {label(C)}" for C in a.decode_contexts]
    hdr += [f"kept KiB {label(max(a.decode_contexts))}"]
    hdr += [f"train µs/tok {label(T)}" for T in tl]
    hdr += ["prefill long/short", "decode large/small"] + (["train long/short"] if tl else [])
    rows = []
    for r in results:
        t = r["timing"]
        err = t.get("error")
        errs = t.get("errors", {})
        name = preset_name(r["path"])

        def cell(kind, L, scale, fmt):
            if L not in r["lens"] and kind in ("prefill", "peak"):
                return "not run: tiny preset"
            if kind in ("prefill", "peak") and L in r["skip"]:
                return r["skip"][L]
            if kind == "peak":
                return r["mem"][L]
            if kind in ("decode", "state", "kept") and L in r["dec_skip"]:
                return r["dec_skip"][L]
            if err:
                return err
            v = _num(t.get(kind, {}), L)
            if v is None:
                return "failed: " + errs.get(f"{'decode' if kind in ('state', 'kept') else kind}:{L}", "no figure")
            return fmt.format(v * scale)

        row = [name, "/".join(t.get("kinds", [])) or "?", f"{t['params'] / 1e6:.2f}" if "params" in t else "?"]
        row += [cell("prefill", T, 1e6, "{:.1f}") for T in lens] + [cell("peak", T, 1, "{}") for T in lens]
        row += [cell("decode", C, 1e3, "{:.2f}") for C in a.decode_contexts]
        row += [cell("state", C, 1 / 1024, "{:.1f}") for C in a.decode_contexts]
        row += [cell("kept", max(a.decode_contexts), 1 / 1024, "{:.1f}")]
        row += [cell("train", T, 1e6, "{:.1f}") for T in tl]

        def ratio(kind, Ls):
            got = [(L, _num(t.get(kind, {}), L)) for L in Ls]
            got = [(L, v) for L, v in got if v]
            if len(got) < 2:
                return "n/a: fewer than two figures"
            (l0, v0), (l1, v1) = got[0], got[-1]
            return f"{v1 / v0:.2f} ({label(l1)}/{label(l0)})"
        row += [ratio("prefill", r["lens"]), ratio("decode", a.decode_contexts)] + ([ratio("train", tl)] if tl else [])
        rows.append(row)
    return hdr, rows


def render(hdr: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def device_line(device: str, threads: int) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores, {threads} thread(s))"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="*", default=None,
                    help="names under configs/, paths or globs (default: every configs/tiny*.yaml)")
    ap.add_argument("--prefill-lens", nargs="*", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--long-lens", nargs="*", type=int, default=[65536],
                    help="more prefill lengths, for the presets outside configs/tiny* (the 125M class)")
    ap.add_argument("--prefill-piece", type=int, default=PREFILL_CHUNK,
                    help="read prefills this many tokens at a time, states carried, as LM.generate does "
                         f"(default {PREFILL_CHUNK}; 0: one call)")
    ap.add_argument("--decode-contexts", nargs="*", type=int, default=[512, 1024, 4096, 16384])
    ap.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per round")
    ap.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                    help="the training forward+backward columns (default on)")
    ap.add_argument("--train-lens", nargs="*", type=int, default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=3, help="interleaved timing rounds (the median counts)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu or cuda (default: cuda where available)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (and OMP_NUM_THREADS of the workers)")
    ap.add_argument("--mem-limit-gib", type=float, default=None,
                    help="skip lengths whose estimated prefill peak exceeds this (default: 80%% of available memory)")
    ap.add_argument("--max-seconds", type=float, default=900.0,
                    help="skip a prefill length whose timed passes are estimated to take longer; also each "
                         "memory subprocess's time limit")
    ap.add_argument("--out", default=None, help="also write the header and table (markdown) to this file")
    ap.add_argument("--quick", action="store_true",
                    help="tiny lengths for a smoke test: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    return ap


def options(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed options, ``--quick``'s lengths filled in where not given, lengths sorted."""
    ap = parser()
    a = ap.parse_args(list(argv))
    if a.worker:
        return a
    if a.quick:
        given = {tok.split("=")[0].lstrip("-").replace("-", "_") for tok in argv if tok.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(a, k, v)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    for name in ("prefill_lens", "decode_contexts"):
        if not getattr(a, name):
            ap.error(f"--{name.replace('_', '-')} needs at least one length")
    a.prefill_lens, a.long_lens = sorted(set(a.prefill_lens)), sorted(set(a.long_lens))
    a.decode_contexts, a.train_lens = sorted(set(a.decode_contexts)), sorted(set(a.train_lens))
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = options(argv)
    torch.set_num_threads(a.threads)
    if a.worker:
        kind, spec = a.worker[0], json.loads(a.worker[1])
        r = worker_memory(spec) if kind == "memory" else worker_timing(spec)
        print(RESULT + json.dumps(r), flush=True)
        return 0

    presets = find_presets(a.presets)
    mem_limit = a.mem_limit_gib * 2 ** 30 if a.mem_limit_gib else default_mem_limit(a.device)

    omp = os.environ.get("OMP_NUM_THREADS")
    command = (f"OMP_NUM_THREADS={omp} " if omp else "") + "python benchmarks/inference.py " + shlex.join(argv)
    head = (f"# {datetime.date.today().isoformat()}, {device_line(a.device, a.threads)}, torch {torch.__version__}, "
            f"commit {_commit()}, {a.dtype}, batch 1, median of {a.reps} interleaved round(s), "
            f"{a.decode_steps} decode steps per round, memory limit {size(mem_limit)}; "
            f"command: `{command.strip()}`")
    print(head, flush=True)
    results = []
    for p in presets:
        t0 = time.perf_counter()
        results.append(measure_preset(p, a, mem_limit))
        print(f"#   {preset_name(p)}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    hdr, rows = table(results, a)
    text = render(hdr, rows)
    print(text, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(head + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
