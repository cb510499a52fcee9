"""The running daemon's alerts, for ``kvwatch record``'s alert lane.

The daemon is what pages, and its detectors have learnt their baselines; a recorder's own
detectors start cold and stay silent through their warm-up (two minutes by default), which is
when an operator starting a recording during an incident needs them. So when a daemon answers
on its top API, the recording's alerts are the daemon's, onset times included; the recorder's
own probes still draw every counter lane. A daemon that stops answering mid-recording leaves
its last alerts open (a gap in the connection is not a clear), and says so once.
"""

from __future__ import annotations

from kvwatch.daemon.model.snapshot import Alert
from kvwatch.exporters.top import DaemonSource, SourceError


class DaemonAlerts:
    def __init__(self, source: DaemonSource) -> None:
        self.source = source
        self.description = source.description
        self.answered = 0
        self.failed = 0
        self.first_error = ""
        self._last: list[Alert] | None = None

    def poll(self) -> list[Alert] | None:
        """The daemon's active alerts; None while it has never answered."""
        try:
            frame = self.source.fetch()
        except SourceError as err:
            self.failed += 1
            self.first_error = self.first_error or str(err)
            return self._last
        self.answered += 1
        self._last = [
            Alert(
                alert=a.alert,
                subject_key=a.subject or f"{a.alert}@{a.pid}",
                labels={"pid": a.pid, **a.labels},
                cause=a.cause,
                severity=a.severity,
                started_at=a.started_at,
                values={},
                summary=a.summary,
            )
            for a in frame.alerts
        ]
        return self._last

    def reachable(self) -> bool:
        """One probe before recording: is a daemon there at all."""
        return self.poll() is not None
