"""KVEvictionBurst, as it stands now, over the whole recorded H200 run (tests/gpu/results), offline.

Feeds the recorded KV event stream (kvwatch's own accounting: blocks per medium, removals of
blocks stored less than 10 s before) and vLLM's /metrics pages (every 2 s, as the daemon
scrapes) into the detector at one evaluation a second, and prints each onset and clear with the
phase it fell in. For judging a detector change against the real engine without a GPU.

    .venv/bin/python tests/tools/rejudge_vllm_run.py CALL1_DIR CALL2_DIR ['{"factor": 5}']
"""

from __future__ import annotations

import gzip
import json
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvwatch.daemon.config import EvictionBurstConfig
from kvwatch.daemon.detectors.eviction_burst import EvictionBurst
from kvwatch.daemon.engines.metrics import parse_exposition
from kvwatch.daemon.model.engine_scrape import ENGINE, NO_ENGINE, EngineState, ScrapeCounts, scrape_counts
from kvwatch.daemon.model.findings import Finding, Subject
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import STREAM, MediumCounts, StreamEvents
from kvwatch.daemon.model.windows import NodeWindow, ProcessWindow

THRASH_SECONDS = 10.0


def jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)


class Stream:
    """kvwatch's stream accounting (kv_events.py) over the recorded batches."""

    def __init__(self, batches: list[tuple[float, float, list[Any]]]) -> None:
        self.batches, self.i = batches, 0
        self.tot = {m: dict.fromkeys(("stored", "removed", "removed_young"), 0.0) for m in ("GPU", "CPU")}
        self.cleared = 0.0
        self.ages: dict[str, dict[int, float]] = {"GPU": {}, "CPU": {}}

    def until(self, t: float) -> tuple[dict[str, MediumCounts], StreamEvents]:
        while self.i < len(self.batches) and self.batches[self.i][0] <= t:
            _, ts, evs = self.batches[self.i]
            for e in evs:
                self._event(e, ts)
            self.i += 1
        return {m: MediumCounts(**n) for m, n in self.tot.items()}, StreamEvents(cleared=self.cleared)

    def _event(self, e: list[Any], ts: float) -> None:
        if e[0] == "C":
            self.cleared += 1
            for a in self.ages.values():
                a.clear()
            return
        medium, ages = e[1], self.ages[e[1]]
        if e[0] == "S":
            self.tot[medium]["stored"] += len(e[2])
            for h in e[2]:
                ages.pop(h, None)
                ages[h] = ts
            return
        self.tot[medium]["removed"] += len(e[2])
        for h in e[2]:
            at = ages.pop(h, None)
            if at is not None and at > ts - THRASH_SECONDS:
                self.tot[medium]["removed_young"] += 1


def describe(f: Finding, t: float, marks: dict[str, float]) -> str:
    phase = max((k for k, mt in marks.items() if mt <= t and k.endswith("_start")), key=marks.get, default="?")
    v = f.values
    return (
        f"{'FIRE ' if f.firing else 'CLEAR'} +{t - marks['vllm_start']:6.1f} s, {phase} +{t - marks[phase]:.1f} s: "
        f"medium {f.subject.labels['medium']} cause {f.cause or '-'} rate {v['eviction_rate']:.0f}/s "
        f"(baseline {v['baseline_rate']:.1f}) hits {v.get('hit_ratio', -1):.2f} (ref {v['reference_hit_ratio']:.2f}) "
        f"usage {v.get('kv_usage', -1):.2f} preemptions {v.get('preemptions_per_second', -1):.1f}/s "
        f"young {v.get('young_fraction', -1):.2f}"
    )


def main() -> None:
    c1, c2 = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = EvictionBurstConfig(**(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
    marks = {m["name"]: m["mono"] for m in json.loads((c2 / "validation.json").read_text())["marks"]}
    with tarfile.open(c2 / "logs_2.tar.gz") as tar:
        member = tar.extractfile("subscriber.log")
        assert member is not None
        head = next(ln for ln in member.read().decode().splitlines() if "t0_monotonic" in ln)
    sub_t0 = json.loads(head)["t0_monotonic"]
    pages = [
        (p["mono"], p["data"])
        for c in (c1 / "vllm_metrics_1.jsonl.gz", c2 / "vllm_metrics_2.jsonl.gz")
        for p in jsonl(c)
    ]
    stream = Stream([(sub_t0 + b["t"], b["ts"], b["ev"]) for b in jsonl(c2 / "stream.jsonl.gz")])
    det, engine, state = EvictionBurst(cfg), History(ScrapeCounts, 120.0), NO_ENGINE
    kv, kv_events = History(MediumCounts, 120.0), History(StreamEvents, 120.0)
    start, t, pi, scraped, firing = marks["vllm_start"] + 5, marks["vllm_start"] + 5, 0, -1e9, False
    while t < marks["closure"]:
        media, events = stream.until(t)
        kv.add(t, media)
        kv_events.add(t, {STREAM: events})
        if t - scraped >= 2.0:
            scraped = t
            while pi + 1 < len(pages) and pages[pi + 1][0] <= t:
                pi += 1
            if pages[pi][0] <= t:
                smp = parse_exposition(pages[pi][1], at=t)
                engine.add(t, {ENGINE: scrape_counts(smp)})
                state = EngineState(True, bool(smp.sleeping), True, smp.usage, scrape=smp)
        subject = Subject("engine", {"pid": "api_server"})
        window = ProcessWindow(subject, t - start + 5, engine=engine, engine_state=state, kv=kv, kv_events=kv_events)
        for f in det.evaluate(NodeWindow(t, {"engine": window}, {})):
            if f.firing != firing:
                print(describe(f, t, marks))
                firing = f.firing
        t += 1.0


if __name__ == "__main__":
    main()
