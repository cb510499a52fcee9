"""Shared test set-up.

Tests are split the way eBPF projects split them:
* tests/unit        — no bcc, no root: parsers, config, detectors, collector, HTTP;
* tests/integration — no bcc, no root: the daemon as a subprocess against simulated engines
  (engine taps), several processes and sockets, tens of seconds each;
* tests/privileged  — root on the real kernel: load, attach, trigger a known workload, assert counts;
* tests/gpu         — run on the lent GPU machine by hand, recorded, not in CI.

Privileged tests skip (saying why) only when not root. As root, a missing bcc is
an error, not a skip: CI runs as root and must not pass by skipping the kernel.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/privileged" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.privileged)
            if os.geteuid() != 0:
                item.add_marker(pytest.mark.skip(reason="needs root for BPF and cgroups (CI runs these as root)"))
