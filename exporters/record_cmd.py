"""``kvwatch record``, the command: root, the output file, signals, the summary it prints."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvwatch.exporters.record import record, write_trace

if TYPE_CHECKING:
    from kvwatch.exporters.loop import Loop
    from kvwatch.exporters.record_daemon import DaemonAlerts


def run_record(
    build: Callable[[], Loop],
    tick_seconds: float,
    duration: float,
    output: Path,
    max_events: int,
    *,
    daemon: DaemonAlerts | None = None,
) -> int:
    """``kvwatch record``: the loop that ``build`` makes (kvwatch's own probes), recorded."""
    if os.geteuid() != 0:
        print("kvwatch record: needs root (it loads its own eBPF probes)", file=sys.stderr)
        return 1
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.with_name(output.name + ".tmp").touch()
    except OSError as err:
        print(f"kvwatch record: cannot write {output}: {err}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        agent = build()
        agent.start()
    except Exception as err:
        print(f"kvwatch record: cannot start probes: {err}", file=sys.stderr)
        return 1
    print(f"kvwatch record: recording {duration:g} s to {output} (ctrl-c ends early)", file=sys.stderr)
    if daemon is None:
        print("kvwatch record: alerts from its own detectors (silent through their warm-up)", file=sys.stderr)
    elif daemon.reachable():
        print(f"kvwatch record: alerts from the {daemon.description}", file=sys.stderr)
    else:
        print(
            f"kvwatch record: alerts from the {daemon.description}, which does not answer yet"
            f" ({daemon.first_error}); its own detectors are silent through their warm-up",
            file=sys.stderr,
        )
    try:
        rec = record(agent, duration, max_events=max_events, stop=stop, daemon=daemon)
        # The trace is written before the probes are detached: detaching from many processes can take
        # longer than whoever stopped us waits.
        trace = rec.finish(rec.ended_at or time.monotonic(), tick_seconds)
        write_trace(trace, output)
    finally:
        agent.close()
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(rec.counts.items()) if k != "metadata") or "no events"
    print(f"kvwatch record: wrote {output}: {kinds}", file=sys.stderr)
    if rec.dropped:
        print(
            f"kvwatch record: NOTE {sum(rec.dropped.values())} events dropped at the limit of {max_events} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(rec.dropped.items()))}); raise --max-events",
            file=sys.stderr,
        )
    if daemon is not None and daemon.failed:
        print(
            f"kvwatch record: NOTE the daemon did not answer {daemon.failed} times: {daemon.first_error}",
            file=sys.stderr,
        )
    if rec.lost:
        print(f"kvwatch record: NOTE the kernel side lost events: {rec.lost}", file=sys.stderr)
    return 0
