"""Fault injection on the real kernel: each scenario says what was lost (nothing, or exactly
what was counted) and that kvwatch kept working. The rest of the matrix lives beside the
feature it breaks; docs/faults.md lists every scenario and its test."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.lab.memcg import MemoryCgroup
from kvwatch.daemon.lab.workloads import workload_rule
from kvwatch.probes.cuda import CudaProbes
from kvwatch.probes.libs import LibraryError
from kvwatch.probes.tracefs import bcc_probe_events_of
from kvwatch.probes.uprobes import ProcessGoneDuringAttach
from tests.support.daemon import DaemonProcess, daemon, free_port, wait_attached, wait_until, watched
from tests.support.http import recording_server
from tests.support.kernel import FOREIGN_PAGE_SLACK, Child, PageFreeTruth

MIB = 1 << 20
N_PAGES = 2311
RULE = workload_rule("faults", "pages", "oom", "cuda", "cudacalls")


def toml(extra: str = "") -> str:
    return f"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{RULE}]
[probes]
cuda_rescan_seconds = 1
[detectors.oom]
active_seconds = 30
{extra}
"""


# --- processes vanishing under the attacher ----------------------------------------------------
def test_process_exits_during_resolution_and_attach(stub: Path) -> None:
    """23 processes killed at random moments while their libraries are resolved and probed:
    every attach either completes or ends in a clean, named error; nothing is left behind."""
    probes = CudaProbes()
    probes.start()
    try:
        base = probes.program.open_uprobes
        outcomes: dict[str, int] = {}
        rnd = random.Random(23)
        for _ in range(23):
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvwatch.daemon.lab.workloads",
                    "cudacalls",
                    "--lib",
                    str(stub / "libcudart.so.12"),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout
            assert child.stdout.readline().strip() == "ready"
            killer = threading.Timer(rnd.uniform(0, 0.02), child.kill)
            killer.start()
            try:
                att = probes.attach(child.pid)
                kind = "attached" if att.attached else "nothing to attach"
            except ProcessGoneDuringAttach:
                kind = "gone during attach"
            except LibraryError:
                kind = "gone during resolution"
            killer.join()
            child.wait()
            probes.detach(child.pid)
            outcomes[kind] = outcomes.get(kind, 0) + 1
        assert sum(outcomes.values()) == 23 and set(outcomes) <= {
            "attached",
            "nothing to attach",
            "gone during attach",
            "gone during resolution",
        }, outcomes
        assert probes.program.open_uprobes == base  # every probe of every process released
        probes.program.wait_releases(60)
        assert probes.program.pending_releases() == 0
        assert bcc_probe_events_of(os.getpid()) == []
    finally:
        probes.close()


def test_library_unmapped_while_probed_then_mapped_again(tmp_path: Path, stub: Path) -> None:
    """The probed runtime is dlclose()d (unmapped) and dlopen()ed again: counts before and
    after are exact, the daemon logs nothing worse than a note and keeps going."""
    lib = tmp_path / "libcudart.so.12"
    shutil.copy(stub / "libcudart.so.12", lib)
    with daemon(tmp_path, toml()) as d:
        with Child("cudacalls", "--lib", "/lib/x86_64-linux-gnu/libc.so.6") as w:
            w.expect("ready")
            wait_until(lambda: watched(d, w.pid), 10, "watched")
            w.step(f"load {lib}", "loaded")
            pid = str(w.pid)
            wait_attached(d, w.pid)
            w.step("calllast 23", "done 23 0")
            wait_until(lambda: d.value("kvwatch_cuda_alloc_calls_total", pid=pid, result="ok") == 23, 5, "23 counted")
            w.step("unload", "unloaded")
            d.run_for(2.5)  # rescans see the library gone
            w.step(f"load {lib}", "loaded")
            d.run_for(2.5)  # and back
            w.step("calllast 7", "done 7 0")
            wait_until(lambda: d.value("kvwatch_cuda_alloc_calls_total", pid=pid, result="ok") == 30, 5, "7 more")
            assert d.value("kvwatch_cuda_free_calls_total", pid=pid, result="ok") == 30
            assert d.value("kvwatch_ready") == 1
    errors = [e for e in d.log_events() if e.get("level") == "error" and e.get("pid") == w.pid]
    assert errors == [], errors


# --- PID reuse ---------------------------------------------------------------------------------
def spawn_with_pid(pid: int, *args: str) -> Child | None:
    """A workload child that gets exactly ``pid`` (kernel.ns_last_pid), or None if another
    process on the node took it first."""
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    c = Child(*args)
    if c.pid != pid:
        c.proc.kill()
        c.proc.wait()
        return None
    return c


def test_pid_reuse_is_a_new_process(tmp_path: Path) -> None:
    with daemon(tmp_path, toml()) as d:
        with Child("pages", str(N_PAGES)) as a:
            pid = a.pid
            wait_until(lambda: watched(d, pid), 10, "first process watched")
            for _ in range(3):
                a.step("go", "done")
            wait_until(lambda: d.value("kvwatch_page_free_pages_total", pid=str(pid)) >= 3 * N_PAGES, 5, "A counted")
        a.proc.wait()
        wait_until(lambda: not watched(d, pid), 10, "first process gone")
        b = None
        for _ in range(20):
            b = spawn_with_pid(pid, "pages", str(N_PAGES))
            if b is not None:
                break
        if b is None:
            pytest.skip("could not get the same PID back (a busy node)")
        with b:
            wait_until(lambda: watched(d, pid), 10, "second process watched")
            b.step("go", "done")
            wait_until(lambda: d.value("kvwatch_page_free_pages_total", pid=str(pid)) >= N_PAGES, 5, "B counted")
            got = d.settled(lambda: d.value("kvwatch_page_free_pages_total", pid=str(pid)))
            assert N_PAGES <= got < 2 * N_PAGES, got  # B's pages only: none of A's carried over
    starts = [e for e in d.log_events() if e.get("event") == "watching process" and e.get("pid") == pid]
    assert len(starts) == 2  # two identities


# --- garbage to kvwatch's own endpoints --------------------------------------------------------
def raw(port: int, payload: bytes, timeout: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        # The server may answer an oversized request (414/431) and close before it has read
        # all of it; the close then resets the connection under the sender (seen in CI under
        # load: shutdown -> ENOTCONN). What it answered, if anything arrived, is still read.
        with contextlib.suppress(OSError):
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def test_garbage_http_requests_change_nothing(tmp_path: Path) -> None:
    with daemon(tmp_path, toml()) as d:
        before = d.get("/metrics")[1]
        idle = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(20)]  # connect, say nothing
        answers = [
            raw(d.port, b"\x00\xff\x16\x03\x01garbage\r\n\r\n"),
            raw(d.port, b"GET /" + b"A" * 100_000 + b" HTTP/1.1\r\n\r\n"),
            raw(d.port, b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"y" * 70_000 + b"\r\n\r\n"),
            raw(d.port, b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            raw(d.port, b"POST /api/v1/top HTTP/1.1\r\nContent-Length: 999999\r\n\r\nshort"),
            raw(d.port, b"GET /../../etc/passwd HTTP/1.1\r\n\r\n"),
            raw(d.port, b"GET /metrics HTTP/9.9\r\n\r\n"),
        ]
        for a in answers:
            assert b"root:" not in a and b"Traceback" not in a
        assert answers[3].startswith(b"HTTP/1.0 405") and answers[5].startswith(b"HTTP/1.0 404")
        # refused, or reset before the refusal arrived (the server closes without reading the rest)
        assert answers[1] == b"" or answers[1].startswith(b"HTTP/1.0 414"), answers[1][:80]
        assert answers[2] == b"" or answers[2].startswith(b"HTTP/1.0 431"), answers[2][:80]
        code, body = d.get("/metrics")
        assert code == 200 and body.splitlines()[0] == before.splitlines()[0]
        assert d.get("/healthz")[0] == 200 and d.get("/api/v1/top")[0] == 200
        for s in idle:
            s.close()
        assert d.proc.poll() is None


# --- many scrapers while events flow ----------------------------------------------------------
def test_concurrent_scrapers_see_consistent_counts(tmp_path: Path) -> None:
    with daemon(tmp_path, toml()) as d, Child("pages", str(N_PAGES)) as w:
        wait_until(lambda: watched(d, w.pid), 10, "watched")
        w.step("go", "done")

        def value() -> float:
            return d.value("kvwatch_page_free_pages_total", pid=str(w.pid))

        stop = threading.Event()
        seen: list[list[float]] = [[] for _ in range(8)]
        failures: list[str] = []

        def scrape(i: int) -> None:
            while not stop.is_set():
                try:
                    seen[i].append(value())
                except Exception as err:
                    failures.append(repr(err))

        def skipped() -> float:
            return d.value("kvwatch_events_lost_total", source="page_free_skipped")

        with PageFreeTruth(w.pid) as truth:
            start = d.settled(value)
            # read once: it moves with every process on the node; an early read only widens the bound
            skipped0 = skipped()
            truth.clear()
            threads = [threading.Thread(target=scrape, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            try:
                for _ in range(23):
                    w.step("go", "done")
                expected = truth.pages()  # complete: the workload frees its pages before it answers
                # the kernel's own trace of the same tracepoint for the same task: exact unless the
                # kernel skipped page-free runs in the window (nested interrupts), then within them
                d.wait_closes(lambda: value() - start, expected, lambda: skipped() - skipped0)
            finally:
                stop.set()
                for t in threads:
                    t.join()
        total = value() - start
        assert 23 * N_PAGES <= total <= 23 * (N_PAGES + FOREIGN_PAGE_SLACK), total
        assert failures == []
        for s in seen:
            assert s == sorted(s), "a counter went backwards between scrapes"  # no read-and-clear
        assert sum(len(s) for s in seen) > 50  # they really hammered it
        lost = {lab["source"]: v for lab, v in d.metrics()["kvwatch_events_lost_total"] if v}
        assert [src for src in lost if not src.endswith("_skipped")] == [], lost  # only the kernel's own skips


# --- SIGTERM mid-burst, kill -9 ----------------------------------------------------------------
@pytest.fixture
def fake_alertmanager() -> Iterator[tuple[str, list[Any]]]:
    with recording_server() as (url, got):
        yield url, got


def test_sigterm_mid_burst_exits_cleanly_with_alerts_flushed(
    tmp_path: Path, fake_alertmanager: tuple[str, list[Any]]
) -> None:
    url, got = fake_alertmanager
    d = DaemonProcess(tmp_path, toml(f'[alerts.alertmanager]\nurl = "{url}"\nresend_seconds = 600\n'))
    try:
        d.wait_ready()
        with MemoryCgroup(f"kvwatch-faults-{os.getpid()}", 48 * MIB) as cg, Child("oom") as victim:
            cg.add(victim.pid)
            wait_until(lambda: watched(d, victim.pid), 10, "victim watched")
            victim.send("go")
            victim.proc.wait(30)
        wait_until(lambda: d.value("kvwatch_alert_active", alert="InferenceProcessOOMKilled") == 1, 10, "OOM alert")
        burst = Child("pages", "20000")
        wait_until(lambda: watched(d, burst.pid), 10, "burst watched")
        for _ in range(3):
            burst.send("go")  # a page-free burst in flight
        code = d.stop(signal.SIGTERM, timeout=60)  # killed if it hangs: then not 0
        burst.proc.kill()
        burst.proc.wait()
    finally:
        d.stop()
    assert code == 0, code
    assert [a["labels"]["alertname"] for _, body in got for a in body] == ["InferenceProcessOOMKilled"]
    events = d.log_events()
    assert any(e.get("event") == "stopped: probes detached, alert sinks flushed" for e in events)
    assert bcc_probe_events_of(d.proc.pid) == []


def test_kill_9_leaves_nothing_behind_and_restart_works(tmp_path: Path, stub: Path) -> None:
    with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        d = DaemonProcess(tmp_path, toml())
        d.wait_ready()
        wait_attached(d, w.pid)
        d.proc.kill()
        d.proc.wait()
        d.stop()
        assert bcc_probe_events_of(d.proc.pid) == []  # nothing of kvwatch left in tracefs
        with daemon(tmp_path, toml()) as d2:
            wait_attached(d2, w.pid)
            w.step("growth 7 1", "done", timeout=30)
            wait_until(
                lambda: d2.value("kvwatch_cuda_alloc_calls_total", pid=str(w.pid), api="cudaMalloc", result="ok") == 7,
                5,
                "counting again",
            )


def test_missing_bpf_rights_are_a_clear_state(tmp_path: Path) -> None:
    """A capability-less uid 0 (a container without the rights): not ready, the reason
    named, the HTTP side answering, a clean exit. (A busy port: test_daemon.py.)"""
    cfg = tmp_path / "kvwatch.toml"
    cfg.write_text(toml())
    # without BPF rights (a capability-less uid 0): not ready, named, and the HTTP side still answers
    port = free_port()
    p = subprocess.Popen(
        [
            "setpriv",
            "--bounding-set=-all",
            "--inh-caps=-all",
            "--",
            sys.executable,
            "-m",
            "kvwatch.daemon",
            "run",
            "--config",
            str(cfg),
            "--listen",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        import urllib.error
        import urllib.request

        def readyz() -> tuple[int, str] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
            except OSError:
                return None

        wait_until(lambda: (readyz() or (0, "starting"))[1].find("starting") < 0, 90, "start-up finished")
        status = readyz()
        assert status is not None and status[0] == 503, status
        assert "memory probes" in status[1], status  # the reason is named
    finally:
        p.terminate()
        out = p.communicate(timeout=30)[0]
    assert p.returncode == 0, out
    assert "Traceback" not in out


# --- secrets ----------------------------------------------------------------------------------
def test_secrets_in_argv_and_environ_never_leave(tmp_path: Path) -> None:
    """An engine with an API key on its command line and a token in its environment: neither
    appears in the daemon's log, /metrics or /api/v1/top."""
    secret_arg, secret_env = "sk-kvwatch-test-4242-ARGV", "hf_kvwatch_test_2323_ENV"
    code = "import sys, time; sys.stdin.readline()"
    env = {**os.environ, "HF_TOKEN": secret_env, "OPENAI_API_KEY": secret_env}
    p = subprocess.Popen(
        [sys.executable, "-c", code, "vllm", "serve", "m", "--api-key", secret_arg],
        stdin=subprocess.PIPE,
        env=env,
    )
    try:
        with daemon(tmp_path, toml(), "--pid", str(p.pid), "--log-format", "json") as d:
            wait_until(lambda: watched(d, p.pid), 10, "watched")
            d.run_for(2)  # its labels published tick after tick
            outputs = [d.get("/metrics")[1], d.get("/api/v1/top")[1], d.log.read_text()]
    finally:
        p.kill()
        p.wait()
    for text in outputs:
        assert secret_arg not in text and secret_env not in text
