"""The CI-side replay fixture of a hybrid model's stream, cut from the KV-cache-group validation on
the H200 (tests/gpu/validate_groups.py, results in tests/gpu/results/h200-2026-12-02-issue22).

From what that run brought back (stream_hybrid.jsonl.gz: every batch the independent subscriber
decoded with vLLM's classes; vllm_metrics.jsonl.gz: each server's /metrics every second;
validation.json: the phase marks), write tests/fixtures/vllm_run/hybrid.json.gz:

* ``batches`` — every batch of the window at its arrival time, its events compacted: vLLM
  announces a block range once per KV cache group (the same hashes six times) and the CPU tier's
  blocks and the GPU's removals one hash at a time, so alike events in a row are merged —
  ``[S|R, medium, block_size, parent, groups, ids]`` is one event per group carrying every id;
  ``[s|r, medium, block_size, [[group, ids], ...]]`` one event per id, per group (such a run of
  one-hash events, parentless, is independent of its order: kept by group, then hash; ids 0: the
  same as the group before). Hash ids are the subscriber's small integers (identity kept), as
  differences.
* ``kinds`` — per medium and group, the kind and window the stores said (every GPU store
  carries them; the CPU tier's placeholders carry none).
* ``pages`` — the hybrid server's /metrics every second, cut to the families kvwatch reads.
* ``marks`` — the phases; ``totals`` — per medium and group what a replay must count, computed
  here from the window's events with a plain multiset per group.

    .venv/bin/python tests/tools/vllm_groups_fixture.py RESULTS_DIR [--server hybrid]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.tools.vllm_run_fixtures import expand, keep_page, runs

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "vllm_run"
Event = tuple[str, str, int | None, Any, int | None, list[int]]  # kind, medium, block_size, parent, group, ids


def compact(events: list[list[Any]]) -> tuple[list[list[Any]], dict[str, dict[str, list[Any]]]]:
    """A batch's events (as the subscriber recorded them) -> records, and the kinds they said."""
    out: list[list[Any]] = []
    kinds: dict[str, dict[str, list[Any]]] = {}
    for e in events:
        if e[0] == "C":
            out.append(["C"])
            continue
        kind, medium, ids = e[0], e[1], e[2]
        bs, group, parent = (e[3], e[4], e[5]) if kind == "S" else (None, e[3], None)
        if kind == "S" and e[6] is not None:
            kinds.setdefault(medium, {})[str(group or 0)] = [e[6], e[7]]
        _append(out, kind, medium, bs, parent, group or 0, ids)
    for r in out:
        if r[0] in ("S", "R"):
            r[5] = runs(r[5])
        elif r[0] in ("s", "r"):
            r[3] = _by_group(r[3], r.pop(4))
    return out, kinds


def _append(
    out: list[list[Any]], kind: str, medium: str, bs: int | None, parent: Any, group: int, ids: list[int]
) -> None:
    last = out[-1] if out else None
    single = len(ids) == 1 and parent is None
    if single and last is not None and last[0] == kind.lower() and last[1:3] == [medium, bs]:
        last[3].append(ids[0])
        last[4].append(group)
    elif last is not None and last[0] == kind and last[1:4] == [medium, bs, parent] and last[5] == ids:
        last[4].append(group)
    elif single:
        out.append([kind.lower(), medium, bs, [ids[0]], [group]])
    else:
        out.append([kind, medium, bs, parent, [group], list(ids)])


def _by_group(ids: list[int], groups: list[int]) -> list[list[Any]]:
    """One-hash events, independent of their order: by group, then hash (0: the group before's)."""
    by_group: dict[int, list[int]] = {}
    for h, g in zip(ids, groups, strict=True):
        by_group.setdefault(g, []).append(h)
    segments: list[list[Any]] = []
    prev: list[int] | None = None
    for g, hs in sorted(by_group.items()):
        hs.sort()
        segments.append([g, 0 if hs == prev else runs(hs)])
        prev = hs
    return segments


def _segments(segments: list[list[Any]]) -> Iterator[tuple[int, int]]:
    prev: list[int] = []
    for g, ids in segments:
        if ids != 0:
            prev = expand(ids)
        for h in prev:
            yield h, g


def uncompact(records: list[list[Any]]) -> Iterator[Event]:
    """The events again, in their order: (kind, medium, block_size, parent, group, hashes)."""
    for r in records:
        if r[0] == "C":
            yield "C", "", None, None, None, []
        elif r[0] in ("S", "R"):
            ids = expand(r[5])
            for g in r[4]:
                yield r[0], r[1], r[2], r[3], g, ids
        else:
            for h, g in _segments(r[3]):
                yield r[0].upper(), r[1], r[2], None, g, [h]


class _Book:
    """One "medium:group": a plain multiset of held hashes and a set of removed ones."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.gone: set[int] = set()
        self.n = dict.fromkeys(("stored", "removed", "announced", "restored", "regretted"), 0)

    def remove(self, ids: list[int]) -> None:
        self.n["removed"] += len(ids)
        for x in ids:
            if self.held.get(x, 0) > 1:
                self.held[x] -= 1
            else:
                self.held.pop(x, None)
                self.gone.add(x)

    def store(self, ids: list[int], announcing: bool) -> None:
        if announcing and self.held.get(ids[-1], 0) > 0:
            self.n["announced"] += len(ids)
            return
        self.n["stored"] += len(ids)
        for x in ids:
            if self.held.get(x, 0) > 0:
                self.n["restored"] += 1
            elif x in self.gone:
                self.n["regretted"] += 1
                self.gone.discard(x)
            self.held[x] = self.held.get(x, 0) + 1


def book(batches: list[list[Any]]) -> dict[str, dict[str, int]]:
    """Per "medium:group": stored, removed, announced, restored, regretted, resident (the
    validation's subscriber's rules: a parentless GPU store of a held last block is announced)."""
    books: dict[str, _Book] = {}
    for *_, records in batches:
        for kind, medium, _bs, parent, group, ids in uncompact(records):
            if kind == "C":
                for b in books.values():
                    b.held.clear()
                    b.gone.clear()
                continue
            b = books.setdefault(f"{medium}:{group}", _Book())
            if kind == "R":
                b.remove(ids)
            else:
                b.store(ids, medium == "GPU" and parent is None)
    return {k: {**b.n, "resident": sum(b.held.values())} for k, b in books.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--server", default="hybrid")
    ap.add_argument("--from-mark", default="noshare_start")
    ap.add_argument("--before", type=float, default=5.0, help="seconds kept before that mark")
    ap.add_argument("--to-mark", default="recover_end")
    args = ap.parse_args()
    v = json.loads((args.results / "validation.json").read_text())
    marks = {m["name"]: m for m in v["marks"]}
    log = (
        (args.results / f"subscriber_{args.server}.log").read_text()
        if (args.results / f"subscriber_{args.server}.log").exists()
        else ""
    )
    t0 = next((json.loads(ln)["t0_monotonic"] for ln in log.splitlines() if "t0_monotonic" in ln), None)
    if t0 is None:
        raise SystemExit(f"subscriber_{args.server}.log (from logs.tar.gz) is needed beside validation.json")
    lo = marks[args.from_mark]["mono"] - args.before
    hi = marks[args.to_mark]["mono"] + 2.0
    batches: list[list[Any]] = []
    kinds: dict[str, dict[str, list[Any]]] = {}
    with gzip.open(args.results / f"stream_{args.server}.jsonl.gz", "rt") as f:
        for line in f:
            b = json.loads(line)
            mono = t0 + b["t"]
            records, said = compact(b["ev"])
            for medium, groups in said.items():
                kinds.setdefault(medium, {}).update(groups)
            if lo <= mono <= hi:
                batches.append([round(mono - lo, 4), b["seq"], b["ts"], b["rank"], records])
    pages = []
    with gzip.open(args.results / "vllm_metrics.jsonl.gz", "rt") as f:
        for line in f:
            p = json.loads(line)
            if p["server"] == args.server and lo - 5 <= p["mono"] <= hi:
                pages.append([round(p["mono"] - lo, 3), keep_page(p["data"])])
    rel = {k: round(m["mono"] - lo, 3) for k, m in marks.items() if lo - 60 <= m["mono"] <= hi + 60}
    out = {
        "server": args.server,
        "window_seconds": round(hi - lo, 3),
        "marks": rel,
        "kinds": kinds,
        "totals": {"batches": len(batches), "groups": book(batches)},
        "batches": batches,
        "pages": pages,
    }
    FIXTURES.mkdir(parents=True, exist_ok=True)
    dest = FIXTURES / f"{args.server}.json.gz"
    with gzip.open(dest, "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {dest}: {len(batches)} batches over {hi - lo:.0f} s, {dest.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
