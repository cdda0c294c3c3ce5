"""Start-up of the GPU campaign's record processes: installs the launch recorder of
``kernels/_launch_cache.py`` before the program runs.

``benchmarks/gpu_campaign.py`` (``record_env``) puts this folder first on ``PYTHONPATH`` of the
commands its warm-up runs in record mode, beside ``TTT_LM_RECORD_LAUNCHES=<file>``; Python imports
this module at start-up in those processes and in every Python process they start (pytest-xdist
workers inherit the environment). Elsewhere nothing imports it, so importing a kernel never
records. A process that cannot install the recorder (no Triton, an unsupported Triton) exits with
status 3 rather than compile and run what it was meant to record.

Any other ``sitecustomize`` later on ``sys.path`` (a distribution's) runs after it, as it would
have without this folder.
"""
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("TTT_LM_RECORD_LAUNCHES"):
    try:
        from kernels._launch_cache import install_recorder_from_env

        install_recorder_from_env()
    except Exception as e:  # noqa: BLE001 - any failure leaves a process that would run, not record
        sys.stderr.write(f"launch recording: cannot install the recorder ({type(e).__name__}: {e})\n")
        sys.stderr.flush()
        os._exit(3)

_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _next is not None and _next.loader is not None:
    _mod = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_mod)
