"""What every engine's command-line plan is made with (``cmdline.py`` runs them; each engine's
own plan is in its module under ``kinds/``): the flags read off argv, a plan's notes and what it
refused by reason, each endpoint reached through ``Reach`` (only the process's own).

Refusals are counted by reason: ``metrics_host``, ``metrics_port``, ``kv_event_streams`` (ranks
past ``MAX_DATA_PARALLEL_RANKS``), ``kv_event_endpoint`` (a port out of 1..65535, an ipc path
leaving the engine's root).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvwatch.daemon.engines.reach import Reach, port_number
from kvwatch.daemon.model.engines import EnginePlan, StreamSpec

MAX_DATA_PARALLEL_RANKS = 256  # as config's [[engines.endpoints]] data_parallel_ranks
MAX_RANK_FLAG = 1 << 31  # a rank count or start read from a command line is clamped to this


def flag_values(argv: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` (last one wins); a bare ``--flag`` is "true"."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-") and len(a) > 1 and not is_number(a):
            name, eq, value = a.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(argv) and not (argv[i + 1].startswith("-") and not is_number(argv[i + 1])):
                out[name] = argv[i + 1]
                i += 1
            else:
                out[name] = "true"
        i += 1
    return out


def is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def first_flag(flags: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        if n in flags:
            return flags[n]
    return None


def rank_flag(value: str | None, default: int) -> int:
    """A data-parallel size, rank or start: clamped to 0..MAX_RANK_FLAG (the default when not a number)."""
    if value is None or len(value) > 20:
        return default
    try:
        return min(max(int(value), 0), MAX_RANK_FLAG)
    except ValueError:
        return default


def offset_port(endpoint: str, rank: int) -> str:
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + rank}"


class Planning:
    """One process's plan being made: its notes, and what it refused counted by reason."""

    def __init__(self, key: str, pid: int, reach: Reach) -> None:
        self.key = key
        self.pid = pid
        self.reach = reach
        self.notes: list[str] = []
        self.refused: dict[str, int] = {}

    def note(self, text: str, refused: str = "", n: int = 1) -> None:
        if text:
            self.notes.append(text)
        if refused:
            self.refused[refused] = self.refused.get(refused, 0) + n

    def connect(self, endpoint: str) -> str | None:
        addr, note, refused = self.reach.connect(endpoint, self.pid)
        self.note(note, "kv_event_endpoint" if refused else "")
        return addr

    def metrics_url(self, scheme: str, host: str | None, port: str | None, default_port: int) -> str | None:
        addr, note, refused = self.reach.http_host(host, self.pid)
        if addr is None:
            self.note(note, "metrics_host" if refused else "")
            return None
        number = default_port if port is None else port_number(port)
        if number is None:
            self.note("metrics --port is not a port in 1..65535: refused", "metrics_port")
            return None
        return f"{scheme}://{_bracket(addr)}:{number}/metrics"

    def plan(self, streams: Sequence[StreamSpec], url: str | None) -> EnginePlan:
        return EnginePlan(self.key, self.pid, tuple(streams), url, tuple(self.notes), refused=self.refused)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
