"""The test tiers: ``-m unit`` selects the tests without a dist, slurm, gpu or aot marker
(tests/conftest.py marks them), and ``make test-fast`` (``-m "unit and not slow"``) leaves out the
slow ones. Collected in a subprocess, as pytest collects them from the command line."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_unit_and_not_slow_selects_the_fast_unit_tests_only():
    files = ["tests/parallel/test_harness.py", "tests/train/test_callbacks.py"]  # dist; unit with slow tests
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "unit and not slow", *files], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert "tests/train/test_callbacks.py::test_the_validation_loader_is_built_once" in ids
    assert all(i.startswith("tests/train/test_callbacks.py::") for i in ids)  # no dist test
    slow = ("test_a_callback_given_to_main_sees_the_steps_and_stops_the_run",
            "test_a_run_validates_at_its_last_step_and_a_rerun_says_it_is_complete")
    assert not any(i.endswith(s) for i in ids for s in slow)


def test_the_run_ends_with_its_time_per_tier_and_per_kind():
    # two tiers in one run (a unit file and an aot test), under two pytest-xdist processes, as make test runs
    files = ["tests/test_tiers.py::test_unit_and_not_slow_selects_the_fast_unit_tests_only",
             "tests/kernels/test_compile_gate.py::test_known_failures_name_real_cases"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *files], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    i = next(i for i, ln in enumerate(lines) if "test time per tier and per layer kind" in ln)
    tiers = dict(x.strip().rsplit(" ", 1) for x in lines[i + 1].removeprefix("tier: ").split(","))
    assert set(tiers) == {"unit", "aot"} and all(float(v) >= 0 for v in tiers.values())
    assert lines[i + 2].startswith("kind: ")


def test_a_test_counts_to_the_longest_kind_its_id_names():
    import importlib.util   # tests/conftest.py by its path: another "conftest" may be imported first
    spec = importlib.util.spec_from_file_location("tests_root_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _kinds_in = mod._kinds_in

    kinds = ("rnn", "gated_rnn", "memory_a", "memory_b", "attn", "local_attn")     # any names
    assert _kinds_in("tests/kernels/test_gated_rnn.py::test_x", kinds) == ["gated_rnn"]
    assert _kinds_in("tests/model/test_x.py::test_y[rnn-memory_b]", kinds) == ["memory_b", "rnn"]
    assert _kinds_in("tests/model/test_window.py::test_local_attn_and_attn", kinds) == ["attn", "local_attn"]
    assert _kinds_in("tests/test_config.py::test_z", kinds) == []


def test_the_report_counts_model_variants_by_their_own_name():
    """A model variant (a subclass of LM, TTT-E2E's) is a name of the report beside the layer kinds,
    named by the config section that switches it on, so its tests are not "(no kind named)"."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tests_root_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ttt_lm.model.config import ModelConfig
    from ttt_lm.model.lm import LM, model_class
    from ttt_lm.model.registry import builtin_kinds

    variants, names = mod.model_variants(), mod.report_names()
    # the subclasses LM(cfg) can build (others, e.g. the parallel wrappers, keep LM.builds: never)
    built = [c for c in LM.__subclasses__() if c.builds.__func__ is not LM.builds.__func__]
    assert len(variants) == len(built) >= 1, (variants, built)
    for v in variants:       # the section names its variant: switched on, LM(cfg) is that class
        cfg = ModelConfig()
        getattr(cfg, v).enabled = True
        assert model_class(cfg) in built, v
    assert set(builtin_kinds()) | set(variants) == set(names) and len(names) == len(set(names))
    v = variants[0]
    assert mod._kinds_in(f"tests/model/test_health.py::test_x[{v}_125m.yaml]", names) == [v]
