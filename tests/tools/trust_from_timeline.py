"""The metric-truth audit's windows and the uprobe cost, read back from a real-vLLM run's
per-second kvwatch timeline (tests/gpu/validate_vllm.py writes kvwatch_timeline_1.jsonl.gz).

    .venv/bin/python tests/tools/trust_from_timeline.py CALL_DIR > summary.json
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any


def summarize(call: Path) -> dict[str, Any]:
    rows = [
        json.loads(line) for line in gzip.decompress((call / "kvwatch_timeline_1.jsonl.gz").read_bytes()).splitlines()
    ]
    marks = {m["name"]: m for m in json.loads((call / "validation_1.json").read_text())["marks"]}
    t0 = marks["steady_start"]["mono"]
    phases = sorted(
        (m["mono"] - t0, n[: -len("_start")]) for n, m in marks.items() if n.endswith("_start") and "mono" in m
    )
    windows: dict[str, list[dict[str, Any]]] = {}
    seen: dict[str, float] = {}
    cost: dict[str, float] = {}
    for r in rows:
        t = r["mono"] - t0
        phase = next((p for start, p in reversed(phases) if t >= start), "before")
        vals: dict[tuple[str, str], float] = {}
        for name, labels, v in r["data"]:
            if name == "kvwatch_engine_metric_audit_value":
                vals[(labels["pair"], labels["source"])] = v
            elif name == "kvwatch_engine_metric_audit_windows_total":
                pair = labels["pair"]
                total = seen.get(pair + labels["result"], -1)
                seen[pair + labels["result"]] = v
                if v > total >= 0 or (total < 0 and v > 0):
                    vals[(pair, "new")] = 1.0
            elif name == "kvwatch_uprobe_cost_ratio":
                cost[labels["pid"]] = max(cost.get(labels["pid"], 0.0), v)
        for pair in {p for p, s in vals if s == "new"}:
            e, k = vals.get((pair, "engine"), 0.0), vals.get((pair, "kvwatch"), 0.0)
            top = max(e, k)
            windows.setdefault(pair, []).append(
                {
                    "t": round(t, 1),
                    "phase": phase,
                    "engine": e,
                    "kvwatch": k,
                    "divergence": round((e - k) / top, 4) if top else 0.0,
                }
            )
    return {
        "windows": {p: len(w) for p, w in windows.items()},
        "max_abs_divergence": {p: max(abs(x["divergence"]) for x in w) for p, w in windows.items()},
        "max_uprobe_cost_ratio": cost,
        "per_window": windows,
    }


if __name__ == "__main__":
    json.dump(summarize(Path(sys.argv[1])), sys.stdout, indent=1)
