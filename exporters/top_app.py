"""The live ``kvwatch top`` view: a Textual app over a :class:`~kvwatch.exporters.top.Source`.

Frames are fetched in a worker thread (an HTTP request or a snapshot), so a slow or
vanished daemon never freezes the keyboard; when fetching fails the last frame stays
on screen under a banner that says why and since when, and fetching goes on.
"""

from __future__ import annotations

import time
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Input, Static

from kvwatch.exporters.top import (
    COLUMNS,
    SORT_KEYS,
    TENANTS_NONE,
    Source,
    SourceError,
    ViewState,
    alerts_text,
    header_text,
    row_cells,
)
from kvwatch.exporters.top_model import TopFrame
from kvwatch.exporters.top_tenants import TENANT_COLUMNS, tenant_cells

INTERVALS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


class TopApp(App[None]):
    TITLE = "kvwatch top"
    CSS = """
    #header { height: auto; padding: 0 1; }
    #table { height: 1fr; }
    #note { height: auto; padding: 0 1; }
    #alerts { height: auto; max-height: 10; padding: 0 1; }
    #filter { display: none; }
    #filter.shown { display: block; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False),
        Binding("s", "next_sort", "sort"),
        Binding("r", "reverse", "reverse"),
        Binding("slash", "filter", "filter"),
        Binding("escape", "clear_filter", "clear filter", show=False),
        Binding("a", "alerting", "alerting only"),
        Binding("t", "tenants", "tenants"),
        Binding("plus,equals_sign", "faster", "faster"),
        Binding("minus", "slower", "slower"),
    ]

    def __init__(self, source: Source, view: ViewState) -> None:
        super().__init__()
        self.source = source
        self.view = view
        self.frame: TopFrame | None = None
        self.problem = ""
        self.failing_since: float | None = None
        self._timer: Timer | None = None
        self._fetching = False

    def compose(self) -> ComposeResult:
        yield Static("kvwatch top: waiting for the first frame", id="header")
        yield DataTable(id="table", cursor_type="row", zebra_stripes=False)
        yield Static("", id="note")
        yield Input(placeholder="filter: text in any column; enter to apply, escape to clear", id="filter")
        yield Static("", id="alerts")
        yield Footer()

    def on_mount(self) -> None:
        self._columns()
        self._fetch()
        self._timer = self.set_interval(self.view.interval, self._fetch)

    def _columns(self) -> None:
        table = self.query_one("#table", DataTable)
        table.clear(columns=True)
        if self.view.tenants:
            for title, _ in TENANT_COLUMNS:
                table.add_column(title, key=title)
        else:
            for c in COLUMNS:
                table.add_column(c.title, key=c.key)

    # --- fetching ------------------------------------------------------------------------------
    def _fetch(self) -> None:
        if self._fetching:
            return
        self._fetching = True
        self.run_worker(self._fetch_in_thread, thread=True, exclusive=True, group="fetch")

    def _fetch_in_thread(self) -> None:
        try:
            frame = self.source.fetch()
        except SourceError as err:
            self.call_from_thread(self._failed, str(err))
        except Exception as err:  # never a traceback on screen: say it and keep trying
            self.call_from_thread(self._failed, f"{type(err).__name__}: {err}")
        else:
            self.call_from_thread(self._got, frame)

    def _got(self, frame: TopFrame) -> None:
        self._fetching = False
        self.frame, self.problem, self.failing_since = frame, "", None
        self._render()

    def _failed(self, why: str) -> None:
        self._fetching = False
        if self.failing_since is None:
            self.failing_since = time.time()
        since = time.strftime("%H:%M:%S", time.localtime(self.failing_since))
        shown = "showing the last frame" if self.frame is not None else "nothing to show yet"
        self.problem = f"{why} since {since}; retrying every {self.view.interval:g} s, {shown}"
        self._render()

    # --- drawing -------------------------------------------------------------------------------
    def _render(self) -> None:
        header = self.query_one("#header", Static)
        note = self.query_one("#note", Static)
        if self.frame is None:
            header.update(Text(f"kvwatch top: {self.problem or 'waiting for the first frame'}", style="bold"))
            return
        header.update(header_text(self.frame, self.source.description, self.view, self.problem))
        self.query_one("#alerts", Static).update(alerts_text(self.frame))
        if self.view.tenants:
            self._render_tenants(self.frame)
            return
        table = self.query_one("#table", DataTable)
        rows = self.view.rows(self.frame)
        table.clear()
        for r in rows:
            table.add_row(*row_cells(r), key=str(r.pid))
        if rows:
            note.update("")
        elif self.frame.rows and (self.view.filter or self.view.alerting_only):
            note.update("no process matches the filter")
        else:
            note.update("no inference processes watched (discovery rules: kvwatch doctor; or --pid)")

    def _render_tenants(self, frame: TopFrame) -> None:
        table = self.query_one("#table", DataTable)
        lines = self.view.tenant_lines(frame)
        table.clear()
        for x in lines:
            table.add_row(*tenant_cells(x), key=f"{x.t.pid}/{x.t.medium}/{x.t.tenant}")
        self.query_one("#note", Static).update("" if lines else TENANTS_NONE)

    # --- keys ----------------------------------------------------------------------------------
    def action_next_sort(self) -> None:
        i = SORT_KEYS.index(self.view.sort) if self.view.sort in SORT_KEYS else -1
        self.view.sort = SORT_KEYS[(i + 1) % len(SORT_KEYS)]
        self._render()

    def action_reverse(self) -> None:
        self.view.reverse = not self.view.reverse
        self._render()

    def action_alerting(self) -> None:
        self.view.alerting_only = not self.view.alerting_only
        self._render()

    def action_tenants(self) -> None:
        self.view.tenants = not self.view.tenants
        self._columns()
        self._render()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = self.view.filter
        box.add_class("shown")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.remove_class("shown")
        box.value = ""
        self.view.filter = ""
        self.query_one("#table", DataTable).focus()
        self._render()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.view.filter = event.value.strip()
        event.input.remove_class("shown")
        self.query_one("#table", DataTable).focus()
        self._render()

    def _retime(self, interval: float) -> None:
        self.view.interval = interval
        if self._timer is not None:
            self._timer.stop()
        self._timer = self.set_interval(interval, self._fetch)
        self._render()

    def action_faster(self) -> None:
        smaller = [i for i in INTERVALS if i < self.view.interval]
        self._retime(smaller[-1] if smaller else self.view.interval)

    def action_slower(self) -> None:
        bigger = [i for i in INTERVALS if i > self.view.interval]
        self._retime(bigger[0] if bigger else self.view.interval)
