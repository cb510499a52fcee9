"""Fixtures shared by the real-kernel tests."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.daemon.lab.stublib import build


@pytest.fixture(scope="session")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub CUDA runtime and driver (libcudart.so.12, libcuda.so.1), built once.
    (test_transfer_probes.py overrides ``stub`` with its transfer-library stubs.)"""
    d = tmp_path_factory.mktemp("stubcuda")
    build(d)
    return d


@pytest.fixture
def kvdir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A KV-tier directory on a real disk (/var/tmp, not tmpfs: its pages are page cache that
    reclaim can evict), named for the test module, removed after the test."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    d = Path("/var/tmp") / f"kvwatch-{name}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)
