"""Fixtures shared by the real-kernel tests."""

from __future__ import annotations

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
