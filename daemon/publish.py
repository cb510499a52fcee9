"""Building the immutable per-tick snapshot from the agent's state."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvwatch.daemon.engines.views import LOST_BYTES, EngineView, LossTotal
from kvwatch.daemon.series import SeriesSet
from kvwatch.daemon.snapshot import CudaView, ProbeView, ProcessView, Snapshot, TierView, TransferView
from kvwatch.probes.cuda import CUDA_APIS
from kvwatch.probes.records import HookState

if TYPE_CHECKING:
    from kvwatch.daemon.agent import Agent
    from kvwatch.daemon.tracker import Tracked

RATE_WINDOW = 5.0
TIER_TOTALS = (
    "reclaim_bytes",
    "policy_bytes",
    "reclaim_pages",
    "policy_pages",
    "refault_pages",
    "added_pages",
)
PROCESS_RATES = (
    "page_free_pages",
    "direct_reclaim_seconds",
    "memcg_reclaim_seconds",
    "cuda_alloc_calls",
    "cuda_free_calls",
    "cuda_alloc_bytes",
    "cuda_freed_bytes",
    "xfer_bytes",
)
KV_RATE_PREFIXES = ("kv_removed_blocks:", "kv_regretted_blocks:", LOST_BYTES)  # per medium / tier:cause
CUDA_API_CLASSES = {
    a.label: "alloc" if a.is_alloc else "free" if a.is_free else "map" for a in CUDA_APIS if not a.is_copy
}


def _process_rates(t: Tracked) -> dict[str, float]:
    """The fixed rates, plus KV blocks removed and regretted per medium (``kv_removed_blocks:GPU``)."""
    names = [*PROCESS_RATES, *(n for n in t.series.series if n.startswith(KV_RATE_PREFIXES))]
    return t.series.rates(names, RATE_WINDOW)


def process_labels(t: Tracked) -> dict[str, str]:
    lab = t.proc.labels
    return {
        "pid": str(t.pid),
        "engine": lab.engine,
        "role": lab.role,
        "component": lab.component,
        "container": lab.container,
        "pod": lab.pod,
    }


def _cuda_view(agent: Agent, t: Tracked) -> CudaView | None:
    if agent.cuda_tracker is None:
        return None
    st = agent.cuda_tracker.state(t.pid)
    if st is None:
        return None
    c = st.counters
    return CudaView(
        apis=dict(c.apis) if c else {},
        api_classes=CUDA_API_CLASSES,
        outstanding=c.outstanding() if c else {"device": 0, "host": 0, "vmm": 0},
        failures=st.failures,
        symbols_attached=st.symbols_attached,
        libraries=st.libraries,
        ucx_hooks=st.ucx,
    )


def _transfer_view(agent: Agent, t: Tracked) -> TransferView | None:
    tracker = agent.transfer_tracker
    if tracker is None:
        return None
    st = tracker.state(t.pid)
    if st is None:
        return None
    c = st.counters
    busy = t.series.delta("nixl_duration_seconds", RATE_WINDOW)
    return TransferView(
        xfers=dict(c.xfers) if c else {},
        registered_bytes=c.registered_bytes if c else 0,
        registrations=c.reg_calls if c else 0,
        deregistrations=c.dereg_calls if c else 0,
        registration_errors=c.reg_errors if c else 0,
        released_incomplete=c.released_incomplete if c else 0,
        symbols_attached=st.symbols_attached,
        libraries=st.libraries,
        effective_bytes_per_second=t.series.delta("nixl_bytes", RATE_WINDOW) / busy if busy > 0 else 0.0,
    )


def _family_probe_views(agent: Agent) -> list[ProbeView]:
    views: list[ProbeView] = []
    for family in agent.families:
        tracker = family.tracker
        if tracker is not None:
            states = tracker.api_states()
            any_attached = bool(tracker.probes.attachments)
            for api in tracker.probes.apis:
                text = states[api.label].value if any_attached else "idle"  # no process of this kind yet
                views.append(
                    ProbeView(
                        api.label, family.name, f"{api.lib}:{api.symbol}", text, False, tracker.hits.get(api.label, 0)
                    )
                )
        elif family.enabled:
            views += [
                ProbeView(a.label, family.name, f"{a.lib}:{a.symbol}", HookState.FAILED.value, True, 0, family.failure)
                for a in family.probe_apis
            ]
    return views


def _probe_views(agent: Agent) -> list[ProbeView]:
    memory = agent.memory_family
    hits = memory.sample.hits if memory.sample else {}
    views = [
        ProbeView(s.name, s.family, s.target, s.state.value, s.required, hits.get(s.name, 0), s.reason)
        for s in memory.statuses
    ]
    views += _family_probe_views(agent)
    return views


def _lost(agent: Agent) -> dict[str, int]:
    """Every count of events kvwatch dropped, by where they were dropped."""
    memory = agent.memory_family
    lost = dict(memory.sample.lost) if memory.sample else {}
    lost["malformed_events"] = memory.malformed
    lost["exec_hints_dropped"] = agent.tracker.stats.hints_dropped
    if agent.cuda_tracker is not None:
        lost.update({f"cuda_{k}" if not k.startswith("cuda_") else k: v for k, v in agent.cuda_tracker.lost.items()})
    if agent.transfer_tracker is not None:
        lost.update(agent.transfer_tracker.lost)
    if agent.engines is not None:
        lost["kv_event_batches"] = agent.engines.lost_batches
        lost.update(agent.engines.blocks_forgotten)
    if memory.tiers is not None and memory.tiers.stats.map_full:
        lost["kv_inodes_full"] = memory.tiers.stats.map_full
    return lost


def _process_views(agent: Agent) -> tuple[ProcessView, ...]:
    gpu = agent.gpu_used
    window = agent.config.detectors.eviction_burst.window_seconds
    return tuple(
        ProcessView(
            key=t.key,
            pid=t.pid,
            labels=process_labels(t),
            source=t.proc.source,
            alive=t.exited_at is None,
            totals=dict(t.totals),
            rates=_process_rates(t),
            gpu_used_bytes=gpu.get(t.pid),
            cuda=_cuda_view(agent, t),
            transfers=_transfer_view(agent, t),
            engine=_engine_view(agent, t, window),
            kv_losses=_losses(agent, t),
            kv_audit=agent.audit.rows.get(t.key, ()),
            uprobe_costs=agent.self_cost.costs(t.key, _shed(agent, t.pid)),
        )
        for t in agent.tracker.tracked()
    )


def _shed(agent: Agent, pid: int) -> dict[str, bool]:
    return {f.name: f.tracker.is_shed(pid) for f in agent.families if f.tracker is not None}


def _engine_view(agent: Agent, t: Tracked, window: float) -> EngineView | None:
    view = agent.engines.view(t, window) if agent.engines else None
    led = agent.losses.engines.get(t.key)
    if view is None or led is None or led.block_bytes.value is None:
        return view
    return replace(view, block_bytes=led.block_bytes.value, block_bytes_source=led.block_bytes.source)


def _losses(agent: Agent, t: Tracked) -> dict[tuple[str, str], LossTotal]:
    led = agent.losses.engines.get(t.key)
    return led.totals() if led is not None else {}


def _tier_views(agent: Agent) -> tuple[TierView, ...]:
    memory = agent.memory_family
    if memory.tiers is None:
        return ()
    views = []
    for tier in memory.tiers.tiers.values():
        series = memory.tier_series.get(tier.tier_id, SeriesSet())
        views.append(
            TierView(
                key=f"tier:{tier.tier_id}",
                tier_id=tier.tier_id,
                name=tier.name,
                path=str(tier.path),
                source=tier.source,
                owners=tuple(sorted(t.pid for t in memory.tier_owners(tier))),
                files=len(tier.files),
                totals={n: series.last(n) for n in TIER_TOTALS},
                rates=series.rates(("reclaim_bytes", "policy_bytes", "refault_pages"), RATE_WINDOW),
            )
        )
    return tuple(views)


def build_snapshot(agent: Agent, now: float, loop_seconds: float) -> Snapshot:
    errors = dict(agent.errors.counts)
    errors["alert_sink"] = agent.alerts.sink_errors
    watched: dict[str, int] = {}
    for t in agent.tracker.tracked():
        if t.exited_at is None:
            watched[t.proc.labels.engine] = watched.get(t.proc.labels.engine, 0) + 1
    reasons = agent.not_ready_reasons()
    return Snapshot(
        wall_time=agent.wall(),
        monotonic=now,
        tick=agent.tick_count,
        ready=not reasons,
        not_ready_reasons=reasons,
        processes=_process_views(agent),
        tiers=_tier_views(agent),
        alerts=tuple(agent.alerts.active.values()),
        alerts_fired=dict(agent.alerts.fired),
        oom_kills=dict(agent.memory_family.oom_kills),
        probes=tuple(_probe_views(agent)),
        lost=_lost(agent),
        errors=errors,
        watched_by_engine=watched,
        label_overflow=agent.tracker.stats.label_overflow,
        loop_seconds=loop_seconds,
        psi_memory_some_avg10=agent.pressure.node(),
        recent_alerts=tuple(agent.alerts.history[-50:]),
        link_bytes_per_second=agent.link_bytes_per_second,
        transfers_pending=agent.transfer_tracker.pending if agent.transfer_tracker else 0,
        uprobe_releases_pending=sum(
            f.probes.program.pending_releases() for f in agent.families if f.tracker is not None and f.probes
        ),
        alertmanager=agent.alerts.sink_stats(),
        departed_losses=tuple((labels, led.totals()) for _, labels, led in agent.losses.departed.values()),
        self_cost=agent.self_cost.view(f.name for f in agent.families if f.tracker is not None),
    )
