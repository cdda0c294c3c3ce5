r"""The Triton launches each preset really makes, captured without a GPU: the compile gate's
captured cases (``kernels/compile_report.py`` compiles every entry of ``kernels/captured_launches.json``
for its target, next to the sweeps the op folders declare in ``compile_cases.py``).

    python -m ttt_lm.launch_capture                       # every preset, write the file
    python -m ttt_lm.launch_capture --check               # exit 1 if a launch is not in the file
    python -m ttt_lm.launch_capture --presets gated_deltanet_125m --print

Per preset (``configs/*.yaml``) and GPU family (sm_90, sm_80), inside
``kernels._launch_cache.capture`` (a stand-in driver; launches recorded, nothing run), with the
model on the ``meta`` device (shapes, dtypes, strides and storage offsets, no data):

The model has one period of the preset's layer pattern (``model.n_layers`` = its length): every
deeper layer repeats one of those, with the same launches.

* **train**: the step a run makes: the preset's model in bfloat16 (as DeepSpeed's bf16 mode casts
  it), its backends chosen as on a GPU (``kernel_backend`` "auto" takes Triton wherever an op has
  it; attention takes SDPA, as without flash-attn), training mode, a [``train.micro_batch_size``,
  ``data.seq_len``] batch, the blocks' forward and the backward from a loss on their output (the
  LM head's chunked loss launches no Triton kernel);
* **decode**: what ``LM.generate`` runs: a ``data.seq_len``-token prompt read through
  ``LM.hidden`` in pieces of ``PREFILL_CHUNK`` with the states carried (the kernels' final-state
  variants, and initial-state ones past the first piece), a ``TURN``-token continuation read from
  the carried state (a chat's next turn: an odd length, with an initial state at any
  ``data.seq_len``), then one ``LM.step``.

Each launch that would compile is one record: the kernel, its signature (argument types,
pointer element types), constexprs (including a None pointer), the specialization attributes a
launch derives (pointer alignment to 16 bytes, integers divisible by 16 or equal to 1), compile
options (warps, stages) and target. The file holds every distinct record with the presets and
steps that launch it, and per preset a digest of its resolved config and of the sources a
capture runs (``source_digest``: the model, the config schema, the kernels and their wrappers,
torch's and Triton's versions). ``--check`` (``tests/kernels/test_launch_capture.py``) captures
again the presets whose digest differs from the file's (``--all``: every preset) and fails when
one launches a specialization the file lacks, so the gate cannot fall behind what runs; with the
sources the file was made from, it captures nothing.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
CAPTURE_FILE = ROOT / "kernels" / "captured_launches.json"
ARCHS = (90, 80)
STEPS = ("train", "decode")
#: the continuation the decode step reads after its prompt
TURN = 17
#: the record fields that make a compile (the rest say where it came from)
COMPILE_FIELDS = ("kernel", "name", "signature", "constexprs", "attrs", "options", "target")


def presets() -> List[str]:
    """Every preset name under ``configs/`` (the files at its top level)."""
    return sorted(Path(p).stem for p in glob.glob(str(ROOT / "configs" / "*.yaml")))


#: compile options that name this machine's files (the backend's own defaults fill them in)
LOCAL_OPTIONS = ("extern_libs",)


def _portable(rec: dict) -> None:
    """Drop the options that hold this machine's paths (libdevice's), so that the record is the
    same on every machine."""
    if isinstance(rec.get("options"), dict) and "__dict" in rec["options"]:
        rec["options"] = {"__dict": [kv for kv in rec["options"]["__dict"] if kv[0] not in LOCAL_OPTIONS]}


def _key(rec: dict) -> str:
    return json.dumps([rec[f] for f in COMPILE_FIELDS], sort_keys=True)


def _step(preset: str, step: str, full_depth: bool = False):
    import torch

    from ttt_lm.config import load_config
    from ttt_lm.model.lm import PREFILL_CHUNK, build_model

    cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"))
    from ttt_lm.model.lm import model_class
    if not model_class(cfg.model).runs_kernel_ops:
        return   # a model variant in plain PyTorch (no kernels/ op) launches nothing to capture
    if not full_depth:
        # one period of the layer pattern: the layers repeat it, each like the one a period
        # before (the same mixer, config and shapes), so a deeper stack launches nothing new
        # (tests/kernels/test_launch_capture.py holds a preset's full stack to this)
        cfg.model.n_layers = len(cfg.model.layer_pattern)
    B, T = int(cfg.train.micro_batch_size), int(cfg.data.seq_len)
    with torch.device("meta"):
        model = build_model(cfg.model).to(torch.bfloat16)
    ids = torch.zeros(B if step == "train" else 1, T, dtype=torch.long, device="meta")
    if step == "train":
        model.train()
        h, _ = model.hidden(ids)
        # the head's loss launches no Triton kernel (and asks autocast about the device, which
        # meta tensors have none of): a loss of the same dtype on the final hidden state
        h.float().square().mean().backward()
        return
    model.eval()
    with torch.no_grad():
        states = None
        for s in range(0, T, PREFILL_CHUNK):
            _, states = model.hidden(ids[:, s:s + PREFILL_CHUNK], states, True)
        _, states = model.hidden(ids[:, :TURN], states, True)
        model.step(ids[:, -1], states)


def capture_preset(preset: str, archs: Sequence[int] = ARCHS, steps: Sequence[str] = STEPS,
                   full_depth: bool = False) -> List[dict]:
    """The distinct launch records of ``preset``'s steps at each of ``archs``, each with
    ``where``: the "preset:step" names that launch it. Run in a process that compiles (no
    ``TRITON_INTERPRET``): the kernels must be real ``@triton.jit`` functions."""
    from kernels import _launch_cache as lc
    from kernels._triton_utils import is_interpreting

    if is_interpreting():
        raise RuntimeError("launch_capture: TRITON_INTERPRET is set; capture in a process without it")
    out: Dict[str, dict] = {}
    for arch in archs:
        for step in steps:
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "rec.jsonl")
                with lc.capture(path, arch):
                    _step(preset, step, full_depth)
                recs = []
                if os.path.exists(path):
                    with open(path) as f:
                        recs = [json.loads(line) for line in f if line.strip()]
            for r in recs:
                _portable(r)
                if r.get("hash") is None:
                    raise RuntimeError(f"launch_capture: {preset} {step} sm_{arch}: a launch of {r['kernel']} "
                                       f"could not be described: {r.get('error')}")
                k = _key(r)
                e = out.setdefault(k, {**{f: r[f] for f in COMPILE_FIELDS}, "num_warps": r["num_warps"],
                                       "num_stages": r["num_stages"], "arch": arch, "where": []})
                if f"{preset}:{step}" not in e["where"]:
                    e["where"].append(f"{preset}:{step}")
    return list(out.values())


def capture_all(names: Sequence[str], progress=None) -> List[dict]:
    """The records of every preset in ``names``, merged (``where`` lists every launcher)."""
    merged: Dict[str, dict] = {}
    for p in names:
        recs = capture_preset(p)
        for r in recs:
            e = merged.setdefault(_key(r), {**r, "where": []})
            e["where"] += [w for w in r["where"] if w not in e["where"]]
        if progress:
            progress(f"{p}: {len(recs)} distinct launches")
    return sorted(merged.values(), key=lambda r: (r["name"], r["arch"], _key(r)))


#: the sources a preset's launches depend on: the model, the configs' schema, the kernels and
#: their wrappers (not the gate's own files, nor the data files beside them), and this module
_SOURCES = ("ttt_lm/model/**/*.py", "ttt_lm/config.py", "ttt_lm/launch_capture.py", "kernels/**/*.py")
_NOT_SOURCES = ("compile_cases.py", "compile_report.py")


def source_digest(root: Path = ROOT) -> str:
    """A digest of every source file a capture runs (``_SOURCES``) and of the torch and Triton
    versions: a capture made from other sources may launch other specializations."""
    import torch
    import triton

    h = hashlib.sha256(f"{torch.__version__} {triton.__version__}".encode())
    files = sorted({p for pat in _SOURCES for p in root.glob(pat) if p.name not in _NOT_SOURCES})
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def preset_digest(preset: str, sources: str) -> str:
    """``sources`` (:func:`source_digest`) with the preset's resolved config."""
    from omegaconf import OmegaConf

    from ttt_lm.config import load_config

    cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"))
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg)) if not isinstance(cfg, dict) else json.dumps(cfg)
    return hashlib.sha256((sources + text).encode()).hexdigest()[:32]


def read(path: Path = CAPTURE_FILE) -> List[dict]:
    if not path.exists():
        return []
    return json.loads(path.read_text())["launches"]


def read_digests(path: Path = CAPTURE_FILE) -> Dict[str, str]:
    """preset → the digest its launches in the file were captured under."""
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("digests", {})


def missing(recs: Sequence[dict], have: Sequence[dict]) -> List[dict]:
    """The records of ``recs`` whose compile is not among ``have``."""
    keys = {_key(r) for r in have}
    return [r for r in recs if _key(r) not in keys]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ttt_lm.launch_capture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="*", help="preset names (default: every configs/*.yaml)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the file instead of writing it: the presets whose digest (their "
                         "config and the sources a capture runs) differs from the file's are captured again")
    ap.add_argument("--all", action="store_true", help="with --check: capture every preset, whatever its digest")
    ap.add_argument("--print", action="store_true", help="print the records, write nothing")
    ap.add_argument("--out", default=str(CAPTURE_FILE))
    a = ap.parse_args(argv)
    out = Path(a.out)
    names = a.presets or presets()
    unknown = sorted(set(names) - set(presets()))
    if unknown:
        print(f"launch_capture: no preset {unknown} under configs/", file=sys.stderr)
        return 2
    sources = source_digest()
    digests = {p: preset_digest(p, sources) for p in names}
    if a.check:
        kept = read_digests(out)
        todo = names if a.all else [p for p in names if kept.get(p) != digests[p]]
        recs = capture_all(todo, progress=lambda s: print(s, file=sys.stderr))
        gone = missing(recs, read(out))
        for r in gone:
            print(f"NOT IN {out}: sm_{r['arch']} {r['name']} ({', '.join(r['where'])})")
        print(f"{len(names) - len(todo)} of {len(names)} presets current (digest unchanged); {len(todo)} captured: "
              f"{len(recs) - len(gone)}/{len(recs)} of their launches are in {out}")
        if gone:
            print("run `python -m ttt_lm.launch_capture` and `python -m kernels.compile_report --save-results`, "
                  "and commit kernels/captured_launches.json and kernels/compile_gate_results.json")
        return 1 if gone else 0
    recs = capture_all(names, progress=lambda s: print(s, file=sys.stderr))
    if a.print:
        print(json.dumps(recs, indent=1))
        return 0
    kept_digests = {}
    if a.presets:       # a subset: merge into what the file holds for the other presets
        keep = [r for r in read(out) if not all(w.split(":")[0] in names for w in r["where"])]
        for r in keep:
            r["where"] = [w for w in r["where"] if w.split(":")[0] not in names]
        recs = sorted(_merge(keep, recs), key=lambda r: (r["name"], r["arch"], _key(r)))
        kept_digests = {p: d for p, d in read_digests(out).items() if p not in names}
    body = {"launches": recs, "digests": dict(sorted({**kept_digests, **digests}.items()))}
    out.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    print(f"{len(recs)} distinct launches of {len(names)} presets written to {out}", file=sys.stderr)
    return 0


def _merge(a: Sequence[dict], b: Sequence[dict]) -> List[dict]:
    merged: Dict[str, dict] = {}
    for r in list(a) + list(b):
        e = merged.setdefault(_key(r), {**r, "where": []})
        e["where"] += [w for w in r["where"] if w not in e["where"]]
    return list(merged.values())


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    sys.exit(main())
