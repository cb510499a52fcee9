"""Prometheus families of the KV loss ledger: per engine process, tier and cause, the blocks
and bytes lost, and the block size that prices them."""

from __future__ import annotations

from collections.abc import Iterator

from kvwatch.daemon.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LOSS_DOC = (
    "KV cache {what} a tier lost, by cause: evicted (engine LRU; disk: files deleted), preempted "
    "(GPU evictions while the engine preempted), offload_dropped (GPU blocks that never reached the "
    "CPU tier), reclaim (disk tier page cache reclaimed), cleared (reset/sleep), oom (resident at an OOM kill)"
)


def loss_families(s: Snapshot) -> Iterator[Metric]:
    labels = [*PROCESS_LABELS, "tier", "cause"]
    lost_bytes = CounterMetricFamily("kvwatch_kv_lost_bytes", LOSS_DOC.format(what="bytes"), labels=labels)
    lost_blocks = CounterMetricFamily(
        "kvwatch_kv_lost_blocks", LOSS_DOC.format(what="blocks") + "; disk tiers count bytes only", labels=labels
    )
    block_bytes = GaugeMetricFamily(
        "kvwatch_kv_block_bytes",
        "bytes of one KV block that price the loss ledger; source config, offload (the common divisor of the "
        "engine's offload bytes) or offload_ratio (those bytes over the CPU blocks announced)",
        labels=[*PROCESS_LABELS, "source"],
    )
    for p in s.processes:
        v = label_values(p.labels, PROCESS_LABELS)
        for (tier, cause), row in sorted(p.kv_losses.items()):
            if row.blocks:
                lost_blocks.add_metric([*v, tier, cause], row.blocks)
            if row.bytes is not None:
                lost_bytes.add_metric([*v, tier, cause], row.bytes)
        e = p.engine
        if e is not None and e.block_bytes is not None:
            block_bytes.add_metric([*v, e.block_bytes_source], e.block_bytes)
    yield from (lost_bytes, lost_blocks, block_bytes)
