"""A memory-limited cgroup (v1 or v2) for canaries, the demo and the tests.

Real reclaim needs a real limit: on cgroup v2 ``memory.max`` (swap off with
``memory.swap.max``), on v1 ``memory.limit_in_bytes`` (``memory.swappiness`` 0)
so the kernel squeezes page cache rather than swapping anonymous memory.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(Exception):
    pass


def memory_controller_root(root: Path = CGROUP_ROOT) -> tuple[Path, int]:
    """(directory to create cgroups under, version)."""
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return root, 2
    v1 = root / "memory"
    if (v1 / "memory.limit_in_bytes").exists():
        return v1, 1
    raise CgroupUnavailable("no memory cgroup controller (neither v2 with memory nor v1 memory)")


class MemoryCgroup:
    def __init__(self, name: str, limit_bytes: int, root: Path = CGROUP_ROOT) -> None:
        base, self.version = memory_controller_root(root)
        self.path = base / name
        self.limit_bytes = limit_bytes

    def create(self) -> MemoryCgroup:
        try:
            self.path.mkdir(exist_ok=True)
            if self.version == 2:
                with contextlib.suppress(OSError):
                    (self.path / "memory.swap.max").write_text("0")
                (self.path / "memory.max").write_text(str(self.limit_bytes))
            else:
                with contextlib.suppress(OSError):
                    (self.path / "memory.swappiness").write_text("0")
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        except OSError as err:
            raise CgroupUnavailable(f"cannot set up {self.path}: {err}") from err
        return self

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int((self.path / name).read_text())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left inside and remove the directory."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            else:
                return

    def __enter__(self) -> MemoryCgroup:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
