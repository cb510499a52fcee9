"""An independent KV event subscriber: vLLM's own classes decode the stream kvwatch also reads.

Ground truth for kvwatch's ``kvwatch_kv_blocks_{stored,removed}_total{medium}`` and
``kvwatch_kv_cache_resets_total``: a ZMQ SUB on the same endpoint, decoding every
payload with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` —
the engine's own struct definitions, none of kvwatch's code — and counting block
hashes per medium per event (an event without a medium is the GPU pool's). Sequence
numbers are checked: a gap is counted, never filled.

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


class Counts:
    def __init__(self) -> None:
        self.stored: dict[str, int] = {}
        self.removed: dict[str, int] = {}
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
            return ["C"]
        medium = ev.medium or "GPU"  # an event without a medium is the GPU pool's
        hashes = [self.ids.setdefault(h, len(self.ids)) for h in ev.block_hashes]
        table = c.stored if isinstance(ev, stored_t) else c.removed
        table[medium] = table.get(medium, 0) + len(hashes)
        if isinstance(ev, stored_t):
            return ["S", medium, hashes, ev.block_size]
        return ["R", medium, hashes]

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
        tmp.write_text(json.dumps({**vars(self.counts), "at": time.monotonic(), "hashes": len(self.ids)}))
        tmp.replace(self.out / "subscriber_counts.json")

    def close(self) -> None:
        self.dump()
        self.stream.close()
        (self.out / "raw_frames.json").write_text(json.dumps(self.raw))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5557")
    ap.add_argument("--topic", default="")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kv-events-py")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(vllm_classes(args.kv_events_py), args.out)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1_000_000)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    print(json.dumps({"subscribed": args.endpoint, "t0_monotonic": rec.t0, "t0_wall": time.time()}), flush=True)
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


if __name__ == "__main__":
    main()
