"""A memory-limited cgroup (v1 or v2) for canaries, the demo and the tests.

Real reclaim needs a real limit: on cgroup v2 ``memory.max`` (swap off with
``memory.swap.max``), on v1 ``memory.limit_in_bytes`` (``memory.swappiness`` 0)
so the kernel squeezes page cache rather than swapping anonymous memory.

A cgroup may have children (``child``): they share its limit, and reclaim that one of them
forces takes page cache charged to any of them. The kernel names a task's cgroup by its
cgroup v2 id (``bpf_get_current_cgroup_id``), so on a hybrid host (memory controller on v1,
the unified hierarchy beside it, as systemd keeps one) each cgroup has a twin of the same
path in the unified hierarchy, and its tasks are put in both, as systemd does.
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
    def __init__(self, name: str, limit_bytes: int | None, root: Path = CGROUP_ROOT) -> None:
        base, self.version = memory_controller_root(root)
        self.name = name
        self.path = base / name
        self.limit_bytes = limit_bytes
        self._root = root
        # the task's cgroup v2 directory: the memory cgroup itself on v2, its twin on a hybrid host
        unified = root if self.version == 2 else root / "unified"
        self.unified: Path | None = unified / name if (unified / "cgroup.procs").exists() else None

    @property
    def cgroup_id(self) -> int:
        """The cgroup v2 id of the tasks added here: the inode of their unified directory."""
        if self.unified is None:
            raise CgroupUnavailable("no unified (v2) hierarchy: tasks here have no cgroup of their own there")
        return self.unified.stat().st_ino

    def child(self, name: str) -> MemoryCgroup:
        """A child cgroup with no limit of its own, created: it shares this one's."""
        if self.version == 2:  # children have memory files only once the parent hands the controller down
            (self.path / "cgroup.subtree_control").write_text("+memory")
        return MemoryCgroup(f"{self.name}/{name}", None, self._root).create()

    def create(self) -> MemoryCgroup:
        try:
            self.path.mkdir(exist_ok=True)
            if self.unified is not None and self.unified != self.path:
                self.unified.mkdir(exist_ok=True)
            if self.limit_bytes is None:
                return self
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
        if self.unified is not None and self.unified != self.path:
            (self.unified / "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int((self.path / name).read_text())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left inside and remove the directory (and its unified twin)."""
        deadline = time.monotonic() + timeout
        for path in (self.path, self.unified):
            while path is not None and path.exists():
                for pid in self.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def __enter__(self) -> MemoryCgroup:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
