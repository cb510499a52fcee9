"""An engine's taps from its own command line (read as argv from /proc, so JSON flag values
keep their spaces):

* vLLM API server (``vllm serve`` / ``vllm.entrypoints``): ``--kv-events-config``
  (JSON, or the dotted ``--kv-events-config.endpoint X`` form) with publisher zmq →
  one stream per local data-parallel rank on endpoint port + rank (the global rank:
  ``--data-parallel-start-rank`` .. + ``--data-parallel-size-local``, or the single
  ``--data-parallel-rank``); ``--host``/``--port`` (default 8000) → ``/metrics``.
* SGLang (``sglang.launch_server``): ``--enable-metrics`` with ``--host``
  (default 127.0.0.1) / ``--port`` (default 30000) → ``/metrics``.

Where each endpoint is reached from kvwatch is ``Reach``'s to say (``reach.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.reach import Reach
from kvwatch.daemon.engines.views import EnginePlan, StreamSpec
from kvwatch.daemon.tracker import Tracked

VLLM_KV_EVENTS_DEFAULT = "tcp://*:5557"
VLLM_PORT = 8000
SGLANG_PORT = 30000


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
