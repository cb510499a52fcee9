"""An independent KV event subscriber: vLLM's own classes decode the stream kvwatch also reads.

Ground truth for kvwatch's ``kvwatch_kv_blocks_{stored,removed}_total{medium}``, its per-group
``kvwatch_kv_group_blocks_*`` and ``kvwatch_kv_cache_resets_total``: a ZMQ SUB on the same
endpoint, decoding every payload with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.
KVEventBatch)`` — the engine's own struct definitions, none of kvwatch's code — and counting
block hashes per medium per event (an event without a medium is the GPU pool's) and per
medium and KV cache group (``group_idx``; 0 without one). Sequence numbers are checked: a gap is
counted, never filled.

Per group it also keeps its own plain book of what is held (a multiset: vLLM may hold one hash
in two blocks) and what was removed (a set): blocks stored while held, stored again after their
removal, held at the end. A GPU store without a parent whose last block the group holds is the
shape of a prefix-hit announcement (``kv_cache_report_mode`` full): counted apart and not booked
(vLLM's own hit counter is what closes those).

It also records the stream for the CI-side replay: every batch as one JSON line
(arrival time, seq, engine timestamp, events with hashes renamed to small integers
in order of first appearance: identity kept, 8-byte randomness dropped), and the raw
frames of the first batches, of the first batches with CPU events and of every batch
with an ``AllBlocksCleared`` (for byte-level decoder fixtures).

    PYTHONPATH=<vllm site> python3 vllm_subscriber.py --endpoint tcp://127.0.0.1:5557 \
        --topic kv --out DIR [--kv-events-py PATH]

``--kv-events-py`` loads vLLM's ``kv_events.py`` by path (stand-ins for the few vLLM
imports it makes) where vLLM itself cannot be imported (the dry run without a GPU).
Counts go to DIR/subscriber_counts.json every 0.5 s and at SIGTERM.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

RAW_FIRST = 40  # raw frames kept: the first batches,
RAW_CPU = 12  # the first batches carrying CPU events,
RAW_CLEARED = 16  # and batches with AllBlocksCleared


def vllm_classes(kv_events_py: str | None) -> Any:
    """vLLM's own module; if importing vLLM fails here, the same file loaded by path (its few
    vLLM imports stood in for) — the classes that decode are vLLM's either way."""
    if kv_events_py is None:
        try:
            import vllm.distributed.kv_events as mod  # the engine's own module, on the device
        except Exception as err:  # any import failure: fall back to the file
            print(json.dumps({"vllm_import_failed": repr(err)}), flush=True)
            found = [Path(p) / "vllm/distributed/kv_events.py" for p in sys.path if p]
            kv_events_py = str(next(f for f in found if f.exists()))
        else:
            return mod
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.tools.vllm_capture import load_path  # stand-ins for vLLM's logger/config imports

    return load_path(Path(kv_events_py))


class Book:
    """One (medium, group): held hashes as a multiset, removed ones as a set."""

    def __init__(self) -> None:
        self.held: dict[Any, int] = {}
        self.gone: set[Any] = set()
        self.restored = self.regretted = self.announced = 0
        self.kind: str | None = None
        self.window: int | None = None

    def store(self, hashes: list[Any], parent: Any, gpu: bool) -> None:
        if gpu and parent is None and hashes and self.held.get(hashes[-1], 0) > 0:
            self.announced += len(hashes)
            return
        for h in hashes:
            if self.held.get(h, 0) > 0:
                self.restored += 1
            elif h in self.gone:
                self.regretted += 1
                self.gone.discard(h)
            self.held[h] = self.held.get(h, 0) + 1

    def remove(self, hashes: list[Any]) -> None:
        for h in hashes:
            n = self.held.get(h, 0)
            if n > 1:
                self.held[h] = n - 1
            else:
                self.held.pop(h, None)
                self.gone.add(h)

    def clear(self) -> None:
        self.held.clear()
        self.gone.clear()

    def summary(self) -> dict[str, Any]:
        return {
            "restored": self.restored,
            "regretted": self.regretted,
            "announced": self.announced,
            "resident": sum(self.held.values()),
            "kind": self.kind,
            "window": self.window,
        }


class Counts:
    def __init__(self) -> None:
        self.stored: dict[str, int] = {}
        self.removed: dict[str, int] = {}
        self.group_stored: dict[str, int] = {}  # "MEDIUM:group" -> blocks
        self.group_removed: dict[str, int] = {}
        self.books: dict[str, Book] = {}
        self.cleared = 0
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.missed = 0
        self.decode_errors = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self.last_at = 0.0


class Recorder:
    """Counts and records every message; vLLM's classes decode, nothing of kvwatch's."""

    def __init__(self, mod: Any, out: Path) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=mod.KVEventBatch)
        self.types = (mod.BlockStored, mod.BlockRemoved, mod.AllBlocksCleared)
        self.out = out
        self.counts = Counts()
        self.ids: dict[Any, int] = {}
        self.raw: list[dict[str, Any]] = []
        self.raw_cpu = self.raw_cleared = 0
        self.stream = gzip.open(out / "stream.jsonl.gz", "wt", compresslevel=6)  # noqa: SIM115 - closed in close()
        self.t0 = time.monotonic()

    def on_frames(self, frames: list[bytes], now: float) -> None:
        c = self.counts
        if len(frames) != 3 or len(frames[1]) != 8:
            c.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if c.last_seq is not None and seq != c.last_seq + 1:
            c.gaps += 1
            c.missed += max(seq - c.last_seq - 1, 0)
        if c.first_seq is None:
            c.first_seq = seq
        c.last_seq = seq
        try:
            batch = self.decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            c.decode_errors += 1
            return
        c.batches += 1
        c.last_at = now
        evs = [self._event(ev) for ev in batch.events]
        line = {"t": round(now - self.t0, 4), "seq": seq, "ts": batch.ts, "rank": batch.data_parallel_rank}
        self.stream.write(json.dumps({**line, "ev": evs}, separators=(",", ":")) + "\n")
        self._keep_raw(line, frames, evs)

    def _event(self, ev: Any) -> list[Any]:
        stored_t, removed_t, _ = self.types
        c = self.counts
        c.events += 1
        if not isinstance(ev, stored_t | removed_t):
            c.cleared += 1
            for b in c.books.values():
                b.clear()
            return ["C"]
        medium = ev.medium or "GPU"  # an event without a medium is the GPU pool's
        group = getattr(ev, "group_idx", None)
        key = f"{medium}:{group or 0}"
        hashes = [self.ids.setdefault(h, len(self.ids)) for h in ev.block_hashes]
        table = c.stored if isinstance(ev, stored_t) else c.removed
        table[medium] = table.get(medium, 0) + len(hashes)
        per_group = c.group_stored if isinstance(ev, stored_t) else c.group_removed
        per_group[key] = per_group.get(key, 0) + len(hashes)
        book = c.books.setdefault(key, Book())
        if isinstance(ev, stored_t):
            parent = None if ev.parent_block_hash is None else self.ids.setdefault(ev.parent_block_hash, len(self.ids))
            book.kind = getattr(ev, "kv_cache_spec_kind", None) or book.kind
            book.window = getattr(ev, "kv_cache_spec_sliding_window", None) or book.window
            book.store(hashes, parent, medium == "GPU")
            return ["S", medium, hashes, ev.block_size, group, parent, book.kind, book.window]
        book.remove(hashes)
        return ["R", medium, hashes, group]

    def _keep_raw(self, line: dict[str, Any], frames: list[bytes], evs: list[list[Any]]) -> None:
        keep = self.counts.batches <= RAW_FIRST
        if any(len(e) > 1 and e[1] == "CPU" for e in evs) and self.raw_cpu < RAW_CPU:
            self.raw_cpu += 1
            keep = True
        if any(e[0] == "C" for e in evs) and self.raw_cleared < RAW_CLEARED:
            self.raw_cleared += 1
            keep = True
        if keep:
            self.raw.append({**line, "frames": [f.hex() for f in frames]})

    def dump(self) -> None:
        tmp = self.out / "subscriber_counts.json.tmp"
        c = self.counts
        out = {k: v for k, v in vars(c).items() if k != "books"}
        out["groups"] = {k: b.summary() for k, b in sorted(c.books.items())}
        tmp.write_text(json.dumps({**out, "at": time.monotonic(), "hashes": len(self.ids)}))
        tmp.replace(self.out / "subscriber_counts.json")

    def close(self) -> None:
        self.dump()
        self.stream.close()
        (self.out / "raw_frames.json").write_text(json.dumps(self.raw))


def subscribe(rec: Any, endpoint: str, topic: str) -> None:
    """Feed ``rec`` (``on_frames``, ``dump`` every 0.5 s, ``close``, ``t0``) every message of the
    stream until SIGTERM or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    print(json.dumps({"subscribed": endpoint, "t0_monotonic": rec.t0, "t0_wall": time.time()}), flush=True)
    next_dump = 0.0
    while not stop.is_set():
        if sub.poll(200):
            for _ in range(5000):
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                rec.on_frames(frames, time.monotonic())
        if time.monotonic() >= next_dump:
            rec.dump()
            next_dump = time.monotonic() + 0.5
    rec.close()
    sub.close(0)
    ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--topic", default="")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kv-events-py")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(vllm_classes(args.kv_events_py), args.out)
    subscribe(rec, args.endpoint, args.topic)


if __name__ == "__main__":
    main()
