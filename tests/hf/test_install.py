"""The install the hf extra needs: transformers imports the Hugging Face ``kernels`` distribution
by its import name whenever it is installed, and that name is this repository's ``kernels/``
package, so ``ttt_lm.hf`` refuses to load with it present, naming the problem and the fix."""
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_distribution_is_not_installed():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")


def test_ttt_lm_hf_refuses_to_load_beside_the_kernels_distribution():
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda name: '0.19.1' if name == 'kernels' else real(name)\n"
        "import ttt_lm.hf\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "'kernels' distribution is installed" in last, r.stderr[-2000:]
    assert "transformers>=5.0,<5.25" in last
