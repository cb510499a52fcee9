"""A simulated vLLM engine: its KV cache, its KV event stream, its /metrics and its HTTP API.

For the demo, end-to-end tests, the benchmark and a dry run of the real-engine validation
(``tests/gpu/validate_vllm.py``) — kvwatch's taps need an engine that behaves like one
without a GPU. What the cache does, and which events it announces, follows vLLM 0.26.0
(``engine_sim_pool``): a prefix-cached GPU block pool, and with ``cpu_blocks`` the
OffloadingConnector's CPU tier announcing the same blocks on medium CPU. Its numbers feed
a prometheus-client registry with vLLM 0.26.0's metric names, labels and types, served
with the OpenAI-style routes vLLM serves (``engine_sim_http``).

Two ways to drive it: requests over HTTP (``/v1/completions`` with token ids, run by an
engine thread step by step: prefill, decode, preemption), or scripted steps from the
tests and the demo (``step``, ``set_active``, ``evict``, ``reset``, ...), each a batch of
requests admitted and finished at once. Events go out on a ``WirePublisher`` (vLLM's wire
format, byte for byte), one batch per step.
"""

from __future__ import annotations

import threading
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvwatch.daemon.lab.engine_sim_http import Server
from kvwatch.daemon.lab.engine_sim_pool import BLOCK, BlockPool, CpuTier, PoolStats, Scheduler, SimRequest, Tenancy
from kvwatch.daemon.lab.vllm_publisher import WirePublisher
from kvwatch.daemon.lab.wire_encode import Layout

LABELS = ("model_name", "engine")
BLOCK_BYTES = 16 * 2 * 8 * 64 * 2 * 16  # 16 tokens x K,V x 8 heads x 64 dims x bf16 x 16 layers: 512 KiB


class _Metrics:
    """vLLM 0.26.0's names for what kvwatch reads; counters follow the pool's statistics."""

    def __init__(self, model: str) -> None:
        r = self.registry = CollectorRegistry()
        lv = (model, "0")

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=r).labels(*lv)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, LABELS, registry=r).labels(*lv)

        self.usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.counters: dict[str, Any] = {
            "queries": counter(
                "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
            ),
            "hits": counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            "ext_queries": counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, in tokens.",
            ),
            "ext_hits": counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, in tokens.",
            ),
            "preemptions": counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            "generated": counter("vllm:generation_tokens", "Number of generation tokens processed."),
            "store_bytes": counter("vllm:kv_offload_store_bytes", "Number of bytes stored by KV offloading"),
            "load_bytes": counter("vllm:kv_offload_load_bytes", "Number of bytes loaded by KV offloading"),
        }
        by_type = Counter(
            "vllm:kv_offload_total_bytes", "Total bytes transferred", [*LABELS, "transfer_type"], registry=r
        )
        self.by_type = {
            "store_bytes": by_type.labels(*lv, "GPU_to_CPU"),
            "load_bytes": by_type.labels(*lv, "CPU_to_GPU"),
        }
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            [*LABELS, "sleep_state"],
            registry=r,
        )
        self.sleep = {s: sleep.labels(*lv, s) for s in ("awake", "weights_offloaded", "discard_all")}
        self.seen = PoolStats()
        self.store_share = 1.0  # of the offload bytes stored, the share reported
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "enable_prefix_caching", "engine", "num_cpu_blocks", "num_gpu_blocks"],
            registry=r,
        )

    def set_pool(self, gpu_blocks: int, cpu_blocks: int) -> None:
        self.cache_config.labels("16", "True", "0", str(cpu_blocks or "None"), str(gpu_blocks)).set(1)

    def sync(self, st: PoolStats, usage: float, running: int, waiting: int) -> None:
        for name, c in self.counters.items():
            delta = self._reported(name, st) - self._reported(name, self.seen)
            if delta > 0:
                c.inc(delta)
                if name in self.by_type:
                    self.by_type[name].inc(delta)
        self.seen = PoolStats(**asdict(st))
        self.usage.set(usage)
        self.running.set(running)
        self.waiting.set(waiting)

    def _reported(self, name: str, st: PoolStats) -> int:
        """What the engine says: the truth, or with ``underreport`` a share of its offload stores
        (whole blocks: an engine that misses some copies, not one that miscounts their size)."""
        v: int = getattr(st, name)
        if name == "store_bytes" and self.store_share < 1.0:
            v = int(v // BLOCK_BYTES * self.store_share) * BLOCK_BYTES
        return v

    def set_sleep(self, level: int | None) -> None:
        self.sleep["awake"].set(0 if level else 1)
        self.sleep["weights_offloaded"].set(1 if level == 1 else 0)
        self.sleep["discard_all"].set(1 if level == 2 else 0)


class SimulatedVllm:
    """The engine: a pool (and CPU tier), a publisher, an engine thread and an HTTP server."""

    def __init__(
        self,
        *,
        kv_endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        http_host: str = "127.0.0.1",
        http_port: int = 0,
        capacity: int = 4000,
        layout: Layout = Layout.V0_26,
        model: str = "demo-model",
        topic: str = "",
        cpu_blocks: int = 0,
        max_num_seqs: int = 256,
        dev_mode: bool = False,
        step_seconds: float = 0.005,
        broken_prefix_cache: bool = False,
    ) -> None:
        self.model = model
        self.dev_mode = dev_mode
        self.step_seconds = step_seconds
        self.pool = BlockPool(capacity, broken=broken_prefix_cache)
        self.cpu = CpuTier(cpu_blocks, BLOCK_BYTES) if cpu_blocks > 0 else None
        self.scheduler = Scheduler(self.pool, self.cpu, max_num_seqs)
        self.publisher = WirePublisher(kv_endpoint, replay_endpoint, layout=layout, topic=topic)
        self.metrics = _Metrics(model)
        self.metrics.set_sleep(None)
        self.metrics.set_pool(capacity, cpu_blocks)
        self._sleep_level: int | None = None
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._waiters: dict[int, threading.Event] = {}
        self._stop = threading.Event()
        self._engine = threading.Thread(target=self._engine_loop, name="sim-vllm-engine", daemon=True)
        self._engine.start()
        self._server = Server(self, http_host, http_port)

    @property
    def http_port(self) -> int:
        return self._server.port

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    def metrics_text(self) -> bytes:
        with self._lock:
            self._sync_metrics()
        return generate_latest(self.metrics.registry)

    def emit(self, events: list[dict[str, Any]]) -> None:
        """One engine step's events as one batch (vLLM publishes once per scheduler step)."""
        if events:
            self.publisher.publish(events)
        self._sync_metrics()

    def _sync_metrics(self) -> None:
        s = self.scheduler
        self.metrics.sync(self.pool.stats, self.pool.usage, len(s.running), len(s.waiting))

    # --- requests over HTTP -----------------------------------------------------------------
    def complete(self, prompt: list[int], max_tokens: int, keys: Tenancy = (None, None)) -> dict[str, Any] | None:
        with self._lock:
            req = self.scheduler.new_request(prompt, max_tokens, keys)
            done = self._waiters[req.rid] = threading.Event()
            self.scheduler.waiting.append(req)
            self._work.notify()
        done.wait()
        with self._lock:
            self._waiters.pop(req.rid, None)
        if not req.finished:
            return None
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": req.generated,
            "total_tokens": len(prompt) + req.generated,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }
        return {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}

    def _engine_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not self._stop.is_set() and (self._sleep_level or not self.scheduler.has_requests()):
                    self._work.wait(0.1)
                events, done = self.scheduler.step()
                self.emit(events)
                for r in done:
                    self._release(r)
            self._stop.wait(self.step_seconds)

    def _release(self, r: SimRequest) -> None:
        w = self._waiters.get(r.rid)
        if w is not None:
            w.set()

    # --- dev-mode routes --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        with self._lock:
            return self.scheduler.reset()

    def sleep(self, level: int) -> None:
        """vLLM: abort what runs, reset the prefix caches (the CPU tier silently) for level >= 1."""
        with self._lock:
            for r in self.scheduler.abort_all():
                self._release(r)
            if level >= 1:
                self.scheduler.reset()
                if self.cpu is not None:
                    self.cpu.lru.clear()
            self.set_sleep(level)

    def wake_up(self) -> None:
        with self._lock:
            self.set_sleep(None)
            self._work.notify()

    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def set_sleep(self, level: int | None) -> None:
        self._sleep_level = level or None
        self.metrics.set_sleep(level)

    # --- scripted steps (tests, demo, doctor) ------------------------------------------------------
    def step(self, prefixes: list[int], blocks: int, keys: Tenancy = (None, None)) -> None:
        """Requests of ``blocks`` full blocks (plus the token vLLM always computes), each named by
        its prefix: the same prefix is the same tokens, hence the same block hashes (within one
        tenant: ``keys``, the requests' cache salt and LoRA adapter)."""
        self.steps([(prefixes, blocks, keys)])

    def steps(self, parts: list[tuple[list[int], int, Tenancy]]) -> None:
        """Several tenants' requests in one engine step (one batch)."""
        with self._lock:
            events: list[dict[str, Any]] = list(self.scheduler.queued)
            self.scheduler.queued = []
            for prefixes, blocks, keys in parts:
                for p in prefixes:
                    events += self.scheduler.run_now(_tokens(p, blocks), keys)
            self.emit(events)

    def set_active(self, blocks: int) -> None:
        with self._lock:
            events: list[dict[str, Any]] = []
            self.pool.set_ballast(blocks, events)
            self.emit(events)

    def evict(self, n: int, *, reset: bool = False) -> None:
        """Drop ``n`` cached blocks (a policy bug); with ``reset``, a prefix-cache reset in the
        same step, so that a subscriber sees both in one batch."""
        with self._lock:
            events: list[dict[str, Any]] = []
            self.pool.evict(n, events)
            if reset:
                self.pool.reset(events)
            self.emit(events)

    def reset(self) -> None:
        with self._lock:
            self.scheduler.reset()
            self._sync_metrics()

    def preempt(self, n: int) -> None:
        with self._lock:
            self.pool.stats.preemptions += n
            self._sync_metrics()

    def generate(self, n: int) -> None:
        """Tokens decoded by the scripted "running requests" (the HTTP engine counts its own)."""
        with self._lock:
            self.pool.stats.generated += n
            self._sync_metrics()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for r in self.scheduler.abort_all():
                self._release(r)
            self._work.notify_all()
        self._engine.join(timeout=5)
        self._server.close()
        self.publisher.close()


def _tokens(prefix: int, blocks: int) -> list[int]:
    base = (prefix * 1_000_003) % 30_000
    return [3 + (base + i) % 31_997 for i in range(blocks * BLOCK + 1)]
