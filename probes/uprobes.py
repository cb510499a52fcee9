"""Per-process uprobe families (CUDA, transfer): the program's lifecycle and attachment.

For each watched process: read its maps, take the libraries whose file names
match a family's exact patterns, read each file's symbols once, and attach an
entry and a return probe per API with ``pid=``, so other processes pay nothing.
Libraries loaded later are picked up by calling ``attach`` again; ``detach`` works
after the process (or the file) is gone, because it uses the recorded event names.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from kvwatch.probes.bpf import Program, percpu_array_sums, program_text, sizeof_flags
from kvwatch.probes.errors import ProbeAttachError
from kvwatch.probes.libs import LibraryError, MappedLibrary, SymbolCache, SymbolTable, read_maps
from kvwatch.probes.records import HookState


@dataclass(frozen=True, slots=True)
class UprobeApi:
    """One probed function: its label, which library kind, and how to find it."""

    label: str
    lib: str  # library kind, a key of the family's library patterns
    symbol: str  # exact symbol, or a prefix of a mangled C++ name when ``prefix``
    fn: str  # suffix of the BPF functions kvw_enter_<fn> / kvw_return_<fn>
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class SymbolAttach:
    library: str  # path as the process sees it
    api: str
    state: HookState
    reason: str = ""


@dataclass(slots=True)
class ProcessAttachment:
    pid: int
    libraries: dict[tuple[str, int], MappedLibrary] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    symbols: list[SymbolAttach] = field(default_factory=list)
    api_events: dict[str, list[tuple[str, bool]]] = field(default_factory=dict)  # api -> (event, is return)
    shed: set[str] = field(default_factory=set)  # api labels detached by the cost budget
    flags: set[str] = field(default_factory=set)  # family facts: "ucx" (libucm mapped), "runtime", ...

    @property
    def attached(self) -> int:
        return sum(1 for s in self.symbols if s.state is HookState.ATTACHED)

    @property
    def ucx(self) -> bool:
        return "ucx" in self.flags


class ProcessGoneDuringAttach(Exception):
    pass


def resolve(table: SymbolTable, api: UprobeApi) -> int | None:
    if not api.prefix:
        return table.probe_address(api.symbol)
    for name in sorted(table.functions):
        if name.startswith(api.symbol) and "." not in name:  # not the .cold split parts
            return table.probe_address(name)
    return None


E = TypeVar("E")
RELEASE_WAIT_SECONDS = 30.0


class PerProcessUprobes(Generic[E]):
    """Base of a uprobe family: one BPF program, loaded once, whose probes are attached per
    process. Subclasses give the program and its flags, the APIs, library patterns and skip
    rules, and decode the program's ring-buffer records into events of type ``E``."""

    family = "uprobes"
    libraries_by_kind: ClassVar[dict[str, re.Pattern[str]]] = {}
    apis: ClassVar[Sequence[UprobeApi]] = ()  # their order gives the hit-counter indices
    source: ClassVar[Path]  # the BPF program
    ring_buffer: ClassVar[str] = ""  # the program's ring buffer of events
    lost_sources: ClassVar[Sequence[str]] = ()  # in-kernel loss counters, in index order
    mirrors: ClassVar[Mapping[str, type[ctypes.Structure]]] = {}  # C struct name -> ctypes class read from it
    process_maps: ClassVar[Sequence[str]] = ()  # maps whose key struct has a tgid field
    process_map: ClassVar[str] = ""  # the map keyed by the TGID alone
    thread_maps: ClassVar[Sequence[str]] = ()  # calls in flight, keyed by pid_tgid (TGID in the high half)

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self.symbols = SymbolCache()
        self.attachments: dict[int, ProcessAttachment] = {}
        self._prog: Program | None = None
        self._program_factory: Callable[[Path, list[str]], Program] = Program
        self._events: list[E] = []
        self.malformed = 0  # ring-buffer records that did not decode

    @property
    def program(self) -> Program:
        if self._prog is None:
            raise RuntimeError(f"{self.family} probes not started")
        return self._prog

    # --- the program ---------------------------------------------------------------------
    def program_flags(self) -> list[str]:
        """The family's own -D flags (override)."""
        return []

    def cflags(self) -> list[str]:
        """Every -D flag the program is compiled with: the hit and loss counters' sizes, the
        family's own flags, the loss indices and the sizes of the ring-buffer records' ctypes classes."""
        flags = [f"-DKVW_NR_HITS={len(self.apis)}", f"-DKVW_NR_LOST={len(self.lost_sources)}"]
        flags += self.program_flags()
        flags += [f"-DKVW_LOST_{s.upper()}={i}" for i, s in enumerate(self.lost_sources)]
        return flags + sizeof_flags(self.mirrors)

    def start(self) -> None:
        """Compile and load the program and open its ring buffer (raises ``ProbeCompileError``)."""
        self._prog = self._program_factory(self.source, self.cflags())
        self._prog.open_ring_buffer(self.ring_buffer, self._on_event)

    def ebpf_text(self) -> str:
        return f"// cflags: {' '.join(self.cflags())}\n" + program_text(self.source)

    # --- what to attach ----------------------------------------------------------------
    def kind_of(self, lib: MappedLibrary) -> str | None:
        for kind, pattern in self.libraries_by_kind.items():
            if pattern.match(lib.name):
                return kind
        return None

    def process_flags(self, libs: Sequence[MappedLibrary]) -> set[str]:
        """Facts about the whole process that change what is attached (override)."""
        return set()

    def skip_reason(self, att: ProcessAttachment, api: UprobeApi) -> str:
        """Why ``api`` is left alone in this process, or "" (override)."""
        return ""

    # --- attaching ---------------------------------------------------------------------------
    def attach(self, pid: int) -> ProcessAttachment:
        """Attach to every matching library ``pid`` mapped that is not attached yet.

        Raises ``ProcessGoneDuringAttach`` when the process exits midway (what was
        attached is detached); a missing or refused symbol is a status, not an error.
        """
        att = self.attachments.setdefault(pid, ProcessAttachment(pid))
        try:
            libs = read_maps(pid, self.proc_root)
        except OSError as err:
            self.detach(pid)
            raise ProcessGoneDuringAttach(f"pid {pid}: {err}") from err
        att.flags |= self.process_flags(libs)
        for lib in libs:
            kind = self.kind_of(lib)
            key = (lib.dev, lib.inode)
            if kind is None or key in att.libraries:
                continue
            att.libraries[key] = lib
            self._attach_library(att, lib, kind)
        return att

    def _alive(self, pid: int) -> bool:
        return (self.proc_root / str(pid)).exists()

    def _attach_library(self, att: ProcessAttachment, lib: MappedLibrary, kind: str) -> None:
        host_path = lib.host_path(self.proc_root)
        try:
            table = self.symbols.get(host_path)
        except LibraryError as err:
            if not self._alive(att.pid):
                self.detach(att.pid)
                raise ProcessGoneDuringAttach(str(err)) from err
            att.symbols += [
                SymbolAttach(lib.path, a.label, HookState.FAILED, str(err)) for a in self.apis if a.lib == kind
            ]
            return
        for api in self.apis:
            if api.lib == kind:
                att.symbols.append(self._attach_symbol(att, lib, host_path, table, api))

    def _attach_symbol(
        self, att: ProcessAttachment, lib: MappedLibrary, host_path: str, table: SymbolTable, api: UprobeApi
    ) -> SymbolAttach:
        skip = self.skip_reason(att, api)
        if skip:
            return SymbolAttach(lib.path, api.label, HookState.DISABLED, skip)
        addr = resolve(table, api)
        if addr is None:
            return SymbolAttach(lib.path, api.label, HookState.MISSING, f"no {api.symbol} in {lib.name}")
        try:
            # the return probe first: an entry probe without its return, on a call running while
            # they attach, would leave the thread a call in flight that never returns, and take
            # its later calls for calls nested beneath it until the record is stale
            for retprobe, fn in ((True, f"kvw_return_{api.fn}"), (False, f"kvw_enter_{api.fn}")):
                ev = self.program.attach_uprobe(api.label, host_path, fn, pid=att.pid, addr=addr, retprobe=retprobe)
                if ev:
                    att.events.append(ev)
                    att.api_events.setdefault(api.label, []).append((ev, retprobe))
        except ProbeAttachError as err:
            if not self._alive(att.pid):
                self.detach(att.pid)
                raise ProcessGoneDuringAttach(f"pid {att.pid} exited during attach") from err
            return SymbolAttach(lib.path, api.label, HookState.FAILED, err.reason)
        return SymbolAttach(lib.path, api.label, HookState.ATTACHED)

    def detach(self, pid: int) -> int:
        att = self.attachments.pop(pid, None)
        if att is None:
            return 0
        n = sum(1 for ev in att.events if self.program.detach_uprobe_event(ev))
        self.forget_counters(pid)
        return n

    def shed(self, pid: int, labels: Iterable[str]) -> int:
        """Detach the probes of these APIs from ``pid``, keeping its counters and the other APIs'
        probes (the cost budget sheds the ones that cost most); returns the probes detached."""
        att = self.attachments.get(pid)
        if att is None:
            return 0
        labels = set(labels)
        events = [e for label in labels for e in att.api_events.pop(label, [])]
        n = 0
        # the entry probes first, released before the returns go: a call running meanwhile
        # still returns through its probe, and no thread is left a call in flight that would
        # make the process's calls of the APIs still probed look nested beneath it
        for returns in (False, True):
            for ev, is_return in events:
                if is_return is returns:
                    att.events.remove(ev)
                    n += self.program.detach_uprobe_event(ev)
            if not returns:
                self.program.wait_releases(RELEASE_WAIT_SECONDS)
        att.symbols = [
            SymbolAttach(s.library, s.api, HookState.SHED) if s.api in labels and s.state is HookState.ATTACHED else s
            for s in att.symbols
        ]
        att.shed |= labels
        return n

    def unshed(self, pid: int) -> None:
        """Attach the shed APIs of ``pid`` again (after the kernel released them: ``settle``),
        its calls left in flight by the shedding dropped first."""
        att = self.attachments.get(pid)
        if att is None or not att.shed:
            return
        self.forget_threads(pid)
        labels, att.shed = att.shed, set()
        att.symbols = [s for s in att.symbols if not (s.api in labels and s.state is HookState.SHED)]
        for lib in att.libraries.values():
            kind = self.kind_of(lib)
            host_path = lib.host_path(self.proc_root)
            try:
                table = self.symbols.get(host_path)
            except LibraryError:
                continue
            for api in self.apis:
                if api.lib == kind and api.label in labels:
                    att.symbols.append(self._attach_symbol(att, lib, host_path, table, api))

    def settle(self, timeout: float | None = None) -> None:
        """Wait until every detached probe is released by the kernel (detach returns first;
        measurements that compare attached with detached need the probes really gone)."""
        self.program.wait_releases(timeout)

    def forget_threads(self, tgid: int) -> None:
        """Drop the calls of a process left in flight by probes detached while they ran: their
        returns were never seen, and an entry would take each for a call nested beneath it."""
        prog = self.program
        for name in self.thread_maps:
            table = prog.table(name)
            for k in [k for k in table if k.value >> 32 == tgid]:
                with contextlib.suppress(KeyError):
                    del table[k]

    def forget_counters(self, tgid: int) -> None:
        """Drop the family's in-kernel counters of a process."""
        prog = self.program
        for name in self.process_maps:
            table = prog.table(name)
            for k in [k for k in table if k.tgid == tgid]:
                with contextlib.suppress(KeyError):
                    del table[k]
        if self.process_map:
            table = prog.table(self.process_map)
            with contextlib.suppress(KeyError):
                del table[table.Key(tgid)]

    # --- reading -------------------------------------------------------------------------------
    def decode(self, data: bytes) -> E:
        """One ring-buffer record as an event; ``ValueError`` when malformed (override)."""
        raise NotImplementedError

    def _on_event(self, data: bytes) -> None:
        try:
            self._events.append(self.decode(data))
        except ValueError:
            self.malformed += 1

    def poll(self, timeout_ms: int) -> None:
        """Drain the ring buffer, waiting at most ``timeout_ms`` for the first record."""
        self.program.poll(timeout_ms)

    def consume(self) -> None:
        """Drain the ring buffer without waiting."""
        self.program.consume()

    def take_events(self) -> list[E]:
        out, self._events = self._events, []
        return out

    def hit_counts(self) -> dict[str, int]:
        """Per API label, the runs of its entry probe in any process since the load."""
        return percpu_array_sums(self.program.table("hits"), [a.label for a in self.apis])

    def lost_counts(self) -> dict[str, int]:
        """Per loss source, the events the program dropped since the load."""
        return percpu_array_sums(self.program.table("lost"), self.lost_sources)

    def close(self) -> None:
        if self._prog is not None:
            for pid in list(self.attachments):
                self.detach(pid)
            self._prog.close()
            self._prog = None
