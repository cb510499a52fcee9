"""Closed-loop load for an OpenAI-compatible completions server (a real vLLM, or the simulated one).

Prompts are token-id lists (``"prompt": [ids]``), so shared prefixes are exact: the
engine hashes the same tokens into the same blocks. Each client thread keeps one
request in flight on its own keep-alive connection and records, per request, when it
started and ended, whether it succeeded, and how many prompt tokens the engine served
from its prefix cache (``usage.prompt_tokens_details.cached_tokens``, which vLLM
reports with ``--enable-prompt-tokens-details``).

Workloads (the validation's scenarios):

* ``hot``     — one of ``hot`` fixed prefixes of ``prefix_tokens`` tokens plus a unique
  one-block suffix: a prefix cache that works serves ~95 % of each prompt;
* ``unique``  — prompts of ``unique_tokens`` random tokens, never seen before;
* ``long``    — unique prompts with long generations (``ignore_eos``): the KV pool fills
  with running requests and the engine preempts.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

VOCAB = (3, 32000)  # ids 0-2 are the tiny tokenizer's special tokens
BLOCK = 16


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # hot / unique / long
    clients: int
    max_tokens: int = 8
    hot: int = 24
    prefix_tokens: int = 320
    unique_tokens: int = 900
    ignore_eos: bool = False


STEADY = Workload("hot", clients=8)
PRESSURE = Workload("unique", clients=32)
NOSHARE = Workload("unique", clients=1)  # prompts that share nothing, at a pace the pool holds
PREEMPT = Workload("long", clients=32, max_tokens=1100, ignore_eos=True)


@dataclass(slots=True)
class Request:
    phase: str
    kind: str
    start: float  # time.monotonic()
    end: float
    ok: bool
    prompt_tokens: int
    cached_tokens: int | None
    hot_index: int = -1
    error: str = ""


class Prompts:
    """Deterministic hot prefixes; every other token is fresh randomness."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._prefixes: dict[tuple[int, int], list[int]] = {}

    def tokens(self, n: int) -> list[int]:
        with self._lock:
            return [self._rng.randrange(*VOCAB) for _ in range(n)]

    def prefix(self, i: int, n: int) -> list[int]:
        key = (i, n)
        with self._lock:
            p = self._prefixes.get(key)
            if p is None:
                rng = random.Random(1_000_003 * (i + 1) + n)
                p = self._prefixes[key] = [rng.randrange(*VOCAB) for _ in range(n)]
            return p

    def make(self, w: Workload) -> tuple[list[int], int]:
        """(prompt, index of the hot prefix or -1)."""
        if w.kind == "hot":
            with self._lock:
                i = self._rng.randrange(w.hot)
            return self.prefix(i, w.prefix_tokens) + self.tokens(BLOCK), i
        return self.tokens(w.unique_tokens), -1


class Client:
    def __init__(
        self,
        host: str,
        port: int,
        model: str,
        timeout: float = 300.0,
        xargs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.host, self.port, self.model, self.timeout = host, port, model, timeout
        self.xargs = xargs  # vLLM's per-request extra arguments (vllm_xargs): kv_cache_report_mode ...
        self.extra = extra  # more top-level body fields: cache_salt ...
        self._conn: http.client.HTTPConnection | None = None

    def complete(self, prompt: list[int], max_tokens: int, ignore_eos: bool) -> tuple[int, int | None]:
        """(prompt tokens, cached tokens) of one completion; raises on any failure."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        if self.xargs:
            body["vllm_xargs"] = self.xargs
        if self.extra:
            body.update(self.extra)
        data = json.dumps(body).encode()
        for attempt in (0, 1):  # a keep-alive connection the server closed: reconnect once
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
                resp = self._conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
                continue
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
            usage = json.loads(raw).get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            return int(usage.get("prompt_tokens", len(prompt))), None if cached is None else int(cached)
        raise RuntimeError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def abort(self) -> None:
        """From another thread: break the request in flight (vLLM aborts a request whose
        client went away)."""
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@dataclass(slots=True)
class Run:
    """One phase of load on its own threads; ``stop()`` ends it (requests in flight finish)."""

    phase: str
    workload: Workload
    requests: list[Request] = field(default_factory=list)
    started: float = 0.0
    stopped: float = 0.0
    aborted: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _clients: list[Client] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, wait: bool = True) -> None:
        if not self._stop.is_set():
            self.stopped = time.monotonic()
            self._stop.set()
        if wait:
            for t in self._threads:
                t.join()

    def abort(self) -> None:
        """Stop now: requests in flight are cut off (and counted as aborted, not failed)."""
        self.aborted = True
        self.stop(wait=False)
        for c in list(self._clients):
            c.abort()
        for t in self._threads:
            t.join()

    def record(self, r: Request) -> None:
        with self._lock:
            self.requests.append(r)


class Load:
    def __init__(
        self,
        host: str,
        port: int,
        model: str,
        seed: int = 0,
        xargs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.host, self.port, self.model, self.xargs, self.extra = host, port, model, xargs, extra
        self.prompts = Prompts(seed)
        self.runs: list[Run] = []

    def start(self, phase: str, w: Workload) -> Run:
        run = Run(phase, w, started=time.monotonic())

        def client_loop() -> None:
            c = Client(self.host, self.port, self.model, xargs=self.xargs, extra=self.extra)
            run._clients.append(c)
            try:
                while not run._stop.is_set():
                    prompt, idx = self.prompts.make(w)
                    t0 = time.monotonic()
                    try:
                        n, cached = c.complete(prompt, w.max_tokens, w.ignore_eos)
                        run.record(Request(phase, w.kind, t0, time.monotonic(), True, n, cached, idx))
                    except Exception as err:  # a failed request is data, not a crash
                        why = "aborted" if run.aborted else str(err)
                        run.record(Request(phase, w.kind, t0, time.monotonic(), False, len(prompt), None, idx, why))
                        run._stop.wait(0.2)
            finally:
                c.close()

        for i in range(w.clients):
            t = threading.Thread(target=client_loop, name=f"load-{phase}-{i}", daemon=True)
            run._threads.append(t)
            t.start()
        self.runs.append(run)
        return run

    def phase(self, phase: str, w: Workload, seconds: float, during: Callable[[Run], None] | None = None) -> Run:
        run = self.start(phase, w)
        if during is not None:
            during(run)
        time.sleep(max(0.0, run.started + seconds - time.monotonic()))
        run.stop()
        return run

    def all_requests(self) -> list[Request]:
        return [r for run in self.runs for r in run.requests]

    def dump(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.all_requests()]


def summary(run: Run, window: tuple[float, float] | None = None) -> dict[str, Any]:
    """Throughput (requests that completed inside the window, per second) and latency."""
    lo, hi = window or (run.started, run.stopped or time.monotonic())
    done = [r for r in run.requests if r.ok and lo <= r.end <= hi]
    lat = sorted(r.end - r.start for r in done)
    failed = sum(1 for r in run.requests if not r.ok and r.error != "aborted")
    out: dict[str, Any] = {
        "phase": run.phase,
        "seconds": hi - lo,
        "completed": len(done),
        "failed": failed,
        "requests_per_second": len(done) / (hi - lo) if hi > lo else 0.0,
    }
    if lat:
        out["p50_seconds"] = statistics.median(lat)
        out["p99_seconds"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    prompts = sum(r.prompt_tokens for r in done)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    if cached and prompts:
        out["cached_fraction"] = sum(cached) / prompts
    return out
