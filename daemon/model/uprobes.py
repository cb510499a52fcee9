"""A process's uprobe families as the family runner and the self-cost meter leave them each tick."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UprobeState:
    """One uprobe family (``cuda``, ``transfer``) of one process, latest."""

    calls: float = 0.0  # probed calls so far, cumulative
    shed: bool = False  # the self-cost budget has them detached
    symbols: int = 0  # symbols attached
