"""Pressure stall information: node-wide and per memory cgroup (cgroup v2 only)."""

from __future__ import annotations

from kvwatch.daemon.host.procfs import ProcError, ProcFS


def parse_some_avg10(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "avg10":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


class PressureReader:
    def __init__(self, procfs: ProcFS) -> None:
        self.procfs = procfs
        self.cgroup2 = procfs.cgroup2_mount()

    def node(self) -> float | None:
        try:
            return parse_some_avg10(self.procfs.pressure("memory"))
        except ProcError:
            return None

    def cgroup(self, unified_path: str) -> float | None:
        if self.cgroup2 is None or not unified_path:
            return None
        try:
            return parse_some_avg10(self.procfs.pressure("memory", self.cgroup2 / unified_path.lstrip("/")))
        except ProcError:
            return None
