"""The KV-tier registry's inotify drain, as the ``kvwatch-kv-files`` thread calls it (here called
directly: unit tests start no thread)."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.config import KVTierDir, KVTiersConfig
from kvwatch.daemon.families.kv_files import DELETE_GRACE_SECONDS, KVTierRegistry
from kvwatch.daemon.families.kv_inotify import KVFileWatcher
from kvwatch.daemon.host.procfs import ProcFS


class Inodes:
    def __init__(self) -> None:
        self.inodes: dict[tuple[int, int], int] = {}

    def set_kv_inode(self, dev: int, ino: int, tier_id: int) -> bool:
        self.inodes[(dev, ino)] = tier_id
        return True

    def remove_kv_inode(self, dev: int, ino: int) -> None:
        self.inodes.pop((dev, ino), None)

    def learn_device(self, directory: Path) -> int | None:
        return None


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def registry(tmp_path: Path) -> tuple[KVTierRegistry, Inodes, Clock, Path]:
    kv = tmp_path / "kv"
    kv.mkdir()
    sink, clock = Inodes(), Clock()
    config = KVTiersConfig(dirs=[KVTierDir(path=kv)], rescan_seconds=3600)
    reg = KVTierRegistry(config, sink, procfs=ProcFS(tmp_path), clock=clock)
    reg.sync([])
    reg.refresh()  # the first rescan is now; the next in an hour
    return reg, sink, clock, kv


def inode(path: Path) -> int:
    return path.stat().st_ino


def test_a_file_drained_after_its_creation_is_registered_until_after_its_deletion(tmp_path: Path) -> None:
    reg, sink, clock, kv = registry(tmp_path)
    f = kv / "chunk.bin"
    f.write_bytes(b"x" * 4096)
    ino = inode(f)
    reg.drain_inotify()  # the thread's drain: no tick, no rescan
    assert [i for _, i in sink.inodes] == [ino]
    assert reg.stats.inodes == 1
    f.unlink()
    reg.drain_inotify()
    assert [i for _, i in sink.inodes] == [ino]  # its pages leave after the unlink is reported
    clock.t += DELETE_GRACE_SECONDS
    reg.refresh()
    assert sink.inodes == {} and reg.stats.inodes == 0
    reg.close()


def test_create_and_delete_in_one_drain_cannot_be_registered(tmp_path: Path) -> None:
    """Why the thread drains as events arrive: once the delete is queued behind the create, the
    stat comes after the unlink and the inode is gone."""
    reg, sink, _, kv = registry(tmp_path)
    f = kv / "chunk.bin"
    f.write_bytes(b"x")
    f.unlink()
    reg.drain_inotify()
    assert sink.inodes == {} and reg.stats.inodes == 0
    reg.close()


def test_files_moved_in_and_out_follow(tmp_path: Path) -> None:
    reg, sink, clock, kv = registry(tmp_path)
    outside = tmp_path / "staged.bin"
    outside.write_bytes(b"y")
    ino = inode(outside)
    outside.rename(kv / "chunk.bin")
    reg.drain_inotify()
    assert [i for _, i in sink.inodes] == [ino]
    (kv / "chunk.bin").rename(tmp_path / "gone.bin")
    reg.drain_inotify()
    clock.t += DELETE_GRACE_SECONDS
    reg.refresh()
    assert sink.inodes == {}
    reg.close()


def test_the_tick_drains_what_no_thread_did(tmp_path: Path) -> None:
    reg, sink, _, kv = registry(tmp_path)
    (kv / "a.bin").write_bytes(b"a")
    reg.refresh()
    assert len(sink.inodes) == 1
    reg.drain_inotify()  # nothing left: the events were applied once
    assert len(sink.inodes) == 1 and reg.stats.inodes == 1
    reg.close()


def test_no_inotify_no_thread(tmp_path: Path) -> None:
    reg, _, _, _ = registry(tmp_path)
    assert reg.inotify_fd() is not None
    reg.close()
    assert reg.inotify_fd() is None
    watcher = KVFileWatcher(reg)
    assert not watcher.start()
    assert not watcher.alive()
    watcher.stop()  # nothing started: nothing to stop
