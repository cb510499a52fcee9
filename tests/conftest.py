"""Shared test set-up.

Tests are split the way eBPF projects split them (docs/architecture.md, "Tests"):
* tests/unit        — no bcc, no root, no sockets or threads: parsers, config, detectors, collector;
* tests/integration — no bcc, no root: sockets, threads, the daemon as a subprocess against
  simulated engines and replayed real runs, tens of seconds each;
* tests/privileged  — root on the real kernel: load, attach, trigger a known workload, assert counts;
* tests/gpu         — run on the lent GPU machine by hand, recorded, not in CI;
* tests/support     — the helpers they share (a test module never imports another).

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
