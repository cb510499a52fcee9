"""Reading /proc and /sys: one root, one boundary where OS errors become ``ProcError``s.

Every read is under one root: ``/`` on a host, a fixture tree in tests. Under it, ``proc``
is the procfs that shows the watched processes (``/proc``, or the host's mounted at
``/host/proc`` in a container) and ``sys`` is kvwatch's own sysfs. ``self`` in that procfs
is kvwatch itself: procfs names a process by its PID in the namespace it shows, and the
host's namespace holds every process. A process is identified by PID **and** start time
(field 22 of ``stat``, clock ticks since boot): a recycled PID is a different process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_CMDLINE = 4096
MAX_ENVIRON = 256 * 1024
MAX_ENGINE_FILE = 65536


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
    cpu_ticks: int = 0  # user + system time, in clock ticks


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


Pid = int | str  # a PID, or "self" (kvwatch)


def _error(pid: Pid, name: str, err: OSError) -> ProcError:
    if isinstance(err, (FileNotFoundError, ProcessLookupError)):
        return ProcessGone(f"pid {pid}: {name} vanished")
    if isinstance(err, PermissionError):
        return ProcAccessDenied(f"pid {pid}: cannot read {name}")
    return ProcessGone(f"pid {pid}: {name}: {err.strerror}")  # ESRCH and friends from a dying task


def _read_file(path: Path, limit: int = 1 << 20) -> bytes:
    """A file that belongs to no process (node-wide /proc, /sys, cgroupfs)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except PermissionError as err:
        raise ProcAccessDenied(f"cannot read {path}") from err
    except OSError as err:
        raise ProcError(f"{path}: {err.strerror}") from err


def parse_cgroup2_mount(mountinfo: str) -> str | None:
    """Where the unified hierarchy is mounted (/sys/fs/cgroup, or .../unified on hybrid hosts)."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            return left.split()[4]
    return None


class ProcFS:
    def __init__(self, root: Path = Path("/"), proc: Path | str = "/proc") -> None:
        self.root = root
        self.proc = self.under_root(proc)
        self.sys = root / "sys"

    def under_root(self, path: Path | str) -> Path:
        """An absolute path of kvwatch's own view of the file system, under the root."""
        return self.root / str(path).lstrip("/")

    def _read(self, pid: Pid, name: str, limit: int = 1 << 20) -> bytes:
        try:
            with open(self.proc / str(pid) / name, "rb") as f:
                return f.read(limit)
        except OSError as err:
            raise _error(pid, name, err) from err

    def pids(self) -> Iterator[int]:
        try:
            entries = os.listdir(self.proc)  # noqa: PTH208 - names only, fastest on /proc
        except OSError as err:
            raise ProcError(f"cannot list {self.proc}: {err}") from err
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
                cpu_ticks=int(rest[11]) + int(rest[12]),
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

    def status_value(self, pid: Pid, key: str) -> str | None:
        """A field of ``status`` (``CapEff``, ``Tgid``...), None when the kernel has no such field."""
        raw = self._read(pid, "status", 8192).decode("utf-8", "replace")
        for line in raw.splitlines():
            name, sep, value = line.partition(":")
            if sep and name == key:
                return value.strip()
        return None

    # --- where a process lives: its file system, its network namespace -------------------
    def root_path(self, pid: int) -> Path:
        """``PID/root``: the process's view of the file system (containers)."""
        return self.proc / str(pid) / "root"

    def cwd_path(self, pid: int) -> Path:
        """``PID/cwd``: the process's working directory, in its own view of the file system."""
        return self.proc / str(pid) / "cwd"

    def read_in_root(self, pid: int, path: str, limit: int = MAX_ENGINE_FILE) -> str:
        """A file as the process sees it (an engine's own config file, inside its container)."""
        try:
            with open(self.root_path(pid) / path.lstrip("/"), "rb") as f:
                return f.read(limit).decode("utf-8", "replace")
        except OSError as err:
            raise _error(pid, f"root{path}", err) from err

    def netns(self, pid: Pid) -> int:
        """The inode of ``ns/net``: two processes share a network namespace when theirs match."""
        try:
            return (self.proc / str(pid) / "ns" / "net").stat().st_ino
        except OSError as err:
            raise _error(pid, "ns/net", err) from err

    def fib_trie(self, pid: Pid) -> str:
        """``net/fib_trie``: the routing table of the process's network namespace."""
        return self._read(pid, "net/fib_trie", -1).decode("utf-8", "replace")

    def if_inet6(self, pid: Pid) -> str:
        """``net/if_inet6``: the IPv6 addresses of the process's network namespace."""
        return self._read(pid, "net/if_inet6", 1 << 20).decode("utf-8", "replace")

    def mountinfo(self, pid: Pid) -> str:
        return self._read(pid, "mountinfo", -1).decode("utf-8", "replace")

    # --- node-wide: pressure, cgroups, the kernel, links -----------------------------------
    def cgroup2_mount(self) -> Path | None:
        """kvwatch's cgroup v2 mount (from its own mountinfo), or None when there is none."""
        try:
            mount = parse_cgroup2_mount(self.mountinfo("self"))
        except ProcError:
            return None
        return self.under_root(mount) if mount is not None else None

    def host_cgroup2_mount(self) -> Path | None:
        """The node's whole cgroup v2 hierarchy: its mount as PID 1 sees it, opened through
        ``1/root`` (in a container, kvwatch's own mount may show its own cgroup only); kvwatch's
        own mount when PID 1's cannot be read."""
        try:
            mount = parse_cgroup2_mount(self.mountinfo(1))
        except ProcError:
            mount = None
        if mount is not None:
            path = self.root_path(1) / mount.lstrip("/")
            with contextlib.suppress(OSError):  # PID 1 may be out of reach (another user namespace)
                if path.is_dir():
                    return path
        return self.cgroup2_mount()

    def cgroup2_dirs(self, mount: Path) -> Iterator[tuple[int, str]]:
        """Every cgroup of the v2 hierarchy mounted at ``mount``: (its id, its path below the
        mount). A cgroup v2 id is the inode number of its directory (what
        ``bpf_get_current_cgroup_id`` returns); a cgroup removed during the walk is skipped."""
        stack = [(mount, "")]
        while stack:
            directory, rel = stack.pop()
            try:
                entries = list(os.scandir(directory))
                yield directory.stat().st_ino, rel or "/"
            except OSError:
                continue
            for e in entries:
                with contextlib.suppress(OSError):
                    if e.is_dir(follow_symlinks=False):
                        stack.append((Path(e.path), f"{rel}/{e.name}"))

    def cgroup2_id(self, mount: Path, path: str) -> int | None:
        """The id of the cgroup at ``path`` below the v2 mount, None when there is none."""
        try:
            return (mount / path.lstrip("/")).stat().st_ino
        except OSError:
            return None

    def pressure(self, resource: str, cgroup_dir: Path | None = None) -> str:
        """Pressure stall information: node-wide (``pressure/RESOURCE``), or of a cgroup v2
        directory under ``cgroup2_mount()`` (``RESOURCE.pressure``)."""
        path = self.proc / "pressure" / resource if cgroup_dir is None else cgroup_dir / f"{resource}.pressure"
        return _read_file(path, 4096).decode("utf-8", "replace")

    def link_speed_mbit(self, interface: str) -> int:
        """``class/net/IF/speed`` in Mb/s (-1 or 0 where the driver does not know it)."""
        path = self.sys / "class" / "net" / interface / "speed"
        raw = _read_file(path, 64)
        try:
            return int(raw.strip())
        except ValueError as err:
            raise ProcError(f"{path}: not a number") from err

    def kernel_btf(self) -> Path | None:
        """The kernel's BTF (``kernel/btf/vmlinux``), when the kernel exposes it."""
        path = self.sys / "kernel" / "btf" / "vmlinux"
        return path if path.exists() else None
