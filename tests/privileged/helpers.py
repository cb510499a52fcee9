"""Helpers for the real-kernel tests: workloads as child processes, a daemon as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from kvwatch.daemon.workloads import Workload
from prometheus_client.parser import text_string_to_metric_families

KVWATCH = [sys.executable, "-m", "kvwatch.daemon"]


class Child(Workload):
    """The shared workload child, with a timeout on each answer so a stuck child fails the test."""

    def expect(self, word: str, timeout: float = 60.0) -> str:
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            return super().expect(word)
        finally:
            timer.cancel()

    def step(self, send: str, expect: str, timeout: float = 60.0) -> None:
        self.send(send)
        self.expect(expect, timeout)


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

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        _, text = self.get("/metrics")
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    def value(self, name: str, **labels: str) -> float:
        total = 0.0
        for lab, v in self.metrics().get(name, []):
            if all(lab.get(k) == want for k, want in labels.items()):
                total += v
        return total

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
