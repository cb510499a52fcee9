"""A cache salt is a tenant's secret: kvwatch decodes it (vLLM puts it in a request's first block's
extra keys) and counts the blocks that carry one, but the salt itself never reaches /metrics, the
top API, the daemon's log or a recorded trace.

A publisher sends vLLM 0.26 events of a hybrid model whose requests carry salts, a LoRA adapter
and a multimodal input; `kvwatch run` taps it (no BPF, no root)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.vllm_publisher import WirePublisher
from kvwatch.daemon.model.engines import EnginePlan, EngineView
from kvwatch.exporters.record import TraceRecorder
from tests.support.daemon import daemon, free_port, wait_until
from tests.support.engine_sim import engines_only
from tests.support.kv_scripts import script_stats
from tests.support.snapshots import T0_NS, T0_WALL, snap
from tests.support.vllm_replay import stand_in_process

SALTS = [f"tenant-{i}-s3cr3t-{i * 7919:x}" for i in range(23)]
CONFIG = (
    engines_only()
    + """
[engines]
endpoints = [{{ cmdline = "{marker}", kv_events = "{kv}", engine = "vllm" }}]
"""
)


def script() -> list[tuple[float, list[dict[str, Any]]]]:
    """23 salted requests (one in LoRA "support-bot" with an image in its first block), each a
    3-block prefix stored in a full-attention and a sliding-window group."""
    out = []
    for i, salt in enumerate(SALTS):
        hashes = [1000 * i + k for k in range(3)]
        lora = "support-bot" if i == 0 else None
        first = [*(["support-bot"] if lora else []), ["mm-0f3a", 4], salt] if i == 0 else [salt]
        evs = [
            we.stored(
                hashes,
                list(range(48)),
                group_idx=g,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=win,
                lora_name=lora,
                extra_keys=[first, None, None],
            )
            for g, (kind, win) in enumerate((("full_attention", None), ("sliding_window", 256)))
        ]
        out.append((100.0 + i, evs))
    return out


@pytest.fixture
def stand_in() -> Iterator[subprocess.Popen[bytes]]:
    with stand_in_process("vllm-salted") as p:
        yield p


def test_salts_are_counted_never_shown(stand_in: Any, tmp_path: Path) -> None:
    port = free_port()
    pub = WirePublisher(f"tcp://127.0.0.1:{port}", layout=we.Layout.V0_26)
    pid = str(stand_in.pid)
    try:
        with daemon(tmp_path, CONFIG.format(marker=stand_in.marker, kv=f"tcp://127.0.0.1:{port}")) as d:
            wait_until(lambda: d.value("kvwatch_kv_event_stream_connected", pid=pid) == 1, 30, "stream connected")
            assert pub.wait_subscribed()
            for ts, evs in script():
                pub.publish(evs, ts=ts)
            assert pub.flush()
            wait_until(lambda: d.value("kvwatch_kv_event_batches_total", pid=pid) == len(SALTS), 30, "every batch")
            wait_until(
                lambda: d.value("kvwatch_kv_blocks_stored_extra_keys_total", pid=pid, key="cache_salt") > 0,
                10,
                "a tick",
            )
            m = d.value_in(d.metrics())
            _, text = d.get("/metrics")
            _, top = d.get("/api/v1/top")
            log = d.log.read_text()
    finally:
        pub.close()
    assert m("kvwatch_kv_blocks_stored_extra_keys_total", pid=pid, key="cache_salt") == 23
    assert m("kvwatch_kv_blocks_stored_extra_keys_total", pid=pid, key="lora") == 3
    assert m("kvwatch_kv_blocks_stored_extra_keys_total", pid=pid, key="multimodal") == 1
    assert m("kvwatch_kv_blocks_stored_total", pid=pid, medium="GPU") == 23 * 3  # the full-attention group's
    for salt in SALTS:
        for where, out in (("/metrics", text), ("/api/v1/top", top), ("log", log)):
            assert salt not in out and "s3cr3t" not in out, where


def test_salts_never_reach_a_trace() -> None:
    stats = script_stats(script())
    assert stats.extras["cache_salt"] == 23 and "s3cr3t" not in repr(stats)
    s = snap(5.0, 100, 0)
    view = EngineView(EnginePlan("7@1", 7), (stats,), None, None, None)
    rec = TraceRecorder(t0_ns=T0_NS, t0_wall=T0_WALL, host="h")
    rec.on_snapshot(replace(s, processes=(replace(s.processes[0], engine=view),)))
    trace = rec.finish(6.0, 1.0)
    assert "s3cr3t" not in str(trace)
