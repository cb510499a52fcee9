"""The Alertmanager sink (``exporters/alertmanager.py``) over real HTTP on loopback: an onset
posted in the background (the loop never waits for the network), a resolve flushed at close."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvwatch.daemon.config import AlertmanagerConfig
from kvwatch.daemon.model.snapshot import Alert
from kvwatch.exporters.alertmanager import AlertmanagerSink
from tests.support.daemon import wait_until
from tests.support.http import recording_server


def alert(ended: float | None = None) -> Alert:
    return Alert("KVEvictionBurst", "7@1", {"pid": "7"}, "pressure", "warning", 1_700_000_000.0, {}, "s", ended)


@contextlib.contextmanager
def held_server() -> Iterator[tuple[str, threading.Event, threading.Event, list[str]]]:
    """An endpoint that answers no POST until ``release`` is set (or 60 s pass): (URL, release,
    answered, paths received)."""
    release, answered = threading.Event(), threading.Event()
    got: list[str] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            got.append(self.path)
            release.wait(60)
            self.send_response(200)
            self.end_headers()
            answered.set()

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", release, answered, got
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


def test_onset_never_waits_for_the_network() -> None:
    """An Alertmanager that takes the post and does not answer: the onset returns (the post is
    made in the background), and the post arrives."""
    with held_server() as (url, release, answered, got):
        s = AlertmanagerSink(AlertmanagerConfig(url=url))
        s.onset(alert())  # a sink that waited for the answer would return only once it came
        assert not answered.is_set()
        wait_until(lambda: got == ["/api/v2/alerts"], 30, "the post received")
        release.set()
        s.close()


def test_real_http_and_close_flushes() -> None:
    with recording_server() as (url, got):
        s = AlertmanagerSink(AlertmanagerConfig(url=url))
        s.onset(alert())
        wait_until(lambda: bool(got), 30, "the onset posted")
        assert got[0][0] == "/api/v2/alerts" and json.dumps(got[0][1])
        s.clear(alert(ended=1_700_000_100.0))
        s.close()
        assert "endsAt" in got[-1][1][0]  # flushed at shutdown
