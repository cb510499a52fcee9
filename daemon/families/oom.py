"""Turning a kernel OOM-kill record into an event about a watched process."""

from __future__ import annotations

from kvwatch.daemon.host.cgroups import parse_cgroup
from kvwatch.daemon.host.procfs import ProcError, ProcFS
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.windows import OomEvent
from kvwatch.daemon.tracker import ProcessTracker, Tracked, process_labels
from kvwatch.probes.records import OomKill


def cgroup_sibling(pid: int, tracker: ProcessTracker, procfs: ProcFS) -> Tracked | None:
    """A watched process in the victim's memory cgroup (the victim itself was not watched)."""
    try:
        path = parse_cgroup(procfs.cgroup(pid)).memory_path
    except ProcError:
        return None
    if not path or path == "/":
        return None
    return next((t for t in tracker.tracked() if t.proc.cgroup.memory_path == path), None)


def oom_event(
    ev: OomKill, tracker: ProcessTracker, procfs: ProcFS, *, include_siblings: bool, now: float
) -> OomEvent | None:
    """The event for a kill that concerns a watched process, or None."""
    victim = tracker.get_recent(ev.victim_pid)
    sibling = None
    if victim is None and include_siblings:
        sibling = cgroup_sibling(ev.victim_pid, tracker, procfs)
    owner = victim or sibling
    if owner is None:
        return None
    labels = process_labels(owner)
    if sibling is not None:
        labels["pid"] = str(ev.victim_pid)
    return OomEvent(
        subject=Subject(owner.key if victim is not None else f"oom:{ev.victim_pid}@{ev.ts_ns}", labels),
        victim_pid=ev.victim_pid,
        victim_comm=ev.victim_comm,
        sibling_of=sibling.key if sibling is not None else "",
        anon_rss_bytes=ev.anon_rss_kb * 1024,
        file_rss_bytes=ev.file_rss_kb * 1024,
        at=now,
    )
