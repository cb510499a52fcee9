"""Process tracking (fork, exit, PID reuse, caps) and KV-tier inode sets, with fake kernels."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.daemon.config import DiscoveryConfig, KVTierDir, KVTiersConfig
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.discovery import Discovery, Labels
from kvwatch.daemon.engines.kinds.lmcache import lmcache_dirs
from kvwatch.daemon.engines.kinds.sglang import hicache_dirs
from kvwatch.daemon.families.kv_files import KVTierRegistry, specs_from_process
from kvwatch.daemon.families.oom import oom_event
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.tracker import EXIT_GRACE_SECONDS, RECENT_SECONDS, ProcessTracker
from kvwatch.probes.memory import decode_event
from kvwatch.probes.records import OomKill, ProcessExec, ProcessForked
from tests.support.procfs import FakeProc, make_proc, write_proc


class FakeKernel:
    def __init__(self, capacity: int = 100) -> None:
        self.map: dict[int, int] = {}
        self.capacity = capacity
        self.unwatched: list[int] = []

    def watch(self, tgid: int, root_tgid: int | None = None) -> bool:
        if len(self.map) >= self.capacity and tgid not in self.map:
            return False
        self.map[tgid] = root_tgid or tgid
        return True

    def unwatch(self, tgid: int) -> None:
        self.unwatched.append(tgid)
        self.map.pop(tgid, None)

    def watched(self) -> dict[int, int]:
        return dict(self.map)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def setup(tmp_path: Path, procs: list[FakeProc], **cfg: object) -> tuple[ProcessTracker, FakeKernel, Clock, Path]:
    root = make_proc(tmp_path / "proc", procs)
    fs = ProcFS(tmp_path)
    config = parse(DiscoveryConfig, {"proc_root": root, **cfg})
    kernel, clock = FakeKernel(), Clock()
    tr = ProcessTracker(Discovery(config, fs), fs, kernel, clock=clock, max_processes=config.max_processes)
    return tr, kernel, clock, root


ENGINE = FakeProc(10, "VLLM::EngineCor", ["VLLM::EngineCore"], start=500)


def test_scan_watches_in_kernel_and_children_follow(tmp_path: Path) -> None:
    tr, kernel, clock, root = setup(tmp_path, [ENGINE])
    tr.rescan()
    assert kernel.map == {10: 10}
    write_proc(root, FakeProc(11, "python3", ["python3", "-c", "compile worker"], ppid=10, start=600))
    kernel.map[11] = 10  # the kernel added the child at fork
    tr.on_fork(10, 11)
    child = tr.get(11)
    assert child is not None and child.proc.source == "child"
    assert child.proc.labels.engine == "vllm"
    assert child.proc.parent is not None and child.proc.parent.pid == 10
    # a fork by an unwatched parent is undone
    kernel.map[99] = 98
    tr.on_fork(98, 99)
    assert 99 not in kernel.map


def test_exit_grace_then_removed(tmp_path: Path) -> None:
    tr, kernel, clock, root = setup(tmp_path, [ENGINE])
    tr.rescan()
    tr.on_exit(10)
    tr.expire()
    assert tr.get(10) is not None  # still counting the memory it frees on the way out
    clock.t += EXIT_GRACE_SECONDS
    tr.expire()
    assert tr.get(10) is None and 10 not in kernel.map
    assert [t.pid for t in tr.take_removed()] == [10]


def test_oom_record_after_the_exit_was_handled_still_counts(tmp_path: Path) -> None:
    """procfs can show the victim gone (and the grace run out) before its OOM record is read."""
    tr, kernel, clock, root = setup(tmp_path, [ENGINE])
    tr.rescan()
    tr.on_exit(10)
    clock.t += EXIT_GRACE_SECONDS
    tr.expire()
    assert tr.get(10) is None
    kill = OomKill(10, "python3", True, 0, 4096, 0, 0, 0, 1)
    ev = oom_event(kill, tr, tr.procfs, include_siblings=False, now=clock.t)
    assert ev is not None and ev.subject.labels["pid"] == "10" and ev.subject.labels["engine"]
    clock.t += RECENT_SECONDS + 1
    assert oom_event(kill, tr, tr.procfs, include_siblings=False, now=clock.t) is None
    assert oom_event(OomKill(11, "x", True, 0, 0, 0, 0, 0, 2), tr, tr.procfs, include_siblings=False, now=0) is None


def test_pid_reuse_is_a_new_identity(tmp_path: Path) -> None:
    tr, kernel, clock, root = setup(tmp_path, [ENGINE])
    tr.rescan()
    first = tr.get(10)
    write_proc(root, FakeProc(10, "VLLM::EngineCor", ["VLLM::EngineCore"], start=999))  # died, PID recycled
    tr.rescan()
    second = tr.get(10)
    assert second is not None and first is not None
    assert second.proc.identity.start_ticks == 999 and second is not first
    assert kernel.unwatched.count(10) >= 1  # old counters cleared before the new process was watched
    assert first in tr.take_removed()


def test_vanished_process_marked_exited(tmp_path: Path) -> None:
    tr, kernel, clock, root = setup(tmp_path, [ENGINE])
    tr.rescan()
    for f in (root / "10").iterdir():
        f.unlink()
    (root / "10").rmdir()
    tr.rescan()
    t = tr.get(10)
    assert t is not None and t.exited_at == clock.t


def test_label_cap_counts_overflow(tmp_path: Path) -> None:
    procs = [FakeProc(20 + i, "VLLM::Worker", ["VLLM::Worker"], start=i) for i in range(5)]
    tr, kernel, clock, root = setup(tmp_path, procs, max_processes=3)
    tr.rescan()
    assert len(tr.tracked()) == 3 and tr.stats.label_overflow == 2


def test_orphans_adopted_after_lost_fork_events(tmp_path: Path) -> None:
    tr, kernel, clock, root = setup(tmp_path, [ENGINE, FakeProc(12, "python3", ["python3"], ppid=10, start=700)])
    tr.rescan()
    kernel.map[12] = 10  # forked while the ring buffer was full: no event reached us
    kernel.map[13] = 10  # and one that is already gone
    tr.rescan()
    assert tr.get(12) is not None and tr.stats.orphans_adopted == 1
    assert 13 not in kernel.map


def test_exec_hints_are_bounded(tmp_path: Path) -> None:
    tr, kernel, clock, root = setup(tmp_path, [ENGINE], exec_hints_per_tick=2)
    tr.hints_per_tick = 2
    for pid in range(1000, 1100):
        tr.hint(pid)
    tr.process_hints()
    assert tr.stats.hints_dropped >= 90


def test_rename_updates_component(tmp_path: Path) -> None:
    p = FakeProc(30, "python3", ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"], start=5)
    tr, kernel, clock, root = setup(tmp_path, [p])
    tr.rescan()
    assert tr.get(30).proc.labels.component == "api_server"  # type: ignore[union-attr]
    write_proc(root, FakeProc(30, "VLLM::EngineCor", ["VLLM::EngineCore"], start=5))
    tr.hint(30)
    tr.process_hints()
    assert tr.get(30).proc.labels == Labels(engine="vllm", component="engine_core")  # type: ignore[union-attr]


# --- KV tiers ----------------------------------------------------------------------------------


class FakeInodes:
    def __init__(self, capacity: int = 10_000) -> None:
        self.inodes: dict[tuple[int, int], int] = {}
        self.capacity = capacity

    def set_kv_inode(self, dev: int, ino: int, tier_id: int) -> bool:
        if len(self.inodes) >= self.capacity:
            return False
        self.inodes[(dev, ino)] = tier_id
        return True

    def remove_kv_inode(self, dev: int, ino: int) -> None:
        self.inodes.pop((dev, ino), None)

    def learn_device(self, directory: Path) -> int | None:
        return None


def test_tier_inodes_follow_files(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "a.bin").write_bytes(b"x")
    sink, clock = FakeInodes(), Clock()
    config = KVTiersConfig(dirs=[KVTierDir(path=kv)], rescan_seconds=3600)
    reg = KVTierRegistry(config, sink, procfs=ProcFS(tmp_path), clock=clock)
    reg.sync([])
    reg.refresh()
    assert len(sink.inodes) == 1
    (kv / "sub").mkdir()
    (kv / "b.bin").write_bytes(b"y")
    reg.refresh()  # inotify: no rescan needed
    assert len(sink.inodes) == 2
    (kv / "sub" / "c.bin").write_bytes(b"z")
    reg.refresh()  # a new subdirectory forces a rescan, which adds the file created before its watch
    reg.refresh()
    assert len(sink.inodes) == 3
    ino_a = (kv / "a.bin").stat().st_ino
    (kv / "a.bin").unlink()
    reg.refresh()
    assert any(i == ino_a for _, i in sink.inodes)  # kept during the grace period: its pages leave after the unlink
    clock.t += 10
    reg.refresh()
    assert not any(i == ino_a for _, i in sink.inodes)
    reg.close()


def test_tier_map_full_is_counted(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    kv.mkdir()
    for i in range(5):
        (kv / f"{i}.bin").write_bytes(b"x")
    sink = FakeInodes(capacity=3)
    config = KVTiersConfig(dirs=[KVTierDir(path=kv)])
    reg = KVTierRegistry(config, sink, procfs=ProcFS(tmp_path), clock=Clock())
    reg.sync([])
    assert len(sink.inodes) == 3 and reg.stats.map_full == 2
    reg.close()


def test_engine_environment_dirs(tmp_path: Path) -> None:
    assert lmcache_dirs({"LMCACHE_LOCAL_DISK": "file:///mnt/kv/"}, "", lambda p: None) == ["/mnt/kv"]
    both = {"LMCACHE_LOCAL_DISK": "file:///mnt/a/, /mnt/b,file:///mnt/a"}
    assert lmcache_dirs(both, "", lambda p: None) == ["/mnt/a", "/mnt/b"]
    assert lmcache_dirs({"LMCACHE_CONFIG_FILE": "/l.yaml"}, "", lambda p: "local_disk: null\n") == []
    two = "local_disk: 'file:///nvme0/kv/,file:///nvme1/kv/'   # two disks\nmax_local_disk_size: 5\n"
    assert lmcache_dirs({"LMCACHE_CONFIG_FILE": "/l.yaml"}, "", lambda p: two) == ["/nvme0/kv", "/nvme1/kv"]
    assert lmcache_dirs({"LMCACHE_LOCAL_DISK": "None"}, "", lambda p: None) == []
    yaml = 'chunk_size: 256\nlocal_disk: "file:///data/lmcache"  # disk tier\nmax_local_disk_size: 20\n'
    assert lmcache_dirs({"LMCACHE_CONFIG_FILE": "/etc/l.yaml"}, "", lambda p: yaml) == ["/data/lmcache"]
    assert hicache_dirs({}, "python -m sglang.launch_server --hicache-storage-backend file", lambda p: None) == [
        "/tmp/hicache"
    ]
    assert hicache_dirs({"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/nvme/h"}, "", lambda p: None) == ["/nvme/h"]
    assert hicache_dirs({}, "--hicache-storage-backend mooncake", lambda p: None) == []

    root = make_proc(
        tmp_path / "proc",
        [
            FakeProc(
                40,
                "python",
                ["python", "-m", "sglang.launch_server"],
                environ={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/nvme/h"},
            )
        ],
    )
    fs = ProcFS(tmp_path)
    d = Discovery(DiscoveryConfig(proc_root=root), fs).scan()[0]
    (spec,) = specs_from_process(d, fs)
    assert spec.path == root / "40" / "root" / "nvme" / "h"  # seen through the process's own root
    assert spec.source == "hicache" and spec.owner == d.identity


# --- ring-buffer decoding --------------------------------------------------------------------------


def raw_event(type_: int, pid: int, tgid: int, aux: int, name: bytes = b"", comm: bytes = b"x") -> bytes:
    return struct.pack("<IIIIQQQQQ16s64s", type_, pid, tgid, aux, 1, 2, 3, 4, 5, comm, name)


def test_decode_known_events() -> None:
    ev = decode_event(raw_event(1, 42, 7, 1, b"python3"))
    assert isinstance(ev, OomKill) and ev.victim_pid == 42 and ev.watched and ev.victim_comm == "python3"
    assert ev.anon_rss_kb == 3
    assert decode_event(raw_event(2, 43, 7, 7)) == ProcessForked(parent_tgid=7, child_pid=43, comm="x", ts_ns=1)
    ev = decode_event(raw_event(3, 44, 44, 44, b"/usr/bin/python3\xff"))
    assert isinstance(ev, ProcessExec) and ev.filename.startswith("/usr/bin/python3")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_decode_garbage_never_crashes(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        decode_event(data)


def test_memory_cgroup_v2_and_v1_files(tmp_path: Path) -> None:
    from kvwatch.daemon.lab.memcg import CgroupUnavailable, MemoryCgroup

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu io memory pids\n")
    cg = MemoryCgroup("t", 64 << 20, root=v2).create()
    assert cg.version == 2
    assert (v2 / "t" / "memory.max").read_text() == str(64 << 20)
    assert (v2 / "t" / "memory.swap.max").read_text() == "0"
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("max")
    cg1 = MemoryCgroup("t", 32 << 20, root=v1).create()
    assert cg1.version == 1 and (v1 / "memory" / "t" / "memory.limit_in_bytes").read_text() == str(32 << 20)
    none = tmp_path / "none"
    none.mkdir()
    with pytest.raises(CgroupUnavailable):
        MemoryCgroup("t", 1, root=none)
