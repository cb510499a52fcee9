"""Prometheus families of an engine's tenants (cache salts, LoRA adapters): per tenant and
medium, the KV blocks stored, evicted, regretted and held, the tokens recomputed, the losses by
tier and cause, and how many tenants have their own label."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvwatch.daemon.model.snapshot import Snapshot
from kvwatch.exporters.labels import PROCESS_LABELS, label_values
from kvwatch.exporters.prom_losses import LOSS_DOC

# TenantRow attribute, metric name, help
COUNTERS = (
    ("stored", "kvwatch_kv_tenant_blocks_stored", "KV blocks stored, per tenant"),
    ("removed", "kvwatch_kv_tenant_blocks_removed", "KV blocks evicted, per tenant (whose blocks they were)"),
    (
        "removed_young",
        "kvwatch_kv_tenant_blocks_removed_young",
        "KV blocks evicted within engines.thrash_seconds of being stored, per tenant",
    ),
    ("regretted", "kvwatch_kv_tenant_blocks_regretted", "KV blocks stored again after their eviction, per tenant"),
    (
        "regret_tokens",
        "kvwatch_kv_tenant_regret_recomputed_tokens",
        "tokens of the tenant's regretted blocks: prefill recomputed (or reloaded) because of evictions",
    ),
)
TENANT_DOC = (
    "; tenant: a configured name, salt-XXXXXXXX (an unnamed cache salt, keyed hash), lora:ADAPTER, default "
    "(no salt, no adapter), unknown (parent never seen), other (past engines.tenant_top_k)"
)


def tenant_families(s: Snapshot) -> Iterator[Metric]:
    labels = [*PROCESS_LABELS, "medium", "tenant"]
    counters = {attr: CounterMetricFamily(name, doc + TENANT_DOC, labels=labels) for attr, name, doc in COUNTERS}
    resident = GaugeMetricFamily(
        "kvwatch_kv_tenant_blocks_resident", "KV blocks held now, per tenant (its share of the pool)", labels=labels
    )
    loss_labels = [*PROCESS_LABELS, "tenant", "tier", "cause"]
    lost_bytes = CounterMetricFamily(
        "kvwatch_kv_tenant_lost_bytes", LOSS_DOC.format(what="bytes") + ", per tenant", labels=loss_labels
    )
    lost_blocks = CounterMetricFamily(
        "kvwatch_kv_tenant_lost_blocks", LOSS_DOC.format(what="blocks") + ", per tenant", labels=loss_labels
    )
    count = GaugeMetricFamily(
        "kvwatch_kv_tenants",
        "tenants seen: labelled (their own label) or folded (counted under tenant other, past engines.tenant_top_k "
        "or a stream's cap)",
        labels=[*PROCESS_LABELS, "state"],
    )
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
