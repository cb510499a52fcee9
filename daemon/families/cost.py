"""What kvwatch's uprobes cost each watched process, live, and the budget's circuit breaker
(docs/architecture.md, "What kvwatch costs, live").

A probed call costs its caller two traps and two BPF programs. The traps are timed at start by
a canary (``probes/canary.py``); the programs' own time comes from the kernel's BPF statistics
when they are on (per program: run time over runs). So a family's per-call cost is the canary's
plus, with statistics, the family's mean program time per call (an entry and a return run).
Per process, each tick: the calls its probes trapped (the families' own counters) times that
cost, as a share of the CPU time the process used (``/proc/PID/stat``: the traps are charged to
it). Judged over disjoint windows of ``window_seconds``; over ``budget`` (and above an absolute
floor) for ``windows`` windows in a row, the family costing the process most has its busiest
uprobes detached for that process: the APIs making up ``HOT_SHARE`` of its calls in the window
(the whole family where it does not count per API). Its counts are kept, its other probes and
the kernel tracepoints stay. They are attached again after a back-off that doubles while
shedding recurs and resets once the process stays within budget for as many windows. While
shed those calls are not seen, so their rate cannot be watched: the back-off is the test of
whether it fell (and nothing more is judged for the process until then).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from kvwatch.daemon.config import SelfCostConfig
from kvwatch.daemon.families.attachments import FamilyProcesses
from kvwatch.daemon.host.procfs import ProcError, ProcFS
from kvwatch.daemon.model.snapshot import FamilyCost, ProgramRuns, SelfCostView
from kvwatch.daemon.tracker import Tracked
from kvwatch.probes.bpf import Program
from kvwatch.probes.uprobes import PerProcessUprobes

log = structlog.get_logger("kvwatch.selfcost")


@dataclass(slots=True)
class _Calls:
    calls: float | None = None  # at the last tick
    cost_seconds: float = 0.0
    window_cost: float = 0.0
    sheds: int = 0
    api_last: dict[str, float] = field(default_factory=dict)  # per API, where the family counts so
    api_window: dict[str, float] = field(default_factory=dict)  # calls in the window


@dataclass(slots=True)
class _Process:
    backoff: float
    t0: float | None = None
    cpu0: float = 0.0
    over: int = 0
    calm: int = 0
    ratio: float | None = None
    families: dict[str, _Calls] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sample:
    """One watched process at one tick: its CPU seconds and, per family, its probed calls
    (None: not attached) and whether the family is shed for it now."""

    key: str
    pid: int
    cpu_seconds: float
    calls: Mapping[str, float | None]
    shed: Mapping[str, bool]
    api_calls: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # family -> API -> calls


HOT_SHARE = 0.9  # of a shed family's calls in the window, the APIs shed (the busiest first)


def hot_apis(window: Mapping[str, float]) -> tuple[str, ...] | None:
    """The busiest APIs making up ``HOT_SHARE`` of the window's calls; None when not counted
    per API (the whole family is shed)."""
    total = sum(window.values())
    if total <= 0:
        return None
    out, acc = [], 0.0
    for api, n in sorted(window.items(), key=lambda kv: -kv[1]):
        out.append(api)
        acc += n
        if acc >= HOT_SHARE * total:
            break
    return tuple(out)


class SelfCost:
    def __init__(self, config: SelfCostConfig) -> None:
        self.config = config
        self.canary_ns: float | None = None
        self.canary_program_ns = 0.0  # of that, the canary's own minimal programs (BPF statistics on)
        self.canary_error = ""
        self.bpf_stats = False
        self._bpf_per_call: dict[str, float] = {}
        self._programs: tuple[ProgramRuns, ...] = ()
        self._procs: dict[str, _Process] = {}
        self.sheds: dict[str, int] = {}

    # --- the per-call cost ------------------------------------------------------------------
    def calibrated(self, canary_ns: float | None, error: str = "", program_ns: float = 0.0) -> None:
        """``program_ns``: the canary's own programs' time per call, where the statistics gave it:
        with a family's program time added instead, the traps are what is left of the canary."""
        self.canary_ns, self.canary_error, self.canary_program_ns = canary_ns, error, program_ns

    def programs(self, runs: Mapping[str, Mapping[str, tuple[int, int]]], stats_on: bool) -> None:
        """Per family, per BPF function: (run_time_ns, run_cnt) since the load."""
        self.bpf_stats = stats_on
        self._programs = tuple(
            ProgramRuns(fam, name, ns / 1e9, cnt) for fam, progs in runs.items() for name, (ns, cnt) in progs.items()
        )
        self._bpf_per_call = {}
        if stats_on:
            for fam, progs in runs.items():
                ns, cnt = sum(v[0] for v in progs.values()), sum(v[1] for v in progs.values())
                if cnt:
                    self._bpf_per_call[fam] = 2 * ns / cnt  # an entry and a return run per call

    def call_ns(self, family: str) -> float | None:
        if self.config.call_cost_ns > 0:
            return self.config.call_cost_ns
        if self.canary_ns is None:
            return None
        if family in self._bpf_per_call:
            return self.canary_ns - self.canary_program_ns + self._bpf_per_call[family]
        return self.canary_ns

    def source(self, family: str) -> str:
        if self.config.call_cost_ns > 0:
            return "config"
        return "canary+bpf_stats" if family in self._bpf_per_call else "canary"

    # --- per tick -----------------------------------------------------------------------------
    def update(self, samples: Iterable[Sample], now: float) -> list[tuple[int, str, tuple[str, ...] | None, float]]:
        """Returns the sheds to make: (pid, family, its APIs to shed (None: all), back-off seconds)."""
        out: list[tuple[int, str, tuple[str, ...] | None, float]] = []
        seen = set()
        for s in samples:
            seen.add(s.key)
            p = self._procs.get(s.key)
            if p is None:
                p = self._procs[s.key] = _Process(self.config.backoff_seconds)
            shed = self._account(p, s, now)
            if shed is not None:
                out.append((s.pid, shed, hot_apis(p.families[shed].api_window), p.backoff))
                p.backoff = min(2 * p.backoff, self.config.backoff_max_seconds)
        for key in list(self._procs):
            if key not in seen:
                del self._procs[key]
        return out

    def _account(self, p: _Process, s: Sample, now: float) -> str | None:
        for fam, calls in s.calls.items():
            f = p.families.setdefault(fam, _Calls())
            cost_ns = self.call_ns(fam)
            if calls is not None and f.calls is not None and calls >= f.calls and cost_ns is not None:
                cost = (calls - f.calls) * cost_ns / 1e9
                f.cost_seconds += cost
                f.window_cost += cost
            f.calls = calls
            for api, n in s.api_calls.get(fam, {}).items():
                last = f.api_last.get(api)
                if last is not None and n >= last:
                    f.api_window[api] = f.api_window.get(api, 0.0) + n - last
                f.api_last[api] = n
        if any(s.shed.values()) or p.t0 is None or (self.canary_ns is None and self.config.call_cost_ns <= 0):
            self._open(p, s, now)  # nothing to judge while shed or before the cost is known
            return None
        dt = now - p.t0
        if dt < self.config.window_seconds:
            return None
        cost = sum(f.window_cost for f in p.families.values())
        cpu = s.cpu_seconds - p.cpu0
        p.ratio = cost / cpu if cpu > 0 else None
        c = self.config
        over = c.budget > 0 and (p.ratio is None or p.ratio > c.budget) and cost / dt * 1e3 >= c.floor_ms_per_second
        p.over, p.calm = (p.over + 1, 0) if over else (0, p.calm + 1)
        if p.calm >= c.windows:
            p.backoff = c.backoff_seconds
        worst = max(p.families.items(), key=lambda kv: kv[1].window_cost)[0] if p.families else ""
        if p.over >= c.windows and worst:
            self._open(p, s, now, keep=worst)
            p.over = 0
            p.families[worst].sheds += 1
            self.sheds[worst] = self.sheds.get(worst, 0) + 1
            log.warning(
                "uprobe cost over budget: shedding",
                pid=s.pid,
                family=worst,
                cost_ratio=round(p.ratio, 4) if p.ratio is not None else None,
                budget=c.budget,
                backoff_seconds=p.backoff,
            )
            return worst
        self._open(p, s, now)
        return None

    @staticmethod
    def _open(p: _Process, s: Sample, now: float, keep: str = "") -> None:
        """A new window; ``keep``: that family's per-API calls stay until the shed is made."""
        p.t0, p.cpu0 = now, s.cpu_seconds
        for name, f in p.families.items():
            f.window_cost = 0.0
            if name != keep:
                f.api_window = {}

    # --- what the snapshot shows ---------------------------------------------------------------
    def ratio(self, key: str) -> float | None:
        p = self._procs.get(key)
        return p.ratio if p is not None else None

    def costs(self, key: str, shed: Mapping[str, bool]) -> tuple[FamilyCost, ...]:
        p = self._procs.get(key)
        if p is None:
            return ()
        return tuple(
            FamilyCost(fam, f.cost_seconds, p.ratio, shed.get(fam, False), f.sheds)
            for fam, f in sorted(p.families.items())
            if f.calls is not None or f.sheds
        )

    def view(self, families: Iterable[str]) -> SelfCostView:
        return SelfCostView(
            bpf_stats=self.bpf_stats,
            canary_call_ns=self.canary_ns,
            call_ns={f: (ns, self.source(f)) for f in families if (ns := self.call_ns(f)) is not None},
            programs=self._programs,
            sheds=dict(self.sheds),
        )


def calibrate_in_background(
    meter: SelfCost, measure: object, then: Callable[[], object] | None = None
) -> threading.Thread:
    """Time the canary off the loop thread (a compile and ~0.2 s of calls); ``then`` runs after
    it either way: the canary compiles after start-up gave the compiler's memory back, so
    ``then`` gives it back again (~40 MiB of heap and library pages otherwise kept for good)."""

    def run() -> None:
        try:
            result = measure()  # type: ignore[operator]
        except Exception as err:  # a canary that cannot run leaves the meter without a cost
            meter.calibrated(None, str(err))
            log.warning("uprobe cost canary failed: the budget is not enforced", error=str(err))
            return
        finally:
            if then is not None:
                then()
        meter.calibrated(result.call_ns, program_ns=result.bpf_ns / result.calls if result.bpf_runs else 0.0)
        log.info(
            "uprobe cost measured",
            call_ns=round(result.call_ns, 1),
            calls=result.calls,
            trapped=result.entries,
            exact=result.exact,
        )

    t = threading.Thread(target=run, name="kvwatch-selfcost-canary", daemon=True)
    t.start()
    return t


CLK_TCK = os.sysconf("SC_CLK_TCK")


class _Family(Protocol):
    name: str

    @property
    def processes(self) -> FamilyProcesses | None: ...

    @property
    def probes(self) -> PerProcessUprobes[Any] | None: ...


def account_self_cost(  # noqa: PLR0917 - one call site, the agent's tick
    meter: SelfCost,
    families: Iterable[_Family],
    memory: Program | None,
    tracked: Sequence[Tracked],
    procfs: ProcFS,
    stats_on: bool,
    now: float,
) -> None:
    """One tick of the meter: the programs' run statistics, each watched process's probed calls
    and CPU time, and the sheds the breaker decided, handed to the families' attachers."""
    fams = {f.name: f for f in families if f.processes is not None and f.probes is not None}
    runs: dict[str, dict[str, tuple[int, int]]] = {}
    if stats_on:
        runs = {n: f.probes.program.run_stats() for n, f in fams.items() if f.probes is not None}
        if memory is not None:
            runs["memory"] = memory.run_stats()
    meter.programs(runs, stats_on)
    samples: list[tuple[Tracked, Sample]] = []
    for t in tracked:
        calls: dict[str, float | None] = {n: t.uprobes[n].calls for n in fams if n in t.uprobes}
        if t.exited_at is not None or not calls:
            continue
        try:
            cpu = procfs.stat(t.pid).cpu_ticks / CLK_TCK
        except ProcError:
            continue
        shed = {n: f.processes.shedding(t.pid) for n, f in fams.items() if f.processes is not None}
        per_api = {n: f.processes.api_calls(t.pid) for n, f in fams.items() if f.processes is not None}
        samples.append((t, Sample(t.key, t.pid, cpu, calls, shed, per_api)))
    for pid, name, apis, backoff in meter.update((s for _, s in samples), now):
        procs = fams[name].processes
        if procs is not None:
            procs.request_shed(pid, backoff, apis)
    for t, s in samples:
        ratio = meter.ratio(s.key)
        if ratio is not None:
            t.uprobe_cost_ratio = ratio
