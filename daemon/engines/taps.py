"""Engine taps: which KV event streams and /metrics endpoints belong to which watched process.

Found from the engine's own command line (read as argv from /proc, so JSON flag
values keep their spaces), or given by hand in ``[[engines.endpoints]]``:

* vLLM API server (``vllm serve`` / ``vllm.entrypoints``): ``--kv-events-config``
  (JSON, or the dotted ``--kv-events-config.endpoint X`` form) with publisher zmq →
  one stream per local data-parallel rank on endpoint port + rank (the global rank:
  ``--data-parallel-start-rank`` .. + ``--data-parallel-size-local``, or the single
  ``--data-parallel-rank``); ``--host``/``--port`` (default 8000) → ``/metrics``.
* SGLang (``sglang.launch_server``): ``--enable-metrics`` with ``--host``
  (default 127.0.0.1) / ``--port`` (default 30000) → ``/metrics``.

A wildcard bind (``tcp://*:5557``) is reached on 127.0.0.1 when the engine shares
kvwatch's network namespace, else on the engine's own address in its namespace (a
pod IP, read from ``/proc/PID/net/fib_trie``). An ``ipc://`` path is reached
through ``/proc/PID/root``. What cannot be reached (an endpoint vLLM connects out
to, ``inproc://``, loopback inside another namespace) is reported as a note on
the process, never guessed.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from kvwatch.daemon.config import EngineEndpoint, EnginesConfig
from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.metrics import EngineScraper
from kvwatch.daemon.engines.records import (
    EnginePlan,
    EngineSample,
    EngineView,
    ScrapeTarget,
    StreamSpec,
    StreamStats,
    TargetState,
)
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.procfs import ProcError, ProcessGone, ProcFS
from kvwatch.daemon.tracker import Tracked

log = structlog.get_logger("kvwatch.engine_taps")

VLLM_KV_EVENTS_DEFAULT = "tcp://*:5557"
VLLM_PORT = 8000
SGLANG_PORT = 30000
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}  # noqa: S104 - names of "all interfaces", matched not bound
_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|::1|\[::1\])$")
REPLAN_SECONDS = 30.0
MAX_FAMILY_DEPTH = 8


# --- command lines ---------------------------------------------------------------------------
def flag_values(argv: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` (last one wins); a bare ``--flag`` is "true"."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-") and len(a) > 1 and not _is_number(a):
            name, eq, value = a.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(argv) and not (argv[i + 1].startswith("-") and not _is_number(argv[i + 1])):
                out[name] = argv[i + 1]
                i += 1
            else:
                out[name] = "true"
        i += 1
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _first(flags: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        if n in flags:
            return flags[n]
    return None


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def vllm_kv_events(flags: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """vLLM's KVEventsConfig from the command line → (config, problem)."""
    cfg: dict[str, Any] = {}
    raw = flags.get("--kv-events-config")
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as err:
            return None, f"--kv-events-config is not JSON: {err}"
        if not isinstance(parsed, dict):
            return None, "--kv-events-config is not a JSON object"
        cfg.update(parsed)
    for name, value in flags.items():
        if name.startswith("--kv-events-config."):
            key = name.split(".", 1)[1].replace("-", "_")
            cfg[key] = json.loads(value) if value in ("true", "false", "null") or _is_number(value) else value
    if not cfg:
        return None, ""
    enabled = cfg.get("enable_kv_cache_events") in (True, "true", "True", 1)
    publisher = cfg.get("publisher") or ("zmq" if enabled else "null")
    if not enabled or publisher != "zmq":
        return None, ""
    return cfg, ""


def data_parallel_ranks(flags: Mapping[str, str]) -> list[int]:
    """The global DP ranks whose engines run under this API server."""
    explicit = _first(flags, "--data-parallel-rank", "-dpn")
    if explicit is not None:
        return [_int(explicit, 0)]
    size = _int(_first(flags, "--data-parallel-size", "-dp"), 1)
    local = _int(_first(flags, "--data-parallel-size-local", "-dpl"), size)
    start = _int(_first(flags, "--data-parallel-start-rank", "-dpr"), 0)
    if "--headless" not in flags and start == 0 and local == size:
        return list(range(size))
    return list(range(start, start + max(local, 0)))


def offset_port(endpoint: str, rank: int) -> str:
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


# --- network namespaces ----------------------------------------------------------------------
def local_ipv4(fib_trie: str) -> str | None:
    """The first non-loopback local IPv4 address in a /proc/PID/net/fib_trie."""
    last_ip = None
    for line in fib_trie.splitlines():
        s = line.strip()
        if s.startswith("|--"):
            last_ip = s[3:].strip()
        elif s == "/32 host LOCAL" and last_ip and not last_ip.startswith("127."):
            return last_ip
    return None


@dataclass(slots=True)
class Reach:
    """How to reach a process's listening sockets from kvwatch."""

    proc_root: Path
    _own_netns: int | None = None

    def own_netns(self) -> int | None:
        if self._own_netns is None:
            try:
                self._own_netns = Path("/proc/self/ns/net").stat().st_ino
            except OSError:
                return None
        return self._own_netns

    def same_netns(self, pid: int) -> bool:
        try:
            return (self.proc_root / str(pid) / "ns" / "net").stat().st_ino == self.own_netns()
        except OSError:
            return True  # cannot tell (no /proc ns access): assume the host network

    def address(self, pid: int) -> str | None:
        if self.same_netns(pid):
            return "127.0.0.1"
        try:
            return local_ipv4((self.proc_root / str(pid) / "net" / "fib_trie").read_text())
        except OSError:
            return None

    def connect(self, endpoint: str, pid: int) -> tuple[str | None, str]:
        """Where kvwatch connects to reach what the engine binds (vLLM's own bind rule)."""
        if endpoint.startswith("tcp://"):
            if "*" not in endpoint and "::" not in endpoint:
                return None, f"{endpoint}: vLLM connects out to this endpoint (no wildcard), nothing to subscribe to"
            port = endpoint.rpartition(":")[2]
            addr = self.address(pid)
            if addr is None:
                return None, f"{endpoint}: no address found in the engine's network namespace"
            return f"tcp://{addr}:{port}", ""
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://") :]
            base = "root" if path.startswith("/") else "cwd"
            return f"ipc://{self.proc_root}/{pid}/{base}/{path.lstrip('/')}", ""
        return None, f"{endpoint}: not reachable from another process"

    def http_host(self, host: str | None, pid: int) -> tuple[str | None, str]:
        if host is None or host in _WILDCARD_HOSTS:
            addr = self.address(pid)
            return addr, "" if addr else "no address found in the engine's network namespace"
        if _LOOPBACK.match(host):
            if self.same_netns(pid):
                return "127.0.0.1", ""
            return None, f"metrics listen on {host} inside another network namespace"
        return host, ""


def _vllm_plan(t: Tracked, flags: Mapping[str, str], cfg: EnginesConfig, reach: Reach, notes: list[str]) -> EnginePlan:
    streams: list[StreamSpec] = []
    kv, problem = vllm_kv_events(flags)
    if problem:
        notes.append(problem)
    if kv is not None and cfg.kv_events:
        endpoint = str(kv.get("endpoint") or VLLM_KV_EVENTS_DEFAULT)
        replay = kv.get("replay_endpoint") if cfg.kv_events_replay else None
        topic = str(kv.get("topic") or "")
        for rank in data_parallel_ranks(flags):
            addr, note = reach.connect(offset_port(endpoint, rank), t.pid)
            if addr is None:
                notes.append(note)
                continue
            raddr = None
            if replay:
                raddr, rnote = reach.connect(offset_port(str(replay), rank), t.pid)
                if rnote:
                    notes.append(rnote)
            streams.append(StreamSpec(addr, raddr, topic, rank, t.key))
    url = None
    if cfg.metrics and "--uds" not in flags:
        host, note = reach.http_host(flags.get("--host"), t.pid)
        scheme = "https" if "--ssl-keyfile" in flags else "http"
        if host is None:
            notes.append(note)
        else:
            url = f"{scheme}://{_bracket(host)}:{_int(flags.get('--port'), VLLM_PORT)}/metrics"
    return EnginePlan(t.key, t.pid, tuple(streams), url, tuple(notes))


def _sglang_plan(
    t: Tracked, flags: Mapping[str, str], cfg: EnginesConfig, reach: Reach, notes: list[str]
) -> EnginePlan:
    url = None
    if cfg.metrics and flags.get("--enable-metrics") == "true":
        host, note = reach.http_host(flags.get("--host", "127.0.0.1"), t.pid)
        if host is None:
            notes.append(note)
        else:
            url = f"http://{_bracket(host)}:{_int(flags.get('--port'), SGLANG_PORT)}/metrics"
    return EnginePlan(t.key, t.pid, (), url, tuple(notes))


def carries_vllm_kv_events(flags: Mapping[str, str]) -> bool:
    return any(f == "--kv-events-config" or f.startswith("--kv-events-config.") for f in flags)


def plan_from_cmdline(t: Tracked, argv: Sequence[str], cfg: EnginesConfig, reach: Reach) -> EnginePlan | None:
    """The taps of an engine's root process (vLLM API server, SGLang server), and of any watched
    process whose command line carries vLLM's ``--kv-events-config`` (a wrapper that launches
    vLLM with vLLM's own argument parser; its /metrics only when it names a ``--port``, or is
    vLLM); None for the rest."""
    engine, component = t.proc.labels.engine, t.proc.labels.component
    flags = flag_values(argv[1:])
    if engine == "vllm" and component == "api_server":
        plan = _vllm_plan(t, flags, cfg, reach, [])
    elif engine == "sglang" and component == "server":
        plan = _sglang_plan(t, flags, cfg, reach, [])
    elif carries_vllm_kv_events(flags):
        metrics = engine == "vllm" or "--port" in flags
        plan = _vllm_plan(t, flags, cfg if metrics else cfg.model_copy(update={"metrics": False}), reach, [])
    else:
        return None
    if not plan.streams and plan.metrics_url is None and not plan.notes:
        return None
    return plan


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def plan_from_config(t: Tracked, ep: EngineEndpoint, cfg: EnginesConfig) -> EnginePlan:
    streams: list[StreamSpec] = []
    if ep.kv_events and cfg.kv_events:
        for rank in range(ep.data_parallel_ranks):
            replay = offset_port(ep.kv_events_replay, rank) if ep.kv_events_replay and cfg.kv_events_replay else None
            streams.append(StreamSpec(offset_port(ep.kv_events, rank), replay, ep.kv_events_topic, rank, t.key))
    url = ep.metrics_url if cfg.metrics else None
    return EnginePlan(t.key, t.pid, tuple(streams), url, (), "config")


def _matches(ep: EngineEndpoint, t: Tracked) -> bool:
    if ep.pid is not None:
        return t.pid == ep.pid
    return ep.cmdline is not None and re.search(ep.cmdline, t.proc.cmdline) is not None


# --- the agent's component -------------------------------------------------------------------------


@dataclass(slots=True)
class _Planned:
    plan: EnginePlan | None
    at: float
    sample_at: float = -1.0


class EngineTaps:
    def __init__(
        self,
        config: EnginesConfig,
        procfs: ProcFS,
        errors: ErrorBook,
        *,
        clock: Callable[[], float] = time.monotonic,
        hub: KVEventHub | None = None,
        scraper: EngineScraper | None = None,
    ) -> None:
        self.config = config
        self.procfs = procfs
        self.errors = errors
        self.clock = clock
        self.reach = Reach(procfs.root)
        self.hub = hub or KVEventHub(
            thrash_seconds=config.thrash_seconds,
            max_tracked_blocks=config.max_tracked_blocks,
            replay_timeout_seconds=config.replay_timeout_seconds,
            clock=clock,
        )
        self.scraper = scraper or EngineScraper(
            interval=config.scrape_interval_seconds,
            timeout=config.scrape_timeout_seconds,
            thrash_seconds=config.thrash_seconds,
            clock=clock,
        )
        self._planned: dict[str, _Planned] = {}
        self._stats: dict[StreamSpec, StreamStats] = {}
        self._scrapes: dict[ScrapeTarget, TargetState] = {}

    def start(self) -> None:
        self.hub.start()
        self.scraper.start()

    def close(self) -> None:
        self.hub.close()
        self.scraper.close()

    def plans(self) -> list[EnginePlan]:
        return [p.plan for p in self._planned.values() if p.plan is not None]

    def sync(self, tracked: Iterable[Tracked]) -> None:
        now = self.clock()
        alive = {t.key: t for t in tracked if t.exited_at is None}
        for key in [k for k in self._planned if k not in alive]:
            del self._planned[key]
        for key, t in alive.items():
            p = self._planned.get(key)
            if p is None or (p.plan is not None and p.plan.notes and now - p.at > REPLAN_SECONDS):
                self._planned[key] = _Planned(self._plan(t), now)
        streams: dict[str, StreamSpec] = {}
        targets: dict[str, ScrapeTarget] = {}
        # one owner per endpoint: the oldest process (a forked child keeps its parent's command line)
        for p in sorted(self._planned.values(), key=lambda x: alive[x.plan.owner].first_seen if x.plan else 0.0):
            if p.plan is None:
                continue
            for s in p.plan.streams:
                streams.setdefault(s.endpoint, s)
            if p.plan.metrics_url:
                targets.setdefault(p.plan.metrics_url, ScrapeTarget(p.plan.metrics_url, p.plan.owner))
        self.hub.set_streams(streams.values())
        self.scraper.set_targets(targets.values())
        self._stats = self.hub.stats()
        self._scrapes = self.scraper.states()

    def _plan(self, t: Tracked) -> EnginePlan | None:
        for ep in self.config.endpoints:
            if _matches(ep, t):
                return plan_from_config(t, ep, self.config)
        if not self.config.from_cmdline:
            return None
        try:
            argv = self.procfs.cmdline(t.pid)
        except ProcessGone as err:  # exited between discovery and now: normal, counted
            self.errors.record("engine_plan_gone", "engine exited before its command line was read", err, level="info")
            return None
        except ProcError as err:
            self.errors.record("engine_plan", "could not read an engine's command line", err)
            return None
        plan = plan_from_cmdline(t, argv, self.config, self.reach)
        if plan is not None:
            log.info(
                "engine taps",
                pid=t.pid,
                engine=t.proc.labels.engine,
                kv_event_streams=[s.endpoint for s in plan.streams],
                metrics=plan.metrics_url,
                notes=list(plan.notes),
            )
        return plan

    # --- per tick -----------------------------------------------------------------------------
    def _streams_of(self, owner: str) -> list[StreamStats]:
        return [s for spec, s in self._stats.items() if spec.owner == owner]

    def _scrape_of(self, owner: str) -> TargetState | None:
        for target, st in self._scrapes.items():
            if target.owner == owner:
                return st
        return None

    def family_owner(self, t: Tracked, by_pid: Mapping[int, Tracked]) -> str | None:
        """The tapped process this one belongs to: itself, or its nearest watched ancestor with
        taps (a vLLM engine core and its workers descend from the API server)."""
        cur: Tracked | None = t
        for _ in range(MAX_FAMILY_DEPTH):
            if cur is None:
                return None
            p = self._planned.get(cur.key)
            if p is not None and p.plan is not None:
                return cur.key
            parent = by_pid.get(cur.proc.ppid)
            cur = parent if parent is not None and parent.first_seen <= cur.first_seen else None
        return None

    def add_series(self, tracked: Iterable[Tracked], now: float) -> None:
        tracked = list(tracked)
        by_pid = {t.pid: t for t in tracked if t.exited_at is None}
        sleeping: dict[str, float] = {}
        for t in tracked:
            sleeping.update(self._add_owner_series(t, now))
        for t in tracked:  # the engine's other processes learn what their server says of it
            owner = self.family_owner(t, by_pid)
            if owner is not None:
                t.series.set_gauges({"engine_family_tapped": 1.0, "engine_sleeping": sleeping.get(owner, 0.0)})

    def _add_owner_series(self, t: Tracked, now: float) -> dict[str, float]:
        """A tapped process's own series; returns {its key: sleeping} when it has a scrape."""
        p = self._planned.get(t.key)
        if p is None or p.plan is None:
            return {}
        streams = self._streams_of(t.key)
        gauges: dict[str, float] = {}
        if streams:
            values: dict[str, float] = {
                "kv_cleared": float(sum(s.cleared for s in streams)),
                "kv_batches_lost": float(sum(s.lost for s in streams)),
                "kv_batches": float(sum(s.batches for s in streams)),
            }
            for s in streams:
                for medium, m in s.media.items():
                    for name, v in (
                        (f"kv_stored_blocks:{medium}", m.stored),
                        (f"kv_removed_blocks:{medium}", m.removed),
                        (f"kv_removed_young:{medium}", m.removed_young),
                    ):
                        values[name] = values.get(name, 0.0) + v
            t.series.add(now, values)
            gauges["kv_events_connected"] = float(any(s.connected for s in streams))
        st = self._scrape_of(t.key)
        sample = st.last if st is not None else None
        if sample is not None:
            if sample.at > p.sample_at:
                p.sample_at = sample.at
                t.series.add(sample.at, sample.counters())
            fresh = now - sample.at <= 3 * self.config.scrape_interval_seconds
            gauges["engine_metrics_fresh"] = float(fresh)
            if sample.usage is not None and fresh:
                gauges["engine_kv_usage"] = sample.usage
            gauges["engine_sleeping"] = float(bool(sample.sleeping) and fresh)
        if gauges:
            t.series.set_gauges(gauges)
        return {t.key: gauges.get("engine_sleeping", 0.0)}

    def view(self, t: Tracked, window: float) -> EngineView | None:
        p = self._planned.get(t.key)
        if p is None or p.plan is None:
            return None
        st = self._scrape_of(t.key)
        age = self.clock() - st.last.at if st is not None and st.last is not None else None
        q = t.series.delta("engine_prefix_queries", window)
        hits = t.series.delta("engine_prefix_hits", window)
        return EngineView(
            plan=p.plan,
            streams=tuple(self._streams_of(t.key)),
            scrape=st,
            scrape_age=age,
            hit_ratio=hits / q if q > 0 else None,
        )

    @property
    def lost_batches(self) -> int:
        return sum(s.lost for s in self._stats.values())

    def sample_of(self, owner: str) -> EngineSample | None:
        st = self._scrape_of(owner)
        return st.last if st is not None else None
