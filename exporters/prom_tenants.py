"""Prometheus families of an engine's tenants (cache salts, LoRA adapters): per tenant and
medium, the KV blocks stored, evicted, regretted and held, the tokens recomputed, the losses by
tier and cause, and how many tenants have their own label."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.metric_specs import COUNTER, GAUGE, Metrics, MetricSpec

METRICS = Metrics(
    (
        MetricSpec(
            "kvwatch_kv_tenant_blocks_stored",
            COUNTER,
            (
                "KV blocks stored, per tenant; tenant: a configured name, salt-XXXXXXXX (an unnamed "
                "cache salt, keyed hash), lora:ADAPTER, default (no salt, no adapter), unknown "
                "(parent never seen), other (past engines.tenant_top_k)"
            ),
            (*PROCESS_LABELS, "medium", "tenant"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_blocks_removed",
            COUNTER,
            (
                "KV blocks evicted, per tenant (whose blocks they were); tenant: a configured name, "
                "salt-XXXXXXXX (an unnamed cache salt, keyed hash), lora:ADAPTER, default (no salt, "
                "no adapter), unknown (parent never seen), other (past engines.tenant_top_k)"
            ),
            (*PROCESS_LABELS, "medium", "tenant"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_blocks_removed_young",
            COUNTER,
            (
                "KV blocks evicted within engines.thrash_seconds of being stored, per tenant; tenant:"
                " a configured name, salt-XXXXXXXX (an unnamed cache salt, keyed hash), lora:ADAPTER,"
                " default (no salt, no adapter), unknown (parent never seen), other (past "
                "engines.tenant_top_k)"
            ),
            (*PROCESS_LABELS, "medium", "tenant"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_blocks_regretted",
            COUNTER,
            (
                "KV blocks stored again after their eviction, per tenant; tenant: a configured name, "
                "salt-XXXXXXXX (an unnamed cache salt, keyed hash), lora:ADAPTER, default (no salt, "
                "no adapter), unknown (parent never seen), other (past engines.tenant_top_k)"
            ),
            (*PROCESS_LABELS, "medium", "tenant"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_regret_recomputed_tokens",
            COUNTER,
            (
                "tokens of the tenant's regretted blocks: prefill recomputed (or reloaded) because of"
                " evictions; tenant: a configured name, salt-XXXXXXXX (an unnamed cache salt, keyed "
                "hash), lora:ADAPTER, default (no salt, no adapter), unknown (parent never seen), "
                "other (past engines.tenant_top_k)"
            ),
            (*PROCESS_LABELS, "medium", "tenant"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_blocks_resident",
            GAUGE,
            "KV blocks held now, per tenant (its share of the pool)",
            (*PROCESS_LABELS, "medium", "tenant"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_lost_bytes",
            COUNTER,
            (
                "KV cache bytes a tier lost, by cause: evicted (engine LRU; disk: files deleted), "
                "preempted (GPU evictions while the engine preempted), offload_dropped (GPU blocks "
                "that never reached the CPU tier), reclaim (disk tier page cache reclaimed), cleared "
                "(reset/sleep), oom (resident at an OOM kill), per tenant"
            ),
            (*PROCESS_LABELS, "tenant", "tier", "cause"),
        ),
        MetricSpec(
            "kvwatch_kv_tenant_lost_blocks",
            COUNTER,
            (
                "KV cache blocks a tier lost, by cause: evicted (engine LRU; disk: files deleted), "
                "preempted (GPU evictions while the engine preempted), offload_dropped (GPU blocks "
                "that never reached the CPU tier), reclaim (disk tier page cache reclaimed), cleared "
                "(reset/sleep), oom (resident at an OOM kill), per tenant"
            ),
            (*PROCESS_LABELS, "tenant", "tier", "cause"),
        ),
        MetricSpec(
            "kvwatch_kv_tenants",
            GAUGE,
            (
                "tenants seen: labelled (their own label) or folded (counted under tenant other, past"
                " engines.tenant_top_k or a stream's cap)"
            ),
            (*PROCESS_LABELS, "state"),
        ),
    )
)

# TenantRow attribute, metric name, help
COUNTERS = (  # per tenant: MediumTotals attribute, metric name
    ("stored", "kvwatch_kv_tenant_blocks_stored"),
    ("removed", "kvwatch_kv_tenant_blocks_removed"),
    ("removed_young", "kvwatch_kv_tenant_blocks_removed_young"),
    ("regretted", "kvwatch_kv_tenant_blocks_regretted"),
    ("regret_tokens", "kvwatch_kv_tenant_regret_recomputed_tokens"),
)


def tenant_families(s: Snapshot) -> Iterator[Metric]:
    counters = {attr: METRICS.counter(name) for attr, name in COUNTERS}
    resident = METRICS.gauge("kvwatch_kv_tenant_blocks_resident")
    lost_bytes = METRICS.counter("kvwatch_kv_tenant_lost_bytes")
    lost_blocks = METRICS.counter("kvwatch_kv_tenant_lost_blocks")
    count = METRICS.gauge("kvwatch_kv_tenants")
    for p in s.processes:
        t = p.kv_tenants
        if t is None:
            continue
        v = label_values(p.labels, PROCESS_LABELS)
        for r in t.rows:
            for attr, fam in counters.items():
                fam.add_metric([*v, r.medium, r.tenant], getattr(r, attr))
            resident.add_metric([*v, r.medium, r.tenant], r.resident)
        for (tenant, tier, cause), row in sorted(t.losses.items()):
            lost_blocks.add_metric([*v, tenant, tier, cause], row.blocks)
            if row.bytes is not None:
                lost_bytes.add_metric([*v, tenant, tier, cause], row.bytes)
        count.add_metric([*v, "labelled"], t.labelled)
        count.add_metric([*v, "folded"], t.folded + t.overflow)
    yield from counters.values()
    yield from (resident, lost_bytes, lost_blocks, count)
