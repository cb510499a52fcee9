"""Prometheus families of the KV loss ledger: per engine process, tier and cause, the blocks
and bytes lost, and the block size that prices them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values

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
