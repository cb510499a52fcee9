"""``kvwatch run`` as a subprocess, and waits on what it publishes: its tick (the top API's
frame header), values that have settled, probes attached. A test waits on the daemon, never for
a number of seconds to pass."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.exporters.top_model import API_PATH
from tests.support.kernel import assert_closes

KVWATCH = [sys.executable, "-m", "kvwatch.daemon"]


T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class DaemonProcess:
    """`kvwatch run` as a subprocess with a TOML config; scrapes its endpoints."""

    def __init__(self, tmp: Path, toml: str, *extra: str) -> None:
        self.port = free_port()
        self.config = tmp / "kvwatch.toml"
        self.config.write_text(toml)
        self.tick_seconds = float(tomllib.loads(toml).get("daemon", {}).get("tick_seconds", 1.0))
        self.log = tmp / "kvwatch.log"
        self._log = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                *KVWATCH,
                "run",
                "--config",
                str(self.config),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--log-format",
                "json",
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                return self.get("/readyz")[0] == 200
            except OSError:
                return False

        wait_until(ready, timeout, "daemon ready")

    def tick(self) -> int:
        """The number of the tick whose snapshot the daemon serves now."""
        status, body = self.get(API_PATH)
        assert status == 200, f"{API_PATH}: {status} {body[:200]}"
        return int(json.loads(body)["header"]["tick"])

    def wait_ticks(self, n: int = 2, timeout: float = 60.0) -> None:
        """Until the daemon has published ``n`` more ticks. With n ≥ 2, whatever it had taken
        in when this was called (a batch received, a probe's event in the ring buffer) is in the
        snapshot it serves: the tick in progress may have begun before, the next one after."""
        target = self.tick() + n
        wait_until(lambda: self.tick() >= target, timeout, f"{n} more ticks of the daemon")

    def run_for(self, seconds: float) -> None:
        """Until the daemon has published the ticks of ``seconds`` of its time: a workload ran
        that long as kvwatch saw it (a learning period, a pattern's windows judged)."""
        self.wait_ticks(math.ceil(seconds / self.tick_seconds), timeout=seconds * 3 + 30)

    def settled(self, read: Callable[[], T], ticks: int = 3, timeout: float = 60.0) -> T:
        """A published value once it has stayed the same over ``ticks`` published ticks."""
        deadline = time.monotonic() + timeout
        value = read()
        while time.monotonic() < deadline:
            self.wait_ticks(ticks, timeout=max(deadline - time.monotonic(), 1.0))
            again = read()
            if again == value:
                return value
            value = again
        raise AssertionError(f"value still changing after {timeout}s (last {value})")

    def wait_closes(
        self, read: Callable[[], float], expected: float, read_skipped: Callable[[], float], timeout: float = 30.0
    ) -> tuple[float, float]:
        """Until a published count closes against ``expected`` (``kernel.assert_closes``);
        returns (count, skipped). Exact equality ends the wait at once; with skipped probe runs
        the count cannot reach ``expected``, so it must stay the same over three ticks instead."""
        deadline = time.monotonic() + timeout
        got, skipped = read(), read_skipped()
        while got != expected and time.monotonic() < deadline:
            if skipped and expected - skipped <= got < expected:
                got = self.settled(read, timeout=max(deadline - time.monotonic(), 1.0))
                skipped = read_skipped()
                break
            time.sleep(0.1)
            got, skipped = read(), read_skipped()
        assert_closes(got, expected, skipped)
        return got, skipped

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        _, text = self.get("/metrics")
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.value_in(self.metrics())(name, **labels)

    @staticmethod
    def value_in(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> Callable[..., float]:
        """``value`` over one scrape already made: numbers that must agree read from one."""

        def value(name: str, **labels: str) -> float:
            return sum(v for lab, v in metrics.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))

        return value

    def log_events(self) -> list[dict[str, object]]:
        out = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def daemon(tmp: Path, toml: str, *extra: str) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp, toml, *extra)
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


def wait_attached(d: DaemonProcess, pid: int, family: str = "cuda", timeout: float = 30.0) -> float:
    """Until the family's probes are attached to ``pid`` and their count has stopped growing: the
    attacher works symbol by symbol, and a workload started at the first one would make calls
    the probes of later symbols miss. Returns the count."""
    metric = f"kvwatch_{family}_probes_attached"
    wait_until(lambda: d.value(metric, pid=str(pid)) > 0, timeout, f"{family} probes attached")
    return d.settled(lambda: d.value(metric, pid=str(pid)), timeout=timeout)


def watched(d: DaemonProcess, pid: int) -> bool:
    """kvwatch watches ``pid`` with its memory probes: it publishes the process's page frees."""
    return any(lab.get("pid") == str(pid) for lab, _ in d.metrics().get("kvwatch_page_free_pages_total", []))
