"""The launches each preset really makes, captured without a GPU (``ttt_lm/launch_capture.py``,
``kernels._launch_cache.capture``), are compile-gate cases (``kernels/captured_launches.json``,
compiled by ``tests/kernels/test_compile_gate.py``).

* every preset's training and decode step launches only specializations the file holds: a
  kernel change that launches a new one (a new constexpr, dtype, None-ness, alignment) fails here
  until ``python -m ttt_lm.launch_capture`` is run again and the gate compiles it (the presets
  whose config and sources are those the file was captured from are not captured again: their
  digest says so);
* a capture records what a launch on a GPU would compile: the preset's head dims, fp32 gates
  where the mixer computes them in fp32, the training step's state-less variant next to the
  decode path's state-carrying one, the launch family's config (sm_90 and sm_80 differ), and
  integer divisibility and pointer alignment from the tensors' offsets;
* leaving a capture restores the process (custom ops' fake functions, the driver, availability);
* the gate compiles a captured case with its recorded attributes, and keeps results by content
  key: a kept result is not compiled again, a changed case is.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run_code(code: str, timeout: float = 600) -> None:
    """Run ``code`` in a process that compiles (no interpreter); it must print "ok" last."""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def _run(*args, timeout=1200):
    return subprocess.run([sys.executable, "-m", "ttt_lm.launch_capture", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.aot
def test_every_preset_launch_is_a_gate_case():
    """The presets whose digest (config, the sources a capture runs, torch and Triton versions)
    differs from the file's are captured again; every launch they make must be in the file."""
    p = _run("--check")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "presets current" in p.stdout


def test_the_file_holds_every_preset_and_its_digest():
    from ttt_lm import launch_capture as lc

    digests = lc.read_digests()
    assert set(digests) == set(lc.presets())
    where = {w.split(":")[0] for r in lc.read() for w in r["where"]}
    # every preset with a Triton kernel in its layers launches something; the attention-only ones,
    # LaCT (its op has no Triton kernel) and the Titans presets (their MLP memory has none) nothing
    assert {"gated_deltanet_125m", "ttt_linear_125m", "ttt_mlp_125m", "mamba_130m", "hawk_125m",
            "deltanet_125m", "griffin_125m", "hybrid_125m"} <= where
    assert not where & {"transformer_125m", "lact_125m", "titans_lmm_125m", "titans_mac_170m"}


def test_the_digest_follows_the_sources_a_capture_runs(tmp_path):
    from ttt_lm import launch_capture as lc

    files = {"ttt_lm/model/lm.py": "x = 1\n", "ttt_lm/config.py": "", "kernels/op/chunk.py": "k = 1\n",
             "kernels/op/compile_cases.py": "g = 1\n", "kernels/compile_report.py": "", "ttt_lm/train/loop.py": "t = 1\n",
             "kernels/captured_launches.json": "{}"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    d0 = lc.source_digest(tmp_path)
    for rel in ("kernels/op/compile_cases.py", "kernels/compile_report.py", "ttt_lm/train/loop.py",
                "kernels/captured_launches.json"):
        (tmp_path / rel).write_text("changed\n")
        assert lc.source_digest(tmp_path) == d0, rel       # not what a launch is made of
    for rel in ("kernels/op/chunk.py", "ttt_lm/model/lm.py", "ttt_lm/config.py"):
        (tmp_path / rel).write_text("changed\n")
        d1 = lc.source_digest(tmp_path)
        assert d1 != d0, rel
        d0 = d1
    (tmp_path / "kernels/op/new.py").write_text("")
    assert lc.source_digest(tmp_path) != d0               # a new source file counts


@pytest.fixture(scope="module")
def gdn():
    p = _run("--presets", "gated_deltanet_125m", "--print")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_a_full_stack_launches_what_one_period_of_its_pattern_does():
    code = """
import os
os.environ["TRITON_INTERPRET"] = "0"
from ttt_lm import launch_capture as lc
for preset in ("gdn_hybrid_125m", "tiny_griffin"):
    full = lc.capture_preset(preset, archs=(90,), full_depth=True)
    one = lc.capture_preset(preset, archs=(90,))
    assert full and sorted(map(lc._key, full)) == sorted(map(lc._key, one)), preset
print("ok")
"""
    _run_code(code, timeout=1200)


def _constexprs(rec):
    from kernels._launch_cache import decode

    names = [n for n, _ in decode(rec["signature"]).items()]
    return {names[k[0]]: decode(v) for k, v in rec["constexprs"]}


def _sig(rec):
    from kernels._launch_cache import decode

    return decode(rec["signature"])


def test_capture_records_what_the_preset_launches(gdn):
    names = {r["name"] for r in gdn}
    # the delta-rule family's forward and backward kernels, per arch
    assert {"_wy_fwd", "_fwd_state", "_fwd_o", "_bwd_wy", "_bwd_dqk"} <= names
    assert {r["arch"] for r in gdn} == {90, 80}
    fwd = [r for r in gdn if r["name"] == "_fwd_state"]
    # d_k = 96 (768 / 8 heads), the preset's, not the sweep's 64 or 128
    assert {_constexprs(r)["DK"] for r in fwd} == {96}
    # the training step passes no initial state; the decode path's prefill carries one
    train = [r for r in fwd if r["where"] == ["gated_deltanet_125m:train"]]
    decode = [r for r in fwd if "gated_deltanet_125m:decode" in r["where"]]
    assert train and decode
    assert all(_constexprs(r)["h0"] is None and _constexprs(r)["ht"] is None for r in train)
    assert all(_sig(r)["ht"].startswith("*") for r in decode)
    assert any(_sig(r)["h0"].startswith("*") for r in decode)
    # β arrives in float32 next to bfloat16 keys
    wy = [r for r in gdn if r["name"] == "_wy_fwd"]
    assert all(_sig(r)["beta"] == "*fp32" and _sig(r)["k"] == "*bf16" for r in wy)
    # each record compiles for the family it was captured at
    from kernels._launch_cache import decode as dec
    assert all(dec(r["target"])["arch"] == r["arch"] for r in gdn)
    # integer arguments carry the divisibility a launch derives (T = 2048 is a multiple of 16)
    assert any(["tt.divisibility", 16] in dec(v) for r in wy for k, v in r["attrs"] if _sig(r)[list(_sig(r))[k[0]]] == "i32")


def test_capture_leaves_the_process_as_it_was():
    code = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from kernels import _launch_cache as lc
from kernels._triton_utils import triton_available, device_arch, num_sms
from torch._library import custom_ops
import tempfile
from triton.runtime.jit import JITFunction
do_compile = JITFunction._do_compile
ops = lc._our_custom_ops()
fakes = {n: d._abstract_fn for n, d in ops.items()}
assert ops and all(f is not None for f in fakes.values())
assert not triton_available("meta")
with tempfile.TemporaryDirectory() as d:
    with lc.capture(os.path.join(d, "r.jsonl"), 80):
        assert triton_available("meta") and device_arch("meta") == 80 and num_sms("meta") == 108
        assert all(d_._abstract_fn is d_._init_fn for d_ in ops.values())
        try:
            with lc.capture(os.path.join(d, "s.jsonl"), 90):
                raise SystemExit("nested capture accepted")
        except RuntimeError:
            pass
assert not triton_available("meta") and device_arch("meta") == 90 and num_sms("meta") == 1
assert all(ops[n]._abstract_fn is fakes[n] for n in ops)
assert lc.recorder_path() is None and JITFunction._do_compile is do_compile
try:
    with lc.capture("x", 75):
        pass
    raise SystemExit("arch 75 accepted")
except ValueError as e:
    assert "75" in str(e)
print("ok")
"""
    _run_code(code, timeout=600)


def test_the_gate_compiles_a_captured_case_as_recorded(gdn, tmp_path):
    f = tmp_path / "captured.json"
    f.write_text(json.dumps({"launches": gdn}))
    code = f"""
import json
from pathlib import Path
from kernels import compile_report as cr
cases = cr.captured_cases(Path({str(f)!r}))
assert len(cases) == {len(gdn)}, len(cases)
assert all(len(c.archs) == 1 and c.config.startswith("captured gated_deltanet_125m:") for c in cases)
assert {{c.matmul for c in cases}} == {{True}}, [c.id for c in cases if not c.matmul]   # every one calls tl.dot
# the content key follows the recorded attributes: a launch with other alignment is another case
c = cases[0]
other = json.loads(json.dumps(c.record))
other["attrs"] = [[k, []] for k, _ in other["attrs"]]
c2 = cr.Case(**{{**c.__dict__, "record": other}})
assert cr.cache_key(c, c.archs[0]) != cr.cache_key(c2, c.archs[0])
# through the worker's JSON and back, the record survives
assert cr.Case.from_json(json.loads(json.dumps(c.to_json()))).record == c.record
# a record is compiled for the target it was captured at only
try:
    cr.compile_one(c, 90 if c.archs[0] == 80 else 80)
    raise SystemExit("compiled for another arch")
except ValueError as e:
    assert "captured for" in str(e)
print("ok")
"""
    _run_code(code, timeout=600)


ROW = {"status": "ok", "error": None, "compile_s": 1.0, "registers": 40, "stack": 0, "spill_stores": 0,
       "spill_loads": 0, "shared": 1024, "wgmma": 0, "mma": 4}


def test_kept_results_are_not_compiled_again(tmp_path, monkeypatch):
    from kernels import compile_report as cr

    case = cr.Case(op="op", module="mod", kernel="k", config="a", signature={}, constexprs={"X": 1},
                   num_warps=4, num_stages=1, matmul=True, archs=(90,))
    kept = tmp_path / "results.json"
    monkeypatch.setattr(cr, "RESULTS_FILE", kept)
    monkeypatch.setenv("TTT_LM_AOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cr, "cache_key", lambda c, arch: f"{c.kernel}:{c.constexprs['X']}:{arch}")
    rows = [{**ROW, "key": "k:1:90", "extra": 1}, {**ROW, "key": "k:2:90", "status": "timeout"}]
    assert cr.save_results(rows) == 1                 # a timeout is not a result
    assert cr.read_results() == {"k:1:90": ROW}

    def no_compile(self, c, a, timeout):
        raise AssertionError(f"compiled {c.id} although its result is kept")
    monkeypatch.setattr(cr._Worker, "compile", no_compile)
    out = cr.run([case], [90], jobs=1)
    assert out[0]["cached"] and out[0]["registers"] == 40 and out[0]["passed"] and out[0]["key"] == "k:1:90"
    # a regression kept under the key fails the case (the gate reads what it keeps)
    cr.save_results([{**ROW, "spill_stores": 8, "key": "k:1:90"}])
    assert not cr.run([case], [90], jobs=1)[0]["passed"]
    # a subset run merges; a full run prunes keys no case has any more
    cr.save_results([{**ROW, "key": "k:3:90"}], prune=False)
    assert set(cr.read_results()) == {"k:1:90", "k:3:90"}
    cr.save_results([{**ROW, "key": "k:3:90"}])
    assert set(cr.read_results()) == {"k:3:90"}
    # a case whose key is not kept is compiled, once
    compiled = []
    monkeypatch.setattr(cr._Worker, "compile", lambda self, c, a, t: compiled.append(c.id) or dict(ROW))
    cr.run([case], [90], jobs=1)
    assert compiled == ["k[a]"]
    # an unreadable file keeps nothing (everything compiles), it is not an error
    kept.write_text("{not json")
    assert cr.read_results() == {}
