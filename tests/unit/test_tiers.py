"""One KV-tier schema across engines: each engine's real exposition text (fixtures written by
tests/tools/engine_metrics_fixtures.py as the engines' sources declare their metrics; where
each name comes from: tests/fixtures/engine_metrics/SOURCES.md) read into
``kvwatch_engine_kv_tier_*``, every number checked against the value the fixture was given."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvwatch.daemon.engines.metrics import parse_exposition
from kvwatch.daemon.model.engines import EnginePlan, EngineView, TierReading
from kvwatch.daemon.model.snapshot import MemoryCounters, ProcessRates, ProcessView, Snapshot
from kvwatch.exporters.prom_engine_tiers import tier_families
from tests.tools.engine_metrics_fixtures import TIER_VALUES

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engine_metrics"


def readings(fixture: str) -> dict[tuple[str, str, str, str], float]:
    sample = parse_exposition((FIXTURES / f"{fixture}.txt").read_text(), at=0.0)
    return {(r.source, r.tier, r.quantity, r.unit): r.value for r in sample.tiers}


def test_vllm_offloading_connector() -> None:
    v = TIER_VALUES["vllm-offload-0.26.0"]
    assert readings("vllm-offload-0.26.0") == {
        ("vllm", "cpu", "stored", "bytes"): v["store_bytes"],  # the flat name, not added to the older one
        ("vllm", "cpu", "loaded", "bytes"): v["load_bytes"],
        ("vllm", "cpu", "queried", "tokens"): v["external_prefix_cache_queries"],
        ("vllm", "cpu", "hit", "tokens"): v["external_prefix_cache_hits"],
    }  # no usage: kv_offload_cpu_cache_usage_perc is transfers in flight, not occupancy


def test_vllm_older_labelled_names_and_the_real_capture() -> None:
    real = readings("vllm-0.26.0")  # the H200 run's page: only the labelled name
    assert real[("vllm", "cpu", "stored", "bytes")] == 212_630_241_280
    assert real[("vllm", "cpu", "loaded", "bytes")] == 2_162_688_000
    assert readings("vllm-0.33.0") == {}  # no KV connector: no tier at all


def test_vllm_connector_other_than_offloading_is_external() -> None:
    text = (
        "# TYPE vllm:external_prefix_cache_queries counter\n"
        'vllm:external_prefix_cache_queries_total{engine="0"} 100.0\n'
        "# TYPE vllm:external_prefix_cache_hits counter\n"
        'vllm:external_prefix_cache_hits_total{engine="0"} 7.0\n'
    )
    got = {(r.tier, r.quantity): r.value for r in parse_exposition(text, at=0.0).tiers}
    assert got == {("external", "queried"): 100.0, ("external", "hit"): 7.0}


def test_lmcache_in_process() -> None:
    v = TIER_VALUES["lmcache-0.5.6-tiers"]
    assert readings("lmcache-0.5.6-tiers") == {
        ("lmcache", "remote", "stored", "bytes"): v["num_remote_write_bytes"],
        ("lmcache", "remote", "loaded", "bytes"): v["num_remote_read_bytes"],
        ("lmcache", "cpu", "evicted", "chunks"): v["local_cpu_evict_keys_count"],
        ("lmcache", "cpu", "used", "bytes"): v["local_cache_usage"],
        ("lmcache", "disk", "used", "bytes"): v["local_storage_usage"],
        ("lmcache", "all", "queried", "tokens"): v["num_requested_tokens"],
        ("lmcache", "all", "hit", "tokens"): v["num_hit_tokens"],
    }  # remote_cache_usage is declared and never set in 0.5.6: not read


def test_lmcache_0_5_3_captured_on_the_h200() -> None:
    """The real page at the end of the LMCache run (tests/gpu/results/h200-2026-12-02-issue25-lmcache):
    the numbers its closure found equal to LMCache's own, and its latency histograms."""
    sample = parse_exposition((FIXTURES / "lmcache-0.5.3-h200.txt").read_text(), at=0.0)
    assert {(r.tier, r.quantity, r.unit): r.value for r in sample.tiers} == {
        ("remote", "stored", "bytes"): 0.0,
        ("remote", "loaded", "bytes"): 0.0,
        ("cpu", "evicted", "chunks"): 99_828,
        ("cpu", "used", "bytes"): 128 * 2**20,  # the 128 MiB pinned pool, full
        ("disk", "used", "bytes"): 384 * 8 * 2**20,  # 384 chunk files of 8 MiB at its 3 GiB limit
        ("all", "queried", "tokens"): 22_240_256,
        ("all", "hit", "tokens"): 22_240_256,
    }
    assert {r.source for r in sample.tiers} == {"lmcache"}
    got = {r.name: (r.sum_seconds, r.count) for r in sample.latencies}
    assert got == {
        "ttft": (2906.3264977931976, 32_000),
        "lmcache_retrieve": (125.89446797699773, 21_963),
        "lmcache_store": (20.674232550997402, 3_244),
    }  # no e2e: the run kept only TTFT of vLLM's histograms


def test_lmcache_multiprocess_server() -> None:
    v = TIER_VALUES["lmcache-mp-0.5.6"]
    got = readings("lmcache-mp-0.5.6")
    assert got[("lmcache_mp", "cpu", "stored", "bytes")] == v["transfer_phase_bytes_d2h"]
    assert got[("lmcache_mp", "cpu", "loaded", "bytes")] == v["transfer_phase_bytes_h2d"]
    assert got[("lmcache_mp", "cpu", "stored", "chunks")] == v["l1_write_chunks"]
    assert got[("lmcache_mp", "cpu", "loaded", "chunks")] == v["l1_read_chunks"]
    assert got[("lmcache_mp", "cpu", "evicted", "chunks")] == v["l1_evicted_chunks"]
    assert got[("lmcache_mp", "cpu", "usage", "ratio")] == v["l1_usage_ratio"]
    assert got[("lmcache_mp", "cpu", "hit", "tokens")] == v["lookup_hit_l1_tokens"]
    assert got[("lmcache_mp", "storage", "stored", "chunks")] == v["l2_store_completed_objects_chunks"]
    assert got[("lmcache_mp", "storage", "loaded", "chunks")] == v["l2_prefetch_load_completed_chunks"]
    assert got[("lmcache_mp", "storage", "evicted", "chunks")] == v["l2_evicted_objects_chunks"]
    assert got[("lmcache_mp", "storage", "used", "bytes")] == v["l2_usage_bytes"]
    assert got[("lmcache_mp", "storage", "hit", "tokens")] == v["lookup_hit_l2_tokens"]
    assert got[("lmcache_mp", "cpu", "queried", "tokens")] == v["lookup_requested_tokens"]


def test_sglang_hicache_bytes_sum_ranks_tokens_do_not() -> None:
    v = TIER_VALUES["sglang-hicache-0.5.23"]
    assert readings("sglang-hicache-0.5.23") == {
        ("sglang", "cpu", "stored", "bytes"): v["hicache_backup_bytes_rank0"] + v["hicache_backup_bytes_rank1"],
        ("sglang", "cpu", "loaded", "bytes"): v["load_back_bytes_rank0"] + v["load_back_bytes_rank1"],
        ("sglang", "cpu", "usage", "ratio"): pytest.approx(
            v["hicache_host_used_tokens"] / v["hicache_host_total_tokens"]
        ),
        ("sglang", "cpu", "queried", "tokens"): v["prompt_tokens_streaming"] + v["prompt_tokens_not_streaming"],
        ("sglang", "cpu", "hit", "tokens"): v["cached_tokens_host"],
        ("sglang", "storage", "stored", "tokens"): v["backuped_tokens"],  # one rank's: all say the same
        ("sglang", "storage", "loaded", "tokens"): v["prefetched_tokens"],
        ("sglang", "storage", "queried", "tokens"): v["prompt_tokens_streaming"] + v["prompt_tokens_not_streaming"],
        ("sglang", "storage", "hit", "tokens"): v["cached_tokens_storage"],
    }
    assert readings("sglang-0.5.23") == {}  # no HiCache: no tier


def test_dynamo_kvbm_directions() -> None:
    v = TIER_VALUES["dynamo-kvbm-1.6.1"]
    assert readings("dynamo-kvbm-1.6.1") == {
        ("kvbm", "cpu", "stored", "blocks"): v["offload_blocks_d2h"],
        ("kvbm", "cpu", "loaded", "blocks"): v["onboard_blocks_h2d"],  # h2d onboard: host -> device
        ("kvbm", "cpu", "hit_ratio", "ratio"): v["host_cache_hit_rate"],
        ("kvbm", "disk", "stored", "blocks"): v["offload_blocks_h2d"]
        + v["offload_blocks_d2d"],  # h2d offload: host -> disk
        ("kvbm", "disk", "loaded", "blocks"): v["onboard_blocks_d2d"],
        ("kvbm", "disk", "hit_ratio", "ratio"): v["disk_cache_hit_rate"],
        ("kvbm", "remote", "stored", "blocks"): v["offload_blocks_d2o"],
        ("kvbm", "remote", "loaded", "blocks"): v["onboard_blocks_o2d"],
        ("kvbm", "remote", "hit_ratio", "ratio"): v["object_cache_hit_rate"],
    }


def exported(view: EngineView) -> dict[tuple[str, str, str], float]:
    p = ProcessView(
        key="1@1",
        pid=1,
        labels={"pid": "1"},
        source="test",
        alive=True,
        memory=MemoryCounters(),
        rates=ProcessRates(),
        engine=view,
    )
    snap = replace(Snapshot.empty(), processes=(p,))
    return {
        (s.name, s.labels["tier"], s.labels["source"] + ":" + s.labels.get("unit", "")): s.value
        for fam in tier_families(snap)
        for s in fam.samples
    }


def test_blocks_priced_only_with_a_configured_block_size() -> None:
    tiers = (TierReading("kvbm", "disk", "stored", "blocks", 10.0),)
    plan = EnginePlan("1@1", 1)
    learnt = exported(
        EngineView(plan, (), None, None, None, tiers=tiers, block_bytes=4096, block_bytes_source="offload")
    )
    assert learnt == {("kvwatch_engine_kv_tier_stored_units_total", "disk", "kvbm:blocks"): 10.0}
    config = exported(
        EngineView(plan, (), None, None, None, tiers=tiers, block_bytes=4096, block_bytes_source="config")
    )
    assert config[("kvwatch_engine_kv_tier_stored_bytes_total", "disk", "kvbm:")] == 40960.0
