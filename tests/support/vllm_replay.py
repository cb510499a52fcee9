"""A real engine's run replayed to ``kvwatch run``: vLLM's /metrics pages served each from its
second of the replay, a stand-in process for kvwatch to attribute the engine to, the alert
onsets read from the daemon's log, and the end of the replayed window waited for."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.daemon import DaemonProcess, free_port, wait_until


class Pages:
    """vLLM's /metrics as it was at each second of the replay."""

    def __init__(self, pages: list[list[Any]]) -> None:
        self.pages = pages
        self.t0 = float("inf")  # until the replay starts: the first page

    def now(self) -> bytes:
        t = time.monotonic() - self.t0
        text = self.pages[0][1]
        for at, page in self.pages:
            if at > t:
                break
            text = page
        return str(text).encode()


def serve(pages: Pages) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.now()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@contextlib.contextmanager
def stand_in_process(name: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose command line carries a unique marker (``.marker``): the engine as kvwatch
    sees it (``[[engines.endpoints]]`` names it by that marker)."""
    marker = f"{name}-{free_port()}"
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", marker], stdin=subprocess.PIPE)
    p.marker = marker  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def onsets(d: DaemonProcess) -> list[dict[str, Any]]:
    """Every alert onset in the daemon's log, with its wall-clock time as ``wall``."""
    out = []
    for line in d.log.read_text().splitlines():
        if line.startswith("{") and '"alert firing"' in line:
            e = json.loads(line)
            e["wall"] = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append(e)
    return out


def through_the_window(d: DaemonProcess, pid: str, end: float) -> None:
    """Until the replayed window's end (monotonic ``end``: its last page is being served), then
    until kvwatch has scraped that page and published what it read."""
    time.sleep(max(end - time.monotonic(), 0.0))  # the replay's own clock: its last pages
    scrapes = d.value("kvwatch_engine_scrapes_total", pid=pid, result="ok")
    wait_until(
        lambda: d.value("kvwatch_engine_scrapes_total", pid=pid, result="ok") > scrapes, 60, "a scrape of the last page"
    )
    d.wait_ticks(2)
