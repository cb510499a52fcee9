"""The node's KV memory budget on the real hub (``engines/kv_events.py``, ``memory_budget.py``):
streams on real ZMQ sockets share ``kv_memory_bytes``; a stream that fills its part shrinks the
others to an equal share at once, one the hub drops gives its part back, and every entry a
shrink drops is counted forgotten. Each wait ends on what the hub has counted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvwatch.daemon.engines.kv_events import KVEventHub
from kvwatch.daemon.engines.memory_budget import cost
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.vllm_publisher import WirePublisher
from kvwatch.daemon.model.engines import StreamSpec, StreamStats
from tests.support.daemon import free_port, wait_until

S, R = 4096, 4096  # one group's bounds: a stream of one GPU group holds at most S + R
BUDGET = 3 * (S + R) // 2  # entries: one and a half stream's worth (both memories scale alike)


@contextlib.contextmanager
def streams(hub: KVEventHub, n: int) -> Iterator[list[tuple[StreamSpec, WirePublisher]]]:
    pairs = []
    try:
        for _ in range(n):
            port = free_port()
            pairs.append((StreamSpec(f"tcp://127.0.0.1:{port}"), WirePublisher(f"tcp://*:{port}")))
        hub.set_streams([spec for spec, _ in pairs])
        for spec, pub in pairs:
            wait_until(lambda s=spec: s in hub.stats() and hub.stats()[s].connected, 10, "subscriber connected")
            assert pub.wait_subscribed(), "no subscription reached the publisher"
        yield pairs
    finally:
        for _, pub in pairs:
            pub.close()


def fill(hub: KVEventHub, spec: StreamSpec, pub: WirePublisher, first: int) -> StreamStats:
    """2(S + R) blocks stored and the first S + R removed: both memories offered more than they
    hold. Waits until the hub has counted the batch."""
    before = hub.stats()[spec].batches
    hashes = list(range(first, first + 2 * (S + R)))
    pub.publish([we.stored(hashes, [], block_size=16), we.removed(hashes[: S + R])], ts=1.0)
    assert pub.flush()
    wait_until(lambda: hub.stats()[spec].batches == before + 1, 30, "the batch counted")
    return hub.stats()[spec]


def forgotten(s: StreamStats) -> int:
    gpu = s.media["GPU"]
    return gpu.stores_forgotten + gpu.removals_forgotten


def test_streams_share_the_budget_and_give_it_back() -> None:
    hub = KVEventHub(max_tracked_blocks=S, regret_memory_blocks=R, kv_memory_bytes=3 * cost(S, R) // 2)
    hub.start()
    try:
        with streams(hub, 2) as [(a, pub_a), (b, pub_b)]:
            alone = fill(hub, a, pub_a, 1 << 40)
            assert alone.tracked_blocks > BUDGET // 2  # alone (b holds nothing yet): its whole bound
            fill(hub, b, pub_b, 1 << 41)  # b fills: a shrinks at once
            now = hub.stats()
            held = now[a].tracked_blocks, now[b].tracked_blocks
            assert sum(held) <= BUDGET and max(held) <= BUDGET // 2, held
            # what a's shrink dropped is counted, not lost silently
            assert forgotten(now[a]) - forgotten(alone) == alone.tracked_blocks - now[a].tracked_blocks
            hub.set_streams([a])  # b goes: its part back to a
            wait_until(lambda: b not in hub.stats(), 10, "stream b closed")
            again = fill(hub, a, pub_a, 1 << 42)
            assert again.tracked_blocks > BUDGET // 2
    finally:
        hub.close()
