"""An engine's taps from its own command line (read as argv from /proc, so JSON flag values
keep their spaces):

* vLLM API server (``vllm serve`` / ``vllm.entrypoints``): ``--kv-events-config``
  (JSON, or the dotted ``--kv-events-config.endpoint X`` form) with publisher zmq →
  one stream per local data-parallel rank on endpoint port + rank (the global rank:
  ``--data-parallel-start-rank`` .. + ``--data-parallel-size-local``, or the single
  ``--data-parallel-rank``); ``--host``/``--port`` (default 8000) → ``/metrics``.
* SGLang (``sglang.launch_server``): ``--enable-metrics`` with ``--host``
  (default 127.0.0.1) / ``--port`` (default 30000) → ``/metrics``.

Where each endpoint is reached from kvwatch is ``Reach``'s to say (``reach.py``), and only an
endpoint of the process's own is tapped. A command line asks for at most
``MAX_DATA_PARALLEL_RANKS`` KV event streams (``[[engines.endpoints]]``'s own bound). What is
refused is a note of the plan and counted in its ``refused`` by reason: ``metrics_host``,
``metrics_port``, ``kv_event_streams`` (ranks past the bound), ``kv_event_endpoint`` (a port
out of 1..65535, an ipc path leaving the engine's root).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.reach import Reach, port_number
from kvwatch.daemon.model.engines import EnginePlan, StreamSpec
from kvwatch.daemon.tracker import Tracked

VLLM_KV_EVENTS_DEFAULT = "tcp://*:5557"
VLLM_PORT = 8000
SGLANG_PORT = 30000
MAX_DATA_PARALLEL_RANKS = 256  # as config's [[engines.endpoints]] data_parallel_ranks
MAX_RANK_FLAG = 1 << 31  # a rank count or start read from a command line is clamped to this


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


def _rank_flag(value: str | None, default: int) -> int:
    """A data-parallel size, rank or start: clamped to 0..MAX_RANK_FLAG (the default when not a number)."""
    if value is None or len(value) > 20:
        return default
    try:
        return min(max(int(value), 0), MAX_RANK_FLAG)
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


def rank_span(flags: Mapping[str, str]) -> range:
    """The global DP ranks whose engines run under this API server, as the command line asks."""
    explicit = _first(flags, "--data-parallel-rank", "-dpn")
    if explicit is not None:
        rank = _rank_flag(explicit, 0)
        return range(rank, rank + 1)
    size = _rank_flag(_first(flags, "--data-parallel-size", "-dp"), 1)
    local = _rank_flag(_first(flags, "--data-parallel-size-local", "-dpl"), size)
    start = _rank_flag(_first(flags, "--data-parallel-start-rank", "-dpr"), 0)
    if "--headless" not in flags and start == 0 and local == size:
        return range(size)
    return range(start, start + local)


def data_parallel_ranks(flags: Mapping[str, str]) -> list[int]:
    """Those ranks, the first MAX_DATA_PARALLEL_RANKS of them."""
    return list(rank_span(flags)[:MAX_DATA_PARALLEL_RANKS])


def offset_port(endpoint: str, rank: int) -> str:
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


class _Planning:
    """A plan's notes, and what it refused counted by reason."""

    def __init__(self, t: Tracked, reach: Reach) -> None:
        self.t = t
        self.reach = reach
        self.notes: list[str] = []
        self.refused: dict[str, int] = {}

    def note(self, text: str, refused: str = "", n: int = 1) -> None:
        if text:
            self.notes.append(text)
        if refused:
            self.refused[refused] = self.refused.get(refused, 0) + n

    def connect(self, endpoint: str) -> str | None:
        addr, note, refused = self.reach.connect(endpoint, self.t.pid)
        self.note(note, "kv_event_endpoint" if refused else "")
        return addr

    def metrics_url(self, scheme: str, host: str | None, port: str | None, default_port: int) -> str | None:
        addr, note, refused = self.reach.http_host(host, self.t.pid)
        if addr is None:
            self.note(note, "metrics_host" if refused else "")
            return None
        number = default_port if port is None else port_number(port)
        if number is None:
            self.note("metrics --port is not a port in 1..65535: refused", "metrics_port")
            return None
        return f"{scheme}://{_bracket(addr)}:{number}/metrics"

    def plan(self, streams: Sequence[StreamSpec], url: str | None) -> EnginePlan:
        return EnginePlan(self.t.key, self.t.pid, tuple(streams), url, tuple(self.notes), refused=self.refused)


def _vllm_streams(
    flags: Mapping[str, str], kv: Mapping[str, Any], cfg: EnginesConfig, p: _Planning
) -> list[StreamSpec]:
    endpoint = str(kv.get("endpoint") or VLLM_KV_EVENTS_DEFAULT)
    replay = kv.get("replay_endpoint") if cfg.kv_events_replay else None
    topic = str(kv.get("topic") or "")
    span = rank_span(flags)
    if len(span) > MAX_DATA_PARALLEL_RANKS:
        first = MAX_DATA_PARALLEL_RANKS
        p.note(f"{len(span)} data-parallel ranks asked for: KV event streams of the first {first} only")
        p.note("", "kv_event_streams", len(span) - first)
    streams: list[StreamSpec] = []
    for rank in span[:MAX_DATA_PARALLEL_RANKS]:
        addr = p.connect(offset_port(endpoint, rank))
        if addr is None:
            continue
        raddr = p.connect(offset_port(str(replay), rank)) if replay else None
        streams.append(StreamSpec(addr, raddr, topic, rank, p.t.key))
    return streams


def _vllm_plan(t: Tracked, flags: Mapping[str, str], cfg: EnginesConfig, reach: Reach) -> EnginePlan:
    p = _Planning(t, reach)
    kv, problem = vllm_kv_events(flags)
    p.note(problem)
    streams = _vllm_streams(flags, kv, cfg, p) if kv is not None and cfg.kv_events else []
    url = None
    if cfg.metrics and "--uds" not in flags:
        scheme = "https" if "--ssl-keyfile" in flags else "http"
        url = p.metrics_url(scheme, flags.get("--host"), flags.get("--port"), VLLM_PORT)
    return p.plan(streams, url)


def _sglang_plan(t: Tracked, flags: Mapping[str, str], cfg: EnginesConfig, reach: Reach) -> EnginePlan:
    p = _Planning(t, reach)
    url = None
    if cfg.metrics and flags.get("--enable-metrics") == "true":
        url = p.metrics_url("http", flags.get("--host", "127.0.0.1"), flags.get("--port"), SGLANG_PORT)
    return p.plan((), url)


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
        plan = _vllm_plan(t, flags, cfg, reach)
    elif engine == "sglang" and component == "server":
        plan = _sglang_plan(t, flags, cfg, reach)
    elif carries_vllm_kv_events(flags):
        metrics = engine == "vllm" or "--port" in flags
        plan = _vllm_plan(t, flags, cfg if metrics else msgspec.structs.replace(cfg, metrics=False), reach)
    else:
        return None
    if not plan.streams and plan.metrics_url is None and not plan.notes:
        return None
    return plan


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
