"""``kvwatch top``: the live table, one row per watched inference process.

Where the numbers come from (a :class:`Source`): a running daemon's
``/api/v1/top`` when one answers, otherwise kvwatch's own probes started in this
process (root needed). The frame is rendered with rich — a Textual app when
stdout is a terminal, one plain frame for ``--once`` and for pipes.
"""

from __future__ import annotations

import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kvwatch.exporters.top_columns import COLUMNS, MIB, SORT_KEYS, Column, mib, num, pct
from kvwatch.exporters.top_model import API_PATH, TopFrame, TopRow, build_frame, decode
from kvwatch.exporters.top_tenants import TENANT_COLUMNS, TenantLine, TenantRates, matches, tenant_cells

if TYPE_CHECKING:
    from kvwatch.daemon.config import Config
    from kvwatch.exporters.loop import Loop

__all__ = ["COLUMNS", "MIB", "SORT_KEYS", "Column", "mib", "num", "pct"]


# --- where frames come from -----------------------------------------------------------------------
class SourceError(Exception):
    """The frame could not be had (daemon gone, garbage answer); the message says why."""


class Source(Protocol):
    description: str

    def fetch(self) -> TopFrame: ...

    def close(self) -> None: ...


class DaemonSource:
    def __init__(self, url: str, timeout: float = 2.0, cafile: str | None = None) -> None:
        self.base = url.rstrip("/")
        self.url = self.base + API_PATH
        self.timeout = timeout
        self.description = f"daemon {self.base}"
        # a daemon with its own (self-signed) certificate: trust that certificate
        self._ssl = ssl.create_default_context(cafile=cafile) if cafile and url.startswith("https") else None

    def fetch(self) -> TopFrame:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout, context=self._ssl) as resp:  # noqa: S310
                body = resp.read()
        except urllib.error.HTTPError as err:
            raise SourceError(f"{self.url}: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise SourceError(f"{self.base} unreachable ({reason})") from None
        try:
            return decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            raise SourceError(f"{self.url}: not a kvwatch top frame ({err})") from None

    def close(self) -> None:
        pass


class LocalSource:
    """kvwatch's own probes and loop, in a thread of this process."""

    def __init__(self, agent: Loop) -> None:
        self.description = "own probes (no daemon reachable)"
        self.agent = agent
        self.stop = threading.Event()
        self.agent.start()
        self._thread = threading.Thread(target=self._run, name="kvwatch-top-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.agent.run(self.stop)

    def fetch(self) -> TopFrame:
        if not self._thread.is_alive():
            raise SourceError("the probe loop stopped")
        return build_frame(self.agent.snapshot)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=10)
        self.agent.close()


def daemon_source(config: Config, url: str | None = None, timeout: float = 2.0) -> DaemonSource:
    """The daemon ``url`` names, else the configured one (trusting its own certificate)."""
    if url:
        return DaemonSource(url, timeout=timeout)
    cert = str(config.daemon.tls_cert) if config.daemon.tls_cert else None
    return DaemonSource(daemon_url(config), timeout=timeout, cafile=cert)


def daemon_url(config: Config) -> str:
    from kvwatch.daemon.config import parse_listen  # noqa: PLC0415

    host, port = parse_listen(config.daemon.listen)
    if host in ("", "0.0.0.0"):  # noqa: S104 - a listen address, not a bind
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if config.daemon.tls_cert else "http"
    return f"{scheme}://{host}:{port}"


_BY_KEY = {c.key: c for c in COLUMNS}


@dataclass
class ViewState:
    sort: str = "alloc"
    reverse: bool = True  # biggest first
    filter: str = ""
    alerting_only: bool = False
    interval: float = 1.0
    tenants: bool = False  # the tenant view (key t) instead of the process table
    rates: TenantRates = field(default_factory=TenantRates)

    def tenant_lines(self, frame: TopFrame) -> list[TenantLine]:
        lines = self.rates.lines(frame)
        if self.alerting_only:
            lines = [x for x in lines if x.t.evicted_by]
        return [x for x in lines if matches(x, self.filter)] if self.filter else lines

    def rows(self, frame: TopFrame) -> list[TopRow]:
        rows = [r for r in frame.rows if r.alive]
        if self.alerting_only:
            rows = [r for r in rows if r.alerts]
        if self.filter:
            f = self.filter.lower()
            rows = [r for r in rows if any(f in c.cell(r).lower() for c in COLUMNS)]
        col = _BY_KEY.get(self.sort, _BY_KEY["alloc"])
        return sorted(rows, key=lambda r: (col.value(r), -r.pid), reverse=self.reverse)


def header_text(frame: TopFrame, source: str, view: ViewState, problem: str = "") -> Text:
    h = frame.header
    t = Text()
    stamp = time.strftime("%H:%M:%S", time.localtime(h.wall_time)) if h.wall_time else "--:--:--"
    t.append(f"kvwatch top - {h.host} - {stamp} - {source}", style="bold")
    t.append(f" - every {view.interval:g} s - sort {view.sort} {'desc' if view.reverse else 'asc'}")
    if view.filter:
        t.append(f" - filter '{view.filter}'")
    if view.alerting_only:
        t.append(" - alerting only")
    if view.tenants:
        t.append(" - tenants")
    t.append("\n")
    engines = ", ".join(f"{k} {v}" for k, v in sorted(h.engines.items())) or "none"
    t.append(f"processes {h.processes} ({engines})  GPU {mib(h.gpu_bytes)} MiB  allocs {num(h.alloc_per_s)}/s  ")
    t.append(f"KV-tier evicted {mib(h.evict_reclaim_bps)} MiB/s (deleted {mib(h.evict_policy_bps)})  ")
    t.append(f"stall {num(h.stall_ms_per_s)} ms/s  transfers {mib(h.xfer_bps)} MiB/s")
    if h.link_bps:
        t.append(f" (link {mib(h.link_bps)} MiB/s)")
    if h.psi_some_avg10 is not None:
        t.append(f"  memory PSI {h.psi_some_avg10:.1f}%")
    t.append("\n")
    t.append(f"probes {h.probes_attached} attached", style="green" if not h.probes_failed else "yellow")
    if h.probes_failed:
        t.append(f"  not working: {', '.join(h.probes_failed)}", style="bold red")
    if h.probes_silent:
        t.append(f"  silent: {', '.join(h.probes_silent)}", style="yellow")
    lost_style = "bold red" if h.lost_events else ""
    t.append(f"  lost events {h.lost_events}", style=lost_style)
    if h.lost:
        t.append(" (" + ", ".join(f"{k} {v}" for k, v in sorted(h.lost.items())) + ")", style=lost_style)
    t.append(f"  loop {h.loop_ms:.0f} ms")
    if not h.ready:
        t.append(f"  NOT READY: {'; '.join(h.not_ready)}", style="bold red")
    if problem:
        t.append(f"\n{problem}", style="bold white on red")
    return t


def row_cells(r: TopRow) -> list[Text]:
    style = "bold red" if r.alerts else ""
    return [Text(c.cell(r), style=style, justify=c.justify) for c in COLUMNS]  # type: ignore[arg-type]


def alerts_text(frame: TopFrame) -> Text:
    t = Text()
    for i, a in enumerate(frame.alerts):
        since = time.strftime("%H:%M:%S", time.localtime(a.started_at))
        who = f"pid {a.pid}" if a.pid else "node"
        t.append(
            ("\n" if i else "") + f"{a.severity.upper():8} {a.alert} ({a.cause}) {who} since {since}: {a.summary}",
            style="red",
        )
    return t


def plain_frame(frame: TopFrame, source: str, view: ViewState, problem: str = "") -> Group:
    """The whole frame as rich renderables: header, table (or a note), alerts."""
    if view.tenants:
        return _tenant_frame(frame, source, view, problem)
    table = Table(box=None, pad_edge=False, header_style="bold reverse", expand=False)
    for c in COLUMNS:
        table.add_column(c.title, justify=c.justify, no_wrap=True)  # type: ignore[arg-type]
    rows = view.rows(frame)
    for r in rows:
        table.add_row(*row_cells(r))
    parts: list[Any] = [header_text(frame, source, view, problem), Text("")]
    if rows:
        parts.append(table)
    elif frame.rows and (view.filter or view.alerting_only):
        parts.append(Text("no process matches the filter"))
    else:
        parts.append(Text("no inference processes watched (discovery rules: kvwatch doctor; or --pid)"))
    if frame.alerts:
        parts += [Text(""), alerts_text(frame)]
    return Group(*parts)


def _tenant_frame(frame: TopFrame, source: str, view: ViewState, problem: str) -> Group:
    table = Table(box=None, pad_edge=False, header_style="bold reverse", expand=False)
    for title, _ in TENANT_COLUMNS:
        table.add_column(title, no_wrap=True)
    lines = view.tenant_lines(frame)
    for x in lines:
        table.add_row(*tenant_cells(x))
    parts: list[Any] = [header_text(frame, source, view, problem), Text("")]
    parts.append(table if lines else Text(TENANTS_NONE))
    if frame.alerts:
        parts += [Text(""), alerts_text(frame)]
    return Group(*parts)


TENANTS_NONE = "no tenants: no engine's KV event stream names a cache salt or a LoRA adapter"


def print_once(frame: TopFrame, source: str, view: ViewState, out: Any = None, width: int | None = None) -> None:
    console = Console(
        file=out or sys.stdout,
        width=width or 240,
        color_system=None,
        force_terminal=False,
        highlight=False,
        emoji=False,
    )
    console.print(plain_frame(frame, source, view), crop=False, overflow="ignore")
