"""Workloads with known numbers, for ``kvwatch doctor``, ``kvwatch demo`` and the tests.

Run as ``python -m kvwatch.daemon.lab.workloads <name> ...``. Each child waits for
a line on stdin before every phase, so the parent can move it into a cgroup and
start watching it first; it reports each phase done with one line on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from kvwatch.daemon.lab.workload_common import MIB, PAGE, say

__all__ = ["MIB", "PAGE"]  # the sizes the doctor, the demo and the tests take from here too

MADV_COLD = 20  # linux/mman.h; Python 3.11 has no constant for it

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_MAP_FAILED = ctypes.c_void_p(-1).value


class Workload:
    """A workload child speaking the one-line protocol: we send a phase, it answers when done."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvwatch.daemon.lab.workloads", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("workload pipes missing")
        self._in: IO[str] = self.proc.stdin
        self._out: IO[str] = self.proc.stdout

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> None:
        self._in.write(line + "\n")
        self._in.flush()

    def reply(self) -> str:
        """The next line the child says."""
        return self._out.readline().strip()

    def expect(self, word: str) -> str:
        line = self._out.readline().strip()
        if line != word:
            raise RuntimeError(f"workload {self.pid}: expected {word!r}, got {line!r}")
        return line

    def step(self, send: str, expect: str) -> None:
        self.send(send)
        self.expect(expect)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("quit")
            self._in.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache right now (mincore on a read-only mapping)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
    finally:
        os.close(fd)
    try:
        n = (size + PAGE - 1) // PAGE
        vec = (ctypes.c_ubyte * n)()
        if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore {path}")
        return sum(b & 1 for b in bytes(vec))
    finally:
        _libc.munmap(ctypes.c_void_p(addr), size)


def resident_total(paths: Iterable[Path]) -> int:
    return sum(resident_pages(p) for p in paths)


def make_files(directory: Path, count: int, size: int, prefix: str = "kv") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    block = (bytes(range(256)) * (MIB // 256))[:MIB]
    out = []
    for i in range(count):
        p = directory / f"{prefix}-{i:05d}.bin"
        with open(p, "wb") as f:
            left = size
            while left > 0:
                f.write(block[: min(left, MIB)])
                left -= MIB
            f.flush()
            os.fsync(f.fileno())
        out.append(p)
    return out


def read_files(paths: Iterable[Path]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(MIB):
                total += len(chunk)
    return total


def drop_file_cache(paths: Iterable[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def touch_and_release(pages: int) -> None:
    """mmap exactly ``pages`` private anonymous pages, touch each, munmap.

    Freshly faulted pages sit in a per-CPU LRU batch holding an extra reference
    (up to ~31 pages); munmap then does not free them, and whoever drains that
    batch later frees them in *its* context. To release exactly these pages
    here, the thread stays on one CPU and MADV_COLD (which drains this CPU's
    batch) runs before munmap. Page tables freed with the range add a few pages.
    """
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        m = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for i in range(pages):
            m[i * PAGE] = 1
        m.madvise(MADV_COLD)
        m.close()
    finally:
        os.sched_setaffinity(0, cpus)


def _wait(tag: str) -> bool:
    line = sys.stdin.readline()
    return bool(line) and line.strip() != "quit"


def workload_pattern(*commands: str, module: str = "workloads") -> str:
    """The command line of this project's own workload processes (``python -m
    kvwatch.daemon.lab.MODULE COMMAND``), as a discovery rule's regex: the tests, the benchmarks
    and the demo watch their workloads with it."""
    return rf"^\S*python\S*\s+-m\s+kvwatch\.daemon\.lab\.{module}\s+({'|'.join(commands)})\b"


def workload_rule(engine: str, *commands: str, module: str = "workloads") -> str:
    """The same rule as a TOML inline table, for a config file."""
    return f"{{ engine = \"{engine}\", cmdline = '{workload_pattern(*commands, module=module)}' }}"


def cmd_pages(args: argparse.Namespace) -> None:
    while _wait("go"):
        touch_and_release(args.pages)
        say("done")


def cmd_read(args: argparse.Namespace) -> None:
    while _wait("go"):
        read_files(Path(f) for f in args.files)
        say("read")


def cmd_engine(args: argparse.Namespace) -> None:
    """A pretend engine with a disk KV tier: warm the tier, then keep serving from it
    (reading its files round-robin) while its anonymous memory grows at ``rate_mb``/s
    up to ``squeeze_mb``. When the tier no longer fits beside that memory in the
    cgroup, every read brings back pages reclaim just evicted: the failure
    KVHostTierEvictionUnderPressure is about."""
    files = sorted(Path(args.kv_dir).glob("*.bin"))
    if not _wait("warm"):
        return
    read_files(files)
    say("warm")
    if not _wait("squeeze"):
        return
    held: list[bytearray] = []
    step = max(1, args.rate_mb // 10) * MIB
    start = time.monotonic()
    next_grow = start
    i = 0
    while time.monotonic() - start < args.seconds:
        now = time.monotonic()
        if now >= next_grow and len(held) * step < args.squeeze_mb * MIB:
            b = bytearray(step)
            for off in range(0, step, PAGE):
                b[off] = 1
            held.append(b)
            next_grow += 0.1
        if files:
            read_files([files[i % len(files)]])
            i += 1
        time.sleep(0.005)
    say("squeezed")
    _wait("exit")


def cmd_hog(args: argparse.Namespace) -> None:
    """Anonymous memory, kept: each "go" allocates and touches ``mb`` MiB more, then answers
    "held". In a memory cgroup at its limit (no swap), every page of it is page cache the
    kernel reclaimed from the cgroup in this process's context."""
    held = []
    while _wait("go"):
        b = bytearray(args.mb * MIB)
        for off in range(0, len(b), PAGE):
            b[off] = 1
        held.append(b)
        say("held")


def cmd_oom(args: argparse.Namespace) -> None:
    if not _wait("go"):
        return
    held = []
    while True:
        b = bytearray(8 * MIB)
        for i in range(0, len(b), PAGE):
            b[i] = 1
        held.append(b)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvwatch.daemon.lab.workloads")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("pages")
    s.add_argument("pages", type=int)
    s = sub.add_parser("engine")
    s.add_argument("--kv-dir", required=True)
    s.add_argument("--squeeze-mb", type=int, default=512)
    s.add_argument("--rate-mb", type=int, default=200)
    s.add_argument("--seconds", type=float, default=20.0)
    sub.add_parser("oom")
    s = sub.add_parser("hog")
    s.add_argument("--mb", type=int, required=True)
    s = sub.add_parser("read")
    s.add_argument("files", nargs="+")
    s = sub.add_parser("xferstub")
    s.add_argument("--lib-dir", required=True)
    s = sub.add_parser("ncclcalls")
    s.add_argument("--lib", required=True)
    s = sub.add_parser("cudacalls")
    s.add_argument("--lib", required=True)
    s = sub.add_parser("cuda")
    s.add_argument("--lib-dir", required=True)
    s.add_argument("--prealloc", type=int, default=4)
    args = p.parse_args(argv)
    if args.cmd in ("cuda", "cudacalls"):
        from kvwatch.daemon.lab import workloads_cuda as mod  # noqa: PLC0415 - only these need CUDA stubs

        {"cuda": mod.cmd_cuda, "cudacalls": mod.cmd_cudacalls}[args.cmd](args)
    elif args.cmd in ("xferstub", "ncclcalls"):
        from kvwatch.daemon.lab import workloads_xfer as xfer  # noqa: PLC0415

        {"xferstub": xfer.cmd_xferstub, "ncclcalls": xfer.cmd_ncclcalls}[args.cmd](args)
    else:
        {"pages": cmd_pages, "engine": cmd_engine, "oom": cmd_oom, "hog": cmd_hog, "read": cmd_read}[args.cmd](args)


if __name__ == "__main__":
    main()
