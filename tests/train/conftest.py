import os
import sys

# the spawning helpers (launch.py) sit beside the tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import subprocess  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)`` mounts a tmpfs of that size (e.g. "1m") and returns its path: a real
    disk that fills up. Needs root (skipped otherwise; the simulated disk-full tests still run)."""
    mounts = []

    def mount(size: str) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs{len(mounts)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(mnt)
        return str(mnt)

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
