"""The direct Alertmanager sink: kvwatch's alerts posted to Alertmanager's v2 API.

For sites without Prometheus rules. The probe loop only records the alert's state
under a lock (onset / clear never block); a sender thread posts everything that
changed, retries failures with exponential back-off, and re-posts firing alerts
every ``resend_seconds`` (Alertmanager resolves an alert it stops hearing about
after its ``resolve_timeout``). Pending work is bounded: past ``max_pending`` the
oldest resolved (then firing) alerts are dropped and counted. ``close`` flushes
what is pending, within a deadline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from kvwatch.daemon.config import AlertmanagerConfig
from kvwatch.daemon.model.snapshot import Alert

log = structlog.get_logger("kvwatch.alertmanager")

LABEL_KEYS = ("cause", "pid", "engine", "role", "component", "container", "pod", "tier", "probe", "medium")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat().replace("+00:00", "Z")


def anchor(alert: str) -> str:
    return alert.lower()


def am_alert(alert: Alert, cfg: AlertmanagerConfig, node: str, *, resolved: bool) -> dict[str, Any]:
    """One alert in Alertmanager's v2 ``postableAlert`` shape."""
    labels = {"alertname": alert.alert, "severity": alert.severity, "node": node, "source": "kvwatch"}
    labels |= {k: v for k, v in alert.labels.items() if k in LABEL_KEYS and v}
    labels |= {k: v for k, v in (("cause", alert.cause),) if v}
    labels |= cfg.labels
    numbers = ", ".join(f"{k}={v:.6g}" for k, v in sorted(alert.values.items()))
    body: dict[str, Any] = {
        "labels": labels,
        "annotations": {
            "summary": alert.summary,
            "description": f"{alert.summary} ({numbers})" if numbers else alert.summary,
            "runbook_url": f"{cfg.runbook_base_url}#{anchor(alert.alert)}",
        },
        "startsAt": _iso(alert.started_at),
        "generatorURL": f"http://{node}/kvwatch#{alert.alert}",
    }
    if resolved:
        body["endsAt"] = _iso(alert.ended_at or time.time())
    return body


@dataclass
class _Entry:
    alert: Alert
    resolved: bool
    sent_at: float = 0.0  # monotonic; 0: never sent in this state


class AlertmanagerSink:
    def __init__(
        self,
        cfg: AlertmanagerConfig,
        *,
        node: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        post: Callable[[bytes], None] | None = None,
        start: bool = True,  # False: no sender thread, the caller drives send_due() (tests)
    ) -> None:
        self.cfg = cfg
        self.node = node or socket.gethostname()
        self.clock = clock
        self.url = f"{cfg.url}/api/v2/alerts"
        self._post = post or self._http_post
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.stats = {"sent": 0, "failed": 0, "dropped": 0}
        self._backoff = 0.0
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._run, name="kvwatch-alertmanager", daemon=True)
        if start:
            self._thread.start()

    # --- the loop's side: never blocks ----------------------------------------------------
    def onset(self, alert: Alert) -> None:
        self._put(alert, resolved=False)

    def clear(self, alert: Alert) -> None:
        self._put(alert, resolved=True)

    def _put(self, alert: Alert, *, resolved: bool) -> None:
        with self._lock:
            self._entries[(alert.alert, alert.subject_key)] = _Entry(alert, resolved)
            over = len(self._entries) - self.cfg.max_pending
            if over > 0:  # drop the oldest resolved first, then the oldest firing
                order = sorted(self._entries.items(), key=lambda kv: (not kv[1].resolved, kv[1].alert.started_at))
                for key, _ in order[:over]:
                    del self._entries[key]
                self.stats["dropped"] += over
        self._wake.set()

    # --- the sender thread -----------------------------------------------------------------
    def _http_post(self, body: bytes) -> None:
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})  # noqa: S310
        with urllib.request.urlopen(req, timeout=self.cfg.timeout_seconds) as resp:  # noqa: S310 - configured URL
            resp.read()

    def _due(self, now: float) -> list[tuple[tuple[str, str], _Entry]]:
        with self._lock:
            return [
                (k, e)
                for k, e in self._entries.items()
                if e.sent_at == 0.0 or (not e.resolved and now - e.sent_at >= self.cfg.resend_seconds)
            ]

    def send_due(self) -> bool:
        """Post what is due now; True when nothing failed."""
        now = self.clock()
        due = self._due(now)
        if not due:
            return True
        body = json.dumps([am_alert(e.alert, self.cfg, self.node, resolved=e.resolved) for _, e in due]).encode()
        try:
            self._post(body)
        except (urllib.error.URLError, OSError, ValueError) as err:
            self.stats["failed"] += 1
            self._backoff = min(self.cfg.max_backoff_seconds, max(0.5, self._backoff * 2))
            self._next_try = now + self._backoff
            if self.stats["failed"] == 1 or self._backoff >= self.cfg.max_backoff_seconds:
                log.warning("alertmanager post failed", url=self.url, error=str(err), retry_in=self._backoff)
            return False
        self._backoff = 0.0
        self.stats["sent"] += len(due)
        with self._lock:
            for key, e in due:
                cur = self._entries.get(key)
                if cur is not e:
                    continue  # changed while we were sending: send the new state next round
                if e.resolved:
                    del self._entries[key]  # resolved and delivered: done
                else:
                    e.sent_at = now
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.clock()
            if now >= self._next_try:
                self.send_due()
            timeout = max(0.05, self._next_try - now) if self._backoff else min(self.cfg.resend_seconds, 5.0)
            self._wake.wait(timeout)
            self._wake.clear()

    def pending(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.sent_at == 0.0)

    def close(self, deadline_seconds: float = 3.0) -> None:
        """Stop the thread, then flush what is pending (resolved alerts included) within a deadline."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=deadline_seconds)
        end = time.monotonic() + deadline_seconds
        while self.pending() and time.monotonic() < end:
            self._next_try = 0.0
            if not self.send_due():
                time.sleep(0.2)
        if self.pending():
            log.warning("alertmanager: alerts not delivered at shutdown", pending=self.pending())
