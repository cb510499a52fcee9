"""Finding inference processes: rules (data), hand-added PIDs, NVML, children.

A scan reads ``/proc`` once per process (stat + cmdline; cgroup and a few
environment keys only for matches) and returns typed ``DiscoveredProcess``
records. Processes that vanish mid-read are skipped and counted, never raised.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvwatch.daemon.config import DiscoveryConfig, EngineEndpoint, EngineRule
from kvwatch.daemon.engines.kinds import KINDS
from kvwatch.daemon.host.cgroups import CgroupIdentity, parse_cgroup
from kvwatch.daemon.host.procfs import (
    ProcAccessDenied,
    ProcError,
    ProcessGone,
    ProcessIdentity,
    ProcessInfo,
    ProcFS,
)

# Which processes are which engine's, which component of it, its disaggregation role and the
# environment kept: each engine's own module says (daemon/engines/kinds/), in KINDS' order.
DEFAULT_RULES: tuple[EngineRule, ...] = tuple(r for k in KINDS for r in k.rules)
_COMPONENTS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), name)
    for pattern, name in (*(c for k in KINDS for c in k.components), *(c for k in KINDS for c in k.late_components))
)
_ROLES: tuple[tuple[re.Pattern[str], Mapping[str, str]], ...] = tuple(
    (re.compile(pattern), names) for k in KINDS for pattern, names in k.roles
)

# Environment keys read from a matched process (and nothing else is kept): the engines' own, and
# the CUDA caching allocator's settings.
ENV_KEYS = (
    "HOSTNAME",
    *(key for k in KINDS for key in k.environ),
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
)


@dataclass(frozen=True, slots=True)
class CompiledRule:
    engine: str
    comm: re.Pattern[str] | None
    cmdline: re.Pattern[str] | None
    role: str | None

    def matches(self, comm: str, cmdline: str) -> bool:
        if self.comm is not None and self.comm.search(comm):
            return True
        return self.cmdline is not None and bool(self.cmdline.search(cmdline))


def compile_rules(rules: Iterable[EngineRule]) -> list[CompiledRule]:
    return [
        CompiledRule(
            engine=r.engine,
            comm=re.compile(r.comm) if r.comm else None,
            cmdline=re.compile(r.cmdline) if r.cmdline else None,
            role=r.role,
        )
        for r in rules
    ]


@dataclass(frozen=True, slots=True)
class Labels:
    engine: str
    role: str = ""  # disaggregation role: prefill / decode / both, "" when not disaggregated
    component: str = ""  # which process of the engine: api_server, engine_core, worker, ...
    container: str = ""
    pod: str = ""


@dataclass(frozen=True, slots=True)
class DiscoveredProcess:
    identity: ProcessIdentity
    comm: str
    cmdline: str
    labels: Labels
    source: str  # rule / manual / nvml / child
    cgroup: CgroupIdentity
    environ: dict[str, str] = field(default_factory=dict)
    parent: ProcessIdentity | None = None
    ppid: int = 0  # the parent's PID when it was read (an engine's processes descend from its server)

    @property
    def pid(self) -> int:
        return self.identity.pid


@dataclass(slots=True)
class ScanStats:
    scanned: int = 0
    vanished: int = 0
    denied: int = 0
    errors: int = 0


def disagg_role(cmdline: str) -> str:
    for pattern, names in _ROLES:
        m = pattern.search(cmdline)
        if m:
            return names.get(m.group(1), "")
    return ""


def component_of(comm: str, cmdline: str) -> str:
    for pattern, name in _COMPONENTS:
        if pattern.search(comm) or pattern.search(cmdline):
            return name
    return ""


def endpoint_targets(endpoints: Iterable[EngineEndpoint]) -> tuple[list[int], list[EngineRule]]:
    """``[[engines.endpoints]]`` name processes to tap: watch them even when no engine rule
    matches (their PIDs as if given with --pid, their command-line patterns as rules)."""
    pids = [ep.pid for ep in endpoints if ep.pid is not None]
    rules = [EngineRule(engine=ep.engine, cmdline=ep.cmdline) for ep in endpoints if ep.cmdline is not None]
    return pids, rules


class Discovery:
    """Stateless scanner: given /proc, config and optional NVML PIDs, which processes to watch."""

    def __init__(
        self,
        config: DiscoveryConfig,
        procfs: ProcFS,
        nvml_pids: Callable[[], Sequence[int]] | None = None,
        endpoints: Sequence[EngineEndpoint] = (),
    ) -> None:
        self.config = config
        self.procfs = procfs
        self.manual, extra_rules = endpoint_targets(endpoints)
        self.manual += config.pids
        rules = list(config.rules)
        if config.default_rules:
            rules += DEFAULT_RULES
        rules += extra_rules  # last: an engine's own rule names it better than a bare pattern
        self.rules = compile_rules(rules)
        self.nvml_pids = nvml_pids
        self.stats = ScanStats()

    def match(self, comm: str, cmdline: str) -> CompiledRule | None:
        for r in self.rules:
            if r.matches(comm, cmdline):
                return r
        return None

    def describe(
        self,
        info: ProcessInfo,
        engine: str,
        source: str,
        *,
        role: str | None = None,
        parent: DiscoveredProcess | None = None,
    ) -> DiscoveredProcess:
        """Build the record for a process we decided to watch (reads its cgroup and env keys)."""
        cg = parse_cgroup(info.cgroup)
        env: dict[str, str] = {}
        try:
            full = self.procfs.environ(info.pid)
        except ProcError:
            full = {}
        env = {k: full[k] for k in ENV_KEYS if k in full}
        text = info.cmdline_text
        labels = Labels(
            engine=engine,
            role=role or disagg_role(text) or (parent.labels.role if parent else ""),
            component=component_of(info.comm, text) or ("child" if parent else ""),
            container=cg.container_id or (parent.labels.container if parent else ""),
            pod=(env.get("HOSTNAME", "") if cg.pod_uid else "") or (parent.labels.pod if parent else ""),
        )
        return DiscoveredProcess(
            identity=info.identity,
            comm=info.comm,
            cmdline=text,
            labels=labels,
            source=source,
            cgroup=cg,
            environ=env,
            parent=parent.identity if parent else None,
            ppid=info.ppid,
        )

    def _classify(self, pid: int, manual: set[int], gpu: set[int]) -> DiscoveredProcess | None:
        """Cheap reads first (stat, cmdline); the full record only for a process we keep."""
        try:
            st = self.procfs.stat(pid)
            cmd = " ".join(self.procfs.cmdline(pid))
            rule = self.match(st.comm, cmd)
            if rule is None and pid not in manual and pid not in gpu:
                return None
            info = self.procfs.info(pid)
        except ProcessGone:
            self.stats.vanished += 1
            return None
        except ProcAccessDenied:
            self.stats.denied += 1
            return None
        if info.identity.start_ticks != st.start_ticks:
            self.stats.vanished += 1  # recycled between the reads
            return None
        if rule is not None:
            return self.describe(info, rule.engine, "rule", role=rule.role)
        return self.describe(info, "unknown", "manual" if pid in manual else "nvml")

    def examine(self, pid: int) -> DiscoveredProcess | None:
        """One PID (an exec or rename hint): a record if it matches a rule or was asked for."""
        return self._classify(pid, set(self.manual), set())

    def scan(self) -> list[DiscoveredProcess]:
        """Every process to watch right now (children are added by the caller, from the kernel)."""
        self.stats = ScanStats()
        manual = set(self.manual)
        gpu: set[int] = set()
        if self.nvml_pids is not None:
            try:
                gpu = set(self.nvml_pids())
            except Exception:  # NVML errors must not stop discovery
                self.stats.errors += 1
        try:
            pids = list(self.procfs.pids())
        except ProcError:
            self.stats.errors += 1
            return []
        found: list[DiscoveredProcess] = []
        for pid in pids:
            self.stats.scanned += 1
            d = self._classify(pid, manual, gpu)
            if d is not None:
                found.append(d)
        return found
