"""The CI-side replay fixture of three salted tenants on a real vLLM with its CPU tier, cut from the
tenant validation on the GPU machine (tests/gpu/validate_tenants.py --scenario issue36 --cpu-tier 2,
results in tests/gpu/results/h100-2026-12-05-issue36/cpu-tier).

From what that run brought back (stream.jsonl.gz: every batch the independent subscriber decoded
with vLLM's classes, block hashes as its small integers; vllm_metrics.jsonl.gz: vLLM's /metrics
every second; validation.json: the phase marks), write tests/fixtures/vllm_run/tenants.json.gz:

* ``batches`` — every batch (``[at, seq, ts, rank, events]``) from the stream's first to the end of the recovery phase, at its
  engine time (``ts``) from the first batch's, its events compacted: ``[S, medium, block_size,
  parent, deltas, salts]`` one store (``salts``: ``[[index, tenant], ...]``, the blocks whose
  extra keys carry a cache salt, the tenant's key standing for the salt); ``[s|r, medium,
  block_size, deltas]`` a run of alike one-hash events, parentless, one event per id;
  ``[R, medium, deltas]`` one removal; ``[C]``. Ids are differences from the one before.
* ``salts`` — each tenant's key -> its cache salt (the test salts of tests/gpu/tenant_run.py).
* ``pages`` — vLLM's /metrics every second of the window, cut to the families kvwatch reads.
* ``marks`` — the phases, in seconds from the first batch; ``totals`` — per medium and tenant key
  what a replay must count, from the window's events through the independent reference
  (tests/support/tenant_reference.py), and the window's batches.

    .venv/bin/python tests/tools/vllm_tenant_fixture.py RUN_DIR
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

from kvwatch.daemon.config import EnginesConfig
from tests.support.tenant_reference import TenantReference
from tests.tools.vllm_run_fixtures import keep_page, runs

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_run" / "tenants.json.gz"
SALTS = {"a": "salt-tenant-a", "c": "salt-tenant-c", "d": "salt-tenant-d"}
LAST = "recover_end"  # the window ends with the recovery (self-thrash is the unit tests' and the GPU run's)


def compact(events: list[dict[str, Any]]) -> list[list[Any]]:
    tenant_of = {salt: k for k, salt in SALTS.items()}
    out: list[list[Any]] = []
    for e in events:
        kind, medium = e["type"], e.get("medium")
        if kind == "AllBlocksCleared":
            out.append(["C"])
            continue
        ids = e["block_hashes"]
        if kind == "BlockRemoved":
            single = ["r", medium, None, []]
        elif "extra_keys" in e or "parent_block_hash" in e or medium == "GPU":
            salts = [[i, tenant_of[x[-1]]] for i, x in enumerate(e.get("extra_keys") or []) if x]
            out.append(["S", medium, e["block_size"], e.get("parent_block_hash"), runs(ids), salts])
            continue
        else:
            single = ["s", medium, e["block_size"], []]
        if len(ids) == 1 and out and out[-1][:3] == single[:3]:
            out[-1][3].append(ids[0])
        elif len(ids) == 1:
            single[3] = list(ids)
            out.append(single)
        else:
            out.append(["R", medium, runs(ids)])
    for r in out:
        if r[0] in ("s", "r"):
            r[3] = runs(r[3])
    return out


def main() -> None:
    run = Path(sys.argv[1])
    marks = {m["name"]: m["wall"] for m in json.loads((run / "validation.json").read_text())["marks"]}
    ref = TenantReference(
        lambda salt, _lora: next(k for k, s in SALTS.items() if s == salt), EnginesConfig().thrash_seconds
    )
    batches: list[list[Any]] = []
    t0 = None
    with gzip.open(run / "stream.jsonl.gz", "rt") as f:
        for line in f:
            b = json.loads(line)
            t0 = b["ts"] if t0 is None else t0
            if b["ts"] > marks[LAST]:
                break
            events = [{**e, "block_hashes": e.get("block_hashes", [])} for e in b["ev"]]
            ref.batch(b["ts"], events)
            batches.append([round(b["ts"] - t0, 4), b["seq"], b["ts"], None, compact(events)])
    assert t0 is not None
    pages = []
    with gzip.open(run / "vllm_metrics.jsonl.gz", "rt") as f:
        for line in f:
            p = json.loads(line)
            if t0 - 5 <= p["wall"] <= marks[LAST] + 5:
                pages.append([round(p["wall"] - t0, 3), keep_page(p["data"])])
    totals = {f"{m}|{t}": c for (m, t), c in sorted(ref.counts.items())}
    data = {
        "source": str(run),
        "window_seconds": round(marks[LAST] - t0, 3),
        "marks": {k: round(v - t0, 3) for k, v in marks.items() if k.endswith(("_start", "_end")) and v <= marks[LAST]},
        "salts": SALTS,
        "batches": batches,
        "pages": pages,
        "totals": {"batches": len(batches), "tenants": totals},
    }
    with gzip.open(OUT, "wt", compresslevel=9) as f:
        json.dump(data, f, separators=(",", ":"))
    print(f"{OUT}: {len(batches)} batches, {data['window_seconds']} s, {OUT.stat().st_size:,} bytes")
    print(json.dumps(totals, indent=1))


if __name__ == "__main__":
    main()
