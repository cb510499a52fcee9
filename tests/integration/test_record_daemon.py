"""`kvwatch record` takes its alerts from the running daemon's top API when it answers: the
daemon's detectors are warm, a fresh recorder's are not."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvwatch.daemon.model.snapshot import Alert
from kvwatch.exporters.record import Lane, TraceRecorder
from kvwatch.exporters.record_daemon import DaemonAlerts
from kvwatch.exporters.top import DaemonSource
from kvwatch.exporters.top_model import API_PATH, build_frame, encode
from tests.support.snapshots import T0_NS, T0_WALL, snap

ALERT = Alert(
    "KVHostTierEvictionUnderPressure",
    "tier:0",
    {"pid": "7", "tier": "lmcache:/var/tmp/lmcache-disk", "engine": "vllm"},
    "refault",
    "warning",
    T0_WALL + 0.25,
    {"evicted_bytes_per_second": 4.0e8},
    "KV tier lmcache:/var/tmp/lmcache-disk losing 396.0 MiB/s of page cache to reclaim",
)


@contextlib.contextmanager
def daemon(frames: list[bytes]) -> Iterator[str]:
    """A top API that answers with each of ``frames`` in turn (the last one again after)."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = frames.pop(0) if len(frames) > 1 else frames[0]
            self.send_response(200 if self.path == API_PATH else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_daemon_alerts_with_their_labels_and_onset() -> None:
    firing = encode(build_frame(snap(6.0, 10, 0, (ALERT,))))
    with daemon([firing]) as url:
        src = DaemonAlerts(DaemonSource(url, timeout=2))
        (a,) = src.poll() or []
    assert (a.alert, a.subject_key, a.cause, a.started_at) == (ALERT.alert, "tier:0", "refault", ALERT.started_at)
    assert a.labels == {"pid": "7", "tier": "lmcache:/var/tmp/lmcache-disk", "engine": "vllm"}
    assert src.answered == 1 and src.failed == 0


def test_no_daemon_is_none_and_a_lost_daemon_keeps_its_last_alerts() -> None:
    src = DaemonAlerts(DaemonSource(f"http://127.0.0.1:{closed_port()}", timeout=2))
    assert src.poll() is None and not src.reachable()
    assert src.failed == 2 and "unreachable" in src.first_error
    firing = encode(build_frame(snap(6.0, 10, 0, (ALERT,))))
    with daemon([firing]) as url:
        src = DaemonAlerts(DaemonSource(url, timeout=2))
        assert len(src.poll() or []) == 1
    assert [a.alert for a in src.poll() or []] == [ALERT.alert]  # gone: not a clear
    assert src.failed == 1


def test_the_recording_shows_the_daemons_alert_not_its_own() -> None:
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    mine = Alert("KVCacheReuseCollapse", "7@1", {"pid": "7"}, "empty_cache", "warning", T0_WALL, {}, "s")
    rec.on_snapshot(snap(5.0, 100, 0, (mine,)), [])  # the daemon answers: no alert active
    rec.on_snapshot(snap(6.0, 110, 0, (mine,)), [ALERT])
    rec.on_snapshot(snap(7.0, 120, 0), [])  # cleared at the daemon
    trace = rec.finish(7.5, 1.0)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "alert"]
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in slices] == [
        (ALERT.alert, 7, Lane.ALERTS, 250_000.0, 1_750_000.0)
    ]
    assert slices[0]["args"]["cause"] == "refault"
