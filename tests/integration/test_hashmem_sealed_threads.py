"""The sealed hash memory loads numpy without BLAS worker threads (daemon/engines/hashmem_sealed.py):
a real interpreter imports it and its threads are counted in /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COUNT = "import os, kvwatch.daemon.engines.hashmem_sealed; print(len(os.listdir('/proc/self/task')))"


@pytest.mark.parametrize("asked", [None, "8"])
def test_numpy_loads_with_no_blas_thread_pool(asked: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if asked:  # an operator's environment asking for a pool: kvwatch never calls BLAS
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = asked
    out = subprocess.run([sys.executable, "-c", COUNT], env=env, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "1"
