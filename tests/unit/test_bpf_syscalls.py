"""``probes/bpf_syscalls.py``: the ``union bpf_attr`` a uprobe_multi link is created with, byte by byte
as ``include/uapi/linux/bpf.h`` lays out ``link_create`` (the syscall itself: tests/privileged)."""

from __future__ import annotations

import struct

from kvwatch.probes.bpf_syscalls import ATTR_SIZE, BPF_F_UPROBE_MULTI_RETURN, BPF_TRACE_UPROBE_MULTI, uprobe_multi_attr


def test_entry_link_attr() -> None:
    attr = uprobe_multi_attr(7, 0x1000, 0x2000, 4242, retprobe=False)
    assert len(attr) == ATTR_SIZE
    prog_fd, target_fd, attach_type, flags = struct.unpack_from("=IIII", attr, 0)
    assert (prog_fd, target_fd, attach_type, flags) == (7, 0, BPF_TRACE_UPROBE_MULTI, 0)
    path, offsets, ref_ctr_offsets, cookies = struct.unpack_from("=QQQQ", attr, 16)
    assert (path, offsets, ref_ctr_offsets, cookies) == (0x1000, 0x2000, 0, 0)
    assert struct.unpack_from("=III", attr, 48) == (1, 0, 4242)  # cnt, flags, pid
    assert attr[60:] == bytes(ATTR_SIZE - 60)  # the kernel refuses a non-zero tail


def test_return_link_attr() -> None:
    attr = uprobe_multi_attr(7, 0x1000, 0x2000, 4242, retprobe=True)
    assert struct.unpack_from("=III", attr, 48) == (1, BPF_F_UPROBE_MULTI_RETURN, 4242)
