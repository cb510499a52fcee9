"""How long the kernel takes to release uprobes, by how they were attached (root, real kernel).

    sudo .venv/bin/python bench/bench_uprobe_release.py --probes 40

kvwatch's daemon stop is mostly this wait: every uprobe it attached (a perf event per probe, as
bcc attaches them) must be released before its probes are proven gone. The kernel destroys a
perf-event uprobe under the global ``event_mutex`` and waits there for an RCU Tasks Trace grace
period (``uprobe_unregister_sync``), so releases run one after another however many threads close
them. A ``BPF_TRACE_UPROBE_MULTI`` link (kernel 6.6+) is released without that mutex, so links
closed side by side share grace periods. Measured here on ``--probes`` libc functions of a
sleeping process: perf-event uprobes closed one by one and side by side, then single-offset
uprobe_multi links closed one by one and side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvwatch.probes.bpf import require_bcc

BPF_PROG_TYPE_KPROBE = 2
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type
SYS_BPF = 321  # x86_64
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


def link_uprobe_multi(fn_fd: int, path: bytes, offset: int, pid: int) -> int:
    """One single-offset entry uprobe_multi link of program ``fn_fd`` (union bpf_attr, link_create:
    prog_fd, target_fd, attach_type, flags, then uprobe_multi's path, offsets, ref_ctr_offsets,
    cookies, cnt, flags, pid)."""
    libc = ctypes.CDLL(None, use_errno=True)
    offs = (ctypes.c_uint64 * 1)(offset)
    cpath = ctypes.create_string_buffer(path)
    attr = (ctypes.c_uint8 * 128)()
    base = ctypes.addressof(attr)
    ctypes.memmove(base, (ctypes.c_uint32 * 4)(fn_fd, 0, BPF_TRACE_UPROBE_MULTI, 0), 16)
    ctypes.memmove(base + 16, (ctypes.c_uint64 * 4)(ctypes.addressof(cpath), ctypes.addressof(offs), 0, 0), 32)
    ctypes.memmove(base + 48, (ctypes.c_uint32 * 3)(1, 0, pid), 12)
    fd = int(libc.syscall(SYS_BPF, BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr)))
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"BPF_LINK_CREATE uprobe_multi: {os.strerror(ctypes.get_errno())}")
    return fd


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
                links = [link_uprobe_multi(fn.fd, path, off, target.pid) for path, off in where]
            except OSError as err:
                print(f"uprobe_multi links: not available here ({err})")
                break
            took = timed_close(links, os.close, parallel)
            print(f"uprobe_multi links, {'side by side' if parallel else 'one by one'}: {len(links)} in {took:.3f} s")
            b.cleanup()
    finally:
        target.kill()
        target.wait()


if __name__ == "__main__":
    main()
