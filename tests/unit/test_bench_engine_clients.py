"""bench/engine_clients.py without a server: the stand-in client's prompts and its result in vLLM's
keys, and the flags handed to vLLM's own client."""

from __future__ import annotations

import pytest

from tests.support.bench import bench_module

clients = bench_module("engine_clients")


def test_prefix_repetition_prompts_share_their_prefixes() -> None:
    load = clients.Load(num_prompts=6, prefix_len=4, suffix_len=3, num_prefixes=2, seed=1)
    p = clients._prompts(load)
    assert len(p) == 6 and all(len(x) == 7 for x in p)
    assert p[0][:4] == p[2][:4] == p[4][:4] and p[0][:4] != p[1][:4]
    assert p == clients._prompts(load) and p != clients._prompts(load.with_(seed=2))
    assert all(len(x) == 9 for x in clients._prompts(load.with_(dataset="random", input_len=9)))


def test_http_result_uses_vllms_keys() -> None:
    r = clients.http_result([(0.1, 10), (0.3, 10)], failed=1, duration=2.0)
    assert set(clients.KEYS) <= set(r)
    assert r["completed"] == 2 and r["failed"] == 1 and r["request_throughput"] == pytest.approx(1.0)
    assert r["output_throughput"] == pytest.approx(10.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["median_tpot_ms"] == pytest.approx(20.0) and r["p99_ttft_ms"] == pytest.approx(298.0)


def test_vllm_client_flags() -> None:
    c = object.__new__(clients.VllmClient)  # no vLLM here: only its argv
    c.base_url, c.model, c.tokenizer = "http://127.0.0.1:8000", "tiny", "/tmp/tiny"
    argv = c.argv(clients.Load(num_prompts=900, seed=5))
    assert "--ignore-eos" in argv and "--disable-tqdm" in argv
    assert argv[argv.index("--num-prompts") + 1] == "900" and argv[argv.index("--seed") + 1] == "5"
    assert argv[argv.index("--prefix-repetition-output-len") + 1] == "32"
    assert "--random-input-len" in c.argv(clients.Load(dataset="random"))
