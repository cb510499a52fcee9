"""kvwatch run against a simulated vLLM started the way pip starts the real one (a ``vllm``
console script through its shebang): discovery, the command-line taps, the KV event stream,
the engine's /metrics, KVEvictionBurst with its causes, and the counts against the engine's own.

Kernel probes are off in these runs (engine taps need no BPF), so they need no root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwatch.daemon.lab.engine_sim_cli import SimulatedEngineProcess
from tests.support.daemon import DaemonProcess, daemon, free_port, wait_until
from tests.support.engine_sim import (
    CONFIG,
    HOT,
    IDLE,
    alert,
    alert_values,
    engine,
    fired,
    kv_config,
    quiesce,
    tapped,
)


@pytest.fixture
def kvwatch(tmp_path: Path) -> Iterator[DaemonProcess]:
    with daemon(tmp_path, CONFIG) as d:
        yield d


def test_pressure_burst_alert_and_exact_counts(tmp_path: Path, kvwatch: DaemonProcess) -> None:
    with engine(tmp_path) as sim:
        tapped(kvwatch, sim.pid)
        sim.do(HOT)
        kvwatch.run_for(22)  # fill the cache, then hit it; kvwatch learns this as normal
        assert alert(kvwatch, sim.pid) is None
        sim.do("active 3800")  # running requests take 95 % of the pool: cached prefixes evicted
        wait_until(lambda: alert(kvwatch, sim.pid) is not None, 15, "KVEvictionBurst")
        labels = alert(kvwatch, sim.pid)
        assert labels is not None and labels["cause"] == "pressure" and labels["medium"] == "GPU"
        assert labels["engine"] == "vllm" and labels["component"] == "api_server"
        st = quiesce(sim, kvwatch)
        pid = str(sim.pid)
        # every block the engine stored and evicted, counted from its stream, nothing else
        assert kvwatch.value("kvwatch_kv_blocks_stored_total", pid=pid, medium="GPU") == st["stored"]
        assert kvwatch.value("kvwatch_kv_blocks_removed_total", pid=pid, medium="GPU") == st["removed"] > 1500
        assert kvwatch.value("kvwatch_kv_event_batches_total", pid=pid) == st["batches"]
        assert kvwatch.value("kvwatch_kv_event_batches_lost_total", pid=pid) == 0
        assert kvwatch.value("kvwatch_engine_kv_usage_ratio", pid=pid) == 0.95
        assert kvwatch.value("kvwatch_alerts_fired_total", alert="KVEvictionBurst") == 1
        # hot prefixes served from the cache, then evicted by pressure and stored again: never a
        # prefix cache that does not work (the traffic's first pass over its 250 prefixes shares
        # nothing yet: not_shared, information), and never a livelock
        assert kvwatch.value("kvwatch_kv_blocks_regretted_total", pid=pid, medium="GPU") > 0
        assert kvwatch.value("kvwatch_kv_blocks_restored_total", pid=pid, medium="GPU") == 0
        assert fired(kvwatch, "KVPrefixCacheIneffective") <= {"not_shared"}
        assert fired(kvwatch, "KVPreemptionLivelock") == set()


def test_unexpected_burst_fires_but_reset_does_not(tmp_path: Path, kvwatch: DaemonProcess) -> None:
    with engine(tmp_path) as sim:
        tapped(kvwatch, sim.pid)
        sim.do("active 400")
        sim.do(HOT)
        kvwatch.run_for(22)
        sim.do("evict 1500 1")  # three quarters of the hot blocks gone at 10 % usage, in the step of
        # a prefix-cache reset: intentional
        kvwatch.run_for(8)  # two windows judged
        assert kvwatch.value("kvwatch_alerts_fired_total", alert="KVEvictionBurst") == 0
        assert kvwatch.value("kvwatch_kv_cache_resets_total", pid=str(sim.pid)) == 1
        kvwatch.run_for(22)  # quiet period over, re-learnt
        sim.do("evict 1500")  # the same burst without a reset
        wait_until(lambda: alert(kvwatch, sim.pid) is not None, 15, "KVEvictionBurst")
        labels = alert(kvwatch, sim.pid)
        assert labels is not None and labels["cause"] == "unexpected"


def test_gaps_replay_loss_garbage_and_engine_restart(tmp_path: Path, kvwatch: DaemonProcess) -> None:
    kv_port, replay_port, http_port = free_port(), free_port(), free_port()
    kv = kv_config(kv_port, replay_port)
    sim = SimulatedEngineProcess(tmp_path / "bin", http_port=http_port, kv_events=kv)
    try:
        tapped(kvwatch, sim.pid)
        pid = str(sim.pid)
        sim.do(HOT)
        kvwatch.run_for(3)
        sim.do(IDLE)
        sim.do("lose 3")  # three batches miss the wire, the replay endpoint still has them
        for _ in range(3):
            sim.do("evict 5")
        sim.do("evict 1")  # the gap is seen when the next batch arrives
        sim.do("forget 2")  # two more are gone for good
        for _ in range(2):
            sim.do("evict 7")
        sim.do("garbage")  # takes a sequence number: the second gap is seen here
        sim.do("evict 1")
        st = sim.stats()
        wait_until(lambda: kvwatch.value("kvwatch_kv_event_batches_lost_total", pid=pid) == 2, 30, "loss counted")
        kvwatch.wait_ticks(2)
        assert kvwatch.value("kvwatch_kv_event_gaps_total", pid=pid) == 2
        assert kvwatch.value("kvwatch_kv_event_batches_replayed_total", pid=pid) == 3
        assert kvwatch.value("kvwatch_kv_event_decode_errors_total", pid=pid, kind="payload") == 1
        assert kvwatch.value("kvwatch_events_lost_total", source="kv_event_batches") == 2
        # what the engine evicted, less the 2 x 7 blocks of the two batches lost for good
        assert kvwatch.value("kvwatch_kv_blocks_removed_total", pid=pid, medium="GPU") == st["removed"] - 14
        assert kvwatch.value("kvwatch_kv_blocks_stored_total", pid=pid, medium="GPU") == st["stored"]

        sim.close()  # the engine restarts: a new process on the same ports
        sim = SimulatedEngineProcess(tmp_path / "bin", http_port=http_port, kv_events=kv)
        tapped(kvwatch, sim.pid)
        assert kvwatch.value("kvwatch_kv_event_stream_connected", pid=pid) == 0  # the old one is gone
        sim.do("traffic 20 10 4 0")
        kvwatch.run_for(2)
        st = quiesce(sim, kvwatch)
        assert kvwatch.value("kvwatch_kv_blocks_stored_total", pid=str(sim.pid), medium="GPU") == st["stored"] > 0
    finally:
        sim.close()


def test_broken_prefix_cache_is_not_hit(tmp_path: Path, kvwatch: DaemonProcess) -> None:
    """The engine's lookups always miss while it stores and announces every block again."""
    with engine(tmp_path, extra=["--broken-prefix-cache"]) as sim:
        tapped(kvwatch, sim.pid)
        sim.do("traffic 20 10 4 0")  # 10 shared prefixes of 4 blocks, 20 requests/s
        wait_until(lambda: alert(kvwatch, sim.pid, "KVPrefixCacheIneffective") is not None, 30, "not_hit")
        labels = alert(kvwatch, sim.pid, "KVPrefixCacheIneffective")
        assert labels is not None and labels["cause"] == "not_hit" and labels["severity"] == "warning"
        pid = str(sim.pid)
        assert kvwatch.value("kvwatch_engine_prefix_cache_hit_tokens_total", pid=pid, medium="GPU") == 0
        # every prefix stored again from its first block while held: the shape of vLLM's hit
        # announcements, counted so on the stream; with no hit to match, the detector counts them
        # as stored while held (its values say so)
        assert kvwatch.value("kvwatch_kv_blocks_announced_total", pid=pid, medium="GPU") > 0
        values = alert_values(kvwatch, sim.pid, "KVPrefixCacheIneffective")
        assert values["stored_while_held"] > 0 and values["recurring_fraction"] >= 0.05


def test_preemption_livelock_fires_and_clears(tmp_path: Path, kvwatch: DaemonProcess) -> None:
    with engine(tmp_path) as sim:
        tapped(kvwatch, sim.pid)
        sim.do("traffic 20 250 8 0")
        sim.do("decode 2000")
        sim.do("preempting 1")  # preempting at a healthy throughput: no livelock
        kvwatch.run_for(12)  # the healthy rate is learnt from calm windows only: none yet
        sim.do("preempting 0")
        kvwatch.run_for(12)  # calm: learnt
        assert kvwatch.value("kvwatch_alerts_fired_total", alert="KVPreemptionLivelock") == 0
        sim.do("preempting 5")
        sim.do("decode 50")
        wait_until(lambda: alert(kvwatch, sim.pid, "KVPreemptionLivelock") is not None, 30, "livelock")
        labels = alert(kvwatch, sim.pid, "KVPreemptionLivelock")
        assert labels is not None and labels["cause"] == "livelock"
        sim.do("preempting 0")
        sim.do("decode 2000")
        wait_until(lambda: alert(kvwatch, sim.pid, "KVPreemptionLivelock") is None, 30, "cleared")
        pid = str(sim.pid)
        assert kvwatch.value("kvwatch_engine_generation_tokens_total", pid=pid) > 0
