"""KVTenantThrash on the simulated vLLM's pool, counted as the daemon counts it (the stream's
per-tenant blocks, the taps' series), one engine step a second: a noisy neighbour is named with
its victim and clears after it; a tenant that evicts its own blocks, a pool with one tenant, and
a flood that hurts nobody stay silent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvwatch.daemon.config import DetectorsConfig, TenantRule, TenantThrashConfig
from kvwatch.daemon.detectors.registry import alert_names, build_detectors
from kvwatch.daemon.detectors.tenant_thrash import TenantThrash
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.taps import stream_observation
from kvwatch.daemon.engines.tenant_view import TenantFolds
from kvwatch.daemon.engines.tenants import TenantNamer
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.engine_sim_pool import BlockPool, Scheduler
from kvwatch.daemon.model.engines import TenantCounts
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import STREAM, MediumCounts, StreamEvents
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow
from tests.support.kv_scripts import SCRIPT_SPEC

CFG = TenantThrashConfig(warmup_seconds=10, baseline_min_seconds=10, window_seconds=5, floor_regretted_per_second=2)
SUBJECT = Subject("7@1", {"pid": "7", "engine": "vllm"})
A, B = ("salt-a", None), ("salt-b", None)


RULES = [TenantRule(name="tenant-a", salt="salt-a"), TenantRule(name="tenant-b", salt="salt-b")]


@dataclass
class Engine:
    pool_blocks: int = 400
    sched: Scheduler = field(init=False)
    counts: StreamCounts = field(
        default_factory=lambda: StreamCounts((100_000, 100_000), 10.0, TenantNamer(RULES, b"k"))
    )
    kv: History[MediumCounts] = field(default_factory=lambda: History(MediumCounts))
    kv_events: History[StreamEvents] = field(default_factory=lambda: History(StreamEvents))
    tenants: History[TenantCounts] = field(default_factory=lambda: History(TenantCounts))
    folds: TenantFolds = field(default_factory=lambda: TenantFolds(8))
    config: TenantThrashConfig = CFG
    detector: TenantThrash = field(init=False)
    t: float = 0.0
    unique: int = 0

    def __post_init__(self) -> None:
        self.sched = Scheduler(BlockPool(self.pool_blocks), None, max_num_seqs=64, seed=3)
        self.detector = TenantThrash(self.config)

    def second(self, *tenants: tuple[Any, int, int]) -> dict[str, Finding]:
        """Per tenant (keys, requests, hot prefixes: 0 for unique prompts) 6-block prompts, one
        engine step; the findings that fire, by victim."""
        self.t += 1.0
        events: list[dict[str, Any]] = []
        for keys, n, hot in tenants:
            for i in range(n):
                if hot:
                    seed = 1000 * len(keys[0] or "") + (int(self.t) * n + i) % hot
                else:
                    self.unique += 1
                    seed = 10_000_000 + self.unique
                events += self.sched.run_now([3 + (seed * 7919 + j) % 31_000 for j in range(6 * 16 + 1)], keys)
        self.counts.ingest(we.encode_batch(we.Layout.V0_26, 1000.0 + self.t, events, 0, msgspec.msgpack.Encoder()))
        stats = self.counts.stats(
            SCRIPT_SPEC, connected=True, gaps=0, missed=0, replayed=0, lost=0, restarts=0,
            replay_requests=0, last_seq=0, last_message_at=0.0,
        )  # fmt: skip
        media, events, state = stream_observation([stats])
        self.kv.add(self.t, media)
        self.kv_events.add(self.t, {STREAM: events})
        self.tenants.add(self.t, self.folds.pool(SUBJECT.key, [stats]))
        window = ProcessWindow(
            SUBJECT, self.t, tenants=self.tenants, kv=self.kv, kv_events=self.kv_events, kv_state=state
        )
        view = NodeWindow(self.t, {SUBJECT.key: window}, {})
        return {f.subject.labels["tenant"]: f for f in self.detector.evaluate(view) if f.firing}


def test_a_noisy_neighbour_is_named_with_its_victim_and_clears_after_it() -> None:
    e = Engine()
    for _ in range(40):  # A's 40 hot prefixes (240 blocks) fit the 400-block pool: no regrets
        assert e.second((A, 8, 40)) == {}
    fired: dict[str, Finding] = {}
    onset = 0
    while not fired and onset < 20:  # B floods unique prompts: A's hot prefixes are pushed out, recomputed
        onset += 1
        fired = e.second((A, 8, 40), (B, 30, 0))
    assert set(fired) == {"tenant-a"} and onset <= 6, onset
    f = fired["tenant-a"]
    v = f.values
    assert f.subject.labels["aggressor"] == "tenant-b" and f.cause == "noisy_neighbour"
    assert f.subject.key == f"{SUBJECT.key}/tenant:tenant-a"
    assert v["aggressor_store_share"] >= 0.5 and v["victim_store_share"] < v["aggressor_store_share"]
    assert v["victim_regret_ratio_during"] > v["victim_regret_ratio_before"]
    assert v["victim_evicted_share"] > 0 and v["victim_evicted_share"] + v["aggressor_evicted_share"] <= 1.0
    for _ in range(30):  # B stops: it clears
        fired = e.second((A, 8, 40))
    assert fired == {}


def test_a_flood_in_an_engines_first_minutes_is_named_within_seconds_at_defaults() -> None:
    """The flood begins 100 s after kvwatch first saw the engine: within what used to be its
    warm-up, and learnt as the victim's normal there. The victim's baseline is known 30 s after it
    was first seen; the flood is evidence from its first window and never learnt."""
    e = Engine(config=TenantThrashConfig())
    for _ in range(100):
        assert e.second((A, 8, 40)) == {}
    onset, fired = 0, {}
    while not fired and onset < 60:
        onset += 1
        fired = e.second((A, 8, 40), (B, 30, 0))
    assert set(fired) == {"tenant-a"} and onset <= 10, onset
    assert fired["tenant-a"].subject.labels["aggressor"] == "tenant-b"
    for _ in range(120):  # a flood that lasts is still a flood: it fires throughout, then clears
        assert set(e.second((A, 8, 40), (B, 30, 0))) == {"tenant-a"}
    for _ in range(30):
        fired = e.second((A, 8, 40))
    assert fired == {}


def test_what_a_tenant_suffered_before_its_baseline_was_known_is_its_normal() -> None:
    """kvwatch started mid-flood cannot tell it from a standing arrangement: learnt, silent."""
    e = Engine(config=TenantThrashConfig())
    for _ in range(120):
        assert e.second((A, 8, 40), (B, 30, 0)) == {}
    assert e.counts.tenants()["GPU"]["tenant-a"].regretted > 1000  # it was thrashed all along


def test_a_tenant_that_evicts_its_own_blocks_is_no_victim() -> None:
    e = Engine()
    for _ in range(40):  # B's one prefix, used every second, is never the least recently used
        assert e.second((A, 8, 40), (B, 2, 1)) == {}
    for _ in range(25):  # A's hot set outgrows the pool: A recomputes, and A's stores dominate
        assert e.second((A, 30, 120), (B, 2, 1)) == {}
    assert e.counts.tenants()["GPU"]["tenant-a"].regretted > 100  # it did thrash, itself


def test_a_tenant_whose_own_thrash_pushes_out_anothers_hot_set_is_its_aggressor() -> None:
    e = Engine()
    for _ in range(40):
        assert e.second((A, 8, 40), (B, 2, 5)) == {}
    named = {}
    for _ in range(25):  # A outgrows the pool; B's 5 hot prefixes, used every 2-3 s, go with A's
        named |= {v: f.subject.labels["aggressor"] for v, f in e.second((A, 30, 120), (B, 2, 5)).items()}
    assert named == {"tenant-b": "tenant-a"}


def test_one_tenant_is_no_shared_pool_and_a_flood_that_hurts_nobody_is_silent() -> None:
    e = Engine()
    for _ in range(40):
        assert e.second((A, 8, 40)) == {}
    for _ in range(20):  # B floods, but A's 4 hot prefixes are used every second: never evicted
        assert e.second((A, 8, 4), (B, 30, 0)) == {}
    solo = Engine()
    for _ in range(40):
        assert solo.second(((None, None), 8, 40)) == {}
    for _ in range(20):  # the same flood from the only tenant: its own pool, nobody else's
        assert solo.second(((None, None), 8, 40), ((None, None), 30, 0)) == {}
    assert "tenant-a" not in solo.counts.tenants().get("GPU", {})


def test_registered() -> None:
    assert "KVTenantThrash" in alert_names(build_detectors(DetectorsConfig(), 0.0))
