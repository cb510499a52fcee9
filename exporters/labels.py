"""Label names every per-process family carries, in one place."""

from __future__ import annotations

from collections.abc import Mapping

PROCESS_LABELS = ("pid", "engine", "role", "component", "container", "pod")


def label_values(labels: Mapping[str, str], names: tuple[str, ...]) -> list[str]:
    return [str(labels.get(n, "")) for n in names]
