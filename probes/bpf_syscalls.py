"""The BPF syscalls kvwatch makes itself, beside bcc: uprobe_multi links and BPF statistics.

kvwatch attaches each uprobe as a uprobe_multi link (``BPF_LINK_CREATE`` with
``BPF_TRACE_UPROBE_MULTI``, kernel 6.6+) with one offset rather than as a perf event: the
kernel destroys a perf-event uprobe under its global ``event_mutex`` and waits an RCU Tasks
Trace grace period there, so releases run one after another (~0.1 s each on kernel 6.18,
bench/results/uprobe_release.md), while links released side by side share their grace
periods. The program must be loaded with expected attach type ``BPF_TRACE_UPROBE_MULTI``.
Plain ctypes: ``probes/bpf.py`` loads the program with bcc and resolves the file offset.
"""

from __future__ import annotations

import ctypes
import os
import struct

SYS_BPF = 321  # x86_64
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type
BPF_F_UPROBE_MULTI_RETURN = 1
ATTR_SIZE = 128  # bytes of union bpf_attr passed; the kernel wants the unused tail zero
# What a kernel without uprobe_multi links answers: EINVAL (the attach type unknown to
# BPF_LINK_CREATE, or to the program load) or EOPNOTSUPP (built without them).
REFUSED = frozenset({22, 95})
_LIBC = ctypes.CDLL(None, use_errno=True)


def uprobe_multi_attr(prog_fd: int, path: int, offsets: int, pid: int, *, retprobe: bool) -> bytes:
    """``union bpf_attr`` for BPF_LINK_CREATE of one uprobe_multi link: link_create's prog_fd,
    target_fd, attach_type and flags, then its uprobe_multi member: the addresses of the path
    string and of the offsets array, no ref_ctr_offsets or cookies, cnt 1, flags, pid."""
    head = struct.pack("=IIII", prog_fd, 0, BPF_TRACE_UPROBE_MULTI, 0)
    flags = BPF_F_UPROBE_MULTI_RETURN if retprobe else 0
    body = struct.pack("=QQQQIII", path, offsets, 0, 0, 1, flags, pid)
    return (head + body).ljust(ATTR_SIZE, b"\0")


def link_uprobe_multi(prog_fd: int, path: bytes, offset: int, pid: int, *, retprobe: bool) -> int:
    """A link running program ``prog_fd`` at file offset ``offset`` of ``path`` (entry, or return
    with ``retprobe``), in the threads of process ``pid`` only; its descriptor, closed to detach.
    Raises OSError with the kernel's errno."""
    cpath = ctypes.create_string_buffer(path)
    offs = (ctypes.c_uint64 * 1)(offset)
    attr = ctypes.create_string_buffer(
        uprobe_multi_attr(prog_fd, ctypes.addressof(cpath), ctypes.addressof(offs), pid, retprobe=retprobe),
        ATTR_SIZE,
    )
    fd = int(_LIBC.syscall(SYS_BPF, BPF_LINK_CREATE, attr, ATTR_SIZE))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_LINK_CREATE uprobe_multi: {os.strerror(err)}")
    return fd


_BPF_ENABLE_STATS = 32
_BPF_STATS_RUN_TIME = 0


def enable_bpf_stats() -> int:
    """Turn the kernel's BPF run-time statistics on for as long as the returned descriptor is
    open (``BPF_ENABLE_STATS``: the kernel counts holders and turns them off when the last one
    closes, crash included, so nothing is left to restore). Raises OSError when refused."""
    attr = (ctypes.c_uint32 * 32)(_BPF_STATS_RUN_TIME)  # union bpf_attr: enable_stats.type first
    fd = int(_LIBC.syscall(SYS_BPF, _BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"BPF_ENABLE_STATS: {os.strerror(err)}")
    return fd
