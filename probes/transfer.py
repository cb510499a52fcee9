"""Loader for the KV-transfer probe family (``transfer.bpf.c``): NIXL, UCX, libibverbs, NCCL.

Libraries are resolved per process from its own maps (NIXL wheels carry UCX and
libibverbs under hashed file names). Costs and caveats are at the top of
``transfer.bpf.c``.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvwatch.probes.bpf import PROBES_DIR, Program, percpu_sum, program_text
from kvwatch.probes.cstruct import read_structs
from kvwatch.probes.records import NBUCKETS, TransferDone, XferCounters
from kvwatch.probes.uprobes import PerProcessUprobes, UprobeApi

FAMILY = "transfer"
SOURCE = PROBES_DIR / "transfer.bpf.c"

R_NIXL_POST, R_NIXL_STATUS, R_NIXL_RELEASE, R_UCP_PUT, R_UCP_GET, R_VERBS_REG, R_VERBS_DEREG, R_NCCL = range(1, 9)
LIBS = ("nixl", "ucx", "nccl")
OPS = ("write", "read", "send", "recv", "allgather", "unknown")

LIBRARY_PATTERNS = {
    "nixl": re.compile(r"^libnixl\.so(\.\d+)*$"),
    "ucp": re.compile(r"^libucp(-[0-9a-f]{8})?\.so(\.\d+)*$"),
    "verbs": re.compile(r"^libibverbs(-[0-9a-f]{8})?\.so(\.\d+)*$"),
    "nccl": re.compile(r"^libnccl\.so(\.\d+)*$"),
}


@dataclass(frozen=True, slots=True)
class TransferApi(UprobeApi):
    role: int = 0
    op: int = 5
    ptr_arg: int = 0
    size_arg: int = 0
    extra_arg: int = 0


TRANSFER_APIS: tuple[TransferApi, ...] = (
    # nixlAgent member functions (mangled; matched by prefix so a changed signature still resolves):
    # this, req_hndl, ... -> the handle is the 2nd argument
    TransferApi("nixl_post", "nixl", "_ZNK9nixlAgent11postXferReqE", "nixl_post", prefix=True, role=R_NIXL_POST),
    TransferApi(
        "nixl_status", "nixl", "_ZNK9nixlAgent13getXferStatusE", "nixl_status", prefix=True, role=R_NIXL_STATUS
    ),
    TransferApi(
        "nixl_release", "nixl", "_ZNK9nixlAgent14releaseXferReqE", "nixl_release", prefix=True, role=R_NIXL_RELEASE
    ),
    # ucp_put_nbx(ep, buffer, count, remote_addr, rkey, param)
    TransferApi("ucp_put_nbx", "ucp", "ucp_put_nbx", "ucp_put", role=R_UCP_PUT, op=0, size_arg=3, extra_arg=1),
    TransferApi("ucp_get_nbx", "ucp", "ucp_get_nbx", "ucp_get", role=R_UCP_GET, op=1, size_arg=3, extra_arg=1),
    # ibv_reg_mr_iova2(pd, addr, length, iova, access); ibv_reg_mr jumps into it
    TransferApi("ibv_reg_mr_iova2", "verbs", "ibv_reg_mr_iova2", "verbs_reg", role=R_VERBS_REG, size_arg=3),
    # ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)
    TransferApi("ibv_reg_dmabuf_mr", "verbs", "ibv_reg_dmabuf_mr", "verbs_reg_dmabuf", role=R_VERBS_REG, size_arg=3),
    # ibv_dereg_mr(mr): the default version (@@IBVERBS_1.1), not the IBVERBS_1.0 one that never fires
    TransferApi("ibv_dereg_mr", "verbs", "ibv_dereg_mr", "verbs_dereg", role=R_VERBS_DEREG, ptr_arg=1),
    # ncclSend/ncclRecv(buff, count, datatype, peer, comm, stream)
    TransferApi("ncclSend", "nccl", "ncclSend", "nccl_send", role=R_NCCL, op=2, size_arg=2, extra_arg=3),
    TransferApi("ncclRecv", "nccl", "ncclRecv", "nccl_recv", role=R_NCCL, op=3, size_arg=2, extra_arg=3),
    # ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
    TransferApi("ncclAllGather", "nccl", "ncclAllGather", "nccl_allgather", role=R_NCCL, op=4, size_arg=3, extra_arg=4),
)

LOST_SOURCES = ("ringbuf", "inflight_full", "stats_full", "pending_full", "ledger_full")
_XFER_FIELDS = ("calls", "errors", "bytes", "completed", "duration_ns")
_PROC_FIELDS = (
    "reg_calls",
    "reg_bytes",
    "dereg_calls",
    "dereg_bytes",
    "reg_errors",
    "released_incomplete",
    "reposted_pending",
    "nested",
)


@dataclass(frozen=True, slots=True)
class PeerCounters:
    lib: str
    peer: int  # an opaque endpoint id: never a label
    first_ns: int
    bytes: int
    duration_ns: int
    completed: int


@dataclass(frozen=True, slots=True)
class ProcessTransfers:
    xfers: dict[tuple[str, str], XferCounters]  # (lib, op) -> counters
    peers: tuple[PeerCounters, ...] = ()
    reg_calls: int = 0
    reg_bytes: int = 0
    dereg_calls: int = 0
    dereg_bytes: int = 0
    reg_errors: int = 0
    released_incomplete: int = 0
    reposted_pending: int = 0
    nested: int = 0

    @property
    def registered_bytes(self) -> int:
        return self.reg_bytes - self.dereg_bytes


@dataclass(frozen=True, slots=True)
class InFlight:
    """A NIXL transfer posted and not completed yet."""

    lib: str
    peer: int
    bytes: int
    start_ns: int


@dataclass(frozen=True, slots=True)
class TransferSample:
    monotonic_ns: int
    processes: dict[int, ProcessTransfers]
    hits: dict[str, int]
    lost: dict[str, int]
    pending: int
    in_flight: dict[int, tuple[InFlight, ...]]  # by TGID


# The ring-buffer record, declared in C only: ``struct xfer_event_t`` of SOURCE, read at import.
RING_STRUCTS = read_structs(program_text(SOURCE), "xfer_event_t")
_RawEvent = RING_STRUCTS["xfer_event_t"]


def decode_event(data: bytes) -> TransferDone:
    if len(data) < ctypes.sizeof(_RawEvent):
        raise ValueError(f"short event: {len(data)} bytes")
    e = _RawEvent.from_buffer_copy(data)
    if e.lib >= len(LIBS) or e.op >= len(OPS) or e.end_ns < e.start_ns:
        raise ValueError("malformed transfer event")
    return TransferDone(e.tgid, LIBS[e.lib], OPS[e.op], e.bytes, e.start_ns, e.end_ns, e.status)


@dataclass(frozen=True, slots=True)
class TransferProbeOptions:
    max_pending: int = 65536
    max_processes: int = 1024
    ringbuf_pages: int = 16
    pending_timeout_seconds: float = 60.0


class TransferProbes(PerProcessUprobes[TransferDone]):
    family = FAMILY
    libraries_by_kind: ClassVar[dict[str, re.Pattern[str]]] = LIBRARY_PATTERNS
    apis: ClassVar[Sequence[UprobeApi]] = TRANSFER_APIS
    source: ClassVar[Path] = SOURCE
    ring_buffer = "xfer_events"
    lost_sources: ClassVar[Sequence[str]] = LOST_SOURCES
    mirrors: ClassVar[Mapping[str, type[ctypes.Structure]]] = RING_STRUCTS
    process_maps: ClassVar[Sequence[str]] = ("xfer_stats", "peers", "pending", "mr_ledger")
    process_map = "proc_xfer"
    thread_maps: ClassVar[Sequence[str]] = ("call_inflight", "post_inflight", "status_inflight")

    def __init__(
        self,
        options: TransferProbeOptions | None = None,
        *,
        proc_root: Path = Path("/proc"),
        program_factory: Callable[[Path, list[str]], Program] = Program,
    ) -> None:
        super().__init__(proc_root)
        self.options = options or TransferProbeOptions()
        self._program_factory = program_factory
        self.abandoned = 0  # transfers posted and never completed nor released (timed out here)

    def program_flags(self) -> list[str]:
        o = self.options
        table = " ".join(
            f"X({a.fn},{i},{a.role},{a.op},{a.ptr_arg},{a.size_arg},{a.extra_arg})" for i, a in enumerate(TRANSFER_APIS)
        )
        return [
            f"-DMAX_PENDING={o.max_pending}",
            f"-DMAX_PROCS={o.max_processes}",
            f"-DRINGBUF_PAGES={o.ringbuf_pages}",
            f"-DKVW_TRANSFER_APIS={table}",
        ]

    def set_emit_events(self, on: bool) -> None:
        """One ring-buffer event per completed transfer (for `kvwatch record`)."""
        t = self.program.table("emit_events")
        t[t.Key(0)] = t.Leaf(1 if on else 0)

    # --- reading -------------------------------------------------------------------------------
    def decode(self, data: bytes) -> TransferDone:
        return decode_event(data)

    def expire_pending(self, now_ns: int | None = None) -> int:
        """Drop transfers posted longer ago than the timeout that never completed (a peer
        that died, a request never polled): bounded table, every drop counted."""
        now = now_ns if now_ns is not None else time.monotonic_ns()
        limit = int(self.options.pending_timeout_seconds * 1e9)
        table = self.program.table("pending")
        stale = [k for k, v in table.items() if now - int(v.start_ns) > limit]
        for k in stale:
            with contextlib.suppress(KeyError):
                del table[k]
        self.abandoned += len(stale)
        return len(stale)

    def sample(self) -> TransferSample:
        prog = self.program
        per: dict[int, dict[tuple[str, str], XferCounters]] = {}
        for k, values in prog.table("xfer_stats").items():
            if k.lib >= len(LIBS) or k.op >= len(OPS):
                continue
            sums = percpu_sum(values, _XFER_FIELDS)
            buckets = tuple(sum(int(v.hist[b]) for v in values) for b in range(NBUCKETS))
            per.setdefault(int(k.tgid), {})[(LIBS[k.lib], OPS[k.op])] = XferCounters(**sums, buckets=buckets)
        peers: dict[int, list[PeerCounters]] = {}
        for k, v in prog.table("peers").items():
            lib = LIBS[k.lib] if k.lib < len(LIBS) else "unknown"
            peers.setdefault(int(k.tgid), []).append(
                PeerCounters(lib, int(k.ep), int(v.first_ns), int(v.bytes), int(v.duration_ns), int(v.completed))
            )
        extra = {int(k.value): v for k, v in prog.table("proc_xfer").items()}
        procs: dict[int, ProcessTransfers] = {}
        for tgid in set(per) | set(extra) | set(peers):
            v = extra.get(tgid)
            procs[tgid] = ProcessTransfers(
                xfers=per.get(tgid, {}),
                peers=tuple(peers.get(tgid, ())),
                **({f: int(getattr(v, f)) for f in _PROC_FIELDS} if v is not None else {}),
            )
        in_flight: dict[int, list[InFlight]] = {}
        for k, v in prog.table("pending").items():
            in_flight.setdefault(int(k.tgid), []).append(InFlight("nixl", int(v.ep), int(v.bytes), int(v.start_ns)))
        lost = self.lost_counts()
        lost["abandoned_transfers"] = self.abandoned
        lost["malformed_events"] = self.malformed
        return TransferSample(
            monotonic_ns=time.monotonic_ns(),
            processes=procs,
            hits=self.hit_counts(),
            lost=lost,
            pending=sum(len(v) for v in in_flight.values()),
            in_flight={k: tuple(v) for k, v in in_flight.items()},
        )
