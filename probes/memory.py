"""Loader for the kernel-memory probe family (``memory.bpf.c``).

Hooks tracepoints only (kprobes may be absent; fentry may be refused), keeps
the watched-TGID map and the KV-tier inode set in the kernel current, and turns
the maps and ring buffer into the typed records of ``kvwatch.probes.records``.
Overhead and caveats are at the top of ``memory.bpf.c``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvwatch.probes import tracefs
from kvwatch.probes.bpf import PROBES_DIR, Program, percpu_array_sums, percpu_sum, program_text, sizeof_flags
from kvwatch.probes.cstruct import read_structs
from kvwatch.probes.errors import ProbeAttachError
from kvwatch.probes.records import (
    RECLAIMER_KINDS,
    EventBatch,
    HookState,
    HookStatus,
    MemoryEvent,
    MemorySample,
    OomKill,
    ProcessExec,
    ProcessExited,
    ProcessForked,
    ProcessMemoryCounters,
    ProcessRenamed,
    ReclaimerKey,
    TierCounters,
)

FAMILY = "memory"
SOURCE = PROBES_DIR / "memory.bpf.c"

FEATURES = ("page_free", "pagecache", "reclaim", "oom", "lifecycle", "hints")


@dataclass(frozen=True, slots=True)
class Hook:
    name: str
    tracepoint: str
    feature: str
    required: bool = True

    @property
    def fn(self) -> str:
        return f"kvw_{self.name}"


# The single list of hooks: its order gives the hit-counter indices passed to the C code.
HOOKS: tuple[Hook, ...] = (
    Hook("page_free", "kmem:mm_page_free", "page_free"),
    Hook("pagecache_delete", "filemap:mm_filemap_delete_from_page_cache", "pagecache"),
    Hook("pagecache_add", "filemap:mm_filemap_add_to_page_cache", "pagecache"),
    Hook("direct_reclaim_begin", "vmscan:mm_vmscan_direct_reclaim_begin", "reclaim"),
    Hook("direct_reclaim_end", "vmscan:mm_vmscan_direct_reclaim_end", "reclaim"),
    Hook("memcg_reclaim_begin", "vmscan:mm_vmscan_memcg_reclaim_begin", "reclaim"),
    Hook("memcg_reclaim_end", "vmscan:mm_vmscan_memcg_reclaim_end", "reclaim"),
    Hook("oom_victim", "oom:mark_victim", "oom"),
    Hook("task_newtask", "task:task_newtask", "lifecycle"),
    Hook("process_exit", "sched:sched_process_exit", "lifecycle"),
    # discovery hints for every process on the node (periodic rescans catch what they miss)
    Hook("process_exec", "sched:sched_process_exec", "hints"),
    Hook("task_rename", "task:task_rename", "hints", required=False),
)

# Loss sources counted in the kernel, in index order.
LOST_SOURCES: tuple[str, ...] = (
    "ringbuf",
    "watched_full",
    "reclaim_window_full",
    "reclaimers_full",
)

_EV_OOM, _EV_FORK, _EV_EXEC, _EV_EXIT, _EV_RENAME = 1, 2, 3, 4, 5

_PROC_FIELDS = (
    "page_free_pages",
    "direct_reclaim_ns",
    "direct_reclaim_count",
    "memcg_reclaim_ns",
    "memcg_reclaim_count",
)
_TIER_FIELDS = ("reclaim_pages", "policy_pages", "added_pages", "refault_pages", "unattributed_pages")
# reclaimer kinds in the kernel: KVW_RECLAIMER_<KIND> = index + 1 (0: no reclaimer)
_KIND_OF = {i + 1: kind for i, kind in enumerate(RECLAIMER_KINDS)}


# The ring-buffer record, declared in C only: ``struct kvw_event_t`` of SOURCE, read at import.
RING_STRUCTS = read_structs(program_text(SOURCE), "kvw_event_t")
_RawEvent = RING_STRUCTS["kvw_event_t"]


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def decode_event(data: bytes) -> OomKill | ProcessForked | ProcessExec | ProcessExited | ProcessRenamed:
    """Decode one ring-buffer record; ``ValueError`` for anything malformed."""
    if len(data) < ctypes.sizeof(_RawEvent):
        raise ValueError(f"short event: {len(data)} bytes")
    e = _RawEvent.from_buffer_copy(data)
    comm = _text(e.comm)
    if e.type == _EV_OOM:
        return OomKill(
            victim_pid=e.pid,
            victim_comm=_text(e.name),
            watched=bool(e.aux),
            total_vm_kb=e.a,
            anon_rss_kb=e.b,
            file_rss_kb=e.c,
            shmem_rss_kb=e.d,
            killer_tgid=e.tgid,
            ts_ns=e.ts_ns,
        )
    if e.type == _EV_FORK:
        return ProcessForked(parent_tgid=e.aux, child_pid=e.pid, comm=comm, ts_ns=e.ts_ns)
    if e.type == _EV_EXEC:
        return ProcessExec(pid=e.pid, old_pid=e.aux, filename=_text(e.name), comm=comm, ts_ns=e.ts_ns)
    if e.type == _EV_EXIT:
        return ProcessExited(tgid=e.pid, comm=comm, ts_ns=e.ts_ns)
    if e.type == _EV_RENAME:
        return ProcessRenamed(tgid=e.tgid, tid=e.aux, new_comm=_text(e.name), ts_ns=e.ts_ns)
    raise ValueError(f"unknown event type {e.type}")


def kernel_dev(st_dev: int) -> int:
    """The kernel's internal dev_t (MKDEV: major << 20 | minor) for a ``stat`` st_dev."""
    return (os.major(st_dev) << 20) | os.minor(st_dev)


@dataclass(frozen=True, slots=True)
class MemoryProbeOptions:
    features: frozenset[str] = frozenset(FEATURES)
    max_watched: int = 4096
    max_kv_inodes: int = 65536
    max_evicted: int = 131072
    max_tiers: int = 64
    max_reclaimers: int = 4096
    ringbuf_pages: int = 64


class MemoryProbes:
    """The kernel-memory family: one BPF program, many tracepoints."""

    family = FAMILY
    mirrors: ClassVar[Mapping[str, type[ctypes.Structure]]] = RING_STRUCTS

    def __init__(
        self,
        options: MemoryProbeOptions | None = None,
        *,
        tracefs_root: Path | None = None,
        program_factory: Callable[[Path, list[str]], Program] = Program,
    ) -> None:
        self.options = options or MemoryProbeOptions()
        self._tracefs_root = tracefs_root
        self._program_factory = program_factory
        self._prog: Program | None = None
        self._statuses: dict[str, HookStatus] = {}
        self._batch = EventBatch()
        self._kv_inodes = 0

    # --- lifecycle -------------------------------------------------------------------
    def plan(self) -> tuple[list[Hook], dict[str, HookStatus]]:
        """Which hooks to compile in, and the status of those left out."""
        chosen: list[Hook] = []
        left_out: dict[str, HookStatus] = {}
        for h in HOOKS:
            if h.feature not in self.options.features:
                left_out[h.name] = HookStatus(
                    h.name, FAMILY, h.tracepoint, HookState.DISABLED, "off in config", h.required
                )
            elif not tracefs.tracepoint_exists(h.tracepoint, self._tracefs_root):
                left_out[h.name] = HookStatus(
                    h.name,
                    FAMILY,
                    h.tracepoint,
                    HookState.MISSING,
                    "tracepoint not present on this kernel",
                    h.required,
                )
            else:
                chosen.append(h)
        return chosen, left_out

    def cflags(self, hooks: Iterable[Hook]) -> list[str]:
        o = self.options
        flags = [
            f"-DKVW_NR_HITS={len(HOOKS)}",
            f"-DKVW_NR_LOST={len(LOST_SOURCES)}",
            f"-DMAX_WATCHED={o.max_watched}",
            f"-DMAX_KV_INODES={o.max_kv_inodes}",
            f"-DMAX_EVICTED={o.max_evicted}",
            f"-DMAX_TIERS={o.max_tiers}",
            f"-DMAX_RECLAIMERS={o.max_reclaimers}",
            f"-DRINGBUF_PAGES={o.ringbuf_pages}",
            f"-DKVW_EV_OOM={_EV_OOM}",
            f"-DKVW_EV_FORK={_EV_FORK}",
            f"-DKVW_EV_EXEC={_EV_EXEC}",
            f"-DKVW_EV_EXIT={_EV_EXIT}",
            f"-DKVW_EV_RENAME={_EV_RENAME}",
        ]
        flags += [f"-DKVW_HIT_{h.name.upper()}={i}" for i, h in enumerate(HOOKS)]
        flags += [f"-DKVW_LOST_{s.upper()}={i}" for i, s in enumerate(LOST_SOURCES)]
        flags += [f"-DKVW_RECLAIMER_{kind.upper()}={i}" for i, kind in _KIND_OF.items()]
        flags += [f"-DKVW_HOOK_{h.name.upper()}" for h in hooks]
        return flags + sizeof_flags(self.mirrors)

    def start(self) -> list[HookStatus]:
        """Compile, load and attach. Raises ``ProbeCompileError``; per-hook failures are statuses."""
        hooks, statuses = self.plan()
        prog = self._program_factory(SOURCE, self.cflags(hooks))
        self._prog = prog
        for h in hooks:
            try:
                prog.attach_tracepoint(h.name, h.tracepoint, h.fn)
            except ProbeAttachError as err:
                statuses[h.name] = HookStatus(h.name, FAMILY, h.tracepoint, HookState.FAILED, err.reason, h.required)
            else:
                statuses[h.name] = HookStatus(h.name, FAMILY, h.tracepoint, HookState.ATTACHED, "", h.required)
        prog.open_ring_buffer("events", self._on_event)
        self._statuses = {h.name: statuses[h.name] for h in HOOKS}
        return list(self._statuses.values())

    @property
    def statuses(self) -> list[HookStatus]:
        return list(self._statuses.values())

    @property
    def program(self) -> Program:
        if self._prog is None:
            raise RuntimeError("memory probes not started")
        return self._prog

    def close(self) -> None:
        if self._prog is not None:
            self._prog.close()
            self._prog = None

    # --- watched processes -----------------------------------------------------------
    def watch(self, tgid: int, root_tgid: int | None = None) -> bool:
        """Add a TGID to the in-kernel filter. False when the map is full."""
        t = self.program.table("watched")
        stats = self.program.table("proc_stats")
        try:
            t[t.Key(tgid)] = t.Leaf(root_tgid if root_tgid is not None else tgid, 0)
            if stats.Key(tgid) not in stats:  # keep counters a fork may already have started
                stats[stats.Key(tgid)] = stats.Leaf()
        except Exception:  # bcc raises bare Exception("Could not update table") when full
            with contextlib.suppress(KeyError):
                del t[t.Key(tgid)]
            return False
        return True

    def unwatch(self, tgid: int) -> None:
        for name in ("watched", "proc_stats"):
            t = self.program.table(name)
            with contextlib.suppress(KeyError):
                del t[t.Key(tgid)]
        readers = self.program.table("tier_readers")
        for k in [k for k in readers if k.tgid == tgid]:
            with contextlib.suppress(KeyError):
                del readers[k]

    def watched(self) -> dict[int, int]:
        """TGID → root TGID, as the kernel holds it (children added by fork included)."""
        t = self.program.table("watched")
        return {int(k.value): int(v.root_tgid) for k, v in t.items()}

    # --- KV-tier inodes ---------------------------------------------------------------
    def set_kv_inode(self, dev: int, ino: int, tier_id: int) -> bool:
        t = self.program.table("kv_inodes")
        try:
            t[t.Key(ino, dev, 0)] = t.Leaf(tier_id, 0)
        except Exception:  # map full
            return False
        return True

    def remove_kv_inode(self, dev: int, ino: int) -> None:
        t = self.program.table("kv_inodes")
        with contextlib.suppress(KeyError):
            del t[t.Key(ino, dev, 0)]

    def kv_inodes(self) -> set[tuple[int, int]]:
        t = self.program.table("kv_inodes")
        return {(int(k.dev), int(k.ino)) for k in t}

    def learn_device(self, directory: Path) -> int | None:
        """The s_dev the kernel reports for files in ``directory``, from a canary write.

        None when the canary could not run (read-only directory, a filesystem that
        bypasses the generic page cache); the caller then falls back to MKDEV(st_dev).
        """
        prog = self.program
        on, devs = prog.table("canary_on"), prog.table("canary_dev")
        fd = -1
        path = directory / f".kvwatch-canary-{os.getpid()}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            ino = os.fstat(fd).st_ino
            devs[devs.Key(ino)] = devs.Leaf(0)
            on[on.Key(0)] = on.Leaf(1)
            os.write(fd, b"kvwatch device canary\n")
            value = int(devs[devs.Key(ino)].value)
        except (OSError, KeyError):
            return None
        finally:
            on[on.Key(0)] = on.Leaf(0)
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    path.unlink()
            for k in list(devs.keys()):
                with contextlib.suppress(KeyError):
                    del devs[k]
        return value or None

    # --- reading -------------------------------------------------------------------------
    def _on_event(self, data: bytes) -> None:
        try:
            self._batch.events.append(decode_event(data))
        except ValueError:
            self._batch.malformed += 1

    def poll(self, timeout_ms: int) -> None:
        """Wait for records, then drain what is there even if no wakeup came.

        The kernel skips the wakeup for a record committed while the consumer looked
        busy (adaptive notification), and libbpf's poll only reads rings that woke it:
        such a record waited for the next wakeup — seconds on a quiet node, long enough
        for an OOM kill to arrive after the victim's exit. The extra consume bounds the
        delay by ``timeout_ms``."""
        prog = self.program
        prog.poll(timeout_ms)
        prog.consume()

    def pending(self) -> list[MemoryEvent]:
        """Events received and not yet taken (read-only view)."""
        return list(self._batch.events)

    def take_events(self) -> EventBatch:
        batch, self._batch = self._batch, EventBatch()
        return batch

    def reclaimers(self) -> dict[ReclaimerKey, int]:
        """Pages reclaimed from each tier, by reclaimer (kind, cgroup v2 id)."""
        return {
            ReclaimerKey(int(k.tier), _KIND_OF.get(int(k.kind), "unknown"), int(k.cgroup_id)): int(v.value)
            for k, v in self.program.table("tier_reclaimers").items()
        }

    def forget_reclaimer(self, key: ReclaimerKey) -> None:
        """Free a reclaimer's entry (its cgroup is gone, its count read for the last time)."""
        t = self.program.table("tier_reclaimers")
        kind = next(i for i, k in _KIND_OF.items() if k == key.kind)
        with contextlib.suppress(KeyError):
            del t[t.Key(key.cgroup_id, key.tier_id, kind)]

    def sample(self) -> MemorySample:
        prog = self.program
        reclaimers = self.reclaimers()  # before the tiers: see MemorySample.reclaimers
        procs: dict[int, ProcessMemoryCounters] = {}
        for k, values in prog.table("proc_stats").items():
            tgid = int(k.value)
            procs[tgid] = ProcessMemoryCounters(tgid, **percpu_sum(values, _PROC_FIELDS))
        tiers: dict[int, TierCounters] = {}
        tier_table = prog.table("tier_stats")
        for i in range(self.options.max_tiers):
            sums = percpu_sum(tier_table[tier_table.Key(i)], _TIER_FIELDS)
            if any(sums.values()):
                tiers[i] = TierCounters(i, **sums)
        readers = {(int(k.tgid), int(k.tier)): int(v.value) for k, v in prog.table("tier_readers").items()}
        return MemorySample(
            monotonic_ns=time.monotonic_ns(),
            processes=procs,
            tiers=tiers,
            tier_readers=readers,
            hits=percpu_array_sums(prog.table("hits"), [h.name for h in HOOKS]),
            lost=percpu_array_sums(prog.table("lost"), LOST_SOURCES) | self.skipped(),
            reclaimers=reclaimers,
        )

    def skipped(self) -> dict[str, int]:
        """Per attached hook, the runs the kernel skipped because a BPF program was already
        running on that CPU (``<hook>_skipped``); see ``Program.skipped_runs``."""
        prog = self.program
        attached = {s.name for s in self._statuses.values() if s.state is HookState.ATTACHED}
        return {f"{h.name}_skipped": prog.skipped_runs(h.fn) for h in HOOKS if h.name in attached}

    def ebpf_text(self) -> str:
        hooks, _ = self.plan()
        flags = " ".join(self.cflags(hooks))
        return f"// cflags: {flags}\n" + program_text(SOURCE)
