"""Pressure stall information: node-wide and per memory cgroup (cgroup v2 only)."""

from __future__ import annotations

from pathlib import Path


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


def read_some_avg10(path: Path) -> float | None:
    try:
        return parse_some_avg10(path.read_text())
    except OSError:
        return None


def cgroup2_root(mountinfo: Path = Path("/proc/self/mountinfo")) -> Path | None:
    """Where the unified hierarchy is mounted (/sys/fs/cgroup, or .../unified on hybrid hosts)."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            return Path(left.split()[4])
    return None


class PressureReader:
    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.node_path = proc_root / "pressure" / "memory"
        self.cgroup2 = cgroup2_root(proc_root / "self" / "mountinfo")

    def node(self) -> float | None:
        return read_some_avg10(self.node_path)

    def cgroup(self, unified_path: str) -> float | None:
        if self.cgroup2 is None or not unified_path:
            return None
        return read_some_avg10(self.cgroup2 / unified_path.lstrip("/") / "memory.pressure")
