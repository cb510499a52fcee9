"""InferenceProcessOOMKilled: immediate and critical; stays active for a while, then clears."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvwatch.daemon.config import OOMConfig
from kvwatch.daemon.model.alerts import AlertSpec
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.windows import NodeWindow, OomEvent

ALERT = "InferenceProcessOOMKilled"
SPECS = (
    AlertSpec(
        name=ALERT,
        fires_when="the OOM killer kills a watched process or its cgroup sibling",
        severities=("critical",),
        causes=("victim", "cgroup_sibling"),
        labels=(),
        summary="OOM killer took {{ $labels.engine }} pid {{ $labels.pid }} on {{ $labels.instance }}",
        description=(
            "The kernel OOM killer killed inference process {{ $labels.pid }} ({{ $labels.engine }} "
            "{{ $labels.role }}, pod {{ $labels.pod }}; cause {{ $labels.cause }}). Its KV cache is "
            "gone; requests on it failed."
        ),
        page_severity="critical",
    ),
)
MIB = 1024 * 1024


@dataclass(slots=True)
class _Active:
    event: OomEvent
    until: float


class OOMKilled:
    name = ALERT
    alerts: ClassVar[tuple[str, ...]] = (ALERT,)
    outlives_subject: ClassVar[bool] = True  # a kill is news after its process is gone: it expires by time only

    def __init__(self, config: OOMConfig) -> None:
        self.config = config
        self._active: dict[str, _Active] = {}

    def forget(self, subject_key: str) -> None:
        """OOM alerts outlive their process on purpose: they expire by time only."""

    def evaluate(self, view: NodeWindow) -> list[Finding]:
        if not self.config.enabled:
            return []
        for ev in view.oom_events:
            if ev.sibling_of and not self.config.include_cgroup_siblings:
                continue
            self._active[ev.subject.key] = _Active(ev, view.now + self.config.active_seconds)
        out: list[Finding] = []
        for key, act in list(self._active.items()):
            ev = act.event
            firing = view.now < act.until
            cause = "cgroup_sibling" if ev.sibling_of else "victim"
            out.append(
                Finding(
                    alert=ALERT,
                    subject=Subject(key, ev.subject.labels),
                    firing=firing,
                    cause=cause,
                    values={
                        "victim_pid": float(ev.victim_pid),
                        "anon_rss_bytes": float(ev.anon_rss_bytes),
                        "file_rss_bytes": float(ev.file_rss_bytes),
                    },
                    summary=(
                        f"OOM killer took {ev.victim_comm} (pid {ev.victim_pid}"
                        + (f", in the memory cgroup of watched {ev.sibling_of}" if ev.sibling_of else "")
                        + f"), anon RSS {ev.anon_rss_bytes / MIB:.0f} MiB"
                    ),
                    severity="critical",
                )
            )
            if not firing:
                del self._active[key]
        return out
