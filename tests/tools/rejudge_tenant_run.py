"""KVTenantThrash, as it stands now, over a recorded tenant run (tests/gpu/validate_tenants.py), offline.

Feeds the run's per-tenant GPU series (kvwatch_timeline.jsonl.gz: kvwatch's own counters every
second) into the detector at one evaluation a second, as if kvwatch had first seen the engine
when vLLM started, or ``--seen-before S`` seconds before the flood (the rows before it unseen),
and prints each onset and clear with the phase it fell in. For judging a detector change against
the real engine without a GPU.

    .venv/bin/python tests/tools/rejudge_tenant_run.py RUN_DIR [--seen-before 100] [--config '{"factor": 5}']
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from kvwatch.daemon.config import TenantThrashConfig
from kvwatch.daemon.detectors.tenant_thrash import TenantThrash
from kvwatch.daemon.model.engines import TenantCounts
from kvwatch.daemon.model.findings import Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

PREFIX = "kvwatch_kv_tenant_blocks_"
COUNTS = ("stored", "removed", "regretted")  # TenantCounts' fields


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--seen-before", type=float, default=None)
    ap.add_argument("--config", default="{}")
    args = ap.parse_args()
    marks = {m["name"]: m["mono"] for m in json.loads((args.run / "validation.json").read_text())["marks"]}
    seen = marks["vllm_start"] if args.seen_before is None else marks["noisy_start"] - args.seen_before
    detector = TenantThrash(TenantThrashConfig(**json.loads(args.config)))
    tenants: History[TenantCounts] = History(TenantCounts)
    now: dict[str, dict[str, float]] = {}
    firing: dict[str, bool] = {}
    subject = Subject("engine", {"pid": "engine"})
    with gzip.open(args.run / "kvwatch_timeline.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            for name, labels, v in row["data"]:
                what = name[len(PREFIX) : -len("_total")] if name.startswith(PREFIX) else ""
                if what in COUNTS and labels.get("medium") == "GPU":
                    now.setdefault(labels["tenant"], {})[what] = v
            t = row["mono"]
            if t < seen:
                continue
            tenants.add(t, {name: TenantCounts(**got) for name, got in now.items()})
            window = ProcessWindow(subject, t - seen, tenants=tenants)
            for fd in detector.evaluate(NodeWindow(t, {"engine": window}, {})):
                tenant = fd.subject.labels["tenant"]
                if fd.firing != firing.get(tenant, False):
                    firing[tenant] = fd.firing
                    phase = max((n for n in marks if n.endswith("_start") and marks[n] <= t), key=marks.get)
                    print(
                        f"{t - marks['noisy_start']:+7.1f} s from the flood ({phase}): {tenant} "
                        f"{'fires, aggressor ' + fd.subject.labels['aggressor'] if fd.firing else 'clears'}; "
                        f"{fd.values['victim_regretted_per_second']} regretted/s, "
                        f"baseline {fd.values['baseline_regretted_per_second']}"
                    )
    print(f"kvwatch saw the engine {marks['noisy_start'] - seen:.1f} s before the flood")


if __name__ == "__main__":
    main()
