"""A recorded tenant run's KV event stream (tests/gpu/validate_tenants.py's stream.jsonl.gz: every
batch the independent subscriber decoded with vLLM's own classes) replayed offline through kvwatch's
stream accounting with a given regret memory, and each tenant's regretted blocks per medium
printed beside the subscriber's truth (validation.json's closure).

For what an older memory would have said of the same real run: ``--removals 524288`` is the
memory before issue 36 (a count of removals per stream and medium), the default is today's
(``engines.regret_memory_seconds`` x ``engines.regret_memory_rate``).

    .venv/bin/python tests/tools/regret_replay.py RUN_DIR [--removals N]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import msgspec

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.tenants import TenantNamer
from kvwatch.daemon.lab.wire_encode import Layout, cleared, encode_batch, removed, stored


def _event(ev: dict[str, Any]) -> dict[str, Any]:
    """The subscriber's record of an event (fields left out where empty) as the wire has it."""
    if ev["type"] == "BlockRemoved":
        return removed(ev["block_hashes"], medium=ev.get("medium"))
    if ev["type"] == "BlockStored":
        more = {k: ev[k] for k in ("extra_keys", "group_idx", "lora_name") if ev.get(k) is not None}
        return stored(
            ev["block_hashes"],
            ev.get("token_ids") or [],
            medium=ev.get("medium"),
            parent=ev.get("parent_block_hash"),
            block_size=ev["block_size"],
            **more,
        )
    return cleared()


def replay(run: Path, removals: int) -> tuple[StreamCounts, dict[str, int]]:
    cfg = EnginesConfig()
    counts = StreamCounts((cfg.max_tracked_blocks, removals), cfg.thrash_seconds, TenantNamer((), b"replay-key"))
    enc = msgspec.msgpack.Encoder()
    salts: dict[str, int] = {}
    with gzip.open(run / "stream.jsonl.gz", "rt") as f:
        for line in f:
            row: dict[str, Any] = json.loads(line)
            for ev in row["ev"]:
                for keys in ev.get("extra_keys") or []:
                    if keys:
                        salts[keys[-1]] = salts.get(keys[-1], 0) + 1
            counts.ingest(encode_batch(Layout.V0_26, row["ts"], [_event(ev) for ev in row["ev"]], encoder=enc))
    return counts, salts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--removals", type=int, default=EnginesConfig().regret_blocks)
    args = ap.parse_args()
    counts, _ = replay(args.run, args.removals)
    found = args.run / "validation.json"  # the truth, where the run's validation came back with it
    truth = json.loads(found.read_text()).get("closure", {}) if found.exists() else {}
    print(f"regret memory: {args.removals:,} removals per medium")
    # unnamed tenants' labels are keyed by the node's key: rows are matched by medium and stored blocks
    ref = {
        (k.split("|")[0], round(v["stored"]["reference"])): (k.split("|")[1], v["regretted"]["reference"])
        for k, v in truth.get("tenants", {}).items()
        if v["stored"]["reference"]
    }
    media = {k: m.logical() for k, m in counts.media.items()}
    for medium, tenants in sorted(counts.tenants().items()):
        for _, t in sorted(tenants.items()):
            label, want = ref.get((medium, t.stored), ("?", None))
            if t.stored:
                said = f"{want:>9,}" if want is not None else "        -"
                print(
                    f"  {medium:4} {label:16} regretted {t.regretted:>9,}  (subscriber: {said})  removed {t.removed:>10,}"
                )
        m = media[medium]
        print(f"  {medium:4} all regretted {m.regretted:,}, removals forgotten {m.removals_forgotten:,}")


if __name__ == "__main__":
    main()
