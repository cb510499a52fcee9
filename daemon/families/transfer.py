"""Transfer probes for the watched processes, and their counters: each process's NIXL transfers
as typed observations (``observe``), the bytes every library moved among them.

A new peer's first seconds are left out of the transfers the detector reads: when a
peer (a UCX endpoint) has been seen for ``peer_grace_seconds``, its counters at
that moment become its offset, and only what it does afterwards counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvwatch.daemon.config import Config
from kvwatch.daemon.families.attachments import FamilyProcesses
from kvwatch.daemon.families.runner import UprobeFamily
from kvwatch.daemon.host.procfs import ProcError, ProcFS
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.transfers import NIXL, TransferCounts, TransfersInFlight
from kvwatch.daemon.tracker import Tracked
from kvwatch.probes.records import TransferDone
from kvwatch.probes.transfer import InFlight, ProcessTransfers, TransferProbes

PENDING_SWEEP_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class TransferProcessState:
    counters: ProcessTransfers | None
    symbols_attached: int
    libraries: tuple[str, ...]


def link_bytes_per_second(bits_per_second: float, interface: str, procfs: ProcFS) -> float:
    """The configured link speed, or the interface's own (sysfs, Mb/s); 0 when unknown."""
    if bits_per_second > 0:
        return bits_per_second / 8
    if interface:
        try:
            mbit = procfs.link_speed_mbit(interface)
        except ProcError:
            return 0.0
        return mbit * 1e6 / 8 if mbit > 0 else 0.0
    return 0.0


class TransferProcesses(FamilyProcesses):
    probes: TransferProbes

    def __init__(
        self,
        probes: TransferProbes,
        errors: ErrorBook,
        *,
        clock: Callable[[], float],
        rescan_seconds: float,
        peer_grace_seconds: float,
    ) -> None:
        super().__init__(probes, errors, clock=clock, rescan_seconds=rescan_seconds)
        self.peer_grace_ns = int(peer_grace_seconds * 1e9)
        self._counters: dict[int, ProcessTransfers] = {}
        self._offsets: dict[tuple[int, str, int], tuple[int, int, int]] = {}
        self._in_flight: dict[int, tuple[InFlight, ...]] = {}
        self._next_sweep = 0.0
        self.pending = 0
        self.events: list[TransferDone] = []  # completed transfers, when `record` asked for them

    def forget(self, pid: int) -> None:
        super().forget(pid)
        self._counters.pop(pid, None)
        for k in [k for k in self._offsets if k[0] == pid]:
            del self._offsets[k]
        self._in_flight.pop(pid, None)

    def ingest(self) -> None:
        now = self.clock()
        if now >= self._next_sweep:
            self._next_sweep = now + PENDING_SWEEP_SECONDS
            self.probes.expire_pending()
        self.events += self.probes.take_events()
        if len(self.events) > 100_000:
            del self.events[:-100_000]
        sample = self.probes.sample()
        self._counters = {pid: c for pid, c in sample.processes.items() if pid in self.attached}
        self._in_flight = {pid: v for pid, v in sample.in_flight.items() if pid in self.attached}
        self.hits, self.lost = sample.hits, {f"transfer_{k}": v for k, v in sample.lost.items()}
        self.pending = sample.pending

    def calls(self, pid: int) -> float | None:
        if pid not in self.attached:
            return None
        c = self._counters.get(pid)
        if c is None:
            return 0.0
        return float(sum(x.calls for x in c.xfers.values()) + c.reg_calls + c.dereg_calls)

    def observe(self, t: Tracked, now: float) -> None:
        """The process's NIXL transfers: cumulative counts into its history, and those in flight."""
        now_ns = time.monotonic_ns()  # one instant for which peers are mature, in both
        counts = self._counts(t.pid, now_ns)
        if counts is not None:
            t.transfers.add(now, {NIXL: counts})
            t.in_flight = self._in_flight_of(t.pid, now_ns)

    def _counts(self, pid: int, now_ns: int) -> TransferCounts | None:
        if pid not in self.attached:
            return None
        c = self._counters.get(pid)
        if c is None:
            return TransferCounts()
        nbytes = seconds = completed = 0.0
        for p in c.peers:
            if p.lib != "nixl" or now_ns - p.first_ns < self.peer_grace_ns:
                continue  # a new peer: connection set-up and warm-up are not its bandwidth
            key = (pid, p.lib, p.peer)
            base = self._offsets.setdefault(key, (p.bytes, p.duration_ns, p.completed))
            nbytes += p.bytes - base[0]
            seconds += (p.duration_ns - base[1]) / 1e9
            completed += p.completed - base[2]
        posts = float(sum(x.calls for (lib, _op), x in c.xfers.items() if lib == "nixl"))
        moved = float(sum(x.bytes for x in c.xfers.values()))  # UCX puts beneath a NIXL post are the post's bytes
        return TransferCounts(posts=posts, completed=completed, bytes=nbytes, seconds=seconds, moved_bytes=moved)

    def _in_flight_of(self, pid: int, now_ns: int) -> TransfersInFlight:
        """Transfers to known (mature) peers posted and not done yet."""
        mature = {
            p.peer
            for p in (self._counters[pid].peers if pid in self._counters else ())
            if now_ns - p.first_ns >= self.peer_grace_ns
        }
        waiting = [f for f in self._in_flight.get(pid, ()) if f.peer in mature]
        return TransfersInFlight(
            transfers=float(len(waiting)),
            bytes=float(sum(f.bytes for f in waiting)),
            seconds=sum(max(now_ns - f.start_ns, 0) for f in waiting) / 1e9,
        )

    def state(self, pid: int) -> TransferProcessState | None:
        att = self.probes.attachments.get(pid)
        if pid not in self.attached or att is None or not att.libraries:
            return None
        return TransferProcessState(
            counters=self._counters.get(pid),
            symbols_attached=att.attached,
            libraries=tuple(lib.path for lib in att.libraries.values()),
        )


TransferFamily = UprobeFamily[TransferProbes, TransferProcesses]


def transfer_family(
    probes: TransferProbes | None, config: Config, errors: ErrorBook, clock: Callable[[], float]
) -> TransferFamily:
    return UprobeFamily(
        "transfer",
        probes,
        lambda p: TransferProcesses(
            p,
            errors,
            clock=clock,
            rescan_seconds=config.probes.transfer_rescan_seconds,
            peer_grace_seconds=config.detectors.transfer_collapse.peer_grace_seconds,
        ),
        errors,
        enabled=config.probes.transfer,
    )
