"""``kvwatch top``, the command: where its frames come from (the daemon, else kvwatch's own
probes) and how they are shown (one frame, or the live Textual app of ``top_app.py``). The view
itself is ``top.py``'s, which neither this module nor the app is imported by."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwatch.exporters.top import LocalSource, Source, SourceError, ViewState, daemon_source, print_once

if TYPE_CHECKING:
    from kvwatch.daemon.config import Config
    from kvwatch.exporters.loop import Loop


# --- the command ---------------------------------------------------------------------------------
@dataclass
class TopOptions:
    interval: float = 1.0
    once: bool = False
    url: str | None = None
    local: bool = False
    sort: str = "alloc"
    filter: str = ""
    width: int | None = None
    tenants: bool = False
    notes: list[str] = field(default_factory=list)


def open_source(config: Config, opts: TopOptions, local: Callable[[], Loop] | None = None) -> Source:
    """The daemon when it answers, else our own probes (``local`` builds them); SourceError says
    why neither works."""
    if opts.url:
        return daemon_source(config, opts.url)  # asked for this daemon: its absence is shown, not worked around
    if not opts.local:
        src = daemon_source(config)
        try:
            src.fetch()
        except SourceError as err:
            opts.notes.append(f"no daemon: {err}; starting kvwatch's own probes")
        else:
            return src

    if os.geteuid() != 0:
        raise SourceError("no kvwatch daemon reachable, and starting probes here needs root (try sudo)")
    if local is None:
        raise SourceError("no kvwatch daemon reachable")
    try:
        return LocalSource(local())
    except Exception as err:  # bcc missing, compile failure: say it plainly
        raise SourceError(f"cannot start kvwatch's own probes: {err}") from None


def run_top(config: Config, opts: TopOptions, local: Callable[[], Loop] | None = None) -> int:
    try:
        source = open_source(config, opts, local)
    except SourceError as err:
        print(f"kvwatch top: {err}", file=sys.stderr)
        return 1
    for note in opts.notes:
        print(f"kvwatch top: {note}", file=sys.stderr)
    view = ViewState(sort=opts.sort, filter=opts.filter, interval=opts.interval, tenants=opts.tenants)
    try:
        if opts.once or not sys.stdout.isatty():
            if not opts.once:
                print(
                    "kvwatch top: stdout is not a terminal; printing one frame (--once does this on purpose)",
                    file=sys.stderr,
                )
            return _once(source, view, opts)
        from kvwatch.exporters.top_app import TopApp  # noqa: PLC0415 - Textual only for the live view

        TopApp(source, view).run()
    except KeyboardInterrupt:
        return 130
    finally:
        source.close()
    return 0


def _once(source: Source, view: ViewState, opts: TopOptions) -> int:
    """One frame, after one interval so that rates exist."""
    try:
        view.rates.lines(source.fetch())  # the first frame: what the rates start from
        time.sleep(view.interval)
        frame = source.fetch()
    except SourceError as err:
        print(f"kvwatch top: {err}", file=sys.stderr)
        return 1
    print_once(frame, source.description, view, width=opts.width)
    return 0
