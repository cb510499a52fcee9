"""Peak memory of the worst KV event messages: what one message can cost kvwatch, against the
chart's memory limit (deploy/helm/kvwatch/values.yaml: 768 MiB; the daemon idles at ~92 MiB).

Each shape runs in a fresh process (so that its peak is its own): the payload is built, the
process's RSS read, its peak reset (``/proc/self/clear_refs``), the payload handed to one
stream's accounting (``StreamCounts.ingest``: decoding, checks, counting) and the peak read back
(VmHWM). "peak" is that peak less the RSS before the ingest, plus the payload itself: what the
message costs while it is handled, its own bytes included. Shapes, each as large as the ZMQ
frame limit lets a message be (``--bytes``; kvwatch's MAX_MESSAGE_BYTES is 16 MiB, it was 64):

* u16_hashes: BlockRemoved events of 131,072 hashes 256..65535 (3 bytes each on the wire, a
  32-byte Python int each once decoded): the densest hashes;
* u64_hashes, digest_hashes: 64-bit ints, 32-byte digests (what vLLM sends);
* u64_at_the_cap: the largest batch that counts: 8 events of 131,072 64-bit hashes (the batch cap);
* one_event: a single event of all the payload's hashes (the issue's 12M-hash message at 64 MiB);
* tiny_events: ``["BlockRemoved", []]`` events, 15 bytes each;
* extra_keys: 7 BlockStored events of 131,072 blocks, each block's extra_keys entry an empty list
  (as many entries as the batch may carry, each read);
* nested: one event nested as deep as the payload is long;
* legit_biggest: what a real engine's biggest batch looks like: one BlockStored of 65,536 blocks
  (a 1M-token prompt at block size 16) with its 1,048,576 token ids, accepted and counted.

``--hub`` also floods a running ``KVEventHub`` over ZMQ with 32 messages of the worst shape from
another process and reports the hub process's peak growth: ZMQ's queue (QUEUE_MESSAGES) and the
message in hand on top of the decoding; and subscribes a hub to a publisher that sends the parts
of one message and never its last (libzmq keeps them all, whatever RCVHWM): its memory guard,
its limit set 128 MiB above the hub process's RSS, reopens the socket.

    .venv/bin/python bench/bench_kv_message_rss.py [--bytes N] [--hub] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20
LIMIT = 768 * MiB  # the chart's resources.limits.memory
IDLE = 92 * MiB  # the daemon's RSS at rest
EVENT_HASHES = 1 << 17


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(field)


def _array(n: int) -> bytes:
    return (
        bytes([0x90 | n])
        if n < 16
        else (b"\xdc" + n.to_bytes(2, "big") if n < 65536 else b"\xdd" + n.to_bytes(4, "big"))
    )


def _str(s: str) -> bytes:
    b = s.encode()
    return bytes([0xA0 | len(b)]) + b if len(b) < 32 else b"\xd9" + bytes([len(b)]) + b


def _batch(events: list[bytes]) -> bytes:
    """``[1.0, events, nil]``: a batch as vLLM lays it out."""
    return b"\x93\xcb" + struct.pack(">d", 1.0) + _array(len(events)) + b"".join(events) + b"\xc0"


def _removed(body: bytes, n: int) -> bytes:
    return b"\x82" + _str("type") + _str("BlockRemoved") + _str("block_hashes") + _array(n) + body


def _hash_events(size: int, make: Callable[[int], bytes], per_event: int) -> list[bytes]:
    body = make(per_event)
    events, total = [], 0
    while total + len(body) < size:
        events.append(_removed(body, per_event))
        total += len(events[-1])
    return events


def _u16(n: int) -> bytes:
    import numpy as np

    a = np.empty(n, dtype=[("t", "u1"), ("v", ">u2")])
    a["t"], a["v"] = 0xCD, 256 + np.arange(n) % 65280
    return a.tobytes()


def _u64(n: int) -> bytes:
    import numpy as np

    a = np.empty(n, dtype=[("t", "u1"), ("v", ">u8")])
    a["t"], a["v"] = 0xCF, (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1 << 63)
    return a.tobytes()


def _digests(n: int) -> bytes:
    return b"".join(b"\xc4\x20" + i.to_bytes(32, "big") for i in range(n))


def _one_event(size: int) -> bytes:
    n = (size - 64) // 3
    return _batch([_removed(_u16(n), n)])


def _tiny_events(size: int) -> bytes:
    ev = b"\x92" + _str("BlockRemoved") + b"\x90"
    return _batch([ev] * ((size - 64) // len(ev)))


def _extra_keys(size: int) -> bytes:
    n = EVENT_HASHES
    ev = (b"\x83" + _str("type") + _str("BlockStored") + _str("block_hashes") + _array(n) + _u64(n)
          + _str("extra_keys") + _array(n) + b"\x90" * n)  # fmt: skip
    return _batch([ev] * 7)  # within the batch's hash cap: every entry is read


def _nested(size: int) -> bytes:
    return _batch([b"\x91" * (size - 64) + b"\xc0"])


def _legit_biggest(size: int) -> bytes:
    n, tokens = 65_536, 1 << 20
    ids = b"".join(b"\xce" + (100_000 + i % 50_000).to_bytes(4, "big") for i in range(tokens))
    ev = (b"\x84" + _str("type") + _str("BlockStored") + _str("block_hashes") + _array(n) + _u64(n)
          + _str("token_ids") + _array(tokens) + ids + _str("block_size") + b"\x10")  # fmt: skip
    return _batch([ev])


SHAPES: dict[str, Callable[[int], bytes]] = {
    "u16_hashes": lambda size: _batch(_hash_events(size, _u16, EVENT_HASHES)),
    "u64_hashes": lambda size: _batch(_hash_events(size, _u64, EVENT_HASHES)),
    "u64_at_the_cap": lambda size: _batch([_removed(_u64(EVENT_HASHES), EVENT_HASHES)] * 8),
    "digest_hashes": lambda size: _batch(_hash_events(size, _digests, EVENT_HASHES // 2)),
    "one_event": _one_event,
    "tiny_events": _tiny_events,
    "extra_keys": _extra_keys,
    "nested": _nested,
    "legit_biggest": _legit_biggest,
}


def payload(shape: str, size: int) -> bytes:
    return SHAPES[shape](size)


def measure(shape: str, size: int) -> dict[str, object]:
    """In this process: one shape's payload through one stream's accounting."""
    import gc

    from kvwatch.daemon.config import EnginesConfig
    from kvwatch.daemon.engines.stream_counts import StreamCounts

    cfg = EnginesConfig()
    counts = StreamCounts((cfg.max_tracked_blocks, cfg.regret_blocks), cfg.thrash_seconds)
    data = payload(shape, size)
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    raised = ""
    try:
        counts.ingest(data)
    except Exception as err:  # the code before the checks raised out of the accounting
        raised = f"raised {type(err).__name__}"
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before + len(data)
    gpu = counts.media.get("GPU")
    counted = (gpu.logical().removed + gpu.logical().stored) if gpu is not None else 0
    outcome = raised or ",".join(sorted(counts.errors)) or f"counted ({counts.batches} batch, {counted:,} blocks)"
    return {"shape": shape, "bytes": len(data), "outcome": outcome, "peak": peak, "seconds": seconds}


FLOOD = """
import sys, time, zmq
sys.path.insert(0, sys.argv[3])
from bench_kv_message_rss import payload
port, n = int(sys.argv[1]), int(sys.argv[2])
data = payload("u16_hashes", int(sys.argv[4]))
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(f"tcp://127.0.0.1:{port}")
pub.recv()
for i in range(n):
    pub.send_multipart([b"", i.to_bytes(8, "big"), data], copy=False)
pub.close(linger=-1)
ctx.term()
"""


def measure_hub(size: int, n: int = 32) -> dict[str, object]:
    """In this process: a hub drains ``n`` worst-shape messages a publisher process floods."""
    import socket

    from kvwatch.daemon.engines.kv_events import KVEventHub
    from kvwatch.daemon.model.engines import StreamSpec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub = KVEventHub()
    spec = StreamSpec(f"tcp://127.0.0.1:{port}")
    pub = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), str(n), str(Path(__file__).parent), str(size)])
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    try:
        hub.set_streams([spec])
        hub.start()
        while time.perf_counter() - t0 < 300:
            st = hub.stats().get(spec)
            if st is not None and sum(st.decode_errors.values()) + st.batches >= n:
                break
            time.sleep(0.05)
        st = hub.stats()[spec]
    finally:
        hub.close()
        pub.wait(timeout=30)
    peak = _status("VmHWM") - before
    outcome = ",".join(f"{k} {v}" for k, v in sorted(st.decode_errors.items())) + f"; gaps {st.gaps}"
    return {"shape": f"hub: {n} x u16_hashes over ZMQ", "bytes": size, "outcome": outcome, "peak": peak,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def _endless_multipart(server: object, total: int) -> None:
    """A publisher speaking ZMTP 3.0 as libzmq's PUB does, sending the 1 MiB parts of a message
    whose last part never comes, ``total`` bytes over as many connections as the SUB makes."""
    import socket

    assert isinstance(server, socket.socket)
    part = 1 << 20
    frame = b"\x03" + struct.pack(">Q", part) + bytes(part)  # MORE | LONG
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"PUB"
    sent = 0
    while sent < total:
        conn, _ = server.accept()
        with conn:
            try:
                conn.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
                conn.recv(64)
                conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
                while sent < total:
                    conn.sendall(frame)
                    sent += part
                    time.sleep(0.004)  # ~256 MiB/s
            except OSError:
                continue


def measure_multipart(total: int = 768 * MiB, headroom: int = 128 * MiB) -> dict[str, object]:
    """In this process: a hub subscribed to a publisher that never ends its message; its memory
    guard's limit set ``headroom`` above the RSS at the start."""
    import socket
    import threading

    from kvwatch.daemon.engines.kv_events import KVEventHub
    from kvwatch.daemon.model.engines import StreamSpec

    server = socket.create_server(("127.0.0.1", 0))
    flood = threading.Thread(target=_endless_multipart, args=(server, total), daemon=True)
    before = _status("VmRSS")
    try:
        hub = KVEventHub(rss_limit=before + headroom)  # type: ignore[call-arg, unused-ignore]
    except TypeError:  # a tree from before the memory guard
        hub = KVEventHub()
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    flood.start()
    try:
        hub.set_streams([StreamSpec(f"tcp://127.0.0.1:{server.getsockname()[1]}")])
        hub.start()
        flood.join(timeout=300)
    finally:
        hub.close()
        server.close()
    resets = hub.failures.get("memory", 0)
    return {"shape": f"hub: one multipart message that never ends, {total // MiB} MiB of 1 MiB parts",
            "bytes": total, "outcome": f"sockets reopened {resets} times" if resets else "held",
            "peak": _status("VmHWM") - before, "seconds": time.perf_counter() - t0}  # fmt: skip


def run(args: list[str], path: str | None = None) -> dict[str, object]:
    """One measurement in a fresh process; ``path``: import kvwatch from there (an older tree)."""
    env = {**os.environ, "PYTHONPATH": path} if path else None
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True, env=env)
    row: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def _mib(r: dict[str, object] | None, key: str = "peak") -> str:
    return "" if r is None else f"{int(str(r[key])) / MiB:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--bytes",
        default=str(16 * MiB),
        help="payload sizes, comma-separated (16 MiB: kvwatch's frame limit; it was 64 MiB)",
    )
    ap.add_argument("--hub", action="store_true", help="also flood a running hub over ZMQ")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument(
        "--before",
        metavar="DIR",
        help="also measure the kvwatch package found in DIR (a link tree of an older commit: DIR/kvwatch/daemon, ...)",
    )
    ap.add_argument("--before-label", help="what to call the --before tree in the results (a commit)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one shape in this process
    a = ap.parse_args()
    if a.one:
        size = int(a.bytes)
        special = {"hub": lambda: measure_hub(size), "multipart": measure_multipart}
        print(json.dumps(special[a.one]() if a.one in special else measure(a.one, size)))
        return
    runs = [(s, n) for n in a.bytes.split(",") for s in a.shapes.split(",")]
    runs += [("hub", a.bytes.split(",")[0]), ("multipart", "0")] if a.hub else []
    rows = [run(["--one", s, "--bytes", n]) for s, n in runs]
    before: list[dict[str, object] | None] = [None] * len(rows)
    if a.before:  # the flood row is left out: the old hub queued every message (the integration test shows it)
        before = [run(["--one", s, "--bytes", n], a.before) if s != "hub" else None for s, n in runs]
    worst = max(int(str(r["peak"])) for r in rows)
    lines = [
        "# Peak memory of the worst KV event messages",
        "",
        f"Host: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}, "
        f"Python {platform.python_version()}.",
        "Each shape in a fresh process: peak RSS (VmHWM, reset before the message) less the RSS before it, plus the "
        "payload's own bytes: what one message costs while one stream's accounting (StreamCounts.ingest) handles it. "
        "The hub rows: a running KVEventHub drained 32 such messages a publisher process sent over ZMQ (its peak "
        "growth includes ZMQ's queue and the message in hand); a hub subscribed to a publisher that never ends its "
        "multipart message, the memory guard's limit 128 MiB above the RSS at the start (peak: VmHWM growth).",
        "",
        "Payloads past 16 MiB are handed to the accounting directly: over ZMQ, kvwatch disconnects a peer whose "
        "frame is longer (MAX_MESSAGE_BYTES); the code before took frames of up to 64 MiB.",
        *([f"Before: the same shapes through {a.before_label or a.before}."] if a.before else []),
        "",
        "| shape | payload (MiB) | outcome | peak (MiB) | seconds | before: outcome | before: peak (MiB) | before: seconds |",
        "| :--- | ---: | :--- | ---: | ---: | :--- | ---: | ---: |",
    ]
    for r, b in zip(rows, before, strict=True):
        old = f"{b['outcome']} | {_mib(b)} | {float(str(b['seconds'])):.2f}" if b is not None else " | | "
        lines.append(f"| {r['shape']} | {_mib(r, 'bytes')} | {r['outcome']} | {_mib(r)} | "
                     f"{float(str(r['seconds'])):.2f} | {old} |")  # fmt: skip
    lines += [
        "",
        f"Worst: {worst / MiB:.0f} MiB; with the daemon's {IDLE / MiB:.0f} MiB at rest, "
        f"{(worst + IDLE) / MiB:.0f} MiB against the chart's limit of {LIMIT / MiB:.0f} MiB "
        f"({'within' if worst + IDLE <= LIMIT else 'OVER'}).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
