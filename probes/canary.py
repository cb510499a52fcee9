"""What kvwatch's probes cost the processes they watch, measured on this node.

* ``UprobeCanary``: a probed call's cost to its caller. An entry and a return probe are put
  on libc's ``basename`` in kvwatch's own process and a loop of calls through ctypes is timed
  without and with them (best of a few rounds each, alternated); the difference per call is
  the two traps and a minimal program, the part of a probed call's cost that the kernel's
  BPF statistics do not include. The program counts its runs: every call must be trapped.
* ``BpfStats``: the kernel's per-program run time and run count (``kernel.bpf_stats_enabled``),
  turned on through ``BPF_ENABLE_STATS`` only when the configuration allows it. The kernel
  keeps them on while kvwatch holds the descriptor and turns them off when it is closed (or
  kvwatch dies): the operator's own setting is never written.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvwatch.probes.bpf import PROBES_DIR, Program, percpu_array_sums
from kvwatch.probes.bpf_syscalls import enable_bpf_stats
from kvwatch.probes.libs import SymbolCache, read_maps

CANARY_SOURCE = PROBES_DIR / "canary.bpf.c"
# A cheap libc function whose first instruction past endbr64 is a push, which uprobes emulate,
# like the entry of the allocator and copy functions kvwatch probes; a function starting with
# an instruction the kernel single-steps out of line (labs: mov) costs ~10x more per trap here.
SYMBOL = "basename"
ARG = b"kvwatch"
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


@dataclass(frozen=True, slots=True)
class CanaryResult:
    call_ns: float  # what one probed call (entry + return) cost the caller, beyond the call itself
    plain_ns: float  # one unprobed call through ctypes, for scale
    calls: int  # probed calls made
    entries: int  # the program's counts of them
    returns: int
    bpf_runs: int = 0  # runs of the two programs by the kernel's BPF statistics (0 while they are off)
    bpf_ns: float = 0.0  # their summed run time

    @property
    def exact(self) -> bool:
        return self.entries == self.returns == self.calls


class UprobeCanary:
    def __init__(self, calls: int = 20000, rounds: int = 3) -> None:
        self.n, self.rounds = calls, rounds

    def _libc(self) -> tuple[str, int]:
        for lib in read_maps(os.getpid()):
            if lib.name.startswith("libc.so"):
                addr = SymbolCache().get(lib.path).probe_address(SYMBOL)
                if addr is not None:
                    return lib.path, addr
        raise OSError(f"no libc with {SYMBOL} mapped in kvwatch's own process")

    def _loop(self, fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
        """The thread's CPU time (user and system: the traps are charged to it), not the wall
        clock: time spent preempted by other work on a busy node is no cost of the probes."""
        t = time.thread_time_ns()
        for _ in range(self.n):
            fn(ARG)
        return time.thread_time_ns() - t

    def measure(self) -> CanaryResult:
        """Raises ``ProbeError`` (compile, attach) or OSError."""
        path, addr = self._libc()
        fn = getattr(ctypes.CDLL(path), SYMBOL)
        fn.argtypes, fn.restype = (ctypes.c_char_p,), ctypes.c_void_p
        prog = Program(CANARY_SOURCE, ["-DKVW_NR_HITS=2", "-DKVW_NR_LOST=1"])
        try:
            plain, probed = [], []
            events: list[str] = []
            for _ in range(self.rounds):
                plain.append(self._loop(fn))
                events = [
                    prog.attach_uprobe("canary", path, f"kvw_canary_{p}", pid=os.getpid(), addr=addr, retprobe=r)
                    for p, r in (("return", True), ("enter", False))  # the return first, as kvwatch attaches
                ]
                probed.append(self._loop(fn))
                for ev in events:
                    prog.detach_uprobe_event(ev)
                prog.wait_releases(10.0)
            hits = percpu_array_sums(prog.table("hits"), ["entries", "returns"])
            runs = prog.run_stats()
        finally:
            prog.close()
        return CanaryResult(
            call_ns=max(min(probed) - min(plain), 0) / self.n,
            plain_ns=min(plain) / self.n,
            calls=self.n * self.rounds,
            entries=hits["entries"],
            returns=hits["returns"],
            bpf_runs=sum(cnt for _ns, cnt in runs.values()),
            bpf_ns=float(sum(ns for ns, _cnt in runs.values())),
        )


class BpfStats:
    """The kernel's BPF run-time statistics, on while this object holds them."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.error = ""

    @staticmethod
    def sysctl() -> bool:
        """The operator's own setting."""
        try:
            return STATS_SYSCTL.read_text().strip() == "1"
        except OSError:
            return False

    def enable(self) -> bool:
        if self._fd is None:
            try:
                self._fd = enable_bpf_stats()
            except OSError as err:
                self.error = str(err)
        return self.active

    @property
    def active(self) -> bool:
        return self._fd is not None or self.sysctl()

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
