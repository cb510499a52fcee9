"""Fixtures for the CI-side replay, cut from a real-vLLM validation run (tests/gpu/validate_vllm.py).

From the files that run brought back (stream.jsonl.gz: every KV event batch as the independent
subscriber decoded it with vLLM's classes; vllm_metrics_*.jsonl.gz: vLLM's /metrics every
second; validation*.json: the phase marks), write into tests/fixtures/vllm_run/:

* ``pressure.json.gz`` — the batches of a window around the pressure scenario (from before
  the pressure phase to into the recovery), at their arrival times, with their events; block
  hashes are the subscriber's small integers (identity kept), sorted within a batch's run of
  alike events (vLLM's CPU tier announces them in hash-set order) and stored as differences; the
  /metrics pages of the same window, cut to the families kvwatch reads; the marks; and the
  totals per medium over the window (what a replay must count).
* ``raw_frames.json`` — frames exactly as vLLM 0.26.0's publisher sent them (the first
  batches, the first with CPU events, those with AllBlocksCleared), each with the counts
  vLLM's own classes decoded from it.
* ``vllm-0.26.0.txt`` (in engine_metrics/) — vLLM's /metrics at quiescence after the run.

    .venv/bin/python tests/tools/vllm_run_fixtures.py DIR_OF_CALL_1 DIR_OF_CALL_2
"""

from __future__ import annotations

import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
BEFORE, AFTER = 35.0, 25.0  # seconds kept before the pressure phase / after recovery starts
KEEP_FAMILIES = (
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:engine_sleep_state",
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_load_bytes",
)


def runs(ids: list[int]) -> list[int]:
    """Ids as differences from the one before (a prompt's blocks differ by 1; the CPU tier's
    announcements are scrambled, but nearby): small numbers, which gzip packs tightly."""
    return [b - a for a, b in zip([0, *ids], ids, strict=False)]


def expand(deltas: list[int]) -> list[int]:
    out, x = [], 0
    for d in deltas:
        x += d
        out.append(x)
    return out


def compact(events: list[list[Any]]) -> list[list[Any]]:
    """Events -> groups [kind, medium, block_size, each, deltas]: ``each`` is one event per id
    (vLLM announces GPU evictions and CPU stores one hash at a time), merged while alike; else
    the group is one event carrying every id."""
    groups: list[list[Any]] = []
    for e in events:
        if e[0] == "C":
            groups.append(["C", None, None, False, []])
            continue
        kind, medium, ids = e[0], e[1], e[2]
        head = [kind, medium, e[3] if kind == "S" else None]
        last = groups[-1] if groups else None
        if len(ids) == 1 and last is not None and last[:3] == head and last[3]:
            last[4] = [*last[4], ids[0]]
        else:
            groups.append([*head, len(ids) == 1, ids])
    for g in groups:  # ids in order within a group: one batch, one timestamp, the same set
        g[4] = runs(sorted(g[4]))
    return groups


def uncompact(groups: list[list[Any]]) -> Iterator[tuple[str, str | None, int | None, list[int]]]:
    """The events again: (kind, medium, block_size, hashes)."""
    for kind, medium, bs, each, rs in groups:
        ids = expand(rs)
        if kind == "C":
            yield "C", None, None, []
        elif each:
            for h in ids:
                yield kind, medium, bs, [h]
        else:
            yield kind, medium, bs, ids


def keep_page(text: str) -> str:
    lines = []
    for ln in text.splitlines():
        name = ln.split()[2] if ln.startswith("# ") and len(ln.split()) > 2 else ln.split("{")[0].split(" ")[0]
        if name.startswith(KEEP_FAMILIES) and not name.endswith("_created"):
            lines.append(ln)
    return "\n".join(lines) + "\n"


def main() -> None:
    call1, call2 = Path(sys.argv[1]), Path(sys.argv[2])
    marks = {m["name"]: m for m in json.loads((call2 / "validation.json").read_text())["marks"]}
    sub_t0 = _subscriber_t0(call2)
    lo = marks["pressure_start"]["mono"] - BEFORE
    hi = marks["recover_start"]["mono"] + AFTER
    batches, totals = [], {"stored": {}, "removed": {}, "cleared": 0, "batches": 0}
    with gzip.open(call2 / "stream.jsonl.gz", "rt") as f:
        for line in f:
            b = json.loads(line)
            mono = sub_t0 + b["t"]
            if not lo <= mono <= hi:
                continue
            for e in b["ev"]:
                if e[0] == "C":
                    totals["cleared"] += 1
                else:
                    table = totals["stored" if e[0] == "S" else "removed"]
                    table[e[1]] = table.get(e[1], 0) + len(e[2])
            totals["batches"] += 1
            batches.append([round(mono - lo, 4), b["seq"], b["ts"], b["rank"], compact(b["ev"])])
    pages = []
    for name in ("vllm_metrics_1.jsonl.gz",):
        with gzip.open(call1 / name, "rt") as f:
            for line in f:
                p = json.loads(line)
                if lo - 5 <= p["mono"] <= hi:
                    pages.append([round(p["mono"] - lo, 3), keep_page(p["data"])])
    rel = {k: round(m["mono"] - lo, 3) for k, m in marks.items() if lo - 60 <= m["mono"] <= hi + 60}
    out = {"window_seconds": round(hi - lo, 3), "marks": rel, "totals": totals, "batches": batches, "pages": pages}
    dest = FIXTURES / "vllm_run"
    dest.mkdir(parents=True, exist_ok=True)
    with gzip.open(dest / "pressure.json.gz", "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"))
    _raw_frames(call2, dest)
    _quiescent_page(call2)
    print(f"{len(batches)} batches, {len(pages)} pages over {hi - lo:.0f} s; totals {totals}")


def _subscriber_t0(call2: Path) -> float:
    import tarfile

    with tarfile.open(call2 / "logs_2.tar.gz") as tar:
        member = tar.extractfile("subscriber.log")
        assert member is not None
        for line in member.read().decode().splitlines():
            if line.startswith("{") and "t0_monotonic" in line:
                return float(json.loads(line)["t0_monotonic"])
    raise SystemExit("subscriber.log has no t0")


def _raw_frames(call2: Path, dest: Path) -> None:
    raw = [r for r in json.loads((call2 / "raw_frames.json").read_text()) if len(r["frames"][2]) <= 16_384]
    first, cpu = raw[:12], [r for r in raw if "a3435055" in r["frames"][2]][:6]  # fixstr "CPU"
    cleared = [r for r in raw if "416c6c426c6f636b73436c6561726564" in r["frames"][2]]  # "AllBlocksCleared"
    raw = sorted({r["seq"]: r for r in [*first, *cpu, *cleared]}.values(), key=lambda r: r["seq"])
    want = {r["seq"] for r in raw}
    counts: dict[int, dict[str, Any]] = {}
    with gzip.open(call2 / "stream.jsonl.gz", "rt") as f:
        for line in f:
            b = json.loads(line)
            if b["seq"] in want:
                c: dict[str, Any] = {"stored": {}, "removed": {}, "cleared": 0, "events": len(b["ev"])}
                for e in b["ev"]:
                    if e[0] == "C":
                        c["cleared"] += 1
                    else:
                        t = c["stored" if e[0] == "S" else "removed"]
                        t[e[1]] = t.get(e[1], 0) + len(e[2])
                counts[b["seq"]] = c
    frames = [{"seq": r["seq"], "frames": r["frames"], "expected": counts[r["seq"]]} for r in raw]
    (dest / "raw_frames.json").write_text(json.dumps({"vllm_version": "0.26.0", "frames": frames}))


def _quiescent_page(call2: Path) -> None:
    last = None
    with gzip.open(call2 / "vllm_metrics_2.jsonl.gz", "rt") as f:
        for line in f:
            last = json.loads(line)
    assert last is not None
    (FIXTURES / "engine_metrics" / "vllm-0.26.0.txt").write_text(last["data"])


if __name__ == "__main__":
    main()
