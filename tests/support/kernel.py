"""Ground truths from the kernel and workload children for the real-kernel tests: the workload
child with a timeout on each answer, ftrace's own count of the pages a task frees, and the rule
by which kvwatch's counts close against it."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from kvwatch.daemon.lab.workloads import Workload, resident_total
from kvwatch.probes.tracefs import tracefs_root

T = TypeVar("T")


class Child(Workload):
    """The shared workload child, with a timeout on each answer so a stuck child fails the test."""

    def expect(self, word: str, timeout: float = 60.0) -> str:
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            return super().expect(word)
        finally:
            timer.cancel()

    def step(self, send: str, expect: str, timeout: float = 60.0) -> None:
        self.send(send)
        self.expect(expect, timeout)


# Pages a page-free workload of N pages may release above N in its own context: its page
# tables (~5) and other tasks' pages from the per-CPU LRU batches it drains (31 folios each).
FOREIGN_PAGE_SLACK = 4 * 31 + 16


class PageFreeTruth:
    """Ground truth independent of kvwatch: the kernel's own ftrace of ``kmem:mm_page_free`` for one task.

    A private tracefs instance (its own ring buffer, ``set_event_pid`` filter)
    records every page-free event that fires in the task's context. That is what
    kvwatch claims to count, including pages the kernel frees on someone else's
    behalf while the task runs (a per-CPU LRU batch it drains holds other tasks'
    pages too), so kvwatch's count must equal this one exactly, not approximately.
    The task must be single-threaded (the filter is by thread id, kvwatch by TGID).
    """

    def __init__(self, pid: int, buffer_kb: int = 8192) -> None:
        root = tracefs_root()
        assert root is not None, "tracefs is not mounted"
        self.dir = root / "instances" / f"kvwatch-truth-{pid}-{time.monotonic_ns()}"
        self.pid = pid
        self.buffer_kb = buffer_kb

    def __enter__(self) -> PageFreeTruth:
        self.dir.mkdir()
        (self.dir / "buffer_size_kb").write_text(str(self.buffer_kb))
        (self.dir / "set_event_pid").write_text(str(self.pid))
        (self.dir / "events/kmem/mm_page_free/enable").write_text("1")
        (self.dir / "tracing_on").write_text("1")
        return self

    def clear(self) -> None:
        (self.dir / "trace").write_text("")

    def pages(self) -> int:
        """Pages freed in the task's context since the start (or the last clear)."""
        lost = 0
        for stats in (self.dir / "per_cpu").glob("cpu*/stats"):
            fields = dict(line.split(":", 1) for line in stats.read_text().splitlines() if ":" in line)
            lost += int(fields.get("overrun", "0")) + int(fields.get("dropped events", "0"))
        assert lost == 0, f"ftrace lost {lost} events: the ground truth is incomplete"
        return sum(1 << int(m) for m in re.findall(r"mm_page_free: .* order=(\d+)", (self.dir / "trace").read_text()))

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            (self.dir / "tracing_on").write_text("0")
            (self.dir / "events/kmem/mm_page_free/enable").write_text("0")
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def assert_closes(got: float, expected: float, skipped: float, what: str = "kvwatch against ftrace") -> None:
    """kvwatch's count against ftrace's, exact unless the kernel skipped probe runs in the window.

    A tracing BPF program does not nest on one CPU: a page freed in an interrupt that
    arrived while the page-free program ran is skipped by the kernel (counted in the
    program's ``recursion_misses``, which kvwatch exports as lost), while ftrace records
    it. ``skipped`` is that node-wide count over the window, an upper bound on what this
    task lost. No skips: exact. Skips: never more than ftrace, never less by more than them."""
    if skipped == 0:
        assert got == expected, f"{what}: {got} vs {expected} (difference {got - expected:+}), no skipped runs"
    else:
        assert expected - skipped <= got <= expected, f"{what}: {got} vs {expected} with {skipped} skipped runs"


def uprobe_files(pid: int) -> list[str]:
    """The file of each uprobe that process ``pid`` holds through a perf event, as the kernel
    reports it (``bpftool perf show``: bcc attaches uprobes through perf events, not tracefs)."""
    out = subprocess.run(["bpftool", "-j", "perf", "show"], capture_output=True, text=True, check=True).stdout
    files = [e["filename"] for e in json.loads(out or "[]") if e.get("pid") == pid and e.get("fd_type") == "uprobe"]
    return files + uprobe_multi_files(pid)


def uprobe_multi_files(pid: int) -> list[str]:
    """The file of each uprobe_multi link process ``pid`` holds (its fdinfo's ``path``)."""
    out = []
    for fd in Path(f"/proc/{pid}/fdinfo").glob("*"):
        with contextlib.suppress(OSError):
            info = fd.read_text()
            if "link_type:\tuprobe_multi" in info or "link_type: uprobe_multi" in info:
                out += [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("path:")]
    return out


def wait_uprobes(tracer_pid: int, *libraries: str, timeout: float = 60.0) -> int:
    """Until process ``tracer_pid`` (kvwatch, through bcc) holds uprobes on a library whose path
    contains each of ``libraries``, and their number has held over three reads half a second
    apart (an attach registers its symbols one by one); returns that number. For a kvwatch that
    serves nothing to ask (``kvwatch record``): the kernel's own list shows it."""
    deadline = time.monotonic() + timeout
    counts: list[int] = []
    while time.monotonic() < deadline:
        files = uprobe_files(tracer_pid)
        if all(any(lib in f for f in files) for lib in libraries):
            counts.append(len(files))
            if len(counts) >= 3 and counts[-1] == counts[-2] == counts[-3]:
                return counts[-1]
        time.sleep(0.5)
    raise AssertionError(
        f"uprobes of {tracer_pid} on {libraries} not settled after {timeout}s: {uprobe_files(tracer_pid)[:5]}"
    )


def resident_at_rest(files: Iterable[Path], count: Callable[[], T], attempts: int = 100) -> tuple[T, int]:
    """``mincore``'s pages of ``files`` with kvwatch's ``count`` of their evictions, taken while no
    eviction happened: the count read before and after the residency agree. The kernel may evict
    at any moment (DAMON's proactive reclaim, kswapd), so a residency and a count read one after
    the other close only when nothing moved between them."""
    paths = list(files)
    for _ in range(attempts):
        before = count()
        resident = resident_total(paths)
        if count() == before:
            return before, resident
    raise AssertionError(f"the tier's pages kept leaving over {attempts} reads")
