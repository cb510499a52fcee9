"""Readings and verdicts of the LMCache validation (``validate_lmcache.py``): kvwatch's numbers
set against LMCache's and vLLM's own /metrics, the tier's files and mincore."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.gpu import lmcache_run as lr
from tests.gpu.vllm_harness import Sample, kvwatch_samples, parse, value

ALERT = "KVHostTierEvictionUnderPressure"
PAGE = 4096


def tier_series(kv: list[Sample], tier: str) -> dict[str, str] | None:
    """The labels of kvwatch_kv_tier_files for this tier, when kvwatch tracks it."""
    return next((lab for n, lab, _ in kv if n == "kvwatch_kv_tier_files" and lab.get("tier") == tier), None)


def tier_counters(kv: list[Sample], tier: str) -> dict[str, float]:
    return {
        "reclaim_bytes": value(kv, "kvwatch_pagecache_evicted_bytes_total", tier=tier, cause="reclaim"),
        "policy_bytes": value(kv, "kvwatch_pagecache_evicted_bytes_total", tier=tier, cause="policy"),
        "refault_pages": value(kv, "kvwatch_pagecache_refault_pages_total", tier=tier),
        "files": value(kv, "kvwatch_kv_tier_files", tier=tier),
        "ledger_disk_reclaim": value(kv, "kvwatch_kv_lost_bytes_total", tier="disk", cause="reclaim"),
        "ledger_disk_policy": value(kv, "kvwatch_kv_lost_bytes_total", tier="disk", cause="policy"),
        "reclaimed_by": sum(v for n, lab, v in kv if n == "kvwatch_pagecache_reclaimed_bytes_total"
                            and lab.get("tier") == tier),
    }  # fmt: skip


def counters_still(tier: str, seconds: float) -> bool:
    a = tier_counters(kvwatch_samples(), tier)
    time.sleep(seconds)
    return a == tier_counters(kvwatch_samples(), tier)


def at_rest(disk: Path, tier: str, attempts: int = 10) -> dict[str, Any]:
    """kvwatch's tier counters and mincore's residency read while neither moved."""
    for _ in range(attempts):
        k0 = tier_counters(kvwatch_samples(), tier)
        res = lr.residency(disk)
        time.sleep(2.5)  # past one kvwatch tick: a page that left during the read is published
        k1 = tier_counters(kvwatch_samples(), tier)
        if k0 == k1 and lr.residency(disk) == res:
            return {"kvwatch": k0, "residency": res, "wall": time.time()}
    return {"kvwatch": k1, "residency": res, "wall": time.time(), "moving": True}


def squeeze_closure(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    lost = (before["residency"]["resident_pages"] - after["residency"]["resident_pages"]) * PAGE
    d = {k: after["kvwatch"][k] - before["kvwatch"][k] for k in before["kvwatch"]}
    return {
        "residency_lost_bytes": lost,
        "kvwatch_reclaim_bytes": d["reclaim_bytes"],
        "kvwatch_policy_bytes": d["policy_bytes"],
        "ledger_disk_reclaim_bytes": d["ledger_disk_reclaim"],
        "reclaimed_by_bytes": d["reclaimed_by"],
        "files_unchanged": before["residency"]["files"] == after["residency"]["files"],
        "exact": lost > 0 and d["reclaim_bytes"] == lost and d["policy_bytes"] == 0,
        "ledger_exact": d["ledger_disk_reclaim"] == d["reclaim_bytes"],
        "before": before,
        "after": after,
    }


def engine_now() -> dict[str, float]:
    try:
        s = parse(lr.vllm_metrics())
    except OSError:
        return {}
    return {
        "ttft_sum": value(s, "vllm:time_to_first_token_seconds_sum"),
        "ttft_count": value(s, "vllm:time_to_first_token_seconds_count"),
        "retrieve_sum": value(s, "lmcache:time_to_retrieve_sum"),
        "retrieve_count": value(s, "lmcache:time_to_retrieve_count"),
        "hit_tokens": value(s, "lmcache:num_hit_tokens_total"),
        "requested_tokens": value(s, "lmcache:num_requested_tokens_total"),
        "stored_tokens": value(s, "lmcache:num_stored_tokens_total"),
        "disk_used": value(s, "lmcache:local_storage_usage"),
        "gpu_hits": value(s, "vllm:prefix_cache_hits_total"),
        "gpu_queries": value(s, "vllm:prefix_cache_queries_total"),
    }


def engine_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a if k in b}
    out = {k: v for k, v in d.items() if not k.endswith(("_sum", "_count"))}
    for m in ("ttft", "retrieve"):
        if d.get(f"{m}_count"):
            out[f"{m}_mean_ms"] = 1000 * d[f"{m}_sum"] / d[f"{m}_count"]
    out["disk_used_end"] = b.get("disk_used", 0.0)
    return out


def tier_rows(kv: list[Sample], vl: list[Sample], pid: int) -> list[dict[str, Any]]:
    """Each LMCache rule of kvwatch's tier schema: kvwatch's value against LMCache's own sample."""
    from kvwatch.daemon.engines.tiers import RULES

    fam = {"queried": "queried_tokens_total", "hit": "hit_tokens_total", "usage": "usage_ratio", "used": "used_bytes"}
    rows = []
    for rule in (r for r in RULES if r.source == "lmcache"):
        truth = sum(v for n, lab, v in vl if n == rule.name and all(lab.get(k) == w for k, w in rule.match))
        present = any(n == rule.name for n, _, _ in vl)
        if rule.quantity in fam:
            name, extra = f"kvwatch_engine_kv_tier_{fam[rule.quantity]}", {}
        elif rule.unit == "bytes":
            name, extra = f"kvwatch_engine_kv_tier_{rule.quantity}_bytes_total", {}
        else:
            name, extra = f"kvwatch_engine_kv_tier_{rule.quantity}_units_total", {"unit": rule.unit}
        by_pid = {lab.get("pid", ""): v for n, lab, v in kv if n == name and lab.get("tier") == rule.tier
                  and lab.get("source") == "lmcache" and all(lab.get(k) == w for k, w in extra.items())}  # fmt: skip
        got = by_pid.get(str(pid))
        rows.append({"lmcache": rule.name, "kvwatch": name, "tier": rule.tier, "present": present,
                     "truth": truth, "kvwatch_value": got, "by_pid": by_pid,
                     "equal": (got == truth) if present else got is None})  # fmt: skip
    return rows


def closure(disk: Path, tier: str, pid: int) -> dict[str, Any]:
    """At quiescence: LMCache publishes its stats every 10 s, kvwatch scrapes every 2 s."""
    time.sleep(14)
    out: dict[str, Any] = {}
    for _ in range(6):
        vl, kv = parse(lr.vllm_metrics()), kvwatch_samples()
        rows = tier_rows(kv, vl, pid)
        if all(r["equal"] for r in rows):
            break
        time.sleep(3)
    res = lr.residency(disk)
    used = value(vl, "lmcache:local_storage_usage")
    out["tier_rows"] = rows
    out["tier_rows_equal"] = all(r["equal"] for r in rows)
    out["disk"] = {"files": res["files"], "bytes": res["bytes"], "lmcache_local_storage_usage": used,
                   "kvwatch_files": value(kv, "kvwatch_kv_tier_files", tier=tier),
                   "kvwatch_tier_labels": tier_series(kv, tier)}  # fmt: skip
    out["disk"]["bytes_equal"] = res["bytes"] == used
    out["disk"]["files_equal"] = res["files"] == out["disk"]["kvwatch_files"]
    out["kvwatch_tier"] = tier_counters(kv, tier)
    out["reclaimers"] = [(lab, v) for n, lab, v in kv if n == "kvwatch_pagecache_reclaimed_bytes_total"]
    out["ledger"] = [(lab, v) for n, lab, v in kv if n == "kvwatch_kv_lost_bytes_total" and lab.get("tier") == "disk"]
    out["stored_tokens"] = value(vl, "lmcache:num_stored_tokens_total")
    return out


def verdict(res: dict[str, Any], found: list[dict[str, Any]]) -> dict[str, Any]:
    def fired(phase: str) -> list[dict[str, Any]]:
        return [a for a in found if a["phase"] == phase and a["alert"] == ALERT]

    marks = {m["name"]: m for m in res.get("marks", [])}
    v: dict[str, Any] = {"tier_found": "tier_found" in marks}
    for quiet in ("warm", "steady", "pre", "release", "sizelimit"):
        if f"{quiet}_start" in marks:
            v[f"{quiet}_silent"] = not fired(quiet)
    if "squeeze_start" in marks:
        sq = fired("squeeze")
        v["squeeze_fired"] = bool(sq)
        if sq:
            v["squeeze_onset_seconds"] = round(sq[0]["after_phase_start"], 1)
            v["squeeze_cause"] = sq[0]["cause"]
            v["cleared"] = sq[0]["clear"] is not None
    q = res.get("phases", {}).get("quiet", {}).get("closure")
    if q:
        v["quiet_exact"], v["ledger_exact"] = q["exact"], q["ledger_exact"]
    c = res.get("closure")
    if c:
        v["tier_rows_equal"] = c["tier_rows_equal"]
        v["disk_files_equal"] = c["disk"]["files_equal"]
        v["policy_bytes"] = c["kvwatch_tier"]["policy_bytes"]
        # LMCache's own gauge against its files: reported, not kvwatch's to pass or fail
        v["lmcache_usage_equals_files"] = c["disk"]["bytes_equal"]
    v["pass"] = all(x for k, x in v.items() if isinstance(x, bool) and k != "lmcache_usage_equals_files")
    return v
