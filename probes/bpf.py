"""The one module that imports bcc.

Everything above this module sees plain Python values and the typed records of
``kvwatch.probes.records``; bcc's objects do not leak out except as the opaque
``Table`` handles the loaders use to read and write their own maps.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from kvwatch.probes.bpf_syscalls import BPF_TRACE_UPROBE_MULTI, REFUSED, link_uprobe_multi
from kvwatch.probes.errors import BccUnavailable, ProbeAttachError, ProbeCompileError

PROBES_DIR = Path(__file__).resolve().parent

# bcc refuses more than 1000 probes per process by default; kvwatch attaches ~34 per
# CUDA library per watched process.
os.environ.setdefault("BCC_PROBE_LIMIT", "100000")

try:  # bcc comes from the distribution (python3-bpfcc), importable by /usr/bin/python3 only
    import bcc as _bcc
except ImportError as _err:  # pragma: no cover - depends on the machine
    _bcc = None
    _IMPORT_ERROR: ImportError | None = _err
else:
    _IMPORT_ERROR = None

Table = Any
"""A bcc map handle; loaders use ``Key``/``Leaf`` and item access on it."""


def bcc_available() -> bool:
    return _bcc is not None


def bcc_version() -> str:
    if _bcc is None:
        return ""
    return str(getattr(_bcc, "__version__", "unknown"))


def require_bcc() -> Any:
    if _bcc is None:
        raise BccUnavailable(
            "cannot import bcc: install python3-bpfcc and run under /usr/bin/python3 "
            f"or a venv built with --system-site-packages on it ({_IMPORT_ERROR})"
        )
    return _bcc


def program_text(source: Path) -> str:
    """``common.h`` followed by the family's source, with #line markers for errors.

    bcc rewrites map calls (``hits.lookup``) only in the main file, not in headers
    it includes, so the shared helpers are put in front of the program text; the
    family's own ``#include "common.h"`` then hits the include guard.
    """
    common = PROBES_DIR / "common.h"
    return f'#line 1 "{common.name}"\n{common.read_text()}\n#line 1 "{source.name}"\n{source.read_text()}'


UPROBE_MULTI = "uprobe_multi"
PERF_EVENT = "perf_event"


class Program:
    """One compiled BPF program: attach/detach hooks, read maps, poll ring buffers.

    Uprobes are uprobe_multi links (``probes/bpf_syscalls.py``, released far faster) unless
    ``uprobe_multi`` is False or the kernel refuses them at the first attach; then perf events,
    bcc's way, for the program's life. ``uprobe_mode`` says which ("" until the first attach),
    ``uprobe_mode_reason`` why perf events."""

    def __init__(self, source: Path, cflags: Sequence[str], *, uprobe_multi: bool = True) -> None:
        bcc = require_bcc()
        self.source = source
        self.cflags = [*cflags, f"-I{PROBES_DIR}"]
        self.text = program_text(source)
        try:
            self._bpf = bcc.BPF(text=self.text.encode(), cflags=self.cflags)
        except Exception as err:  # bcc raises bare Exception on compile/load failure
            raise ProbeCompileError(f"{source.name}: {err}") from err
        self._tracepoints: list[str] = []
        self._tables: dict[str, Table] = {}
        self._closer: ThreadPoolExecutor | None = None
        self._closing: set[Future[None]] = set()
        self._links: dict[str, int] = {}  # event name -> link descriptor
        self._link_closers: set[threading.Thread] = set()
        self._releases = threading.Lock()  # the attacher adds releases while the loop counts them
        self._serial = 0
        self.uprobe_mode = "" if uprobe_multi else PERF_EVENT
        self.uprobe_mode_reason = "" if uprobe_multi else "uprobe_multi links not asked for"
        self._closed = False

    # --- attachment ------------------------------------------------------------
    def attach_tracepoint(self, hook: str, tracepoint: str, fn_name: str) -> None:
        try:
            self._bpf.attach_tracepoint(tp=tracepoint.encode(), fn_name=fn_name.encode())
        except Exception as err:
            raise ProbeAttachError(hook, tracepoint, str(err)) from err
        self._tracepoints.append(tracepoint)

    def detach_tracepoint(self, tracepoint: str) -> None:
        if tracepoint in self._tracepoints:
            self._tracepoints.remove(tracepoint)
            self._bpf.detach_tracepoint(tp=tracepoint.encode())

    def attach_uprobe(
        self,
        hook: str,
        path: str,
        fn_name: str,
        *,
        pid: int,
        addr: int,
        retprobe: bool = False,
    ) -> str:
        """Attach at ELF address ``addr`` of ``path`` for ``pid`` only; returns the event
        name to detach with (which works after the file or the process is gone)."""
        try:
            if self.uprobe_mode != PERF_EVENT:
                event = self._attach_link(path, fn_name, pid, addr, retprobe)
                if event:
                    return event
            return self._attach_perf_event(path, fn_name, pid, addr, retprobe)
        except Exception as err:
            raise ProbeAttachError(hook, f"{path}:{addr:#x}", str(err)) from err

    def _attach_link(self, path: str, fn_name: str, pid: int, addr: int, retprobe: bool) -> str:
        """A uprobe_multi link; "" when the kernel refuses them at the first attach, which makes
        this program attach perf events from then on (a refusal later is an error)."""
        bcc = require_bcc()
        name = fn_name.encode()
        try:  # cached by name: every uprobe function of a program in links mode is loaded this way
            fn = self._bpf.load_func(name, bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
        except Exception as err:
            if self.uprobe_mode:
                raise
            return self._fall_back(name, f"program load with attach type uprobe_multi: {err}")
        # bcc turns the ELF address into the file offset the kernel wants (via the PT_LOAD
        # segment holding it), as its own attach_uprobe does before opening the perf event
        file, offset = bcc.BPF._check_path_symbol(path.encode(), b"", addr, pid)
        try:
            fd = link_uprobe_multi(fn.fd, file, offset, pid, retprobe=retprobe)
        except OSError as err:
            if self.uprobe_mode or err.errno not in REFUSED:
                raise
            return self._fall_back(name, str(err))
        self.uprobe_mode = UPROBE_MULTI
        self._serial += 1
        event = f"kvw_link{self._serial}_{'r' if retprobe else 'p'}_{pid}_{offset:#x}"
        self._links[event] = fd
        return event

    def _fall_back(self, name: bytes, reason: str) -> str:
        fn = self._bpf.funcs.pop(name, None)  # loaded for links: bcc's attach loads it again its own way
        if fn is not None:
            os.close(fn.fd)
        self.uprobe_mode, self.uprobe_mode_reason = PERF_EVENT, reason
        return ""

    def _attach_perf_event(self, path: str, fn_name: str, pid: int, addr: int, retprobe: bool) -> str:
        before = set(self._bpf.uprobe_fds)
        kwargs: dict[str, Any] = {
            "name": path.encode(),
            "fn_name": fn_name.encode(),
            "pid": pid,
            "addr": addr,
        }
        if retprobe:
            self._bpf.attach_uretprobe(**kwargs)
        else:
            self._bpf.attach_uprobe(**kwargs)
        created = set(self._bpf.uprobe_fds) - before
        return created.pop().decode() if created else ""

    def detach_uprobe_event(self, event: str) -> bool:
        """Detach now, release in the background; ``wait_releases`` and ``close`` wait for it.

        Closing a uprobe's descriptor waits out an RCU Tasks Trace grace period (~0.05 s): inline,
        a process exiting with tens of probes would stall the caller for seconds. Each link is
        closed by a thread of its own, so links released together share one grace period. A
        perf event's release also holds the kernel's ``event_mutex``, which serialises them
        whatever the threads: a pool of closers keeps them off the caller, no more."""
        fd = self._links.pop(event, None)
        if fd is not None:
            closer = threading.Thread(target=os.close, args=(fd,), name="kvwatch-link-close", daemon=True)
            closer.start()
            with self._releases:
                self._link_closers.add(closer)
            return True
        ev = event.encode()
        fd = self._bpf.uprobe_fds.get(ev)
        if fd is None:
            return False
        self._bpf._del_uprobe_fd(ev)  # bcc's own bookkeeping (open-probe count), private API
        if self._closer is None:
            self._closer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvwatch-uprobe-close")
        with self._releases:
            self._closing.add(self._closer.submit(_release_uprobe, fd, ev))
        return True

    def pending_releases(self) -> int:
        with self._releases:
            self._closing = {f for f in self._closing if not f.done()}
            self._link_closers = {t for t in self._link_closers if t.is_alive()}
            return len(self._closing) + len(self._link_closers)

    def wait_releases(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._releases:
            closers, closing = list(self._link_closers), list(self._closing)
        for closer in closers:
            closer.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        wait(closing, timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
        self.pending_releases()

    @property
    def open_uprobes(self) -> int:
        return len(self._bpf.uprobe_fds) + len(self._links)

    def skipped_runs(self, fn_name: str) -> int:
        """Times the kernel skipped ``fn_name`` instead of running it (``recursion_misses``).

        A BPF program does not nest on one CPU: when the tracepoint fires again while a
        tracing program runs there (a page freed in an interrupt that arrived during the
        page-free program, an RCU batch of page-table pages), the kernel drops that run and
        counts it in the program's statistics. Those events are lost to kvwatch but not to
        ftrace, so they are reported as lost rather than silently missing. Read from the
        program's /proc/self/fdinfo (no struct layout involved); 0 for a program not loaded."""
        return int(self.fdinfo(fn_name, "recursion_misses") or 0)

    def fdinfo(self, fn_name: str, key: str) -> str | None:
        """One field of loaded program ``fn_name``'s fdinfo (prog_id, run_cnt, recursion_misses, ...)."""
        fn = self._bpf.funcs.get(fn_name.encode())
        return None if fn is None else fdinfo_field(fn.fd, key)

    # --- maps ----------------------------------------------------------------------
    def run_stats(self) -> dict[str, tuple[int, int]]:
        """Per loaded BPF function: (run_time_ns, run_cnt) since the load, as the kernel keeps
        them while BPF statistics are on (``kernel.bpf_stats_enabled``); zeros while off."""
        out: dict[str, tuple[int, int]] = {}
        for name, fn in list(self._bpf.funcs.items()):
            ns, cnt = fdinfo_fields(fn.fd, ("run_time_ns", "run_cnt"))
            out[name.decode() if isinstance(name, bytes) else str(name)] = (int(ns or 0), int(cnt or 0))
        return out

    def table(self, name: str) -> Table:
        """The map called ``name``; bcc rebuilds key/leaf types on every get_table (half a
        millisecond), so handles are kept for the program's life."""
        t = self._tables.get(name)
        if t is None:
            t = self._tables[name] = self._bpf.get_table(name.encode())
        return t

    def open_ring_buffer(self, name: str, callback: Callable[[bytes], None]) -> None:
        def _cb(_ctx: Any, data: Any, size: int) -> int:
            callback(ctypes.string_at(data, size))
            return 0

        self._bpf[name.encode()].open_ring_buffer(_cb)

    def poll(self, timeout_ms: int) -> None:
        """Drain ring buffers, waiting at most ``timeout_ms`` for the first record."""
        self._bpf.ring_buffer_poll(timeout_ms)

    def consume(self) -> None:
        """Drain ring buffers without waiting."""
        self._bpf.ring_buffer_consume()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tables.clear()
        for event in [*self._links, *(ev.decode() for ev in self._bpf.uprobe_fds)]:
            self.detach_uprobe_event(event)  # the rest in parallel too, not one by one in cleanup()
        self.wait_releases()
        if self._closer is not None:
            self._closer.shutdown(wait=True)
            self._closer = None
        self._bpf.cleanup()


def fdinfo_field(fd: int, key: str) -> str | None:
    """Field ``key`` of this process's /proc/self/fdinfo/``fd``; None when absent or the descriptor is gone."""
    return fdinfo_fields(fd, (key,))[0]


def fdinfo_fields(fd: int, keys: Sequence[str]) -> list[str | None]:
    """Fields of this process's /proc/self/fdinfo/``fd`` from one read; None when absent or gone.

    Read every tick for each attached hook, so it is plain os calls and one byte search per
    field, with no file object and no parsed dict: those cost several times as much, paid per
    hook per tick."""
    try:
        f = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY)
    except OSError:
        return [None] * len(keys)
    try:
        text = os.read(f, 4096)
    finally:
        os.close(f)
    out: list[str | None] = []
    for key in keys:
        i = text.find(f"\n{key}:".encode())
        if i < 0:
            out.append(None)
            continue
        start = i + len(key) + 2
        end = text.find(b"\n", start)
        out.append(text[start : end if end >= 0 else None].strip().decode())
    return out


def _release_uprobe(fd: int, event: bytes) -> None:
    bcc = require_bcc()
    bcc.lib.bpf_close_perf_event_fd(fd)
    bcc.lib.bpf_detach_uprobe(event)  # the tracefs entry, when bcc had to create one


def percpu_sum(values: Sequence[Any], fields: Sequence[str]) -> dict[str, int]:
    """Sum a per-CPU leaf (a list of ctypes structs) field by field."""
    out = dict.fromkeys(fields, 0)
    for v in values:
        for f in fields:
            out[f] += int(getattr(v, f))
    return out


def percpu_array_sums(table: Table, labels: Sequence[str]) -> dict[str, int]:
    """Per label, the sum over CPUs of a BPF_PERCPU_ARRAY's entry at the label's index."""
    return {label: sum(int(v) for v in table[table.Key(i)]) for i, label in enumerate(labels)}


def sizeof_flags(mirrors: Mapping[str, type[ctypes.Structure]]) -> list[str]:
    """``-DKVW_SIZEOF_<struct>=<bytes>`` per C struct (by its name) decoded with a ctypes class.

    A ring-buffer record is laid out by the C compiler and decoded by the ctypes class that
    ``cstruct.read_structs`` built from the same declaration. The program asserts each
    struct's size against the size passed here (``KVW_MIRRORED`` in common.h), so a layout
    the two disagree on fails the compile with the struct's name instead of decoding garbage."""
    return [f"-DKVW_SIZEOF_{name}={ctypes.sizeof(record)}" for name, record in mirrors.items()]


_MADV_DONTNEED = 4


def release_compiler_memory(smaps: Path = Path("/proc/self/smaps")) -> int:
    """Give back what compiling cost: LLVM's freed heap (``malloc_trim``) and our
    mapping of the compiler's untouched file pages (libLLVM, libclang: ~80 MiB of
    RSS that only a compile uses). Only mappings that are not writable and hold no
    copied-on-write page are dropped (never RELRO, which relocation modified);
    their pages fault back in from the library if another compile comes.
    Returns the bytes of mappings dropped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.malloc_trim(0)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    candidates: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":"):
            current = None
            name = parts[5].rsplit("/", 1)[-1] if len(parts) >= 6 else ""
            if "w" not in parts[1] and name.startswith(("libLLVM", "libclang")):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                current = (start, end)
        elif current is not None and parts[0] == "Anonymous:":
            if int(parts[1]) == 0:  # no private (relocated / CoW) page in this mapping
                candidates.append(current)
            current = None
    dropped = 0
    for start, end in candidates:
        if libc.madvise(ctypes.c_void_p(start), end - start, _MADV_DONTNEED) == 0:
            dropped += end - start
    return dropped
