"""What an alert is about (``Subject``) and a detector's verdict on it (``Finding``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Subject:
    """What an alert is about: a process, a KV tier, or both."""

    key: str  # stable id: "pid:1234@5678" or "tier:3"
    labels: Mapping[str, str]  # pid, engine, role, component, container, pod, tier


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's verdict on one subject at one evaluation."""

    alert: str
    subject: Subject
    firing: bool
    cause: str = ""
    values: Mapping[str, float] = field(default_factory=dict)
    summary: str = ""
    severity: str = "warning"
