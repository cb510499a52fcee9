"""Prometheus families of the KV loss ledger: per engine process, tier and cause, the blocks
and bytes lost, and the block size that prices them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_kv_lost_bytes",
            COUNTER,
            (
                "KV cache bytes a tier lost, by cause: evicted (engine LRU; disk: files deleted), "
                "preempted (GPU evictions while the engine preempted), offload_dropped (GPU blocks "
                "that never reached the CPU tier), reclaim (disk tier page cache reclaimed), cleared "
                "(reset/sleep), oom (resident at an OOM kill)"
            ),
            (*PROCESS_LABELS, "tier", "cause"),
        ),
        MetricSpec(
            "kvwatch_kv_lost_blocks",
            COUNTER,
            (
                "KV cache blocks a tier lost, by cause: evicted (engine LRU; disk: files deleted), "
                "preempted (GPU evictions while the engine preempted), offload_dropped (GPU blocks "
                "that never reached the CPU tier), reclaim (disk tier page cache reclaimed), cleared "
                "(reset/sleep), oom (resident at an OOM kill); disk tiers count bytes only"
            ),
            (*PROCESS_LABELS, "tier", "cause"),
        ),
        MetricSpec(
            "kvwatch_kv_block_bytes",
            GAUGE,
            (
                "bytes of one KV block that price the loss ledger; source config, offload (the common"
                " divisor of the engine's offload bytes) or offload_ratio (those bytes over the CPU "
                "blocks announced)"
            ),
            (*PROCESS_LABELS, "source"),
        ),
    )
)


def loss_families(s: Snapshot) -> Iterator[Metric]:
    lost_bytes = METRICS.counter("kvwatch_kv_lost_bytes")
    lost_blocks = METRICS.counter("kvwatch_kv_lost_blocks")
    block_bytes = METRICS.gauge("kvwatch_kv_block_bytes")
    # processes gone within engines.loss_linger_seconds keep their rows (an OOM kill's losses),
    # unless a live process has the same labels (its PID reused): one series per label set
    live = [(label_values(p.labels, PROCESS_LABELS), p.kv_losses) for p in s.processes]
    seen = {tuple(v) for v, _ in live}
    gone = [(label_values(lab, PROCESS_LABELS), rows) for lab, rows in s.departed_losses]
    for v, losses in live + [(v, rows) for v, rows in gone if tuple(v) not in seen]:
        for (tier, cause), row in sorted(losses.items()):
            if row.blocks:
                lost_blocks.add_metric([*v, tier, cause], row.blocks)
            if row.bytes is not None:
                lost_bytes.add_metric([*v, tier, cause], row.bytes)
    for p in s.processes:
        v = label_values(p.labels, PROCESS_LABELS)
        e = p.engine
        if e is not None and e.block_bytes is not None:
            block_bytes.add_metric([*v, e.block_bytes_source], e.block_bytes)
    yield from (lost_bytes, lost_blocks, block_bytes)
