"""How long the kernel takes to release uprobes, by how they were attached (root, real kernel).

    sudo .venv/bin/python bench/bench_uprobe_release.py --probes 40

kvwatch's daemon stop is mostly this wait: every uprobe it attached (a perf event per probe, as
bcc attaches them) must be released before its probes are proven gone. The kernel destroys a
perf-event uprobe under the global ``event_mutex`` and waits there for an RCU Tasks Trace grace
period (``uprobe_unregister_sync``), so releases run one after another however many threads close
them. A ``BPF_TRACE_UPROBE_MULTI`` link (kernel 6.6+) is released without that mutex, so links
closed side by side share grace periods. Measured here on ``--probes`` libc functions of a
sleeping process: perf-event uprobes closed one by one and side by side, then single-offset
uprobe_multi links closed one by one and side by side; then kvwatch's own ``Program``
(probes/bpf.py, what the daemon's uprobe families use) with ``--probes`` probes attached (entry
and return pairs) and released by its ``close``, in each of its attach modes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvwatch.probes.bpf import Program, require_bcc
from kvwatch.probes.bpf_syscalls import BPF_TRACE_UPROBE_MULTI, link_uprobe_multi
from kvwatch.probes.canary import CANARY_SOURCE
from kvwatch.probes.libs import SymbolCache, read_maps

BPF_PROG_TYPE_KPROBE = 2
SYMBOLS = [
    "malloc",
    "free",
    "calloc",
    "realloc",
    "memcpy",
    "memset",
    "strlen",
    "strcmp",
    "open",
    "close",
    "read",
    "write",
    "fopen",
    "fclose",
    "puts",
    "printf",
    "getenv",
    "setenv",
    "qsort",
    "time",
    "strchr",
    "strrchr",
    "strncmp",
    "strdup",
    "fputs",
    "fwrite",
    "fread",
    "fflush",
    "fseek",
    "ftell",
    "memmove",
    "memcmp",
    "atoi",
    "strtol",
    "strtoul",
    "snprintf",
    "sprintf",
    "vsnprintf",
    "abort",
    "exit",
]


def timed_close(fds: list[int], close: Callable[[int], object], parallel: bool) -> float:
    t0 = time.monotonic()
    if parallel:
        threads = [threading.Thread(target=close, args=(fd,)) for fd in fds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for fd in fds:
            close(fd)
    return time.monotonic() - t0


def program_release(pid: int, symbols: list[str], links: bool) -> str:
    """kvwatch's Program: a return and an entry probe (as the daemon attaches them) on the first
    ``len(symbols) // 2`` of ``symbols`` in ``pid``'s libc, all released by ``close``."""
    libc = next(lib for lib in read_maps(pid) if lib.name.startswith("libc.so"))
    table = SymbolCache().get(libc.path)
    addrs = [a for a in (table.probe_address(s) for s in symbols) if a is not None]
    prog = Program(CANARY_SOURCE, ["-DKVW_NR_HITS=2", "-DKVW_NR_LOST=1"], uprobe_multi=links)
    for addr in addrs[: len(symbols) // 2]:
        for fn, ret in (("kvw_canary_return", True), ("kvw_canary_enter", False)):
            prog.attach_uprobe("bench", libc.path, fn, pid=pid, addr=addr, retprobe=ret)
    opened = prog.open_uprobes
    t0 = time.monotonic()
    prog.close()
    return f"kvwatch Program ({prog.uprobe_mode}), released by close: {opened} in {time.monotonic() - t0:.3f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=40, help=f"at most {len(SYMBOLS)}")
    args = ap.parse_args()
    bcc = require_bcc()
    target = subprocess.Popen(["sleep", "600"])
    try:
        symbols = [s.encode() for s in SYMBOLS[: args.probes]]
        where = [bcc.BPF._check_path_symbol(b"c", s, 0, target.pid) for s in symbols]
        for parallel in (False, True):
            b = bcc.BPF(text=b"int f(void *ctx) { return 0; }")
            for s in symbols:
                b.attach_uprobe(name=b"c", sym=s, fn_name=b"f", pid=target.pid)
            fds = list(b.uprobe_fds.items())
            for ev, _ in fds:
                b._del_uprobe_fd(ev)
            took = timed_close([fd for _, fd in fds], bcc.lib.bpf_close_perf_event_fd, parallel)
            for ev, _ in fds:
                bcc.lib.bpf_detach_uprobe(ev)
            print(f"perf-event uprobes, {'side by side' if parallel else 'one by one'}: {len(fds)} in {took:.3f} s")
            b.cleanup()
        for parallel in (False, True):
            b = bcc.BPF(text=b"int f(void *ctx) { return 0; }")
            fn = b.load_func(b"f", BPF_PROG_TYPE_KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
            try:
                links = [link_uprobe_multi(fn.fd, path, off, target.pid, retprobe=False) for path, off in where]
            except OSError as err:
                print(f"uprobe_multi links: not available here ({err})")
                break
            took = timed_close(links, os.close, parallel)
            print(f"uprobe_multi links, {'side by side' if parallel else 'one by one'}: {len(links)} in {took:.3f} s")
            b.cleanup()
        for links in (False, True):
            print(program_release(target.pid, SYMBOLS[: args.probes], links))
    finally:
        target.kill()
        target.wait()


if __name__ == "__main__":
    main()
