"""What the tenant validation (``validate_tenants.py``) concludes from what it recorded: per-tenant
closure against the independent subscriber, KVTenantThrash by phase, and the salts' secrecy.

Every check keeps both numbers beside its verdict. A family kvwatch does not export (yet) is
named under ``missing_families`` and its checks read as not equal: nothing here raises on it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.gpu.vllm_harness import Sample, log_events, value

ALERT = "KVTenantThrash"
FIELDS = ("stored", "removed", "removed_young", "regretted", "regret_tokens", "resident")
TENANT_FAMILIES = {
    "stored": "kvwatch_kv_tenant_blocks_stored_total",
    "removed": "kvwatch_kv_tenant_blocks_removed_total",
    "removed_young": "kvwatch_kv_tenant_blocks_removed_young_total",
    "regretted": "kvwatch_kv_tenant_blocks_regretted_total",
    "regret_tokens": "kvwatch_kv_tenant_regret_recomputed_tokens_total",
    "resident": "kvwatch_kv_tenant_blocks_resident",
}
MEDIUM_FAMILIES = {
    "stored": "kvwatch_kv_blocks_stored_total",
    "removed": "kvwatch_kv_blocks_removed_total",
    "removed_young": "kvwatch_kv_blocks_removed_young_total",
    "regretted": "kvwatch_kv_blocks_regretted_total",
    "regret_tokens": "kvwatch_kv_regret_recomputed_tokens_total",
}
OTHER_FAMILIES = (
    "kvwatch_kv_tenant_lost_bytes_total",
    "kvwatch_kv_tenant_lost_blocks_total",
    "kvwatch_kv_tenants",
)
HASHED = re.compile(r"^salt-[0-9a-f]{8}$")
UNNAMED_SALT = "salt-*"  # the subscriber's placeholder (tenant_subscriber.py)


def pair(k: float | None, ref: float) -> dict[str, Any]:
    """kvwatch's value (None: no such series; equal to a reference of 0) beside the reference's."""
    return {"kvwatch": k, "reference": ref, "equal": (0 if k is None else k) == ref}


def declared(text: str) -> set[str]:
    """Family names a /metrics page declares (``# TYPE``), counters with ``_total``."""
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            out.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return out


def missing_families(text: str) -> list[str]:
    have = declared(text)
    want = [*TENANT_FAMILIES.values(), *OTHER_FAMILIES, "kvwatch_alert_active"]
    return [n for n in want if n not in have]


def kvwatch_tenants(kv: list[Sample], api: str) -> dict[tuple[str, str], dict[str, float]]:
    """(medium, tenant label) -> field -> kvwatch's value."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for field, name in TENANT_FAMILIES.items():
        for n, lab, v in kv:
            if n == name and lab.get("pid") == api:
                row = out.setdefault((lab.get("medium", ""), lab.get("tenant", "")), {})
                row[field] = row.get(field, 0.0) + v
    return out


def label_map(mine: dict[tuple[str, str], dict[str, float]]) -> tuple[dict[str, str], list[str]]:
    """The subscriber's names -> kvwatch's labels: itself, but its unnamed-salt placeholder is
    kvwatch's one hashed label (several hashed labels: none is chosen, and they are listed)."""
    hashed = sorted({t for _, t in mine if HASHED.match(t)})
    return ({UNNAMED_SALT: hashed[0]} if len(hashed) == 1 else {}), hashed


def closure(counts: dict[str, Any], kv: list[Sample], api: str, rename: dict[str, str] | None = None) -> dict[str, Any]:
    """Per tenant and medium, every field: kvwatch's against the subscriber's; the tenants' sums
    against kvwatch's per-medium totals; batches, gaps. ``rename``: the subscriber's placeholders
    -> kvwatch's labels, where the run knows them (else its one unnamed salt's)."""
    mine = kvwatch_tenants(kv, api)
    names, hashed = label_map(mine)
    names = rename if rename is not None else names
    theirs: dict[tuple[str, str], dict[str, int]] = {}
    for key, row in counts.get("tenants", {}).items():
        medium, tenant = key.split("|", 1)
        theirs[(medium, names.get(tenant, tenant))] = row
    rows: dict[str, Any] = {}
    for medium, tenant in sorted(set(theirs) | set(mine)):
        k, r = mine.get((medium, tenant)), theirs.get((medium, tenant), {})
        rows[f"{medium}|{tenant}"] = {f: pair(None if k is None else k.get(f), r.get(f, 0)) for f in FIELDS}
    sums: dict[str, Any] = {}
    for medium in sorted({m for m, _ in mine} | {m for m, _ in theirs}):
        for field, name in MEDIUM_FAMILIES.items():
            total = sum(v.get(field, 0.0) for (m, _), v in mine.items() if m == medium)
            sums[f"{medium}|{field}"] = {
                "tenants_sum": total,
                "medium_total": value(kv, name, pid=api, medium=medium),
                "equal": total == value(kv, name, pid=api, medium=medium),
            }
    exact = all(p["equal"] for row in rows.values() for p in row.values()) and bool(rows)
    return {
        "tenants": rows,
        "unnamed_salt_labels": hashed,
        "sums": sums,
        "batches": pair(value(kv, "kvwatch_kv_event_batches_total", pid=api), counts.get("batches", 0)),
        "gaps": pair(value(kv, "kvwatch_kv_event_gaps_total", pid=api), counts.get("gaps", 0)),
        "stream_totals": counts.get("totals", {}),
        "tenants_exact": exact,
        "double_removals": double_removals(rows, int(counts.get("removed_twice", 0))),
        "sums_exact": all(s["equal"] for s in sums.values()) and bool(sums),
    }


def double_removals(rows: dict[str, Any], removed_twice: int) -> dict[str, Any]:
    """A hash removed twice with no store between (one hash in two blocks, one store announced):
    TenantReference marks its second removal as the ``default`` tenant's, so the hash's next
    regret goes to ``default``; kvwatch keeps the first removal's tenant. Explained: every other
    field equal, the regrets' sum equal, and what kvwatch's tenants have above the reference's is
    what the reference has under ``default`` (at most one per double removal)."""

    def diff(row: dict[str, Any], f: str) -> float:
        return float(row[f]["kvwatch"] or 0) - float(row[f]["reference"])

    others = all(p["equal"] for row in rows.values() for f, p in row.items() if f not in ("regretted", "regret_tokens"))
    moved = {k: diff(row, "regretted") for k, row in rows.items() if not row["regretted"]["equal"]}
    to_default = -sum(v for k, v in moved.items() if k.endswith("|default"))
    return {
        "regretted_diff": moved,
        "removed_twice": removed_twice,
        "explained": others and sum(moved.values()) == 0 and 0 <= to_default <= removed_twice,
    }


def tenant_count(kv: list[Sample], api: str) -> dict[str, float]:
    return {s: value(kv, "kvwatch_kv_tenants", pid=api, state=s) for s in ("labelled", "folded")}


# --- alerts ----------------------------------------------------------------------------------------
def _wall(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def alerts(log: Path) -> list[dict[str, Any]]:
    """Every onset in kvwatch's log with its clear (same subject), labels and values."""
    resolved = [(e, _wall(e["timestamp"])) for e in log_events(log, "alert resolved")]
    out = []
    for e in log_events(log, "alert firing"):
        on = _wall(e["timestamp"])
        clear = next(
            (t for r, t in resolved if r.get("subject") == e.get("subject") and r["alert"] == e["alert"] and t >= on),
            None,
        )
        out.append({
            "alert": e["alert"],
            "cause": e.get("cause"),
            "pid": e.get("label_pid"),
            "tenant": e.get("label_tenant"),
            "aggressor": e.get("label_aggressor"),
            "medium": e.get("label_medium"),
            "subject": e.get("subject"),
            "onset": on,
            "clear": clear,
            "values": e.get("values", {}),
            "summary": e.get("summary"),
        })  # fmt: skip
    return out


def by_phase(found: list[dict[str, Any]], marks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each alert with the phase its onset fell in and its onset (and clear) after that start."""
    starts = sorted((m["wall"], m["name"][: -len("_start")]) for m in marks if m["name"].endswith("_start"))
    out = []
    for a in found:
        at = [(w, n) for w, n in starts if w <= a["onset"]]
        w, phase = at[-1] if at else (a["onset"], "before")
        clear_in = [(cw, n) for cw, n in starts if a["clear"] is not None and cw <= a["clear"]]
        out.append({
            **a,
            "phase": phase,
            "after_phase_start": a["onset"] - w,
            "cleared_in": clear_in[-1][1] if clear_in else None,
        })  # fmt: skip
    return out


def timeline_onset(path: Path, since_mono: float, tenant: str, aggressor: str) -> float | None:
    """Seconds from ``since_mono`` to the first /metrics sample (1 s polls) with the alert active."""
    if not path.exists():
        return None
    with gzip.open(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            if row["mono"] < since_mono:
                continue
            for n, lab, v in row["data"]:
                if (n == "kvwatch_alert_active" and v == 1 and lab.get("alert") == ALERT
                        and lab.get("tenant") == tenant and lab.get("aggressor") == aggressor):  # fmt: skip
                    return float(row["mono"] - since_mono)
    return None


def top_alerts(path: Path) -> list[dict[str, Any]]:
    """KVTenantThrash as the top API listed it: first and last listing of each onset."""
    seen: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return []
    with gzip.open(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            for a in row.get("data") or []:
                if a.get("alert") != ALERT:
                    continue
                victim = re.search(r"tenant (\S+)'s", str(a.get("summary", "")))  # the top API's summary names it
                ident = {k: v for k, v in a.items() if k not in ("summary", "values")}
                key = json.dumps([ident, victim.group(1) if victim else None], sort_keys=True, default=str)
                entry = seen.setdefault(key, {"first": a, "first_wall": row["wall"]})
                entry["last"], entry["last_wall"] = a, row["wall"]
    return list(seen.values())


def verdict(phased: list[dict[str, Any]], marks: list[dict[str, Any]], victim: str, aggressor: str) -> dict[str, Any]:
    tt = [a for a in phased if a["alert"] == ALERT]
    phases = {m["name"][: -len("_start")] for m in marks if m["name"].endswith("_start")}
    hit = next((a for a in tt if a["phase"] == "noisy" and a["tenant"] == victim and a["aggressor"] == aggressor), None)
    out: dict[str, Any] = {
        "solo_silent": not [a for a in tt if a["phase"] not in ("noisy", "recover", "selfthrash")],
        "noisy_fired": hit is not None,
        "noisy_onset_after_flood_start": hit["after_phase_start"] if hit else None,
        "noisy_cause": hit["cause"] if hit else None,
        "noisy_values": hit["values"] if hit else None,
        "recover_cleared": hit is not None and hit["clear"] is not None and hit["cleared_in"] in ("noisy", "recover"),
        "all_cleared": all(a["clear"] is not None for a in tt),
        "others_in_noisy": [(a["tenant"], a["aggressor"]) for a in tt if a["phase"] == "noisy" and a is not hit],
        "onsets_in_recover": [(a["tenant"], a["aggressor"]) for a in tt if a["phase"] == "recover"],
    }
    if "selfthrash" in phases:
        out["selfthrash_silent"] = not [a for a in tt if a["phase"] == "selfthrash"]
    return out


# --- secrecy ---------------------------------------------------------------------------------------
def secrecy(texts: dict[str, str], salts: dict[str, str]) -> dict[str, Any]:
    """Where each salt (or its SHA-256 hex) occurs in kvwatch's outputs: nowhere, for each."""
    out: dict[str, Any] = {}
    for who, salt in salts.items():
        sha = hashlib.sha256(salt.encode()).hexdigest()
        found = {src: [w for w, needle in (("salt", salt), ("sha256", sha)) if needle in text]
                 for src, text in texts.items()}  # fmt: skip
        out[who] = {"found_in": {k: v for k, v in found.items() if v}, "hidden": not any(found.values())}
    out["sources"] = {src: len(text) for src, text in texts.items()}
    return out
