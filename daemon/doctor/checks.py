"""What a doctor check reports."""

from __future__ import annotations

from dataclasses import dataclass

OK, FAIL, WARN, SKIP, INFO = "ok", "fail", "warn", "skip", "info"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
