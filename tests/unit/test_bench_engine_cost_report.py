"""bench/engine_cost_report.py: rounds grouped into (on, off) pairs, the summary's figures, the
measured CPU difference beside kvwatch's meter, the proofs counted, and the markdown."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.support.bench import bench_module

rep = bench_module("engine_cost_report")


START = {"action": "start", "ok": True, "ready_s": 5.0, "tapped_s": 7.0, "cuda_probes": {"11": 0.0, "12": 22.0},
         "programs_held": 58}  # fmt: skip
STOP = {"action": "stop", "clean": True, "exited_on_sigterm": True, "stop_s": 2.0, "programs_listed_by": "bpf syscall"}


def _row(index: int, pair: int, on: bool, cpu: float, rps: float) -> dict[str, Any]:
    r: dict[str, Any] = {
        "round": index,
        "pair": pair,
        "kvwatch": on,
        "wall_s": 20.0,
        "result": {"completed": 1000, "request_throughput": rps, "output_throughput": 32 * rps,
                   "median_ttft_ms": 20.0, "p99_ttft_ms": 40.0, "median_tpot_ms": 5.0, "p99_tpot_ms": 9.0},
        "cpu_s_per_1000": cpu,
        "cpu_api_s_per_1000": cpu / 4,
        "cpu_core_s_per_1000": 3 * cpu / 4,
        "toggle": START if on else STOP,
    }  # fmt: skip
    if on:
        r["tapped_before"] = {"ok": True}
        r["tapped_after"] = {"ok": pair != 1, "shed": 1.0 if pair == 1 else 0.0}
        r.update(meter_s_per_1000=0.2, meter_api_s_per_1000=0.0, meter_core_s_per_1000=0.2)
        r["daemon_cpu_s_per_1000"] = 0.5
    return r


def _rows() -> list[dict[str, Any]]:
    out = []
    for i, (pair, on) in enumerate(bench_module("pairstats").abba(4)):
        out.append(_row(i, pair, on, 25.0 + (0.25 if on else 0.0) + 0.1 * i, 50.0 - (0.5 if on else 0.0)))
    return out


def test_pairs_are_on_off_of_each_complete_pair() -> None:
    rows = _rows()
    got = rep.pairs(rows, "request_throughput")
    assert got == [(49.5, 50.0)] * 4
    assert rep.pairs([*rows, _row(8, 4, False, 1.0, 1.0)], "cpu_s_per_1000")[3] == pytest.approx((25.85, 25.7))
    assert len(rep.pairs([*rows, _row(8, 4, False, 1.0, 1.0)], "cpu_s_per_1000")) == 4  # a half pair is left out


def test_summary_sets_the_measured_difference_beside_the_meter() -> None:
    s = rep.summarize(_rows())
    assert s["pairs"] == 4
    assert s["figures"]["request_throughput"]["ratio"] == pytest.approx(0.99)
    beside = s["cpu_diff_vs_meter_s_per_1000"]
    assert beside["all"]["measured"][0] == pytest.approx(0.25)  # the drift cancels in ABBA
    assert beside["core"]["measured"][0] == pytest.approx(0.1875)
    assert beside["all"]["meter"] == pytest.approx(0.2) and beside["api"]["meter"] == 0.0
    assert s["daemon_cpu_s_per_1000"] == pytest.approx(0.5)
    p = s["proofs"]
    assert (p["off_rounds"], p["off_proven_clean"], p["on_rounds"], p["on_proven_tapped"]) == (4, 4, 4, 4)
    assert p["on_still_tapped_after"] == 3 and p["on_rounds_with_probes_shed"] == 1


def test_no_rounds_summarize_to_nothing() -> None:
    s = rep.summarize([])
    assert s["pairs"] == 0 and s["figures"] == {} and math.isnan(s["cpu_diff_vs_meter_s_per_1000"]["all"]["meter"])


def test_render_names_every_figure_and_round() -> None:
    rows = _rows()
    text = rep.render({"summary": rep.summarize(rows), "rounds": rows, "args": {"client": "http"}})
    assert "| requests/s | 50.000 | 49.500 | 0.9900 |" in text
    assert "4 of 4 off rounds began with kvwatch proven gone" in text
    assert "its TTFT is each request's whole latency" in text
    assert text.count("| start, tapped |") == 4 and text.count("| stop, clean |") == 4
    assert "shed 1" in text
    assert rep.render({"summary": rep.summarize([]), "rounds": []}).startswith("# kvwatch's cost")


def test_a_busy_engine_core_is_read_as_cpu_bound_and_the_meter_is_set_against_its_cpu() -> None:
    rows = _rows()
    for r in rows:
        r["core_cores_busy"] = 1.02
    s = rep.summarize(rows)
    on = [r for r in rows if r["kvwatch"]]
    assert s["meter_share_of_core"] == pytest.approx(0.2 * len(on) / sum(r["cpu_core_s_per_1000"] for r in on))
    text = rep.render({"summary": s, "rounds": rows, "args": {}})
    assert "kept 1.02 cores busy off and 1.02 on" in text
    assert "inverse of its throughput" in text  # 0.95+ cores: one busy loop
    for r in rows:
        r["core_cores_busy"] = 0.5
    assert "inverse of its throughput" not in rep.render({"summary": rep.summarize(rows), "rounds": rows, "args": {}})


def test_the_engine_core_threads_are_set_side_by_side() -> None:
    rows = _rows()
    for r in rows:
        r["core_threads_cpu_s"] = {"VLLM::EngineCor": 20.0, "ZMQbg/IO/0": 0.4 if r["kvwatch"] else 0.2}
    text = rep.render({"summary": rep.summarize(rows), "rounds": rows, "args": {}})
    assert "| VLLM::EngineCor | 1.0000 | 1.0000 | 0.0000 |" in text  # 20 s over a 20 s round
    assert "| ZMQbg/IO/0 | 0.0100 | 0.0200 | 0.0100 |" in text


def test_the_bpf_statistics_round_names_each_program_by_its_time() -> None:
    rows = _rows()
    extra = {**_row(8, 0, True, 30.0, 45.0), "meter_core_s_per_1000": 0.01}
    extra["bpf_programs"] = {
        "kvw_page_free": {"run_ns": 2_000_000, "runs": 4_000},  # 500 ns a run, 4 a request
        "kvw_oom_victim": {"run_ns": 0, "runs": 0},
        "kvw_return_cuda": {"run_ns": 9_000_000, "runs": 12_000},
    }
    summary = rep.summarize(rows)
    text = rep.render({"summary": summary, "rounds": rows, "args": {}, "attribution": extra})
    assert "| kvw_return_cuda | 12.00 | 750 | 0.0090 |" in text  # 9 ms over 1,000 requests
    assert "| kvw_page_free | 4.00 | 500 | 0.0020 |" in text
    assert "| kvw_oom_victim | 0.00 | — | 0.0000 |" in text
    assert text.index("kvw_return_cuda") < text.index("kvw_page_free")
    assert "Total 0.0110 CPU s per 1,000 requests" in text


def test_the_cost_by_parts_sums_meter_programs_and_side_threads() -> None:
    rows = _rows()
    for r in rows:  # side threads: 0.2 s off, 0.3 s on over 1,000 requests
        r["core_threads_cpu_s"] = {"VLLM::EngineCor": 20.0, "ZMQbg/IO/0": 0.3 if r["kvwatch"] else 0.2}
        if r["kvwatch"]:
            r["meter_core_s_per_1000"] = 0.02
    extra = {**_row(8, 0, True, 30.0, 45.0), "bpf_programs": {"kvw_page_free": {"run_ns": 30_000_000, "runs": 9}}}
    s = rep.summarize(rows)
    assert s["figures"]["core_side_s_per_1000"]["diff_mean"] == pytest.approx(0.1)
    text = rep.render({"summary": s, "rounds": rows, "args": {}, "attribution": extra})
    # 0.02 + 0.03 + 0.1 = 0.15 s of the EngineCore's 3/4 x (25 + 0.1 i) s in off rounds 0, 3, 4, 7: 19.0125
    assert "= **0.1500**, **0.79 %** of its 19.012 with kvwatch off" in text
