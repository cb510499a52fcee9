"""structlog set-up (JSON lines off a terminal, console on one) and log-once bookkeeping."""

from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(log_format: str = "auto", level: str = "info", stream: Any = None) -> None:
    stream = stream or sys.stderr
    as_json = log_format == "json" or (log_format == "auto" and not stream.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if as_json:
        processors.append(structlog.processors.dict_tracebacks)
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


class ErrorBook:
    """Counts every error by kind; logs each kind once (the count says how often since)."""

    def __init__(self, logger: Any = None) -> None:
        self.counts: Counter[str] = Counter()
        self._log = logger or structlog.get_logger("kvwatch.errors")

    def record(
        self, kind: str, message: str = "", exc: BaseException | None = None, *, level: str = "error", **context: Any
    ) -> None:
        """``level``: ``info`` for races that are part of normal life (a process exiting
        while it is being attached), still counted under ``kind``."""
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            kw: dict[str, Any] = {"kind": kind, **context}
            if exc is not None:
                kw["error"] = f"{type(exc).__name__}: {exc}"
            getattr(self._log, level)(message or kind, **kw)

    def add(self, kind: str, n: int) -> None:
        """Count errors observed elsewhere (no log line)."""
        if n > 0:
            self.counts[kind] += n
