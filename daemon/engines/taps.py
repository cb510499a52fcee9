"""Engine taps: which KV event streams and /metrics endpoints belong to which watched process.

Given by hand in ``[[engines.endpoints]]`` (matched by PID or command-line pattern), or
found from the engine's own command line (``cmdline.py``) and reached across network
namespaces (``reach.py``). The component here keeps one plan per watched process, one
owner per endpoint, and turns the streams' and scrapes' state into per-process typed observations.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from kvwatch.daemon.config import EngineEndpoint, EnginesConfig
from kvwatch.daemon.engines.cmdline import plan_from_cmdline
from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.metrics import EngineScraper
from kvwatch.daemon.engines.planning import offset_port
from kvwatch.daemon.engines.reach import Reach
from kvwatch.daemon.engines.tenant_view import TenantFolds
from kvwatch.daemon.engines.tenants import TenantNamer, load_key
from kvwatch.daemon.host.procfs import ProcError, ProcessGone, ProcFS
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.cuda import CUDA, TREE, CopyCounts
from kvwatch.daemon.model.engine_scrape import ENGINE, NO_ENGINE, EngineState, scrape_counts, tier_counts
from kvwatch.daemon.model.engines import (
    EnginePlan,
    EngineSample,
    EngineView,
    GroupTotals,
    MediumTotals,
    ScrapeTarget,
    StreamSpec,
    StreamStats,
    TargetState,
    groups_of,
    media_of,
)
from kvwatch.daemon.model.kv_counts import LOGICAL_COUNTS, STREAM, KVState, MediumCounts, StreamEvents
from kvwatch.daemon.model.snapshot import ProbeView
from kvwatch.daemon.model.uprobes import UprobeState
from kvwatch.daemon.tracker import Tracked

log = structlog.get_logger("kvwatch.engine_taps")

REPLAN_SECONDS = 30.0
MAX_TREE_DEPTH = 8


def stream_observation(streams: Sequence[StreamStats]) -> tuple[dict[str, MediumCounts], StreamEvents, KVState]:
    """A tapped process's KV event counts per medium, its stream-wide events and gauges, from
    the same sums over its streams as the exporters' view (``media_of``, ``groups_of``)."""
    events = StreamEvents(float(sum(s.cleared for s in streams)), float(sum(s.lost for s in streams)))
    groups = groups_of(streams)
    physical: dict[str, float] = {}
    bounded: set[str] = set()
    window_group: dict[str, GroupTotals] = {}
    for g in groups:  # physical: every group's blocks
        physical[g.medium] = physical.get(g.medium, 0.0) + g.totals.stored
        if g.full:
            continue
        if g.reference:
            bounded.add(g.medium)
        else:
            window_group.setdefault(g.medium, g)
    media: dict[str, MediumCounts] = {}
    logical = media_of(streams)  # each medium's reference group
    for medium in sorted(set(logical) | set(physical)):
        m = logical.get(medium, MediumTotals())
        w = window_group.get(medium)
        media[medium] = MediumCounts(
            **{name: float(getattr(m, name)) for name in LOGICAL_COUNTS},
            physical_stored=physical.get(medium, 0.0),
            window_regretted=float(w.totals.regretted) if w else 0.0,
        )
    resident = sum(g.totals.resident for g in groups if g.medium == "GPU")
    return media, events, KVState(float(resident), frozenset(bounded))


def plan_from_config(t: Tracked, ep: EngineEndpoint, cfg: EnginesConfig) -> EnginePlan:
    streams: list[StreamSpec] = []
    if ep.kv_events and cfg.kv_events:
        for rank in range(ep.data_parallel_ranks):
            replay = offset_port(ep.kv_events_replay, rank) if ep.kv_events_replay and cfg.kv_events_replay else None
            streams.append(StreamSpec(offset_port(ep.kv_events, rank), replay, ep.kv_events_topic, rank, t.key))
    url = ep.metrics_url if cfg.metrics else None
    return EnginePlan(t.key, t.pid, tuple(streams), url, (), "config")


def _matches(ep: EngineEndpoint, t: Tracked) -> bool:
    if ep.pid is not None:
        return t.pid == ep.pid
    return ep.cmdline is not None and re.search(ep.cmdline, t.proc.cmdline) is not None


# --- the agent's component -------------------------------------------------------------------------


@dataclass(slots=True)
class _Planned:
    plan: EnginePlan | None
    at: float
    sample_at: float = -1.0


class EngineTaps:
    def __init__(
        self,
        config: EnginesConfig,
        procfs: ProcFS,
        errors: ErrorBook,
        *,
        clock: Callable[[], float] = time.monotonic,
        hub: KVEventHub | None = None,
        scraper: EngineScraper | None = None,
    ) -> None:
        self.config = config
        self.procfs = procfs
        self.errors = errors
        self.clock = clock
        self.reach = Reach(procfs)

        def node_key() -> bytes:  # read (or made) at the first unnamed cache salt, not before
            key, problem = load_key(config.tenant_key_file)
            if problem:
                errors.record("tenant_key", f"tenant names will change at the next restart: {problem}", level="warning")
            return key

        self.hub = hub or KVEventHub(
            thrash_seconds=config.thrash_seconds,
            max_tracked_blocks=config.max_tracked_blocks,
            regret_memory_blocks=config.regret_blocks,
            kv_memory_bytes=config.kv_memory_bytes,
            replay_timeout_seconds=config.replay_timeout_seconds,
            clock=clock,
            namer=TenantNamer(config.tenants, node_key),
            errors=errors,  # the hub's own failures: kvwatch_errors_total{kind="kv_events_..."}
        )
        self.scraper = scraper or EngineScraper(
            interval=config.scrape_interval_seconds,
            timeout=config.scrape_timeout_seconds,
            thrash_seconds=config.thrash_seconds,
            clock=clock,
        )
        self._planned: dict[str, _Planned] = {}
        self._stats: dict[StreamSpec, StreamStats] = {}
        self._scrapes: dict[ScrapeTarget, TargetState] = {}
        # one tenant fold per tapped process: the detectors' tenant history here and the snapshot's view
        # (``tenants.view``) read the same, so an alert names only tenants the exporters label
        self.tenants = TenantFolds(config.tenant_top_k)
        # per tapped process, this tick: every process of the engine has its copy probes attached
        self.copy_probes: dict[str, bool] = {}

    def start(self) -> None:
        self.hub.start()
        self.scraper.start()

    def close(self) -> None:
        self.hub.close()
        self.scraper.close()

    def sync(self, tracked: Iterable[Tracked]) -> None:
        now = self.clock()
        alive = {t.key: t for t in tracked if t.exited_at is None}
        for key in [k for k in self._planned if k not in alive]:
            del self._planned[key]
        self.tenants.keep(alive)
        for key, t in alive.items():
            p = self._planned.get(key)
            if p is None or (p.plan is not None and p.plan.notes and now - p.at > REPLAN_SECONDS):
                self._planned[key] = _Planned(self._plan(t), now)
        streams: dict[str, StreamSpec] = {}
        targets: dict[str, ScrapeTarget] = {}
        # one owner per endpoint: the oldest process (a forked child keeps its parent's command line)
        for p in sorted(self._planned.values(), key=lambda x: alive[x.plan.owner].first_seen if x.plan else 0.0):
            if p.plan is None:
                continue
            for s in p.plan.streams:
                streams.setdefault(s.endpoint, s)
            if p.plan.metrics_url:
                targets.setdefault(p.plan.metrics_url, ScrapeTarget(p.plan.metrics_url, p.plan.owner))
        self.hub.set_streams(streams.values())
        self.scraper.set_targets(targets.values())
        self._stats = self.hub.stats()
        self._scrapes = self.scraper.states()

    def _plan(self, t: Tracked) -> EnginePlan | None:
        for ep in self.config.endpoints:
            if _matches(ep, t):
                return plan_from_config(t, ep, self.config)
        if not self.config.from_cmdline:
            return None
        try:
            argv = self.procfs.cmdline(t.pid)
        except ProcessGone as err:  # exited between discovery and now: normal, counted
            self.errors.record("engine_plan_gone", "engine exited before its command line was read", err, level="info")
            return None
        except ProcError as err:
            self.errors.record("engine_plan", "could not read an engine's command line", err)
            return None
        plan = plan_from_cmdline(t, argv, self.config, self.reach)
        if plan is not None:
            log.info(
                "engine taps",
                pid=t.pid,
                engine=t.proc.labels.engine,
                kv_event_streams=[s.endpoint for s in plan.streams],
                metrics=plan.metrics_url,
                notes=list(plan.notes),
            )
        return plan

    # --- per tick -----------------------------------------------------------------------------
    def tapped(self, t: Tracked) -> bool:
        p = self._planned.get(t.key)
        return p is not None and p.plan is not None

    def sample_of(self, owner: str) -> EngineSample | None:
        st = self._scrape_of(owner)
        return st.last if st is not None else None

    def streams_of(self, owner: str) -> list[StreamStats]:
        return self._streams_of(owner)

    def _streams_of(self, owner: str) -> list[StreamStats]:
        return [s for spec, s in self._stats.items() if spec.owner == owner]

    def _scrape_of(self, owner: str) -> TargetState | None:
        for target, st in self._scrapes.items():
            if target.owner == owner:
                return st
        return None

    def tapped_owner(self, t: Tracked, by_pid: Mapping[int, Tracked]) -> str | None:
        """The tapped process this one belongs to: itself, or its nearest watched ancestor with
        taps (a vLLM engine core and its workers descend from the API server)."""
        cur: Tracked | None = t
        for _ in range(MAX_TREE_DEPTH):
            if cur is None:
                return None
            p = self._planned.get(cur.key)
            if p is not None and p.plan is not None:
                return cur.key
            parent = by_pid.get(cur.proc.ppid)
            cur = parent if parent is not None and parent.first_seen <= cur.first_seen else None
        return None

    def sample(self, tracked: Iterable[Tracked], now: float) -> None:
        tracked = list(tracked)
        by_pid = {t.pid: t for t in tracked if t.exited_at is None}
        owners: dict[str, EngineState] = {}
        for t in tracked:
            state = self._observe_owner(t, now)
            if state is not None:
                owners[t.key] = state
        copies: dict[str, list[float]] = {}  # owner -> d2h, h2d bytes, members probed, members shed
        for t in tracked:  # the engine's other processes learn what their server says of it
            owner = self.tapped_owner(t, by_pid) if t.exited_at is None else None
            if owner is None:
                t.engine_state = NO_ENGINE
                continue
            own = owners.get(owner, EngineState(tapped=True))
            t.engine_state = own if t.key == owner else EngineState(tapped=True, sleeping=own.sleeping)
            if CUDA in t.copies:
                acc = copies.setdefault(owner, [0.0, 0.0, 0.0, 0.0])
                mine = t.copies.last(CUDA)
                probes = t.uprobes.get(CUDA, UprobeState())
                acc[0] += mine.d2h_bytes
                acc[1] += mine.h2d_bytes
                acc[2] += float(probes.symbols > 0)  # a CUDA library's probes attached
                acc[3] += float(probes.shed)
        self.copy_probes = {}
        for t in tracked:  # the copies of the engine's processes, summed on the tapped one (the audit's)
            if t.key in copies:
                d2h, h2d, probed, shed = copies[t.key]
                t.copies.add(now, {TREE: CopyCounts(h2d_bytes=h2d, d2h_bytes=d2h)})
                self.copy_probes[t.key] = probed > 0 and shed == 0

    def _observe_owner(self, t: Tracked, now: float) -> EngineState | None:
        """A tapped process's stream and scrape observations; its engine's gauges (None: not tapped)."""
        p = self._planned.get(t.key)
        if p is None or p.plan is None:
            return None
        streams = self._streams_of(t.key)
        if streams:
            media, events, t.kv_state = stream_observation(streams)
            t.kv.add(now, media)
            t.kv_events.add(now, {STREAM: events})
            t.tenants.add(now, self.tenants.pool(t.key, streams))
        st = self._scrape_of(t.key)
        sample = st.last if st is not None else None
        if sample is None:
            return EngineState(tapped=True)
        if sample.at > p.sample_at:  # a new scrape: its counters at its own time
            p.sample_at = sample.at
            t.engine.add(sample.at, {ENGINE: scrape_counts(sample)})
            t.engine_tiers.add(sample.at, tier_counts(sample.tiers))
        fresh = now - sample.at <= 3 * self.config.scrape_interval_seconds
        return EngineState(
            tapped=True,
            sleeping=bool(sample.sleeping) and fresh,
            fresh=fresh,
            usage=sample.usage if fresh else None,
            pool_blocks=sample.pool_blocks if sample.pool_blocks is not None and fresh else 0.0,
            scrape=sample,
        )

    def view(self, t: Tracked) -> EngineView | None:
        """What the taps know of the process (its ratios over windows are the snapshot's to add)."""
        p = self._planned.get(t.key)
        if p is None or p.plan is None:
            return None
        st = self._scrape_of(t.key)
        sample = st.last if st is not None else None
        return EngineView(
            plan=p.plan,
            streams=tuple(self._streams_of(t.key)),
            scrape=st,
            scrape_age=self.clock() - sample.at if sample is not None else None,
            hit_ratio=None,
            tiers=sample.tiers if sample is not None else (),
            latencies=sample.latencies if sample is not None else (),
        )

    name = "engines"

    def not_ready(self) -> tuple[str, ...]:
        return ()  # an engine's stream or page that cannot be read is an error, not a probe missing

    def probe_views(self) -> list[ProbeView]:
        return []

    def lost(self) -> dict[str, int]:
        """Batches missed and not replayed; entries the streams' full block memories dropped
        (store times: young removals missed; removals: regrets missed)."""
        media = [g.totals for s in self._stats.values() for g in s.groups]
        return {
            "kv_event_batches": sum(s.lost for s in self._stats.values()),
            "kv_store_times_forgotten": sum(m.stores_forgotten for m in media),
            "kv_removals_forgotten": sum(m.removals_forgotten for m in media),
        }
