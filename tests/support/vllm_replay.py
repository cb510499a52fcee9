"""A real engine's run replayed to ``kvwatch run``: vLLM's /metrics pages served each from its
second of the replay, a stand-in process for kvwatch to attribute the engine to, the alert
onsets read from the daemon's log, and the end of the replayed window waited for."""

from __future__ import annotations

import contextlib
import gzip
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvwatch.daemon.lab.vllm_publisher import WirePublisher
from kvwatch.daemon.lab.wire_encode import Layout
from tests.support.daemon import DaemonProcess, daemon, free_port, wait_until


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


def onsets(d: DaemonProcess, pid: str) -> list[dict[str, Any]]:
    """Every alert onset in the daemon's log about process ``pid`` or about no process, with its
    wall-clock time as ``wall``. The daemon watches every engine-like process on the host: another
    suite's stand-in engines running beside this one must not count as this replay's alerts."""
    out = []
    for line in d.log.read_text().splitlines():
        if line.startswith("{") and '"alert firing"' in line:
            e = json.loads(line)
            if e.get("label_pid", pid) != pid:
                continue
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


def load_run(path: Path) -> dict[str, Any]:
    """A run cut by the fixture tools: batches, pages, marks, totals."""
    with gzip.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


@dataclass(frozen=True)
class Replay:
    d: DaemonProcess
    pub: WirePublisher
    pages: Pages
    pid: str  # the stand-in's, which kvwatch attributes the engine to

    def start(self) -> tuple[float, float]:
        """The replay's clock starts: its pages are served from their second on. (monotonic, wall)"""
        self.pages.t0 = time.monotonic()
        return self.pages.t0, time.time()

    def publish(
        self,
        batches: list[list[Any]],
        events: Callable[[Any], list[dict[str, Any]]],
        t0: float,
        watch: Callable[[float], None] | None = None,
    ) -> bool:
        """Each batch of the run (one data-parallel rank) at its second, its events made by
        ``events``; ``watch`` called every 5 s with the replay's time. The publisher's flush."""
        next_watch = t0
        for at, _seq, ts, _rank, records in batches:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.pub.publish(events(records), ts=ts)
            if watch is not None and time.monotonic() >= next_watch:
                watch(time.monotonic() - t0)
                next_watch += 5.0
        return self.pub.flush()

    def wait_every_batch(self, batches: int) -> None:
        """Until kvwatch has counted the run's ``batches`` batches."""
        d, pid = self.d, self.pid
        wait_until(lambda: d.value("kvwatch_kv_event_batches_total", pid=pid) == batches, 60, "every batch")


@contextlib.contextmanager
def replaying(tmp_path: Path, config: str, run: dict[str, Any], name: str) -> Iterator[Replay]:
    """``kvwatch run`` tapping a stand-in for the engine: the run's /metrics pages served, a
    publisher in vLLM 0.26.0's wire format, the stream connected and its subscription landed.
    ``config`` is formatted with the stand-in's ``marker``, the ``kv`` endpoint and the ``url``."""
    kv = f"tcp://127.0.0.1:{free_port()}"
    pages = Pages(run["pages"])
    srv = serve(pages)
    pub = WirePublisher(kv, layout=Layout.V0_26, topic="kv")
    try:
        with stand_in_process(name) as proc:
            url = f"http://127.0.0.1:{srv.server_port}/metrics"
            pid = str(proc.pid)
            with daemon(tmp_path, config.format(marker=proc.marker, kv=kv, url=url)) as d:  # type: ignore[attr-defined]
                wait_until(lambda: d.value("kvwatch_kv_event_stream_connected", pid=pid) == 1, 30, "stream connected")
                assert pub.wait_subscribed(), "kvwatch's subscription did not reach the publisher"
                yield Replay(d, pub, pages, pid)
    finally:
        pub.close()
        srv.shutdown()
