"""The KV metric-truth audit (engines/audit.py) and KVEngineMetricDivergence, on synthetic series
and on a real vLLM 0.26.0's KV event stream and /metrics pages, offline."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvwatch.daemon.config import MetricDivergenceConfig
from kvwatch.daemon.detectors.metric_divergence import EngineMetricDivergence
from kvwatch.daemon.engines.audit import AuditInputs, AuditSettings, Evidence, ProcessAudit, divergence, diverges
from kvwatch.daemon.engines.metrics import parse_exposition
from kvwatch.daemon.model.cuda import TREE, CopyCounts
from kvwatch.daemon.model.engine_scrape import NO_ENGINE, EngineState
from kvwatch.daemon.model.engines import AuditRow, EngineSample
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import NO_STREAM, STREAM, KVState, MediumCounts, StreamEvents
from kvwatch.daemon.model.series import CounterSeries
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow
from tests.support.kv_scripts import REAL_BLOCK_BYTES
from tests.tools.vllm_run_fixtures import uncompact

FIXTURES = Path(__file__).parent.parent / "fixtures"
MIB = 1 << 20
SETTINGS = AuditSettings(window_seconds=10.0, tolerance=0.10, floor_bytes=64 * MIB)


def inputs() -> AuditInputs:
    """An engine process's readings, empty: its tree's copy sums, its stream's counts."""
    return AuditInputs(History(CopyCounts), History(MediumCounts), History(StreamEvents), NO_STREAM, NO_ENGINE)


FULL_EVIDENCE = Evidence(copy_probes=1.0, block_bytes=REAL_BLOCK_BYTES)  # probes attached, block size known


def feed(
    seconds: int,
    *,
    engine_share: float = 1.0,
    copies_share: float = 1.0,
    scrape_every: int = 2,
    bytes_per_second: float = 100 * MIB,
    evidence: Evidence = FULL_EVIDENCE,
    lost_at: int | None = None,
) -> tuple[ProcessAudit, list[tuple[AuditRow, ...]]]:
    """An engine offloading ``bytes_per_second`` in whole 512 KiB blocks; kvwatch's stream and
    copy probes read every second, the engine's counter every ``scrape_every`` seconds."""
    x = inputs()
    audit = ProcessAudit(SETTINGS)
    rows = []
    engine = NO_ENGINE
    blocks_per_second = bytes_per_second / REAL_BLOCK_BYTES
    for t in range(seconds):
        blocks = int(blocks_per_second * t)
        if t % scrape_every == 0:
            stored = int(blocks * engine_share) * float(REAL_BLOCK_BYTES)
            sample = EngineSample(float(t), offload_store_bytes=stored, offload_load_bytes=0.0)
            engine = EngineState(tapped=True, fresh=True, scrape=sample)
        x.copies.add(float(t), {TREE: CopyCounts(d2h_bytes=blocks * REAL_BLOCK_BYTES * copies_share)})
        x.kv.add(float(t), {"CPU": MediumCounts(physical_stored=float(blocks))})
        x.kv_events.add(float(t), {STREAM: StreamEvents(batches_lost=float(lost_at is not None and t >= lost_at))})
        rows.append(audit.update(replace(x, engine=engine), evidence, float(t)))
    return audit, rows


def by_pair(rows: tuple[AuditRow, ...]) -> dict[str, AuditRow]:
    return {r.pair: r for r in rows}


def test_value_at_interpolates_between_ticks() -> None:
    c = CounterSeries()
    for t, v in ((0.0, 0.0), (1.0, 10.0), (3.0, 30.0)):
        c.add(t, v)
    assert c.value_at(0.5) == 5.0 and c.value_at(2.0) == 20.0 and c.value_at(3.0) == 30.0
    assert c.value_at(-1.0) is None and c.value_at(3.5) is None


def test_relations() -> None:
    assert divergence(50, 100) == -0.5 and divergence(0, 0) == 0.0
    assert diverges("equal", 100, 80, 0.1) and diverges("equal", 80, 100, 0.1)
    assert not diverges("kvwatch_at_most", 100, 10, 0.1)  # kvwatch seeing less: not judged
    assert diverges("kvwatch_at_most", 10, 100, 0.1)


def test_engine_telling_the_truth_agrees_window_after_window() -> None:
    _, rows = feed(61)
    last = by_pair(rows[-1])
    for pair in ("offload_store_copies", "offload_store_blocks"):
        r = last[pair]
        assert r.window == 6 and r.windows_diverged == 0, r  # 0-10, 10-20, ... 50-60
        assert r.engine == pytest.approx(r.kvwatch, rel=0.01) and r.engine >= 10 * 100 * MIB * 0.99
    assert "offload_load_copies" not in last  # nothing moved that way: under the floor, never judged


def test_an_engine_reporting_half_its_stores_diverges_on_both_pairs() -> None:
    _, rows = feed(41, engine_share=0.5)
    last = by_pair(rows[-1])
    for pair in ("offload_store_copies", "offload_store_blocks"):
        r = last[pair]
        assert r.diverged and r.windows_diverged == r.window == 4
        assert r.divergence == pytest.approx(-0.5, abs=0.01)
        assert r.engine_source == "vllm:kv_offload_store_bytes"


def test_copy_probes_missing_or_shed_are_not_judged() -> None:
    _, rows = feed(41, engine_share=0.5, evidence=Evidence(copy_probes=0.0, block_bytes=REAL_BLOCK_BYTES))
    last = by_pair(rows[-1])
    assert "offload_store_copies" not in last and last["offload_store_blocks"].diverged


def test_windows_with_stream_batches_lost_are_not_judged() -> None:
    _, rows = feed(41, engine_share=0.5, lost_at=15)
    r = by_pair(rows[-1])["offload_store_blocks"]
    assert r.window == 3  # 0-10; the loss at 15 drops 10-16 and opens at the scrape at 16: 16-26, 26-36
    assert by_pair(rows[-1])["offload_store_copies"].window == 4  # the copy probes lost nothing


def test_under_the_floor_nothing_is_judged() -> None:
    _, rows = feed(41, engine_share=0.5, bytes_per_second=4 * MIB)
    assert rows[-1] == ()


def test_resident_blocks_bound() -> None:
    x = inputs()
    audit = ProcessAudit(SETTINGS)
    rows: tuple[AuditRow, ...] = ()
    for t, resident in enumerate([500.0] * 11 + [2600.0] * 11):
        x.kv.add(float(t), {"GPU": MediumCounts()})
        x.kv_events.add(float(t), {STREAM: StreamEvents()})
        engine = EngineState(tapped=True, fresh=True, scrape=EngineSample(float(t), pool_blocks=2048.0))
        x = replace(x, kv_state=KVState(resident_gpu=resident), engine=engine)
        rows = audit.update(x, Evidence(), float(t)) or rows
        if t == 10:
            r = by_pair(rows)["resident_blocks"]
            assert not r.diverged and (r.engine, r.kvwatch) == (2048.0, 500.0)
    r = by_pair(rows)["resident_blocks"]
    assert r.diverged and r.kvwatch == 2600.0 and r.window == 2


def _window(rows: tuple[AuditRow, ...]) -> NodeWindow:
    p = ProcessWindow(Subject("pid:7@1", {"pid": "7", "engine": "vllm"}), 100.0, audit=rows)
    return NodeWindow(now=0.0, processes={"pid:7@1": p}, tiers={})


def test_detector_fires_after_confirm_windows_and_clears_naming_both_numbers() -> None:
    det = EngineMetricDivergence(MetricDivergenceConfig(confirm_windows=3, clear_windows=2))
    _, bad = feed(41, engine_share=0.5)
    states = []
    seen = set()
    for rows in bad:
        f = det.evaluate(_window(rows))
        if f and rows and by_pair(rows)["offload_store_blocks"].window not in seen:
            seen.add(by_pair(rows)["offload_store_blocks"].window)
            states.append(f[0].firing)
    assert states == [False, False, True, True]  # the third window in a row fires
    f = det.evaluate(_window(bad[-1]))[0]
    assert f.severity == "info" and f.cause == "offload_store_copies"
    assert "vllm:kv_offload_store_bytes" in f.summary and "device-to-host copy probes" in f.summary
    assert "500.0 MiB" in f.summary and "1,000.0 MiB" in f.summary and "-50%" in f.summary
    assert f.values["offload_store_blocks_divergence"] == pytest.approx(-0.5, abs=0.01)
    # the engine tells the truth again: two agreeing windows clear it
    good = [tuple(replace(r, diverged=False, window=r.window + i) for r in bad[-1]) for i in (1, 2)]
    assert det.evaluate(_window(good[0]))[0].firing
    assert not det.evaluate(_window(good[1]))[0].firing


def test_parse_pool_blocks_from_cache_config_info() -> None:
    text = (FIXTURES / "engine_metrics" / "vllm-0.26.0.txt").read_text()
    assert parse_exposition(text, at=0.0).pool_blocks == 2048
    assert parse_exposition("# TYPE x counter\nx_total 1\n", at=0.0).pool_blocks is None


def real_run_audit(window: float) -> tuple[list[AuditRow], list[bool], int]:
    """Replays the recording at the daemon's cadence (a tick a second, the engine's page read
    the second it was taken): each judged window of offload_store_blocks, and whether the
    detector (default confirm and clear windows) was firing after it."""
    run = json.loads(gzip.decompress((FIXTURES / "vllm_run" / "pressure.json.gz").read_bytes()))
    pages = [(t, parse_exposition(text, at=t)) for t, text in run["pages"]]
    batches = run["batches"]
    x = inputs()
    audit = ProcessAudit(AuditSettings(window_seconds=window))
    det = EngineMetricDivergence(MetricDivergenceConfig())
    judged: list[AuditRow] = []
    firing: list[bool] = []
    cpu_stored, b, p = 0, 0, 0
    engine = NO_ENGINE
    t = batches[0][0]
    while t <= batches[-1][0] + 1.0:
        while b < len(batches) and batches[b][0] <= t:
            cpu_stored += sum(len(h) for k, m, _, h in uncompact(batches[b][4]) if k == "S" and m == "CPU")
            b += 1
        while p < len(pages) and pages[p][0] <= t:
            sample = pages[p][1]
            assert sample.offload_store_bytes is not None
            engine = EngineState(tapped=True, fresh=True, scrape=sample)
            p += 1
        x.kv.add(t, {"CPU": MediumCounts(physical_stored=float(cpu_stored))})
        x.kv_events.add(t, {STREAM: StreamEvents()})
        rows = audit.update(replace(x, engine=engine), Evidence(block_bytes=REAL_BLOCK_BYTES), t)
        found = det.evaluate(_window(rows))
        if rows and (not judged or rows[0].window != judged[-1].window):
            judged.append(rows[0])
            firing.append(found[0].firing)
        t += 1.0
    return judged, firing, cpu_stored - run["totals"]["stored"]["CPU"]


def test_real_vllm_offload_counter_agrees_with_its_stream() -> None:
    """135 s of a real vLLM 0.26.0 (steady, 45 s of pressure offloading ~3.5 GB/s, hot again):
    its offload bytes against the CPU blocks its own stream announced, times the block size.
    At the default 30 s windows every window agrees within 1 %; at 10 s windows one does not:
    the one where the pressure phase ended (the counter counts copies once finished, the
    stream blocks once scheduled; the next window agrees). Never enough windows in a row to
    fire."""
    judged, firing, missed = real_run_audit(30.0)
    assert missed == 0  # every CPU block of the recording fed
    assert len(judged) == 4 and all(abs(r.divergence) < 0.01 for r in judged), judged
    assert sum(r.engine for r in judged) > 180e9  # the pressure phase's offload is in them
    assert not any(firing)
    judged, firing, _ = real_run_audit(10.0)
    assert len(judged) == 13 and [r.window for r in judged if r.diverged] == [9], judged
    assert not any(firing)


def test_a_firing_alert_clears_when_its_evidence_stops() -> None:
    """Offload traffic stops (no window judged any more): the alert does not stay for ever."""
    det = EngineMetricDivergence(MetricDivergenceConfig(confirm_windows=3, clear_windows=2, window_seconds=10.0))
    _, bad = feed(41, engine_share=0.5)
    for t, rows in enumerate(bad):
        p = ProcessWindow(Subject("pid:7@1", {"pid": "7"}), 100.0, audit=rows)
        det.evaluate(NodeWindow(now=float(t), processes={"pid:7@1": p}, tiers={}))
    p = ProcessWindow(Subject("pid:7@1", {"pid": "7"}), 100.0, audit=bad[-1])
    view = lambda t: NodeWindow(now=t, processes={"pid:7@1": p}, tiers={})  # noqa: E731 - the same rows, later
    assert det.evaluate(view(45.0))[0].firing
    assert det.evaluate(view(50.0))[0].firing  # one window's time without a judgement: one cool step
    assert not det.evaluate(view(60.0))[0].firing  # two: cleared
