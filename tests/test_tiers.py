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
