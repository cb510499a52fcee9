"""What the agent runs every source of observations through (docs/architecture.md, the tick):
the kernel-memory family, NVML's GPU memory, each uprobe family, the engine taps. Each is built in
``wiring.py``; the agent starts them, samples them into the processes' histories every tick, reads
what they lost and why they are not ready, and closes them, all alike. What each contributes to
the snapshot is its own (per process, per tier), read by ``snapshots``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from kvwatch.daemon.model.snapshot import ProbeView
from kvwatch.daemon.tracker import Tracked


class Source(Protocol):
    name: str

    def start(self) -> None: ...

    def close(self) -> None: ...

    def sample(self, tracked: Sequence[Tracked], now: float) -> None:
        """Its readings of this tick into each watched process's histories."""

    def lost(self) -> Mapping[str, int]:
        """What it dropped so far, by where (each key names its source)."""

    def not_ready(self) -> tuple[str, ...]:
        """Why what the configuration asks of it is not working, if it is not."""

    def probe_views(self) -> list[ProbeView]:
        """Its probes as the snapshot shows them (none for a source without probes)."""
