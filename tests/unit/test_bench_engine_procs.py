"""bench/engine_procs.py: CPU seconds between two snapshots of a process tree (no /proc read here)."""

from __future__ import annotations

import pytest

from tests.support.bench import bench_module

procs = bench_module("engine_procs")


def test_cpu_between_counts_own_and_reaped_children_time() -> None:
    a = {10: (100, 5.0, 1.0, "vllm"), 11: (101, 20.0, 0.0, "VLLM::EngineCor"), 12: (102, 1.0, 0.0, "gone")}
    b = {10: (100, 6.5, 1.5, "vllm"), 11: (101, 29.0, 0.0, "VLLM::EngineCor"), 13: (140, 0.25, 0.0, "new")}
    d = procs.cpu_between(a, b)
    assert d["per_pid"] == {"10": 2.0, "11": 9.0, "13": 0.25}  # a process new in b counts whole
    assert d["total"] == pytest.approx(11.25)
    assert d["gone"] == [12] and d["comm"]["11"] == "VLLM::EngineCor"


def test_a_reused_pid_is_a_new_process() -> None:
    a = {20: (100, 50.0, 0.0, "old")}
    b = {20: (900, 0.5, 0.0, "new")}  # same pid, another start time
    assert procs.cpu_between(a, b)["total"] == pytest.approx(0.5)


def test_thread_cpu_is_summed_by_name_and_a_new_thread_counts_whole() -> None:
    a = {1: ("VLLM::EngineCor", 10.0), 2: ("ZMQbg/IO/0", 1.0), 3: ("gone", 5.0)}
    b = {1: ("VLLM::EngineCor", 12.5), 2: ("ZMQbg/IO/0", 1.25), 4: ("ZMQbg/IO/0", 0.5)}
    assert procs.threads_between(a, b) == {"VLLM::EngineCor": 2.5, "ZMQbg/IO/0": 0.75}


def test_program_run_time_is_summed_by_name_and_a_program_loaded_between_counts_whole() -> None:
    a = {7: ("kvw_page_free", 1_000, 10), 8: ("kvw_enter_cudaM", 500, 5), 9: ("kvw_gone", 9, 9)}
    b = {7: ("kvw_page_free", 4_000, 40), 8: ("kvw_enter_cudaM", 800, 8), 12: ("kvw_enter_cudaM", 300, 2)}
    assert procs.stats_between(a, b) == {
        "kvw_page_free": {"run_ns": 3_000, "runs": 30},
        "kvw_enter_cudaM": {"run_ns": 600, "runs": 5},  # 300 / 3 of id 8, and id 12 whole
    }
