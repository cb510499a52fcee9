"""What an exporter that runs kvwatch's loop in its own process needs of it (``top`` without a
daemon, ``record``). The daemon's wiring builds the loop and hands it over: exporters never
build one, and see it only through this."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.probes.records import TransferDone


class Loop(Protocol):
    @property
    def snapshot(self) -> Snapshot: ...

    def start(self) -> None: ...

    def tick(self) -> Snapshot: ...

    def run(self, stop: threading.Event) -> None: ...

    def subscribe(
        self, on_tick: Callable[[Snapshot], None], on_transfers: Callable[[list[TransferDone]], None] | None = None
    ) -> Callable[[], None]: ...

    def close(self) -> None: ...
