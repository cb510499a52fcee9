"""A uprobe probe family as the agent runs it: load once, drain its ring buffer between
ticks, ingest every tick, feed per-process observations, close. A family that fails to load
is reported (not ready, with the reason) and the rest of kvwatch goes on.

Attaching and detaching run in the family's own thread, never in the probe loop:
releasing a uprobe waits for the kernel to unregister it (up to hundreds of milliseconds
each) and attaches queue behind those releases, so in the loop a watched process exiting
while another starts would stall every tick for seconds. The loop hands the attacher the
current process list each tick and reads only what the attacher has published (dict
lookups and copies, safe under the GIL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from kvwatch.daemon.families.attachments import FamilyProcesses
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.snapshot import ProbeView
from kvwatch.daemon.model.uprobes import UprobeState
from kvwatch.daemon.tracker import Tracked
from kvwatch.probes.errors import ProbeError
from kvwatch.probes.records import HookState
from kvwatch.probes.uprobes import PerProcessUprobes

P = TypeVar("P", bound=PerProcessUprobes[Any])
T = TypeVar("T", bound=FamilyProcesses)


class UprobeFamily(Generic[P, T]):
    def __init__(
        self,
        name: str,
        probes: P | None,
        make_processes: Callable[[P], T],
        errors: ErrorBook,
        *,
        enabled: bool,
        more_observations: Callable[[Tracked], None] | None = None,
    ) -> None:
        """``more_observations``: more of an attached process's observations to take with the
        family's (the CUDA family: NVML's)."""
        self.name = name
        self.probes = probes
        self.probe_apis = tuple(type(probes).apis) if probes is not None else ()
        self.make_processes = make_processes
        self.enabled = enabled
        self.processes: T | None = None
        self.failure = ""
        self._wanted: list[Tracked] | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._attacher: threading.Thread | None = None
        self._errors = errors
        self.more_observations = more_observations
        self.syncs = 0  # attacher passes done (tests wait on it)

    def start(self) -> None:
        if self.probes is None:
            return
        try:
            self.probes.start()
        except ProbeError as err:
            self._errors.record(f"probe_load_{self.name}", f"{self.name} probes did not load", err)
            self.failure = str(err)
            self.probes = None
            return
        self.processes = self.make_processes(self.probes)
        self._attacher = threading.Thread(target=self._run, name=f"kvwatch-attach-{self.name}", daemon=True)
        self._attacher.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            wanted, procs = self._wanted, self.processes
            if wanted is None or procs is None or self._stop.is_set():
                continue
            try:
                procs.sync(wanted)
            except Exception as err:  # the attacher must outlive any one process
                self._errors.record(f"attach_loop_{self.name}", f"{self.name} attacher failed", err)
            self.syncs += 1

    def active(self) -> bool:
        """Some process has this family's probes attached: its ring buffer can get events."""
        return self.processes is not None and bool(self.processes.attached)

    def consume(self) -> None:
        if self.probes is None:
            return
        try:
            self.probes.consume()
        except Exception as err:
            self._errors.record(f"ring_poll_{self.name}", "ring buffer poll failed", err)

    def tick(self, tracked: list[Tracked]) -> None:
        if self.processes is None:
            return
        if self._attacher is not None:
            self._wanted = list(tracked)
            self._wake.set()
        else:
            self.processes.sync(tracked)
        self.processes.ingest()

    def sample(self, tracked: Iterable[Tracked], now: float) -> None:
        if self.processes is None:
            return
        procs = self.processes
        for t in tracked:
            if t.pid not in procs.attached:
                continue
            procs.observe(t, now)
            if self.more_observations is not None:
                self.more_observations(t)
            calls = procs.calls(t.pid)
            t.uprobes[self.name] = UprobeState(
                calls=calls if calls is not None else 0.0,
                shed=procs.is_shed(t.pid),
                symbols=procs.symbols_attached(t.pid),
            )

    # --- what the snapshot shows of the family (frozen data) ------------------------------------
    def probe_views(self) -> list[ProbeView]:
        """One per API the family probes: its state across the processes, its hits."""
        procs = self.processes
        if procs is not None:
            states = procs.api_states()
            any_attached = bool(procs.probes.attachments)
            return [
                ProbeView(
                    api.label,
                    self.name,
                    f"{api.lib}:{api.symbol}",
                    states[api.label].value if any_attached else "idle",  # no process of this kind yet
                    False,
                    procs.hits.get(api.label, 0),
                )
                for api in procs.probes.apis
            ]
        if not self.enabled:
            return []
        failed = HookState.FAILED.value
        return [
            ProbeView(a.label, self.name, f"{a.lib}:{a.symbol}", failed, True, 0, self.failure) for a in self.probe_apis
        ]

    def lost(self) -> dict[str, int]:
        """Events the family dropped, by where (each key names its family)."""
        if self.processes is None:
            return {}
        return {k if k.startswith(f"{self.name}_") else f"{self.name}_{k}": v for k, v in self.processes.lost.items()}

    def pending_releases(self) -> int:
        return self.probes.program.pending_releases() if self.processes is not None and self.probes else 0

    def is_shed(self, pid: int) -> bool | None:
        """Whether the budget has the family detached from the process (None: no family)."""
        return self.processes.is_shed(pid) if self.processes is not None else None

    def not_ready(self) -> tuple[str, ...]:
        if self.enabled and self.probes is None:
            return (f"{self.name} probes not loaded ({self.failure or 'bcc unavailable'})",)
        return ()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._attacher is not None:
            self._attacher.join(timeout=60)  # an attach in progress finishes first
            self._attacher = None
        if self.processes is not None:
            self.processes.close()
        if self.probes is not None:
            self.probes.close()
