"""An independent per-tenant count of a real vLLM's KV event stream: vLLM's own classes decode it,
``tests/support/tenant_reference.TenantReference`` counts it (nothing of kvwatch's code).

Ground truth for kvwatch's ``kvwatch_kv_tenant_blocks_{stored,removed,removed_young,regretted}_total``,
``kvwatch_kv_tenant_regret_recomputed_tokens_total`` and ``kvwatch_kv_tenant_blocks_resident``:
a second ZMQ SUB on the stream kvwatch reads, each payload decoded with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``, each event handed to the
reference as a dict (``msgspec.structs.asdict`` plus ``"type"``: the class's name) with the
batch's engine timestamp.

Names: ``--names FILE`` (JSON ``{"salts": {salt: name}, "loras": {adapter: name}}``, kept in a
file so that no salt is on a command line). A salt named there gets its name, an adapter named
there its name; an unnamed salt cannot be named as kvwatch names it (a keyed hash of the salt
under the node's key), so every unnamed salt is counted under the placeholder ``salt-*`` (the
validation compares it with kvwatch's one ``salt-`` + 8 hex label); an unnamed adapter is
``lora:NAME``, as kvwatch names it. The counts carry names only.

Every batch is also recorded (``stream.jsonl.gz``: arrival time, seq, engine timestamp, events
with hashes renamed to small integers in order of first appearance; the extra keys, hence the
test's salts, and the adapters kept) for a CI-side replay. Counts go to DIR/tenant_counts.json every 0.5 s and at SIGTERM.

    PYTHONPATH=<vllm site> python3 tenant_subscriber.py --endpoint tcp://127.0.0.1:5557 --topic kv \\
        --out DIR --names names.json [--thrash-seconds 10] [--kv-events-py PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu.vllm_subscriber import subscribe, vllm_classes
from tests.support.tenant_reference import FIELDS, TenantReference

UNNAMED_SALT = "salt-*"


def namer(names: dict[str, dict[str, str]]) -> Any:
    """kvwatch's naming order (daemon/engines/tenants.py), less the keyed hash."""
    salts, loras = names.get("salts", {}), names.get("loras", {})

    def name(salt: str | None, lora: str | None) -> str:
        if salt is not None and salt in salts:
            return salts[salt]
        if lora is not None and lora in loras:
            return loras[lora]
        if salt is not None:
            return UNNAMED_SALT
        return f"lora:{lora}" if lora is not None else "default"

    return name


class TenantRecorder:
    def __init__(self, mod: Any, out: Path, names: dict[str, dict[str, str]], thrash: float) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=mod.KVEventBatch)
        self.ref = TenantReference(namer(names), thrash)
        self.out = out
        self.totals: dict[str, dict[str, int]] = {}  # medium -> stored / removed blocks, as announced
        self.batches = self.events = self.gaps = self.missed = self.decode_errors = self.cleared = 0
        self.unheld_removed = self.removed_twice = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.last_at = 0.0
        self.ids: dict[Any, int] = {}
        self.stream = gzip.open(out / "stream.jsonl.gz", "wt", compresslevel=6)  # noqa: SIM115 - closed in close()
        self.t0 = time.monotonic()

    def on_frames(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
            self.missed += max(seq - self.last_seq - 1, 0)
        self.first_seq = seq if self.first_seq is None else self.first_seq
        self.last_seq = seq
        try:
            batch = self.decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.decode_errors += 1
            return
        self.batches += 1
        self.last_at = now
        events = [{**msgspec.structs.asdict(ev), "type": type(ev).__name__} for ev in batch.events]
        for ev in events:
            self._unheld(ev)
        self.ref.batch(batch.ts, events)
        self.events += len(events)
        for ev in events:
            self._total(ev)
        line = {"t": round(now - self.t0, 4), "seq": seq, "ts": batch.ts, "ev": [self._short(ev) for ev in events]}
        self.stream.write(json.dumps(line, separators=(",", ":"), default=str) + "\n")

    def _unheld(self, ev: dict[str, Any]) -> None:
        """Removals of hashes the reference does not hold (before it books them): never stored
        since the subscription, or removed twice without a store between (one hash in two blocks;
        the reference then marks the hash's removal as the default tenant's)."""
        if ev["type"] != "BlockRemoved":
            return
        g = self.ref.groups.get((ev.get("medium") or "GPU", ev.get("group_idx") or 0))
        for h in ev["block_hashes"]:
            if g is None or h not in g.held:
                self.unheld_removed += 1
                self.removed_twice += g is not None and h in g.gone

    def _total(self, ev: dict[str, Any]) -> None:
        if ev["type"] == "AllBlocksCleared":
            self.cleared += 1
            return
        t = self.totals.setdefault(ev.get("medium") or "GPU", {"stored": 0, "removed": 0})
        t["stored" if ev["type"] == "BlockStored" else "removed"] += len(ev["block_hashes"])

    def _short(self, ev: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in ev.items() if v is not None and k not in ("token_ids", "lora_id")}
        if "block_hashes" in out:
            out["block_hashes"] = [self.ids.setdefault(h, len(self.ids)) for h in ev["block_hashes"]]
        if out.get("parent_block_hash") is not None:
            out["parent_block_hash"] = self.ids.setdefault(ev["parent_block_hash"], len(self.ids))
        return out

    def summary(self) -> dict[str, Any]:
        tenants: dict[str, dict[str, int]] = {}
        for (medium, tenant), c in sorted(self.ref.counts.items()):
            tenants[f"{medium}|{tenant}"] = {f: c.get(f, 0) for f in FIELDS}
        media = {m for m, _ in self.ref.groups} | {m for m, _ in self.ref.counts}
        for medium in sorted(media):
            for tenant, n in self.ref.resident(medium).items():
                tenants.setdefault(f"{medium}|{tenant}", dict.fromkeys(FIELDS, 0))["resident"] = n
        for row in tenants.values():
            row.setdefault("resident", 0)
        keep = ("batches", "events", "gaps", "missed", "decode_errors", "cleared", "first_seq", "last_seq", "last_at",
                "unheld_removed", "removed_twice")  # fmt: skip
        return {**{k: getattr(self, k) for k in keep}, "totals": self.totals, "tenants": tenants}

    def dump(self) -> None:
        tmp = self.out / "tenant_counts.json.tmp"
        tmp.write_text(json.dumps({**self.summary(), "at": time.monotonic(), "hashes": len(self.ids)}))
        tmp.replace(self.out / "tenant_counts.json")

    def close(self) -> None:
        self.dump()
        self.stream.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--topic", default="")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--names", type=Path, required=True)
    ap.add_argument("--thrash-seconds", type=float, default=10.0, help="kvwatch's engines.thrash_seconds")
    ap.add_argument("--kv-events-py")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = json.loads(args.names.read_text())
    rec = TenantRecorder(vllm_classes(args.kv_events_py), args.out, names, args.thrash_seconds)
    subscribe(rec, args.endpoint, args.topic)


if __name__ == "__main__":
    main()
