"""Reading /proc: one boundary where OS errors become ``ProcessGone``/``ProcAccessDenied``.

The root is injectable so tests run on fixture trees. A process is identified by
PID **and** start time (field 22 of ``stat``, clock ticks since boot): a
recycled PID is a different process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_CMDLINE = 4096
MAX_ENVIRON = 256 * 1024


class ProcError(Exception):
    pass


class ProcessGone(ProcError):
    """The process exited (or never existed) while we were reading it."""


class ProcAccessDenied(ProcError):
    """The entry exists but cannot be read (hidepid, missing privileges)."""


@dataclass(frozen=True, slots=True, order=True)
class ProcessIdentity:
    pid: int
    start_ticks: int

    def __str__(self) -> str:
        return f"{self.pid}@{self.start_ticks}"


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    start_ticks: int


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    identity: ProcessIdentity
    comm: str
    ppid: int
    cmdline: tuple[str, ...]
    cgroup: tuple[str, ...]

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def cmdline_text(self) -> str:
        return " ".join(self.cmdline)


class ProcFS:
    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def _read(self, pid: int, name: str, limit: int = 1 << 20) -> bytes:
        path = self.root / str(pid) / name
        try:
            with open(path, "rb") as f:
                return f.read(limit)
        except (FileNotFoundError, ProcessLookupError) as err:
            raise ProcessGone(f"pid {pid}: {name} vanished") from err
        except PermissionError as err:
            raise ProcAccessDenied(f"pid {pid}: cannot read {name}") from err
        except OSError as err:  # ESRCH and friends from a dying task
            raise ProcessGone(f"pid {pid}: {name}: {err.strerror}") from err

    def pids(self) -> Iterator[int]:
        try:
            entries = os.listdir(self.root)  # noqa: PTH208 - names only, fastest on /proc
        except OSError as err:
            raise ProcError(f"cannot list {self.root}: {err}") from err
        for name in entries:
            if name.isdigit():
                yield int(name)

    def stat(self, pid: int) -> ProcStat:
        raw = self._read(pid, "stat", 4096).decode("utf-8", "replace")
        # comm is in parentheses and may itself contain ')' and spaces: split on the last ')'
        lpar, rpar = raw.find("("), raw.rfind(")")
        if lpar < 0 or rpar < lpar:
            raise ProcessGone(f"pid {pid}: malformed stat")
        rest = raw[rpar + 2 :].split()
        try:
            return ProcStat(
                pid=pid,
                comm=raw[lpar + 1 : rpar],
                state=rest[0],
                ppid=int(rest[1]),
                start_ticks=int(rest[19]),
            )
        except (IndexError, ValueError) as err:
            raise ProcessGone(f"pid {pid}: malformed stat") from err

    def identity(self, pid: int) -> ProcessIdentity:
        return ProcessIdentity(pid, self.stat(pid).start_ticks)

    def cmdline(self, pid: int) -> tuple[str, ...]:
        raw = self._read(pid, "cmdline", MAX_CMDLINE)
        parts = raw.rstrip(b"\0").split(b"\0")
        if len(parts) == 1 and b" " in parts[0]:
            # setproctitle rewrites argv into one space-separated string
            return (parts[0].decode("utf-8", "replace"),)
        return tuple(p.decode("utf-8", "replace") for p in parts if p)

    def cgroup(self, pid: int) -> tuple[str, ...]:
        raw = self._read(pid, "cgroup", 64 * 1024).decode("utf-8", "replace")
        return tuple(line for line in raw.splitlines() if line)

    def environ(self, pid: int) -> dict[str, str]:
        raw = self._read(pid, "environ", MAX_ENVIRON)
        out: dict[str, str] = {}
        for item in raw.split(b"\0"):
            key, eq, value = item.partition(b"=")
            if eq and key:
                out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        return out

    def info(self, pid: int) -> ProcessInfo:
        st = self.stat(pid)
        cmd = self.cmdline(pid)
        try:
            cg = self.cgroup(pid)
        except ProcAccessDenied:
            cg = ()
        # re-check identity: the PID may have been recycled between the reads
        if self.stat(pid).start_ticks != st.start_ticks:
            raise ProcessGone(f"pid {pid} was recycled while being read")
        return ProcessInfo(
            identity=ProcessIdentity(pid, st.start_ticks),
            comm=st.comm,
            ppid=st.ppid,
            cmdline=cmd,
            cgroup=cg,
        )

    def tgid(self, pid: int) -> int:
        raw = self._read(pid, "status", 8192).decode("utf-8", "replace")
        for line in raw.splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
        raise ProcessGone(f"pid {pid}: no Tgid in status")

    def root_path(self, pid: int) -> Path:
        """``/proc/PID/root``: the process's view of the file system (containers)."""
        return self.root / str(pid) / "root"

    def boot_time(self) -> float:
        try:
            text = (self.root / "stat").read_text()
        except OSError:
            return 0.0
        for line in text.splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
        return 0.0
