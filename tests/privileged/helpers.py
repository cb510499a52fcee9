"""Helpers for the real-kernel tests: workloads as child processes, a daemon as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from typing import TypeVar

from kvwatch.daemon.lab.workloads import Workload
from kvwatch.probes.tracefs import tracefs_root
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


# Pages a page-free workload of N pages may release above N in its own context: its page
# tables (~5) and other tasks' pages from the per-CPU LRU batches it drains (31 folios each).
FOREIGN_PAGE_SLACK = 4 * 31 + 16


class PageFreeTruth:
    """Ground truth independent of kvwatch: the kernel's own ftrace of ``kmem:mm_page_free`` for one task.

    A private tracefs instance (its own ring buffer, ``set_event_pid`` filter)
    records every page-free event that fires in the task's context. That is what
    kvwatch claims to count, including pages the kernel frees on someone else's
    behalf while the task runs (a per-CPU LRU batch it drains holds other tasks'
    pages too), so kvwatch's count must equal this one exactly, not approximately.
    The task must be single-threaded (the filter is by thread id, kvwatch by TGID).
    """

    def __init__(self, pid: int, buffer_kb: int = 8192) -> None:
        root = tracefs_root()
        assert root is not None, "tracefs is not mounted"
        self.dir = root / "instances" / f"kvwatch-truth-{pid}-{time.monotonic_ns()}"
        self.pid = pid
        self.buffer_kb = buffer_kb

    def __enter__(self) -> PageFreeTruth:
        self.dir.mkdir()
        (self.dir / "buffer_size_kb").write_text(str(self.buffer_kb))
        (self.dir / "set_event_pid").write_text(str(self.pid))
        (self.dir / "events/kmem/mm_page_free/enable").write_text("1")
        (self.dir / "tracing_on").write_text("1")
        return self

    def clear(self) -> None:
        (self.dir / "trace").write_text("")

    def pages(self) -> int:
        """Pages freed in the task's context since the start (or the last clear)."""
        lost = 0
        for stats in (self.dir / "per_cpu").glob("cpu*/stats"):
            fields = dict(line.split(":", 1) for line in stats.read_text().splitlines() if ":" in line)
            lost += int(fields.get("overrun", "0")) + int(fields.get("dropped events", "0"))
        assert lost == 0, f"ftrace lost {lost} events: the ground truth is incomplete"
        return sum(1 << int(m) for m in re.findall(r"mm_page_free: .* order=(\d+)", (self.dir / "trace").read_text()))

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            (self.dir / "tracing_on").write_text("0")
            (self.dir / "events/kmem/mm_page_free/enable").write_text("0")
        with contextlib.suppress(OSError):
            self.dir.rmdir()


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


def assert_closes(got: float, expected: float, skipped: float, what: str = "kvwatch against ftrace") -> None:
    """kvwatch's count against ftrace's, exact unless the kernel skipped probe runs in the window.

    A tracing BPF program does not nest on one CPU: a page freed in an interrupt that
    arrived while the page-free program ran is skipped by the kernel (counted in the
    program's ``recursion_misses``, which kvwatch exports as lost), while ftrace records
    it. ``skipped`` is that node-wide count over the window, an upper bound on what this
    task lost. No skips: exact. Skips: never more than ftrace, never less by more than them."""
    if skipped == 0:
        assert got == expected, f"{what}: {got} vs {expected} (difference {got - expected:+}), no skipped runs"
    else:
        assert expected - skipped <= got <= expected, f"{what}: {got} vs {expected} with {skipped} skipped runs"


def wait_closes(
    read: Callable[[], float], expected: float, read_skipped: Callable[[], float], timeout: float = 5.0
) -> tuple[float, float]:
    """Wait for a published count to close against ``expected`` (see ``assert_closes``); returns (count, skipped).

    Exact equality ends the wait at once; with skipped runs the count cannot reach
    ``expected``, so it must stay the same for more than two daemon ticks instead."""
    deadline = time.monotonic() + timeout
    got, skipped, since = read(), read_skipped(), time.monotonic()
    while got != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        again, skipped = read(), read_skipped()
        if again != got:
            got, since = again, time.monotonic()
        elif skipped and expected - skipped <= got < expected and time.monotonic() - since > 1.2:
            break
    assert_closes(got, expected, skipped)
    return got, skipped


def settled(read: Callable[[], T], quiet: float = 1.2, timeout: float = 10.0) -> T:
    """A published value once it has stayed the same for ``quiet`` seconds (more than two daemon ticks)."""
    deadline = time.monotonic() + timeout
    value = read()
    while time.monotonic() < deadline:
        time.sleep(quiet)
        again = read()
        if again == value:
            return value
        value = again
    raise AssertionError(f"value still changing after {timeout}s (last {value})")


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


def wait_attached(d: DaemonProcess, pid: int, family: str = "cuda", timeout: float = 15.0) -> float:
    """Until the family's probes are attached to ``pid`` and their count has stopped growing: the
    attacher works symbol by symbol, and a workload started at the first one would make calls
    the probes of later symbols miss. Returns the count."""
    metric = f"kvwatch_{family}_probes_attached"
    wait_until(lambda: d.value(metric, pid=str(pid)) > 0, timeout, f"{family} probes attached")
    return settled(lambda: d.value(metric, pid=str(pid)), quiet=1.5, timeout=timeout)
