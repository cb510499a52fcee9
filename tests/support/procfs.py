"""Build fixture /proc trees for discovery and procfs tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FakeProc:
    pid: int
    comm: str
    cmdline: list[str] | bytes
    ppid: int = 1
    start: int = 1000
    cgroup: str = "0::/system.slice/foo.service\n"
    environ: dict[str, str] = field(default_factory=dict)
    tgid: int | None = None


def stat_line(p: FakeProc) -> str:
    # fields after comm: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice num_threads itrealvalue starttime ...
    rest = ["S", str(p.ppid)] + ["0"] * 17 + [str(p.start)] + ["0"] * 30
    return f"{p.pid} ({p.comm}) " + " ".join(rest) + "\n"


def write_proc(root: Path, p: FakeProc) -> Path:
    d = root / str(p.pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(p))
    raw = p.cmdline if isinstance(p.cmdline, bytes) else b"\0".join(a.encode() for a in p.cmdline) + b"\0"
    (d / "cmdline").write_bytes(raw)
    (d / "cgroup").write_text(p.cgroup)
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in p.environ.items()))
    (d / "status").write_text(f"Name:\t{p.comm}\nTgid:\t{p.tgid or p.pid}\nPid:\t{p.pid}\n")
    return d


def make_proc(root: Path, procs: list[FakeProc]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu 0 0 0 0\nbtime 1700000000\n")
    for p in procs:
        write_proc(root, p)
    return root
