"""A real vLLM 0.26.0 serving a hybrid model, its KV event stream and /metrics replayed at real
speed to `kvwatch run`.

The fixture (tests/fixtures/vllm_run/full.json.gz, cut by tests/tools/vllm_groups_fixture.py) is
193 s of the H200 run of tests/gpu/results/h200-2026-12-02-issue22: a Gemma-3-style model (five
sliding-window layers of 256 tokens to one full-attention layer: six KV cache groups, every
block range announced once per group) with every request asking for ``kv_cache_report_mode``
full (each prefix-cache hit's blocks announced again), through four phases: unique prompts from
the start (a workload that shares nothing), 24 hot prefixes, a flood of unique prompts, the hot
prefixes again. Here a publisher re-sends every batch in vLLM 0.26.0's wire format on its
schedule and a server serves each second's /metrics page; kvwatch taps them as it would the
engine (``[[engines.endpoints]]`` naming a stand-in process; no BPF, no root).

What the real run showed must hold here: every count exact per group against a plain decoder of
the same events (the fixture's totals); the full-attention group is the reference; the prefix
hits announced are counted as such, not as stores; KVPrefixCacheIneffective says ``not_shared``
(info) while nothing is shared and nothing else; KVEvictionBurst on the GPU during the flood,
cleared after; no other alert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.lab import wire_encode as we
from tests.support.engine_sim import engines_only
from tests.support.vllm_replay import load_run, onsets, replaying, through_the_window
from tests.tools.vllm_groups_fixture import uncompact

FIXTURE = Path(__file__).parent.parent / "fixtures" / "vllm_run" / "full.json.gz"

CONFIG = (
    engines_only(tick_seconds=1.0)
    + """
[engines]
endpoints = [{{ cmdline = "{marker}", kv_events = "{kv}", metrics_url = "{url}", engine = "vllm" }}]
# every removal of the window remembered in every group: the five sliding-window groups share one
# regret memory between them (221,000 removals each here), the full-attention group has its own
regret_memory_seconds = 60
regret_memory_rate = 20_000
[detectors.eviction_burst]          # as the H200 run had them (tests/gpu/validate_groups.py)
warmup_seconds = 0
baseline_min_seconds = 30
baseline_half_life_seconds = 60
[detectors.prefix_cache_ineffective]
warmup_seconds = 0
window_seconds = 20
min_queried_tokens = 5000
"""
)


def events(records: list[list[Any]], kinds: dict[str, dict[str, list[Any]]]) -> list[dict[str, Any]]:
    """The batch's events as vLLM sent them: GPU stores with their group's kind and window."""
    out: list[dict[str, Any]] = []
    for kind, medium, bs, parent, group, ids in uncompact(records):
        if kind == "C":
            out.append(we.cleared())
        elif kind == "R":
            out.append(we.removed(ids, medium=medium, group_idx=group))
        else:
            spec, window = kinds.get(medium, {}).get(str(group), [None, None])
            out.append(
                we.stored(
                    ids,
                    [],
                    medium=medium,
                    parent=parent,
                    block_size=bs,
                    group_idx=group,
                    kv_cache_spec_kind=spec,
                    kv_cache_spec_sliding_window=window,
                )
            )
    return out


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    return load_run(FIXTURE)


def test_real_hybrid_vllm_replayed(run: dict[str, Any], tmp_path: Path) -> None:
    totals = run["totals"]
    with replaying(tmp_path, CONFIG, run, "vllm-groups-replay") as r:
        t0, wall0 = r.start()
        assert r.publish(run["batches"], lambda records: events(records, run["kinds"]), t0)
        r.wait_every_batch(totals["batches"])
        through_the_window(r.d, r.pid, t0 + run["window_seconds"])
        metrics = r.d.metrics()
        alerts = onsets(r.d, r.pid)
        log = r.d.log.read_text()
    check_counts(metrics, r.pid, totals["groups"])
    check_alerts(alerts, log, run["marks"], wall0)


def check_counts(metrics: dict[str, Any], pid: str, groups: dict[str, dict[str, int]]) -> None:
    def of(name: str) -> dict[str, float]:
        return {f"{lab['medium']}:{lab['group']}": v for lab, v in metrics[name] if lab["pid"] == pid}

    info = [lab for lab, _ in metrics["kvwatch_kv_cache_group_info"] if lab["pid"] == pid]
    kinds = {lab["group"]: (lab["kind"], lab["sliding_window"], lab["reference"]) for lab in info}
    assert kinds == {
        **{str(i): ("sliding_window", "256", "false") for i in range(5)},
        "5": ("full_attention", "", "true"),
    }
    for what in ("stored", "removed", "announced", "restored", "regretted"):
        assert of(f"kvwatch_kv_group_blocks_{what}_total") == {k: float(v[what]) for k, v in groups.items()}, what
    assert of("kvwatch_kv_group_blocks_resident") == {k: float(v["resident"]) for k, v in groups.items()}
    ref = groups["GPU:5"]  # the logical counts are the full-attention group's
    logical = {lab["medium"]: v for lab, v in metrics["kvwatch_kv_blocks_stored_total"] if lab["pid"] == pid}
    announced = {lab["medium"]: v for lab, v in metrics["kvwatch_kv_blocks_announced_total"] if lab["pid"] == pid}
    assert (logical, announced) == ({"GPU": ref["stored"]}, {"GPU": ref["announced"]})
    assert ref["announced"] > 0 and ref["restored"] == 0  # the hits' announcements are no stores again
    lost = dict((lab["source"], v) for lab, v in metrics["kvwatch_events_lost_total"])
    assert lost["kv_removals_forgotten"] == 0 and lost["kv_store_times_forgotten"] == 0


def check_alerts(onsets: list[dict[str, Any]], log: str, marks: dict[str, float], wall0: float) -> None:
    def phase(e: dict[str, Any]) -> str:
        at = e["wall"] - wall0
        return max((n for n in marks if n.endswith("_start") and marks[n] <= at), key=marks.get, default="before")

    seen = [(e["alert"], e["cause"], phase(e)) for e in onsets]
    assert seen == [
        ("KVPrefixCacheIneffective", "not_shared", "noshare_start"),
        ("KVEvictionBurst", seen[1][1], "pressure_start"),
    ], seen
    shared, burst = onsets
    assert shared["severity"] == "info" and burst["label_medium"] == "GPU" and burst["cause"] in ("thrash", "pressure")
    resolved = [ln for ln in log.splitlines() if '"alert resolved"' in ln]
    assert any('"KVPrefixCacheIneffective"' in ln for ln in resolved), "not_shared never cleared"
    assert any('"KVEvictionBurst"' in ln for ln in resolved), "the burst never cleared"
