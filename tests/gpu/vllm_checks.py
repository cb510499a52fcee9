"""What the real-engine validation concludes from what it recorded: closure, scenarios, cost.

Every check keeps both numbers (kvwatch's and the reference's) beside its verdict, so the
committed results show what was compared, not only that it passed.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.gpu.vllm_harness import Sample, by_label, get_text, log_events, parse, stop, value, vllm_url

INTENTIONAL_ALERTS = ("KVEvictionBurst", "KVCacheReuseCollapse", "CUDAMemoryGrowth")


def vllm_samples() -> list[Sample]:
    return parse(get_text(vllm_url("/metrics")))


def pair(k: float, ref: float) -> dict[str, Any]:
    return {"kvwatch": k, "reference": ref, "equal": k == ref}


def cuda_counters(kv: list[Sample], pid: str) -> dict[str, float]:
    """One process's CUDA counters by API (and direction for copies), flat."""
    out: dict[str, float] = {}
    for name, lab, v in kv:
        if lab.get("pid") != pid or not name.startswith("kvwatch_cuda_"):
            continue
        key = name.removeprefix("kvwatch_cuda_").removesuffix("_total")
        for extra in ("api", "direction", "result", "kind"):
            if extra in lab:
                key += f":{lab[extra]}"
        out[key] = out.get(key, 0.0) + v
    return out


def closure(counts: dict[str, Any], kv: list[Sample], vl: list[Sample], st: Any) -> dict[str, Any]:
    api, core = str(st.pids["vllm"]), str(st.engine_core_pid)
    blocks: dict[str, Any] = {}
    media = set(counts["stored"]) | set(counts["removed"])
    media |= set(by_label(kv, "kvwatch_kv_blocks_stored_total", "medium", pid=api))
    for m in sorted(media):
        for what, name in (
            ("stored", "kvwatch_kv_blocks_stored_total"),
            ("removed", "kvwatch_kv_blocks_removed_total"),
        ):
            blocks[f"{what}:{m}"] = pair(value(kv, name, pid=api, medium=m), counts[what].get(m, 0))
    blocks["cleared"] = pair(value(kv, "kvwatch_kv_cache_resets_total", pid=api), counts["cleared"])
    blocks["batches"] = pair(value(kv, "kvwatch_kv_event_batches_total", pid=api), counts["batches"])
    blocks["gaps"] = pair(value(kv, "kvwatch_kv_event_gaps_total", pid=api), counts["gaps"])
    awake = value(vl, "vllm:engine_sleep_state", sleep_state="awake")
    usage = max((v for n, _, v in vl if n == "vllm:kv_cache_usage_perc"), default=0.0)
    engine = {
        "kv_usage": pair(value(kv, "kvwatch_engine_kv_usage_ratio", pid=api), usage),
        "queried:GPU": pair(
            value(kv, "kvwatch_engine_prefix_cache_queried_tokens_total", pid=api, medium="GPU"),
            value(vl, "vllm:prefix_cache_queries_total"),
        ),
        "hit:GPU": pair(
            value(kv, "kvwatch_engine_prefix_cache_hit_tokens_total", pid=api, medium="GPU"),
            value(vl, "vllm:prefix_cache_hits_total"),
        ),
        "queried:CPU": pair(
            value(kv, "kvwatch_engine_prefix_cache_queried_tokens_total", pid=api, medium="CPU"),
            value(vl, "vllm:external_prefix_cache_queries_total"),
        ),
        "hit:CPU": pair(
            value(kv, "kvwatch_engine_prefix_cache_hit_tokens_total", pid=api, medium="CPU"),
            value(vl, "vllm:external_prefix_cache_hits_total"),
        ),
        "preemptions": pair(
            value(kv, "kvwatch_engine_preemptions_total", pid=api), value(vl, "vllm:num_preemptions_total")
        ),
        "offload:d2h": pair(
            value(kv, "kvwatch_engine_kv_offload_bytes_total", pid=api, direction="d2h"),
            value(vl, "vllm:kv_offload_store_bytes_total"),
        ),
        "offload:h2d": pair(
            value(kv, "kvwatch_engine_kv_offload_bytes_total", pid=api, direction="h2d"),
            value(vl, "vllm:kv_offload_load_bytes_total"),
        ),
        "sleeping": pair(value(kv, "kvwatch_engine_sleeping", pid=api), 1.0 - awake if awake in (0.0, 1.0) else -1),
    }
    copies = by_label(kv, "kvwatch_cuda_copy_bytes_total", "api", pid=core)
    by_dir = {
        d: by_label(kv, "kvwatch_cuda_copy_bytes_total", "api", pid=core, direction=d)
        for d in ("d2h", "h2d", "d2d", "h2h", "default")
    }
    offload = {}
    for d, engine_name in (("d2h", "vllm:kv_offload_store_bytes_total"), ("h2d", "vllm:kv_offload_load_bytes_total")):
        batched = sum(v for a, v in by_dir[d].items() if "BatchAsync" in a)
        ref = value(vl, engine_name)
        offload[d] = {
            **pair(batched, ref),
            "ratio": batched / ref if ref else None,
            "all_copy_apis": by_dir[d],
        }
    offload["default_direction"] = by_dir["default"]
    offload["copy_bytes_by_api"] = copies
    return {"blocks": blocks, "engine_metrics": engine, "offload": offload, "subscriber": counts}


def stop_kvwatch(pid: int) -> dict[str, Any]:
    t0 = time.monotonic()
    clean = stop(pid, 30)
    left: list[str] = []
    with contextlib.suppress(OSError):
        left = [ln for ln in Path("/sys/kernel/tracing/uprobe_events").read_text().splitlines() if f"_bcc_{pid}" in ln]
    return {"exited_on_sigterm": clean, "seconds": round(time.monotonic() - t0, 2), "uprobes_left": len(left)}


def _wall(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def ledger(kv: list[Sample], api: str) -> dict[str, Any]:
    """kvwatch's loss ledger for the engine: blocks and bytes per tier:cause, the block size."""
    out: dict[str, Any] = {}
    for name, key in (("kvwatch_kv_lost_blocks_total", "blocks"), ("kvwatch_kv_lost_bytes_total", "bytes")):
        for n, labels, v in kv:
            if n == name and labels.get("pid") == api:
                out.setdefault(f"{labels['tier']}:{labels['cause']}", {})[key] = v
    sizes = {
        labels.get("source", ""): v for n, labels, v in kv if n == "kvwatch_kv_block_bytes" and labels.get("pid") == api
    }
    return {"rows": out, "block_bytes": sizes}


TRUST = (
    "kvwatch_engine_metric_audit_value",
    "kvwatch_engine_metric_divergence_ratio",
    "kvwatch_engine_metric_audit_windows_total",
    "kvwatch_engine_kv_tier_",
    "kvwatch_uprobe",
    "kvwatch_bpf_stats_enabled",
    "kvwatch_probe_run",
)


def trust(kv: list[Sample]) -> list[tuple[str, dict[str, str], float]]:
    """The metric-truth audit's pairs, the engine's KV tiers and what kvwatch's probes cost, as read."""
    return [
        (n, {k: v for k, v in labels.items() if k not in ("container", "pod", "role")}, v)
        for n, labels, v in kv
        if n.startswith(TRUST)
    ]


def alerts(log: Path) -> list[dict[str, Any]]:
    return _alerts(log)


def _alerts(log: Path) -> list[dict[str, Any]]:
    """Onsets with their clears: alert, subject, pid, medium, cause, onset / clear wall time, values."""
    out = []
    resolved = [(e, _wall(e["timestamp"])) for e in log_events(log, "alert resolved")]
    for e in log_events(log, "alert firing"):
        on = _wall(e["timestamp"])
        clear = next(
            (t for r, t in resolved if r["subject"] == e["subject"] and r["alert"] == e["alert"] and t >= on), None
        )
        out.append(
            {
                "alert": e["alert"],
                "pid": e.get("label_pid"),
                "component": e.get("label_component"),
                "medium": e.get("label_medium"),
                "cause": e.get("cause"),
                "onset": on,
                "clear": clear,
                "values": e.get("values", {}),
                "summary": e.get("summary"),
            }
        )
    return out


def _mark(st: Any, name: str) -> dict[str, Any] | None:
    return next((m for m in reversed(st.marks) if m["name"] == name), None)


def _hot_collapse(st: Any, requests: Path) -> float | None:
    """Wall time of the first hot-phase request served mostly from scratch (its prefix evicted)."""
    hot = _mark(st, "hot_start")
    if hot is None or not requests.exists():
        return None
    offset = hot["wall"] - hot["mono"]
    with gzip.open(requests, "rt") as f:
        rows = [json.loads(line) for line in f]
    misses = [
        r["start"]
        for r in rows
        if r["phase"] == "hot"
        and r["ok"]
        and r["cached_tokens"] is not None
        and r["cached_tokens"] < r["prompt_tokens"] / 2
    ]
    return min(misses) + offset if misses else None


def scenarios(st: Any, log: Path, requests: Path) -> dict[str, Any]:
    api = str(st.pids["vllm"])
    alerts = _alerts(log)
    m = {x["name"]: x["wall"] for x in st.marks}
    out: dict[str, Any] = {"alerts": alerts}

    def within(a: dict[str, Any], lo: str, hi: str) -> bool:
        return lo in m and m[lo] <= a["onset"] < m.get(hi, float("inf"))

    out["steady"] = {"alerts": [a for a in alerts if within(a, "vllm_ready", "pressure_start")]}
    out["steady"]["pass"] = not out["steady"]["alerts"]
    burst = [a for a in alerts if a["alert"] == "KVEvictionBurst" and a["pid"] == api]
    p = next((a for a in burst if within(a, "pressure_start", "preempt_start")), None)
    collapse = _hot_collapse(st, requests)
    res: dict[str, Any] = {"alert": p, "hot_collapse_wall": collapse}

    def since(t: float | None, name: str) -> float | None:
        return t - m[name] if t is not None and name in m else None

    if p is not None:
        res["onset_after_pressure_start"] = since(p["onset"], "pressure_start")
        res["onset_after_hot_start"] = since(p["onset"], "hot_start")
        if collapse is not None:
            res["active_at_collapse_plus_3s"] = p["onset"] <= collapse + 3 and (p["clear"] or 1e18) > collapse + 3
            res["onset_minus_collapse"] = p["onset"] - collapse
        res["clear_after_hot_start"] = since(p["clear"], "hot_start")
        res["clear_after_recover_start"] = since(p["clear"], "recover_start")
        res["pass"] = (
            p["medium"] == "GPU"
            and p["cause"] in ("pressure", "thrash")
            and bool(res.get("active_at_collapse_plus_3s", collapse is None))
            and p["clear"] is not None
            and p["clear"] < m.get("preempt_start", float("inf"))
        )
    out["pressure"] = res
    q = next((a for a in burst if within(a, "preempt_start", "before_reset_start")), None)
    pre = {"alert": q, "preemptions": _delta(st, "preempt_start", "recover2_end", "preemptions")}
    if q is not None:
        pre["onset_after_preempt_start"] = since(q["onset"], "preempt_start")
        pre["clear_after_recover2_start"] = since(q["clear"], "recover2_start")
        pre["pass"] = q["cause"] == "thrash" and q["medium"] == "GPU"
    out["preempt"] = pre
    lo = m.get("reset", m.get("before_reset_start", 0.0)) - 1.0
    intentional = [a for a in alerts if a["alert"] in INTENTIONAL_ALERTS and lo <= a["onset"]]
    out["intentional"] = {"alerts": intentional, "pass": not intentional and "reset" in m}
    return out


def _delta(st: Any, a: str, b: str, key: str) -> dict[str, Any] | None:
    ma, mb = _mark(st, a), _mark(st, b)
    if ma is None or mb is None or "engine" not in ma or "engine" not in mb:
        return None
    return {
        src: mb["engine"][src].get(key, 0) - ma["engine"][src].get(key, 0)
        for src in ("vllm", "kvwatch")
        if src in ma["engine"] and src in mb["engine"]
    }


def engine_snapshot(api: str) -> dict[str, Any]:
    """vLLM's own counters and kvwatch's re-exports of them, read now (phase marks carry it)."""
    snap: dict[str, Any] = {}
    try:
        vl = vllm_samples()
        snap["vllm"] = {
            "preemptions": value(vl, "vllm:num_preemptions_total"),
            "queries": value(vl, "vllm:prefix_cache_queries_total"),
            "hits": value(vl, "vllm:prefix_cache_hits_total"),
            "store_bytes": value(vl, "vllm:kv_offload_store_bytes_total"),
            "generation_tokens": value(vl, "vllm:generation_tokens_total"),
        }
    except OSError:
        pass
    try:
        from tests.gpu.vllm_harness import kvwatch_samples

        kv = kvwatch_samples()
        snap["kvwatch"] = {
            "preemptions": value(kv, "kvwatch_engine_preemptions_total", pid=api),
            "queries": value(kv, "kvwatch_engine_prefix_cache_queried_tokens_total", pid=api, medium="GPU"),
            "hits": value(kv, "kvwatch_engine_prefix_cache_hit_tokens_total", pid=api, medium="GPU"),
            "generation_tokens": value(kv, "kvwatch_engine_generation_tokens_total", pid=api),
            "ledger": ledger(kv, api),
        }
    except OSError:
        pass
    return snap


def cost_ratios(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("steady", "pressure"):
        for metric in ("requests_per_second", "p50_seconds", "p99_seconds"):
            on = [r[phase][metric] for r in rounds if r["kvwatch"] and metric in r[phase]]
            off = [r[phase][metric] for r in rounds if not r["kvwatch"] and metric in r[phase]]
            if on and off:
                out[f"{phase}:{metric}"] = {
                    "on_median": statistics.median(on),
                    "off_median": statistics.median(off),
                    "on_over_off": statistics.median(on) / statistics.median(off),
                    "on": on,
                    "off": off,
                }
    return out


def vllm_log_facts(log: Path) -> dict[str, Any]:
    """What vLLM itself printed that the checks compare with (sleep freed memory, runner)."""
    if not log.exists():
        return {}
    text = log.read_text(errors="replace")
    facts: dict[str, Any] = {}
    m = re.search(r"Sleep mode freed ([\d.]+) GiB memory, ([\d.]+) GiB memory is still in use", text)
    if m:
        facts["sleep_freed_gib"], facts["sleep_still_used_gib"] = float(m.group(1)), float(m.group(2))
    facts["v2_model_runner"] = "Using V2 Model Runner" in text
    facts["cross_layer_kv"] = "cross layer KV cache" in text
    return facts


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.4g}" if abs(x) < 1e6 else f"{x:,.0f}"
    return str(x)


def report(res: dict[str, Any]) -> str:
    lines = ["# kvwatch on vLLM 0.26.0 (H200): validation", ""]
    sc = res.get("scenarios", {})
    for name in ("steady", "pressure", "preempt", "intentional"):
        s = sc.get(name, {})
        lines.append(f"* **{name}**: {'PASS' if s.get('pass') else 'FAIL'} — {json.dumps(_short(s), default=str)}")
    cl = res.get("closure", {})
    for section in ("blocks", "engine_metrics"):
        lines += [
            "",
            f"## closure: {section}",
            "",
            "| item | kvwatch | reference | equal |",
            "| --- | --- | --- | --- |",
        ]
        for k, v in cl.get(section, {}).items():
            lines.append(f"| {k} | {_fmt(v['kvwatch'])} | {_fmt(v['reference'])} | {v['equal']} |")
    off = cl.get("offload", {})
    lines += ["", "## offload bytes (engine core's batched copies vs vLLM's counters)", ""]
    for d in ("d2h", "h2d"):
        if d in off:
            o = off[d]
            lines.append(f"* {d}: kvwatch {_fmt(o['kvwatch'])}, vLLM {_fmt(o['reference'])}, ratio {_fmt(o['ratio'])}")
    ratios = res.get("cost", {}).get("ratios", {})
    if ratios:
        lines += [
            "",
            "## cost (medians, kvwatch on / off)",
            "",
            "| metric | off | on | on/off |",
            "| --- | --- | --- | --- |",
        ]
        for k, v in ratios.items():
            lines.append(f"| {k} | {_fmt(v['off_median'])} | {_fmt(v['on_median'])} | {v['on_over_off']:.4f} |")
    lines += ["", "## notes", "", *(f"* {n}" for n in res.get("notes", []))]
    return "\n".join(lines) + "\n"


def _short(s: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in s.items() if k not in ("alert", "alerts")}
    a = s.get("alert")
    if a:
        out["alert"] = {k: a[k] for k in ("medium", "cause") if k in a}
    if s.get("alerts"):
        out["alerts"] = [(x["alert"], x["cause"]) for x in s["alerts"]]
    return out
