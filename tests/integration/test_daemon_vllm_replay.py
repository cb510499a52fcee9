"""A real vLLM 0.26.0's KV event stream and /metrics, replayed at real speed to `kvwatch run`.

The fixture (tests/fixtures/vllm_run/pressure.json.gz, cut by tests/tools/vllm_run_fixtures.py)
is 135 s of the H200 validation run (tests/gpu/results/h200-2026-12-01-vllm): steady hot
prefixes, 45 s of unique 900-token prompts at 32 concurrent, the hot prefixes again, then
steady — every batch the engine published, at the second it arrived, and vLLM's /metrics page
of every second. Here a publisher re-sends those batches in vLLM 0.26.0's wire format on their
schedule and an HTTP server serves each page from its second on; kvwatch taps them as it
would the engine (``[[engines.endpoints]]`` naming a stand-in process, no BPF, no root).

What the real run showed must hold here: no alert while steady; KVEvictionBurst on medium GPU,
cause pressure or thrash, during the pressure phase; cleared before the end; and
every block counted exactly (the totals vLLM's own classes decoded in that window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.lab.wire_encode import cleared, removed, stored
from tests.support.daemon import DaemonProcess
from tests.support.engine_sim import engines_only
from tests.support.kv_scripts import REAL_BLOCK_BYTES
from tests.support.vllm_replay import load_run, onsets, replaying, through_the_window
from tests.tools.vllm_run_fixtures import uncompact

FIXTURE = Path(__file__).parent.parent / "fixtures" / "vllm_run" / "pressure.json.gz"

CONFIG = (
    engines_only(tick_seconds=1.0)
    + """
[engines]
endpoints = [{{ cmdline = "{marker}", kv_events = "{kv}", metrics_url = "{url}", engine = "vllm" }}]
[detectors.eviction_burst]
warmup_seconds = 0        # the window holds 35 s of steady load: learn from its first second
baseline_min_seconds = 20
"""
)


def events(groups: list[list[Any]]) -> list[dict[str, Any]]:
    out = []
    for kind, medium, bs, ids in uncompact(groups):
        if kind == "C":
            out.append(cleared())
        elif kind == "S":
            out.append(stored(ids, [], medium=medium, block_size=bs))
        else:
            out.append(removed(ids, medium=medium))
    return out


def regrets(batches: list[list[Any]]) -> dict[str, tuple[int, int]]:
    """Per medium, the blocks stored again after a removal and their tokens, computed here from
    the recorded stream with a plain set per medium (a reset forgets every removal)."""
    removed: dict[str, set[Any]] = {}
    out: dict[str, tuple[int, int]] = {}
    for _at, _seq, _ts, _rank, groups in batches:
        for kind, medium, bs, ids in uncompact(groups):
            if kind == "C":
                removed.clear()
                continue
            gone = removed.setdefault(medium or "GPU", set())
            if kind == "R":
                gone.update(ids)
                continue
            back = [h for h in ids if h in gone]
            gone.difference_update(back)
            blocks, tokens = out.get(medium or "GPU", (0, 0))
            out[medium or "GPU"] = (blocks + len(back), tokens + len(back) * (bs or 0))
    return out


def check_ledger(d: DaemonProcess, pid: str, totals: dict[str, Any]) -> None:
    """The loss ledger closes on the stream: every removal in one (tier, cause) row, none dropped
    (each GPU block the window saw stored reached the CPU tier: test_ledger.py computes it),
    priced at the model's block size learnt from vLLM's offload counter."""
    rows = {
        (lab["tier"], lab["cause"]): v for lab, v in d.metrics()["kvwatch_kv_lost_blocks_total"] if lab["pid"] == pid
    }
    gpu = rows.get(("gpu", "evicted"), 0) + rows.get(("gpu", "preempted"), 0)
    assert gpu == totals["removed"]["GPU"] and rows[("cpu", "evicted")] == totals["removed"]["CPU"], rows
    assert ("cpu", "offload_dropped") not in rows, rows
    assert d.value("kvwatch_kv_block_bytes", pid=pid, source="offload") == REAL_BLOCK_BYTES
    for (tier, cause), blocks in rows.items():
        assert d.value("kvwatch_kv_lost_bytes_total", pid=pid, tier=tier, cause=cause) == blocks * REAL_BLOCK_BYTES


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    return load_run(FIXTURE)


def test_real_vllm_pressure_replayed(run: dict[str, Any], tmp_path: Path) -> None:
    with replaying(tmp_path, CONFIG, run, "vllm-replay") as r:
        d, pid = r.d, r.pid
        t0, wall0 = r.start()
        seen: list[tuple[float, float, float]] = []  # for the failure message: t, hit ratio, usage

        def watch(t: float) -> None:
            seen.append(
                (
                    round(t),
                    d.value("kvwatch_engine_prefix_cache_hit_ratio", pid=pid),
                    d.value("kvwatch_kv_blocks_removed_total", pid=pid, medium="GPU"),
                )
            )

        r.publish(run["batches"], events, t0, watch)
        totals = run["totals"]
        r.wait_every_batch(totals["batches"])
        through_the_window(d, pid, t0 + run["window_seconds"])
        for medium in ("GPU", "CPU"):
            for what in ("stored", "removed"):
                got = d.value(f"kvwatch_kv_blocks_{what}_total", pid=pid, medium=medium)
                assert got == totals[what][medium], (what, medium)
        assert d.value("kvwatch_kv_event_gaps_total", pid=pid) == 0
        expected = regrets(run["batches"])
        assert expected["GPU"][0] == 480  # the hot prefixes' blocks, stored again after the pressure
        for medium, (blocks, tokens) in expected.items():
            assert d.value("kvwatch_kv_blocks_regretted_total", pid=pid, medium=medium) == blocks, medium
            assert d.value("kvwatch_kv_regret_recomputed_tokens_total", pid=pid, medium=medium) == tokens
        lost = dict((lab["source"], v) for lab, v in d.metrics()["kvwatch_events_lost_total"])
        assert lost["kv_removals_forgotten"] == 0  # every removal remembered: none of the regrets missed
        check_ledger(d, pid, totals)
        alerts = onsets(d, pid)
    pressure = wall0 + run["marks"]["pressure_start"]
    bursts = [e for e in alerts if e["alert"] == "KVEvictionBurst"]
    assert [e for e in alerts if e["wall"] < pressure] == [], "an alert while steady"
    assert len(bursts) == 1, ([(e["alert"], e["wall"] - pressure) for e in alerts], seen)
    b = bursts[0]
    # during the pressure phase it names (the real run: 3.1 s into it; how soon is bench_detection's)
    pressure_end = wall0 + run["marks"]["pressure_end"]
    assert pressure <= b["wall"] <= pressure_end, f"onset {b['wall'] - pressure:.1f} s after the pressure phase began"
    assert b["label_medium"] == "GPU" and b["cause"] in ("pressure", "thrash"), b
    assert b["values"]["hit_ratio"] <= b["values"]["reference_hit_ratio"] - 0.3
    resolved = [
        line for line in d.log.read_text().splitlines() if '"alert resolved"' in line and '"KVEvictionBurst"' in line
    ]
    assert resolved, "the burst never cleared"
