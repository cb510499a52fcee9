"""kvwatch's tenants on a real vLLM 0.26.0 (the lent H200): per-tenant counts exact against
vLLM's own decoder, KVTenantThrash on a noisy neighbour and silent otherwise, and no salt in
anything kvwatch serves or logs (issue 24). One device call after the bundles are unpacked.

One server (the tiny Llama of ``make_tiny_model.py``, prefix caching, KV events over ZMQ topic
``kv``, ``--num-gpu-blocks-override`` small enough that a flood evicts), one kvwatch daemon
watching it, one independent subscriber (``tenant_subscriber.py``: vLLM's classes decode,
``tests/support/tenant_reference.py`` counts). Tenants, by the OpenAI ``cache_salt`` of
``/v1/completions`` (prompts as token-id lists):

* ``tenant-a`` (salt named in kvwatch's config): 32 hot 320-token prefixes, 4 clients;
* ``tenant-b`` (named): unique 1024-token prompts, 24 clients: the flood;
* tenant C (salt not named: kvwatch must export ``salt-`` + 8 hex, and never the salt): 2 hot
  prefixes, 1 client;
* with ``--lora`` (default), two dummy LoRA adapters (``tenant_lora.py``) served with
  ``--enable-lora``: ``lora-x`` named ``adapter-x`` in kvwatch's config, ``lora-y`` unnamed
  (``lora:lora-y``), 1 client each. Should vLLM not serve them, the failure is recorded and the
  run goes on without.

Phases: ``solo`` (A, C and the adapters: KVTenantThrash silent), ``noisy`` (B floods beside
them: KVTenantThrash fires for victim tenant-a, aggressor tenant-b; the onset after the flood's
start is recorded), ``recover`` (A alone: it clears), ``selfthrash`` if time allows (A alone on
160 prefixes, more than the pool: it evicts its own blocks, and KVTenantThrash stays silent).
Then, at quiescence, every tenant's counts per medium against the subscriber's, the tenants'
sums against kvwatch's per-medium totals, and the salts searched for in kvwatch's /metrics, its
log and its top API.

Writes into --out (at most 8 files come back): validation.json, kvwatch_timeline.jsonl.gz,
vllm_metrics.jsonl.gz, top_alerts.jsonl.gz, stream.jsonl.gz, requests.jsonl.gz, logs.tar.gz.

    with-bcc python3 tests/gpu/validate_tenants.py --out $OUT --deadline 500
    python3 tests/gpu/validate_tenants.py --out /tmp/o --engine sim --quick     (dry run, no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import tenant_checks as checks
from tests.gpu import tenant_run as tr
from tests.gpu.tenant_run import TenantRun
from tests.gpu.vllm_harness import WORK, get_text, kvwatch_samples, kvwatch_url, parse, value, wait_until

FULL = {"solo": 60, "noisy": 45, "recover": 45, "selfthrash": 40}
QUICK = {"solo": 55, "noisy": 25, "recover": 30, "selfthrash": 20}
# issue 36: a steady phase the victims' baselines learn from, then a 60 s flood
FULL_36 = {"solo": 100, "noisy": 60, "recover": 40, "selfthrash": 30}
FULL_36_PARK = {**FULL_36, "noisy": 80}  # past 524,288 GPU removals at ~7k blocks/s
RESERVE = 75.0  # seconds kept for quiescence, closure, stopping and packing


def phases(r: TenantRun) -> None:
    t, plans = r.t, tr.PLANS[r.args.scenario]
    for name in ("solo", "noisy", "recover", "selfthrash"):
        if name != "selfthrash" or r.args.selfthrash:
            r.phase(name, plans[name], t[name])
    r.stop_loads()


def quiesce(r: TenantRun) -> dict[str, Any]:
    """Until the stream is idle and kvwatch counted every batch the subscriber did, then two more
    of kvwatch's ticks (its counters are published once a tick)."""
    counts: dict[str, Any] = {}
    api = str(r.pid)

    def same() -> bool:
        counts.clear()
        counts.update(r.counts())
        idle = time.monotonic() - counts.get("last_at", 0.0) > 2.0
        return idle and value(kvwatch_samples(), "kvwatch_kv_event_batches_total", pid=api) == counts.get("batches")

    try:
        r.st.mark("quiet", seconds=round(wait_until(same, 45, "kvwatch counted every batch the subscriber did"), 1))
    except TimeoutError as err:
        r.st.note(str(err))
    tick = r.tick()
    try:
        wait_until(lambda: r.tick() >= tick + 2, 15, "two kvwatch ticks")
    except TimeoutError as err:
        r.st.note(str(err))
    return r.counts()


def close(r: TenantRun, counts: dict[str, Any]) -> None:
    text = get_text(kvwatch_url("/metrics"))
    kv = parse(text)
    api = str(r.pid)
    res = r.results
    res["missing_families"] = missing = checks.missing_families(text)
    if missing:
        r.st.note(f"kvwatch does not export: {', '.join(missing)}")
    rename = r.unnamed_labels() if r.args.scenario.startswith("issue36") else None
    r.labels.update({k: (rename or {}).get(f"salt-*{k}", t.name) for k, t in r.tenants.items()})
    res["scenario"]["labels"] = r.labels
    res["closure"] = checks.closure(counts, kv, api, rename)
    res["tenants_gauge"] = checks.tenant_count(kv, api)
    res["regret_memory"] = {
        "removals_forgotten": value(kv, "kvwatch_events_lost_total", source="kv_removals_forgotten"),
        "store_times_forgotten": value(kv, "kvwatch_events_lost_total", source="kv_store_times_forgotten"),
        "horizon_seconds": {
            m: value(kv, "kvwatch_kv_regret_horizon_seconds", pid=api, medium=m) for m in ("GPU", "CPU")
        },
    }
    res["subscriber"] = {k: v for k, v in counts.items() if k != "tenants"}
    res["engine_final"] = r.engine()
    top = get_text(kvwatch_url("/api/v1/top"))
    log = (WORK / "kvwatch.log").read_text(errors="replace") if (WORK / "kvwatch.log").exists() else ""
    res["secrecy"] = checks.secrecy({"metrics": text, "log": log, "top_api": top}, r.secret_salts())


def judge(r: TenantRun) -> None:
    res = r.results
    found = checks.by_phase(checks.alerts(WORK / "kvwatch.log"), r.st.marks)
    res["alerts"] = found
    res["alerts_per_phase"] = {}
    for a in found:
        res["alerts_per_phase"].setdefault(a["phase"], []).append([a["alert"], a["cause"], a["tenant"], a["aggressor"]])
    aggressor = r.labels.get(tr.AGGRESSOR[r.args.scenario], "tenant-b")
    v = checks.verdict(found, r.st.marks, "tenant-a", aggressor)
    noisy = next((m for m in r.st.marks if m["name"] == "noisy_start"), None)
    if noisy is not None:
        v["noisy_onset_from_metrics"] = checks.timeline_onset(
            r.out / "kvwatch_timeline.jsonl.gz", noisy["mono"], "tenant-a", aggressor
        )
    res["top_api_tenant_alerts"] = checks.top_alerts(r.out / "top_alerts.jsonl.gz")
    cl = res.get("closure", {})
    batches = bool(cl.get("batches", {}).get("equal"))
    v["closure_exact"] = bool(cl.get("tenants_exact")) and batches
    v["closure_exact_but_double_removals"] = bool(cl.get("double_removals", {}).get("explained")) and batches
    v["sums_exact"] = bool(cl.get("sums_exact"))
    unnamed = [k for k, t in r.tenants.items() if t.salt and not t.named]
    v["unnamed_salt_one_label"] = len(cl.get("unnamed_salt_labels", [])) == len(unnamed)
    secrecy = res.get("secrecy", {})
    v["salt_c_hidden"] = all(bool(x.get("hidden")) for k, x in secrecy.items() if k != "sources")
    must = ("solo_silent", "noisy_fired", "recover_cleared", "sums_exact", "salt_c_hidden")
    closed = v["closure_exact"] or v["closure_exact_but_double_removals"]
    missing = res.get("missing_families", ["(not read)"])
    v["pass"] = all(v.get(k) for k in must) and closed and v.get("selfthrash_silent", True) and not missing
    res["verdict"] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--kv-events-py", help="dry run: vLLM's kv_events.py, for the subscriber")
    ap.add_argument("--lora", action=argparse.BooleanOptionalAction, default=True, help="adapters' traffic too")
    ap.add_argument("--selfthrash", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gpu-blocks", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phase-seconds", default="", help="override phases' lengths: solo=40,recover=20")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds this script may take, all told")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--scenario", choices=["issue24", "issue36", "issue36park"], default="issue24", help="tenants and phases"
    )
    ap.add_argument("--cpu-tier", type=float, default=0.0, help="GiB of vLLM's CPU offload tier (0: none)")
    ap.add_argument("--defaults", action="store_true", help="kvwatch's detectors at their defaults")
    args = ap.parse_args()
    if args.scenario.startswith("issue36"):
        args.lora = False
    full = {"issue36": FULL_36, "issue36park": FULL_36_PARK}.get(args.scenario, FULL)
    lengths = dict(QUICK if args.quick else full)
    for item in filter(None, args.phase_seconds.split(",")):
        name, _, seconds = item.partition("=")
        if name not in lengths:
            ap.error(f"--phase-seconds: no phase {name!r} (phases: {', '.join(lengths)})")
        lengths[name] = int(seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    if args.engine == "sim":
        sim_paths(args)
    r = TenantRun(args, lengths, RESERVE)
    r.st.mark("begin")
    try:
        r.start()
        r.results["scenario"] = {"name": args.scenario, "cpu_tier_gib": args.cpu_tier, "defaults": args.defaults}
        r.start_pollers()
        phases(r)
        r.st.mark("quiesce")
        close(r, quiesce(r))
    except Exception as err:
        r.st.note(f"run failed: {err!r}")
        raise
    finally:
        r.stop_pollers()
        r.save()
        r.stop_all()
        judge(r)
        r.save()
        r.pack()
    print(json.dumps({"verdict": r.results.get("verdict"), "left_seconds": round(r.left())}, default=str), flush=True)


def sim_paths(args: argparse.Namespace) -> None:
    """The dry run: kvwatch from this working tree (src/, first on the path of every process started
    here), and vLLM's kv_events.py from the vLLM bundle for the subscriber."""
    repo = Path(__file__).resolve().parents[2]
    os.environ["PYTHONPATH"] = ":".join(filter(None, (str(repo / "src"), str(repo), os.environ.get("PYTHONPATH"))))
    sys.path.insert(0, str(repo / "src"))
    for name in [k for k in sys.modules if k == "kvwatch" or k.startswith("kvwatch.")]:
        del sys.modules[name]
    bundled = repo / ".vllm-bundle/site/vllm/distributed/kv_events.py"
    if args.kv_events_py is None and bundled.exists():
        args.kv_events_py = str(bundled)


if __name__ == "__main__":
    main()
