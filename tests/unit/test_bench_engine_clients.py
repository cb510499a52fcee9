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


FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": (
        "import argparse\n"
        "class FlexibleArgumentParser(argparse.ArgumentParser):\n"
        "    def parse_args(self, argv=None, namespace=None):\n"
        "        return self.parse_known_args(argv, namespace)[0]\n"
    ),
    "vllm/tokenizers/__init__.py": "LOADS = []\ndef get_tokenizer(name, **kw):\n    LOADS.append(name)\n    return name\n",
    "vllm/benchmarks/__init__.py": "",
    "vllm/benchmarks/datasets.py": (
        "import random\n"
        "CALLS = []\n"
        "def get_samples(args, tok):\n"
        "    CALLS.append(args.seed)\n"
        "    return [(tok, random.random()) for _ in range(args.num_prompts)]\n"
    ),
    "vllm/benchmarks/serve.py": (
        "from vllm.benchmarks.datasets import get_samples\n"
        "from vllm.tokenizers import get_tokenizer\n"
        "SEEN = []\n"
        "def add_cli_args(p):\n"
        "    p.add_argument('--seed', type=int)\n"
        "    p.add_argument('--num-prompts', type=int)\n"
        "    p.add_argument('--tokenizer')\n"
        "    p.add_argument('--tokenizer-mode', default='auto')\n"
        "    p.add_argument('--trust-remote-code', action='store_true')\n"
        "def main(args):\n"
        "    reqs = get_samples(args, get_tokenizer(args.tokenizer))\n"
        "    SEEN.append(reqs)\n"
        "    return {'completed': len(reqs), 'failed': 0}\n"
    ),
}


def test_vllm_client_runs_prepared_requests(tmp_path, monkeypatch) -> None:
    """A prepared round's requests are the ones vLLM's ``main`` sends (sampled once, with the
    tokenizer loaded once, as ``main`` seeds them); vLLM's module is as it was after the round."""
    import argparse
    import random
    import sys

    for rel, text in FAKE_VLLM.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    c = clients.VllmClient("http://127.0.0.1:1", "tiny", "/tmp/tiny", tmp_path / "client.log")
    from vllm import tokenizers
    from vllm.benchmarks import datasets, serve

    a, b = clients.Load(num_prompts=3, seed=7), clients.Load(num_prompts=3, seed=8)
    c.prepare(a)
    c.prepare(b)
    c.prepare(a)  # once per load
    assert datasets.CALLS == [7, 8]
    random.seed(7)
    assert c.prepared[a] == datasets.get_samples(argparse.Namespace(seed=7, num_prompts=3), "/tmp/tiny")
    datasets.CALLS.clear()
    prepared_a = c.prepared[a]
    assert c.run(a)["completed"] == 3 and serve.SEEN[-1] is prepared_a and a not in c.prepared
    assert c.run(clients.Load(num_prompts=2, seed=9))["completed"] == 2  # not prepared: sampled for the round
    assert datasets.CALLS == [9] and tokenizers.LOADS == ["/tmp/tiny"]
    assert serve.get_samples is datasets.get_samples and serve.get_tokenizer is tokenizers.get_tokenizer
