"""The load of one round of bench/bench_engine_cost.py, and the two clients that run it.

* ``VllmClient``: vLLM's own benchmark client (``vllm bench serve``) in this process:
  ``vllm.benchmarks.serve.add_cli_args`` builds its parser once, ``main(args)`` runs a round and
  returns its result dict (vLLM 0.26.0: ``completed``, ``failed``, ``duration``,
  ``request_throughput``, ``output_throughput``, ``median_ttft_ms``, ``p99_ttft_ms``,
  ``median_tpot_ms``, ``p99_tpot_ms``, ...; p99 because ``--metric-percentiles 99``). Its import
  takes ~50 s on the H200 host, so it is paid once. Every round passes ``--ignore-eos``, so every
  request generates exactly the output length and rounds of the same size do the same work.
  ``prepare(load)`` samples a round's requests ahead of it (``vllm.benchmarks.datasets.get_samples``
  with the tokenizer loaded once; prefix_repetition encodes and decodes every prompt, about a
  second per round on the H200 host), so that a round pays only ``main(args)``'s own steps: while
  a prepared round runs, ``serve.get_samples`` and ``serve.get_tokenizer`` hand ``main`` the
  prepared requests and the loaded tokenizer, and everything else (the server tokenizer check,
  sampling parameters, ``benchmark``) is vLLM's ``vllm bench serve`` unchanged.
* ``HttpClient``: a stand-in for machines without vLLM (the dry run): threads POSTing token-id
  prompts to ``/v1/completions`` without streaming, so its "TTFT" is the whole request's latency
  and its "TPOT" that latency over the output tokens. The same result keys.

Both send ``num_prompts`` requests with at most ``concurrency`` in flight; ``seed`` picks the
prompts (each round its own, so that no round finds the previous one's suffixes cached: both
rounds of a pair sending the same prompts would give the second one prefix-cache hits, which
favour whichever mode runs second and swap sides from pair to pair). Both take ``prepare(load)``:
a round's prompts built before it runs (``run`` builds them itself when not prepared).
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

KEYS = (
    "completed",
    "failed",
    "duration",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


@dataclass(frozen=True)
class Load:
    dataset: str = "prefix_repetition"  # or "random"
    num_prompts: int = 200
    concurrency: int = 16
    prefix_len: int = 256  # prefix_repetition: shared prefix, unique suffix, num_prefixes prefixes
    suffix_len: int = 256
    num_prefixes: int = 10
    input_len: int = 512  # random
    output_len: int = 32
    seed: int = 0

    def with_(self, **kw: Any) -> Load:
        return replace(self, **kw)


class Client(Protocol):
    name: str

    def prepare(self, load: Load) -> None: ...

    def run(self, load: Load) -> dict[str, Any]: ...


class VllmClient:
    name = "vllm"

    def __init__(self, base_url: str, model: str, tokenizer: str, log: Path) -> None:
        t0 = time.monotonic()
        from vllm.benchmarks.serve import add_cli_args, main  # type: ignore[import-not-found]
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

        self.import_seconds = time.monotonic() - t0
        self.parser = FlexibleArgumentParser()
        add_cli_args(self.parser)
        self.main: Callable[[Any], dict[str, Any]] = main
        self.base_url, self.model, self.tokenizer, self.log = base_url, model, tokenizer, log
        self._tok: Any = None
        self.prepared: dict[Load, list[Any]] = {}
        self.prepare_seconds = 0.0

    def argv(self, load: Load) -> list[str]:
        argv = [
            "--backend", "vllm", "--base-url", self.base_url, "--model", self.model, "--tokenizer", self.tokenizer,
            "--dataset-name", load.dataset, "--num-prompts", str(load.num_prompts),
            "--max-concurrency", str(load.concurrency), "--seed", str(load.seed), "--ignore-eos",
            "--temperature", "0", "--metric-percentiles", "99", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--disable-tqdm",
        ]  # fmt: skip
        if load.dataset == "prefix_repetition":
            argv += ["--prefix-repetition-prefix-len", str(load.prefix_len)]
            argv += ["--prefix-repetition-suffix-len", str(load.suffix_len)]
            argv += ["--prefix-repetition-num-prefixes", str(load.num_prefixes)]
            argv += ["--prefix-repetition-output-len", str(load.output_len)]
        else:
            argv += ["--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len)]
        return argv

    def tokenizer_(self) -> Any:
        """vLLM's ``get_tokenizer`` as ``main`` calls it, once (loading it is seconds)."""
        if self._tok is None:
            from vllm.tokenizers import get_tokenizer  # type: ignore[import-not-found]

            args = self.parser.parse_args(self.argv(Load()))
            self._tok = get_tokenizer(
                args.tokenizer, tokenizer_mode=args.tokenizer_mode, trust_remote_code=args.trust_remote_code
            )
        return self._tok

    def prepare(self, load: Load) -> None:
        """The requests ``main`` would sample for ``load``: seeded as ``main_async`` seeds before
        ``get_samples`` (the dataset seeds itself from ``--seed`` too), so the same prompts."""
        if load in self.prepared:
            return
        import numpy as np  # type: ignore[import-not-found]
        from vllm.benchmarks.datasets import get_samples  # type: ignore[import-not-found]

        t0 = time.monotonic()
        args = self.parser.parse_args(self.argv(load))
        tok = self.tokenizer_()
        with open(self.log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            random.seed(args.seed)
            np.random.seed(args.seed)
            self.prepared[load] = get_samples(args, tok)
        self.prepare_seconds += time.monotonic() - t0

    def run(self, load: Load) -> dict[str, Any]:
        from vllm.benchmarks import serve  # type: ignore[import-not-found]

        self.prepare(load)
        requests, tok = self.prepared.pop(load), self.tokenizer_()
        args = self.parser.parse_args(self.argv(load))
        saved = serve.get_samples, serve.get_tokenizer
        serve.get_samples = lambda _args, _tok: requests
        serve.get_tokenizer = lambda *_a, **_k: tok
        try:
            with open(self.log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                result = self.main(args)
        finally:
            serve.get_samples, serve.get_tokenizer = saved
        return {k: result.get(k) for k in KEYS}


def _prompts(load: Load, vocab: int = 30_000) -> list[list[int]]:
    rng = random.Random(load.seed)  # noqa: S311 - prompts, not secrets

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    if load.dataset == "random":
        return [ids(load.input_len) for _ in range(load.num_prompts)]
    prefixes = [ids(load.prefix_len) for _ in range(load.num_prefixes)]
    return [prefixes[i % load.num_prefixes] + ids(load.suffix_len) for i in range(load.num_prompts)]


class HttpClient:
    name = "http"

    def __init__(self, base_url: str, model: str) -> None:
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.prepared: dict[Load, list[list[int]]] = {}
        self.prepare_seconds = 0.0

    def prepare(self, load: Load) -> None:
        if load not in self.prepared:
            t0 = time.monotonic()
            self.prepared[load] = _prompts(load)
            self.prepare_seconds += time.monotonic() - t0

    def _one(self, prompt: list[int], max_tokens: int) -> tuple[float, int] | None:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.url, data=body.encode(), headers=headers)  # noqa: S310 - our server's URL
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - our server's URL
                out = json.loads(r.read())
        except OSError:
            return None
        return time.perf_counter() - t0, int(out.get("usage", {}).get("completion_tokens", 0))

    def run(self, load: Load) -> dict[str, Any]:
        self.prepare(load)
        prompts = self.prepared.pop(load)
        lock = threading.Lock()
        done: list[tuple[float, int]] = []
        failed = 0

        def send(p: list[int]) -> None:
            nonlocal failed
            r = self._one(p, load.output_len)
            with lock:
                if r is None:
                    failed += 1
                else:
                    done.append(r)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=load.concurrency) as pool:
            list(pool.map(send, prompts))
        duration = time.perf_counter() - t0
        return http_result(done, failed, duration)


def http_result(done: list[tuple[float, int]], failed: int, duration: float) -> dict[str, Any]:
    """vLLM's result keys from (latency s, output tokens) per completed request."""
    from pairstats import percentile

    lat = [1e3 * s for s, _ in done] or [0.0]
    tpot = [1e3 * s / n for s, n in done if n] or [0.0]
    tokens = sum(n for _, n in done)
    return {
        "completed": len(done),
        "failed": failed,
        "duration": duration,
        "total_output_tokens": tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": tokens / duration if duration else 0.0,
        "median_ttft_ms": statistics.median(lat),
        "p99_ttft_ms": percentile(lat, 99),
        "median_tpot_ms": statistics.median(tpot),
        "p99_tpot_ms": percentile(tpot, 99),
    }
