"""Engines' latency histograms read off their /metrics as (sum, count): vLLM's real 0.26.0 page,
a data-parallel vLLM with LMCache in process, SGLang; absent where not exported."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.engines.latency import RULES
from kvwatch.daemon.engines.metrics import parse_exposition
from kvwatch.daemon.model.engines import LATENCY_NAMES, LatencyReading

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engine_metrics"

# vLLM 0.26.0 with two data-parallel engines and LMCache 0.5.6 in process, as exposed on vLLM's
# /metrics (label sets as the engines write them; LMCache's histograms have no TYPE line here:
# read by their sample names all the same)
VLLM_LMCACHE = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 8.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 8.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.5
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 11.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 11.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 4.25
lmcache:time_to_retrieve_bucket{le="0.01",model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="0"} 15.0
lmcache:time_to_retrieve_bucket{le="+Inf",model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="0"} 16.0
lmcache:time_to_retrieve_sum{model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="0"} 0.10268032199999766
lmcache:time_to_retrieve_count{model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="0"} 16.0
lmcache:time_to_retrieve_sum{model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="1"} 0.02
lmcache:time_to_retrieve_count{model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="1"} 4.0
lmcache:time_to_store_sum{model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="0"} 0.3
lmcache:time_to_store_count{model_name="/tmp/tiny",role="worker",served_model_name="tiny",worker_id="0"} 20.0
"""

SGLANG = """\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="tiny"} 2.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 3.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 5.0
sglang:time_to_first_token_seconds_count{model_name="tiny"} 5.0
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{model_name="tiny"} 9.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="tiny"} 5.0
sglang:e2e_request_latency_seconds_count{model_name="tiny"} 5.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="tiny",tp_rank="0"} 1.0
"""


def latencies(text: str) -> dict[str, tuple[float, float]]:
    return {r.name: (r.sum_seconds, r.count) for r in parse_exposition(text, at=0.0).latencies}


def test_real_vllm_026_page() -> None:
    """vLLM 0.26.0's own /metrics from the H200 run: TTFT and e2e; no LMCache there."""
    got = latencies((FIXTURES / "vllm-0.26.0.txt").read_text())
    assert got == {"ttft": (1419.5959331989288, 26589.0), "e2e": (4913.174619913101, 26560.0)}


def test_summed_over_engines_and_workers() -> None:
    s = parse_exposition(VLLM_LMCACHE, at=0.0)
    got = {r.name: (round(r.sum_seconds, 9), r.count) for r in s.latencies}
    assert got == {
        "ttft": (2.0, 20.0),
        "e2e": (4.25, 11.0),
        "lmcache_retrieve": (0.122680322, 20.0),
        "lmcache_store": (0.3, 20.0),
    }
    assert all(isinstance(r, LatencyReading) for r in s.latencies)


NIXL_DECODE = """\
# vLLM 0.26.0's NixlConnector metrics on the decode instance (names, labels and units as
# vllm/distributed/kv_transfer/kv_connector/v1/nixl declares them), one observation per KV pull
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.042
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 7.0
vllm:nixl_post_time_seconds_sum{engine="0",model_name="tiny"} 0.0021
vllm:nixl_post_time_seconds_count{engine="0",model_name="tiny"} 7.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 2.3121664e+08
vllm:nixl_bytes_transferred_count{engine="0",model_name="tiny"} 7.0
"""


def test_vllm_nixl_transfer_times() -> None:
    """The decode side's NIXL transfer and post times; bytes are not a latency."""
    assert latencies(NIXL_DECODE) == {"nixl_xfer": (0.042, 7.0), "nixl_post": (0.0021, 7.0)}


def test_sglang() -> None:
    assert latencies(SGLANG) == {"ttft": (2.0, 5.0), "e2e": (9.0, 5.0)}


def test_absent_when_not_exported() -> None:
    """No histogram, or half of one: nothing, never a zero."""
    assert latencies((FIXTURES / "lmcache-0.5.6-tiers.txt").read_text()) == {}
    half = 'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 12.0\n'
    assert latencies(half) == {}
    buckets_only = 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0\n'
    assert latencies(buckets_only) == {}


def test_every_rule_names_a_reading_the_lane_draws() -> None:
    assert {r.name for r in RULES} == set(LATENCY_NAMES)
