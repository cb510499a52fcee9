"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvwatch.daemon.engines.kv_events import KVEventHub


@pytest.fixture
def hub() -> Iterator[KVEventHub]:
    """A KV event hub running in its thread (thrash_seconds 5)."""
    h = KVEventHub(thrash_seconds=5.0, replay_timeout_seconds=1.0)
    h.start()
    try:
        yield h
    finally:
        h.close()
