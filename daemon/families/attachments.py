"""A uprobe family for the watched processes: attach on discovery, rescan for libraries
loaded later, detach on exit. Each failure is per process: counted, logged once, and
the other processes and families keep working. Families add their own reading."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from kvwatch.daemon.host.procfs import ProcessIdentity
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.tracker import Tracked
from kvwatch.probes.libs import LibraryError
from kvwatch.probes.records import HookState
from kvwatch.probes.uprobes import PerProcessUprobes, ProcessGoneDuringAttach

log = structlog.get_logger("kvwatch.uprobes")


@dataclass(slots=True)
class Attached:
    identity: ProcessIdentity
    next_rescan: float


class FamilyProcesses:
    """A uprobe family's processes: those it is attached to (attached on discovery, rescanned for
    libraries loaded later, detached on exit) and what each counted. The watched set itself is the
    ``ProcessTracker``'s (``daemon/tracker.py``)."""

    def __init__(
        self,
        probes: PerProcessUprobes[Any],
        errors: ErrorBook,
        *,
        clock: Callable[[], float],
        rescan_seconds: float,
    ) -> None:
        self.probes = probes
        self.family = probes.family
        self.errors = errors
        self.clock = clock
        self.rescan_seconds = rescan_seconds
        self.attached: dict[int, Attached] = {}
        self.hits: dict[str, int] = {}
        self.lost: dict[str, int] = {}
        # pid -> back-off seconds and the APIs to shed (None: all of the family's) (the loop asks)
        self.shed_requests: dict[int, tuple[float, tuple[str, ...] | None]] = {}
        self.shed_until: dict[int, float] = {}  # pid -> when its shed probes are attached again
        self.sheds = 0
        self.attach_mode = ""  # how the program attaches uprobes, once its first attach decided it

    def request_shed(self, pid: int, backoff: float, apis: tuple[str, ...] | None = None) -> None:
        """From the loop: detach these APIs' probes from ``pid`` (keeping its counts and its other
        probes) for ``backoff`` seconds."""
        self.shed_requests[pid] = (backoff, apis)

    def is_shed(self, pid: int) -> bool:
        """Its probes are detached by the budget now."""
        return pid in self.shed_until

    def shedding(self, pid: int) -> bool:
        """Shed, or asked to be and the attacher has not got to it yet."""
        return pid in self.shed_until or pid in self.shed_requests

    def sync(self, tracked: Iterable[Tracked]) -> None:
        """Attach to new processes, rescan due ones, detach the gone, shed and re-attach."""
        now = self.clock()
        alive = {t.pid: t for t in tracked if t.exited_at is None}
        for pid, a in list(self.attached.items()):  # copies: the loop thread reads these dicts
            t = alive.get(pid)
            if t is None or t.proc.identity != a.identity:
                self.detach(pid)
        self._shed(now)
        for pid, t in alive.items():
            known = self.attached.get(pid)
            until = self.shed_until.get(pid)
            if until is not None:
                # attached again only once the kernel released the shed probes: a probe opened
                # on a function while an earlier one there is being released in the same
                # process was seen to stay silent (breakpoints taken out under it)
                if now >= until and not self.probes.program.pending_releases():
                    del self.shed_until[pid]
                    self._unshed(pid)
                continue  # no rescan while shed: a library loaded meanwhile is attached afterwards
            if known is not None and now < known.next_rescan:
                continue
            if known is None:
                known = self.attached[pid] = self.new_attached(t.proc.identity, now)
            known.next_rescan = now + self.rescan_seconds
            self._attach(pid)

    def new_attached(self, identity: ProcessIdentity, now: float) -> Attached:
        return Attached(identity, now)

    def _attach(self, pid: int) -> None:
        fam = self.family
        previous = self.probes.attachments.get(pid)
        before = len(previous.libraries) if previous is not None else 0
        try:
            att = self.probes.attach(pid)
        except ProcessGoneDuringAttach as err:
            self.errors.record(
                f"{fam}_attach_process_gone", f"process exited while {fam} probes attached", err, level="info", pid=pid
            )
            self.forget(pid)
            return
        except LibraryError as err:
            self.errors.record(f"{fam}_attach_library", f"{fam} library unreadable", err, pid=pid)
            return
        except Exception as err:
            self.errors.record(f"{fam}_attach", f"{fam} attach failed", err, pid=pid)
            return
        self._note_attach_mode()
        if len(att.libraries) > before:
            states: dict[str, int] = {}
            for s in att.symbols:
                states[s.state.value] = states.get(s.state.value, 0) + 1
            log.info(
                f"{fam} probes attached",
                pid=pid,
                libraries=[lib.path for lib in att.libraries.values()],
                symbols=states,
                flags=sorted(att.flags),
            )
            for s in att.symbols:
                if s.state is HookState.FAILED:
                    self.errors.record(
                        f"{fam}_symbol_failed", f"{fam} symbol refused", None, api=s.api, reason=s.reason
                    )

    def _note_attach_mode(self) -> None:
        prog = self.probes.program
        if prog.uprobe_mode and prog.uprobe_mode != self.attach_mode:
            self.attach_mode = prog.uprobe_mode
            log.info("uprobe attach mode", family=self.family, mode=prog.uprobe_mode, reason=prog.uprobe_mode_reason)

    def _shed(self, now: float) -> None:
        for pid in list(self.shed_requests):
            backoff, apis = self.shed_requests.pop(pid)
            if pid not in self.attached or pid in self.shed_until:
                continue
            labels = apis if apis is not None else tuple(a.label for a in self.probes.apis)
            self.shed_until[pid] = now + backoff  # first: the loop reads it while the detach runs
            try:
                n = self.probes.shed(pid, labels)
            except Exception as err:
                self.errors.record(f"{self.family}_shed", f"{self.family} shed failed", err, pid=pid)
                continue
            self.sheds += 1
            log.warning(
                f"{self.family} probes shed: over the cost budget",
                pid=pid,
                apis=sorted(labels),
                probes=n,
                backoff_seconds=backoff,
            )

    def _unshed(self, pid: int) -> None:
        try:
            self.probes.unshed(pid)
        except Exception as err:
            self.errors.record(f"{self.family}_unshed", f"{self.family} re-attach failed", err, pid=pid)
            return
        att = self.probes.attachments.get(pid)
        log.info(f"{self.family} probes attached again after shedding", pid=pid, attached=att.attached if att else 0)

    def detach(self, pid: int) -> None:
        try:
            self.probes.detach(pid)
        except Exception as err:
            self.errors.record(f"{self.family}_detach", f"{self.family} detach failed", err, pid=pid)
        self.forget(pid)

    def forget(self, pid: int) -> None:
        self.attached.pop(pid, None)
        self.shed_until.pop(pid, None)
        self.shed_requests.pop(pid, None)

    def calls(self, pid: int) -> float | None:
        """Calls the family's probes trapped in ``pid`` (each an entry and a return), cumulative (override)."""
        return None

    def api_calls(self, pid: int) -> dict[str, float]:
        """The same per API label, where the family counts them per API (override)."""
        return {}

    def api_states(self) -> dict[str, HookState]:
        """Per API: attached in at least one process, else why not (for the probe table)."""
        out: dict[str, HookState] = {}
        for att in list(self.probes.attachments.values()):  # the attacher thread adds to it
            for s in att.symbols:
                if s.state is HookState.ATTACHED or s.api not in out:
                    out[s.api] = s.state
        return {a.label: out.get(a.label, HookState.MISSING) for a in self.probes.apis}

    def ingest(self) -> None:
        """Read the family's events and counters, once a tick (override)."""
        raise NotImplementedError

    def observe(self, t: Tracked, now: float) -> None:
        """Typed observations of an attached process for its histories (override)."""

    def symbols_attached(self, pid: int) -> int:
        att = self.probes.attachments.get(pid)
        return att.attached if att is not None and pid in self.attached else 0

    def close(self) -> None:
        for pid in list(self.attached):
            self.detach(pid)
