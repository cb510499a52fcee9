"""Who hears of each published snapshot, in the loop's thread (``kvwatch record``, ``top --local``):
``on_tick`` with the snapshot, ``on_transfers`` with the KV transfers completed since the last
tick, one record each. Per-transfer events cost the kernel a ring-buffer record each, so they are
turned on only while some subscriber asks for them. A subscriber that raises is counted and the
others still hear."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.daemon.families.transfer import TransferProcesses
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.probes.records import TransferDone


@dataclass(slots=True)
class _Subscriber:
    on_tick: Callable[[Snapshot], None]
    on_transfers: Callable[[list[TransferDone]], None] | None


class SnapshotBus:
    def __init__(self, transfers: Callable[[], TransferProcesses | None], errors: ErrorBook) -> None:
        self._transfers = transfers  # the transfer family's processes, once (and if) its probes loaded
        self._errors = errors
        self._subscribers: list[_Subscriber] = []

    def subscribe(
        self, on_tick: Callable[[Snapshot], None], on_transfers: Callable[[list[TransferDone]], None] | None = None
    ) -> Callable[[], None]:
        """Returns the unsubscribe."""
        sub = _Subscriber(on_tick, on_transfers)
        self._subscribers.append(sub)
        tt = self._transfers()
        if on_transfers is not None and tt is not None:
            tt.probes.set_emit_events(True)
            tt.events.clear()

        def unsubscribe() -> None:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            if tt is not None and not any(s.on_transfers for s in self._subscribers):
                tt.probes.set_emit_events(False)

        return unsubscribe

    def deliver(self, snap: Snapshot) -> None:
        tt = self._transfers()
        done: list[TransferDone] = []
        if tt is not None and any(s.on_transfers for s in self._subscribers):
            done, tt.events = tt.events, []
        for sub in list(self._subscribers):
            try:
                sub.on_tick(snap)
                if sub.on_transfers is not None:
                    sub.on_transfers(done)
            except Exception as err:
                self._errors.record("subscriber", "a snapshot subscriber failed", err)
