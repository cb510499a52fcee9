"""A simulated vLLM engine: a prefix-cached block pool, its KV event stream and its /metrics.

For the demo, end-to-end tests and the benchmark — kvwatch's taps need an engine
that behaves like one without a GPU. The pool is an LRU of cached blocks (as vLLM's
free-block queue is) beside blocks held by running requests; each request looks up
its prefix block by block (hits), stores what was missing (``BlockStored``) and
evicts least-recently-used cached blocks to make room (``BlockRemoved``). The same
numbers feed a prometheus-client registry with vLLM 0.33's metric names, labels and
types (``vllm:prefix_cache_queries`` / ``hits`` in tokens, ``kv_cache_usage_perc``
0..1, ``num_preemptions``, ``engine_sleep_state``), served over HTTP.

Events go out on a ``WirePublisher`` (vLLM's wire format, byte for byte).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvwatch.daemon.kv_wire import Layout, cleared, removed, stored
from kvwatch.daemon.vllm_publisher import WirePublisher
from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

BLOCK = 16  # tokens per block
LABELS = ("model_name", "engine")


@dataclass(slots=True)
class PoolStats:
    queries: int = 0  # tokens looked up
    hits: int = 0
    stored: int = 0  # blocks
    removed: int = 0
    preemptions: int = 0


@dataclass(slots=True)
class BlockPool:
    """Prefix cache over ``capacity`` blocks; ``active`` of them are held by running requests."""

    capacity: int
    active: int = 0
    cached: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> stored at (LRU order)
    stats: PoolStats = field(default_factory=PoolStats)

    @property
    def usage(self) -> float:
        return self.active / self.capacity

    def request(self, prefix: int, blocks: int, now: float) -> list[dict[str, Any]]:
        """One prompt of ``blocks`` blocks whose content is named by ``prefix``."""
        events: list[dict[str, Any]] = []
        self.stats.queries += blocks * BLOCK
        hashes = [hash((prefix, i)) & 0xFFFFFFFFFFFFFFFF for i in range(blocks)]
        hit = 0
        for h in hashes:
            if h not in self.cached:
                break
            self.cached.move_to_end(h)
            hit += 1
        self.stats.hits += hit * BLOCK
        new = hashes[hit:]
        if new:
            events += self._make_room(len(new))
            for h in new:
                self.cached[h] = now
            events.append(stored(new, list(range(len(new) * BLOCK))))
            self.stats.stored += len(new)
        return events

    def _make_room(self, n: int) -> list[dict[str, Any]]:
        room = self.capacity - self.active - len(self.cached)
        victims = []
        while room < n and self.cached:
            h, _ = self.cached.popitem(last=False)
            victims.append(h)
            room += 1
        self.stats.removed += len(victims)
        return [removed(victims)] if victims else []

    def set_active(self, blocks: int) -> list[dict[str, Any]]:
        """Running requests now hold ``blocks`` blocks; cached ones give way (evicted)."""
        self.active = max(0, min(blocks, self.capacity))
        return self._make_room(0)

    def evict(self, n: int) -> list[dict[str, Any]]:
        """Remove ``n`` cached blocks though there is room (a policy bug, pollution)."""
        victims = [self.cached.popitem(last=False)[0] for _ in range(min(n, len(self.cached)))]
        self.stats.removed += len(victims)
        return [removed(victims)] if victims else []

    def reset(self) -> list[dict[str, Any]]:
        """vLLM's reset_prefix_cache(): every hash dropped, one AllBlocksCleared."""
        self.cached.clear()
        return [cleared()]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


class SimulatedVllm:
    """The engine: a pool, a publisher and a /metrics server on loopback."""

    def __init__(
        self,
        *,
        kv_endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        http_host: str = "127.0.0.1",
        http_port: int = 0,
        capacity: int = 4000,
        layout: Layout = Layout.V0_33,
        model: str = "demo-model",
    ) -> None:
        self.pool = BlockPool(capacity)
        self.publisher = WirePublisher(kv_endpoint, replay_endpoint, layout=layout)
        self.registry = CollectorRegistry()
        lv = (model, "0")
        r = self.registry
        self._usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=r
        ).labels(*lv)
        self._queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            LABELS,
            registry=r,
        ).labels(*lv)
        self._hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", LABELS, registry=r
        ).labels(*lv)
        self._preempt = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS, registry=r
        ).labels(*lv)
        self._running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=r
        ).labels(*lv)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=r
        ).labels(*lv)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*LABELS, "sleep_state"],
            registry=r,
        )
        self._sleep = {s: sleep.labels(*lv, s) for s in ("awake", "weights_offloaded", "discard_all")}
        self.set_sleep(None)
        self._seen = PoolStats()
        self._lock = threading.RLock()
        self._server: WSGIServer = make_server(
            http_host, http_port, make_wsgi_app(self.registry), handler_class=_QuietHandler
        )
        self._http = threading.Thread(target=self._server.serve_forever, name="sim-vllm-http", daemon=True)
        self._http.start()

    @property
    def http_port(self) -> int:
        return int(self._server.server_port)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    def set_sleep(self, level: int | None) -> None:
        self._sleep["awake"].set(0 if level else 1)
        self._sleep["weights_offloaded"].set(1 if level == 1 else 0)
        self._sleep["discard_all"].set(1 if level == 2 else 0)

    def emit(self, events: list[dict[str, Any]]) -> None:
        """One engine step's events as one batch (vLLM publishes per scheduler step)."""
        if events:
            self.publisher.publish(events)
        self._sync_metrics()

    def _sync_metrics(self) -> None:
        with self._lock:
            st = self.pool.stats
            self._queries.inc(st.queries - self._seen.queries)
            self._hits.inc(st.hits - self._seen.hits)
            self._preempt.inc(st.preemptions - self._seen.preemptions)
            self._seen = PoolStats(st.queries, st.hits, st.stored, st.removed, st.preemptions)
            self._usage.set(self.pool.usage)
            self._running.set(self.pool.active // 64)

    def step(self, prefixes: list[int], blocks: int) -> None:
        with self._lock:
            now = time.time()
            events: list[dict[str, Any]] = []
            for p in prefixes:
                events += self.pool.request(p, blocks, now)
            self.emit(events)

    def set_active(self, blocks: int) -> None:
        with self._lock:
            self.emit(self.pool.set_active(blocks))

    def evict(self, n: int) -> None:
        with self._lock:
            self.emit(self.pool.evict(n))

    def reset(self) -> None:
        with self._lock:
            self.emit(self.pool.reset())

    def preempt(self, n: int) -> None:
        with self._lock:
            self.pool.stats.preemptions += n
            self._sync_metrics()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.publisher.close()


@dataclass(slots=True)
class Traffic:
    """Requests per second, drawn from ``hot`` prefixes, or unique prompts when ``unique``."""

    rate: float = 20.0
    hot: int = 20
    blocks: int = 8
    unique: bool = False
    _n: int = 0

    def prefixes(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            self._n += 1
            out.append(10_000_000 + self._n if self.unique else self._n % self.hot)
        return out


@contextmanager
def running(sim: SimulatedVllm, traffic: Traffic, *, hz: float = 20.0) -> Iterator[threading.Event]:
    """Drive ``traffic`` into ``sim`` on a thread until the block exits (the Event stops it early)."""
    stop = threading.Event()

    def loop() -> None:
        carry = 0.0
        while not stop.wait(1.0 / hz):
            carry += traffic.rate / hz
            k, carry = int(carry), carry - int(carry)
            sim.step(traffic.prefixes(k), traffic.blocks)

    t = threading.Thread(target=loop, name="sim-vllm-traffic", daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(timeout=5)


# --- a stand-in for `vllm serve`, driven line by line on stdin -----------------------------------
USAGE = """commands (one per line; each answered with "ok <command>"):
  traffic RATE HOT BLOCKS UNIQUE   requests/s from HOT prefixes of BLOCKS blocks (UNIQUE 1: new prompts)
  active N      running requests hold N blocks      evict N   drop N cached blocks (policy bug)
  reset         prefix-cache reset                   preempt N
  sleep LEVEL   sleep mode 1/2 (0: awake)            lose N / forget N   batches off the wire
  garbage       one malformed message               stats     pool counters as JSON
  quit"""


def _commands(sim: SimulatedVllm, traffic: Traffic) -> dict[str, Callable[[list[float]], object]]:
    def set_traffic(n: list[float]) -> None:
        traffic.rate, traffic.hot, traffic.blocks, traffic.unique = n[0], int(n[1]), int(n[2]), bool(n[3])

    pub = sim.publisher
    return {
        "traffic": set_traffic,
        "active": lambda n: sim.set_active(int(n[0])),
        "evict": lambda n: sim.evict(int(n[0])),
        "reset": lambda n: sim.reset(),
        "preempt": lambda n: sim.preempt(int(n[0])),
        "sleep": lambda n: sim.set_sleep(int(n[0]) or None),
        "lose": lambda n: pub.lose(int(n[0])),
        "forget": lambda n: pub.forget(int(n[0])),
        "garbage": lambda n: pub.publish_raw(b"\xc1 not msgpack"),
    }


def main(argv: list[str] | None = None) -> None:
    import argparse  # noqa: PLC0415 - only the stand-in needs them
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="vllm", description="simulated vLLM engine (kvwatch tests and demo)")
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--host", default="0.0.0.0")  # noqa: S104 - vLLM's default: every interface
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--kv-events-config", default="{}")
    ap.add_argument("--capacity", type=int, default=4000)
    ap.add_argument("--layout", default=Layout.V0_33.value, choices=[x.value for x in Layout])
    args = ap.parse_args(argv)
    kv = json.loads(args.kv_events_config)

    sim = SimulatedVllm(
        kv_endpoint=kv.get("endpoint", "tcp://*:5557"),
        replay_endpoint=kv.get("replay_endpoint"),
        http_host=args.host,
        http_port=args.port,
        capacity=args.capacity,
        layout=Layout(args.layout),
        model=args.model,
    )
    traffic = Traffic(rate=0.0)
    commands = _commands(sim, traffic)
    print("ready", flush=True)
    with running(sim, traffic):
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            cmd, nums = words[0], [float(w) for w in words[1:] if _number(w)]
            if cmd == "quit":
                break
            if cmd == "stats":
                st = sim.pool.stats
                print(json.dumps({**asdict(st), "batches": sim.publisher.sent}), flush=True)
                continue
            handler = commands.get(cmd)
            if handler is None:
                print(f"unknown {cmd}\n{USAGE}", flush=True)
                continue
            handler(nums)
            sim.publisher.flush()
            print(f"ok {cmd}", flush=True)
    sim.close()


def _number(w: str) -> bool:
    try:
        float(w)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()


class SimulatedEngineProcess:
    """The stand-in run the way pip installs vLLM: a console script named ``vllm`` executed
    through its shebang, so /proc shows "/path/python /dir/vllm serve MODEL ..." as for the real
    engine (and kvwatch's discovery and command-line parsing see what they would see)."""

    def __init__(
        self,
        workdir: Path,
        *,
        http_port: int,
        kv_events: Mapping[str, Any] | None,
        capacity: int = 4000,
        layout: Layout = Layout.V0_33,
        netns: str | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        import json  # noqa: PLC0415
        import subprocess  # noqa: PLC0415
        import sys  # noqa: PLC0415

        workdir.mkdir(parents=True, exist_ok=True)
        script = workdir / "vllm"
        script.write_text(f"#!{sys.executable}\nfrom kvwatch.daemon.engine_sim import main\n\nmain()\n")
        script.chmod(0o755)
        argv = [str(script), "serve", "demo-model", "--port", str(http_port), "--capacity", str(capacity)]
        argv += ["--layout", layout.value, *extra]
        if kv_events is not None:
            argv += ["--kv-events-config", json.dumps(dict(kv_events))]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("simulated engine pipes missing")
        self._in, self._out = self.proc.stdin, self.proc.stdout
        self._expect("ready")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _expect(self, word: str, timeout: float = 30.0) -> str:
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            line = self._out.readline().strip()
        finally:
            timer.cancel()
        if line != word:
            raise RuntimeError(f"simulated engine {self.pid}: expected {word!r}, got {line!r}")
        return line

    def do(self, line: str) -> None:
        self._in.write(line + "\n")
        self._in.flush()
        self._expect(f"ok {line.split(maxsplit=1)[0]}")

    def stats(self) -> dict[str, int]:
        import json  # noqa: PLC0415

        self._in.write("stats\n")
        self._in.flush()
        out: dict[str, int] = json.loads(self._out.readline())
        return out

    def close(self) -> None:
        import contextlib  # noqa: PLC0415

        with contextlib.suppress(OSError, ValueError):
            self._in.write("quit\n")
            self._in.flush()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> SimulatedEngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
