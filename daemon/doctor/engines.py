"""``kvwatch doctor``'s engine-tap canary: a simulated vLLM in this process (its KV event
stream in vLLM's wire format, and its /metrics) serves 23 requests; the subscriber must count
exactly the blocks it stored, recover two batches dropped off the wire through the replay
endpoint, and the /metrics reader must read exactly the tokens it queried."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from kvwatch.daemon.config import Config
from kvwatch.daemon.doctor.checks import FAIL, OK, SKIP, Check
from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.metrics import EngineScraper
from kvwatch.daemon.lab.engine_sim import SimulatedVllm
from kvwatch.daemon.model.engines import ScrapeTarget, StreamSpec

CANARY = 23


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def engine_canaries(config: Config) -> list[Check]:
    if not (config.engines.kv_events or config.engines.metrics):
        return [Check("canary engine taps", SKIP, "engine taps off in config")]
    port, rport = _port(), _port()
    sim = SimulatedVllm(kv_endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    hub = KVEventHub(replay_timeout_seconds=1.0)
    spec = StreamSpec(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
    scraper = EngineScraper(timeout=2.0)
    target = ScrapeTarget(sim.metrics_url, "doctor")
    try:
        hub.set_streams([spec])
        hub.start()
        if not _wait(lambda: spec in hub.stats() and hub.stats()[spec].connected, 5):
            return [Check("canary kv events", FAIL, f"subscriber did not connect to {spec.endpoint}")]
        time.sleep(0.3)
        sim.step([0], 2)  # the first batch, so the next ones have a sequence to follow
        for i in range(1, CANARY + 1):
            if i == 5:
                sim.publisher.lose(2)  # these two reach only the replay buffer
            sim.step([i], 2)
        sim.publisher.flush()
        want = sim.pool.stats.stored

        def stored() -> int:
            m = hub.stats()[spec].media.get("GPU")
            return m.stored if m is not None else 0

        _wait(lambda: stored() >= want, 5)
        st = hub.stats()[spec]
        scraper.set_targets([target])
        scraper.scrape_once()
        sample = scraper.states()[target].last
        queried = sample.prefix_queries if sample else None
        return [
            Check(
                "canary kv events",
                OK if stored() == want and st.replayed == 2 and st.lost == 0 else FAIL,
                f"{stored()} of {want} blocks counted from {st.batches} batches; {st.replayed} of 2 dropped batches "
                f"recovered by replay",
            ),
            Check(
                "canary engine metrics",
                OK if queried == sim.pool.stats.queries else FAIL,
                f"/metrics read {queried} queried tokens of {sim.pool.stats.queries}",
            ),
        ]
    finally:
        hub.close()
        scraper.close()
        sim.close()
