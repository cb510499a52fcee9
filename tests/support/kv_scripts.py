"""KV event batches for the tests: vLLM's own frames as captured off the wire, and scripts of
batches counted the way a stream counts them, without sockets (``StreamCounts`` fed the bytes
vLLM's encoder would have sent)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.model.engines import MediumTotals, StreamSpec, StreamStats

FIXTURES = Path(__file__).parents[1] / "fixtures"
# Captured off the wire from the real ZmqEventPublisher of four vLLM releases (tests/tools/vllm_capture.py).
CAPTURES = sorted((FIXTURES / "kv_events").glob("vllm-*.json"))
LAYOUT = {"0.9.2": we.Layout.V0_9, "0.11.0": we.Layout.V0_11, "0.26.0": we.Layout.V0_26, "0.33.0": we.Layout.V0_33}
# The real run's model on the H200: 2 (K, V) x 16 tokens x 8 KV heads x 64 head dim x 2 bytes x 16 layers.
REAL_BLOCK_BYTES = 2 * 16 * 8 * 64 * 2 * 16
SCRIPT_SPEC = StreamSpec("tcp://127.0.0.1:5557")

Script = list[tuple[float, list[dict[str, Any]]]]  # (engine timestamp, events) per batch


def load(path: Path) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(path.read_text())
    return d


def unjson(x: Any) -> Any:
    """A capture's JSON with byte strings (``{"bytes": hex}``) back as bytes."""
    if isinstance(x, dict) and set(x) == {"bytes"}:
        return bytes.fromhex(x["bytes"])
    if isinstance(x, list):
        return [unjson(v) for v in x]
    if isinstance(x, dict):
        return {k: unjson(v) for k, v in x.items()}
    return x


def frames(capture: dict[str, Any], key: str = "frames") -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in msg] for msg in capture[key]]


def script_stats(
    script: Script,
    *,
    layout: we.Layout = we.Layout.V0_33,
    thrash_seconds: float = 5.0,
    bounds: tuple[int, int] = (1_000_000, 524_288),
) -> StreamStats:
    """Every batch of a script, encoded as ``layout``'s vLLM encodes it, through one stream's
    counting, in order and none lost: the stream's stats after the last."""
    counts = StreamCounts(bounds, thrash_seconds)
    enc = msgspec.msgpack.Encoder()
    for ts, events in script:
        counts.ingest(we.encode_batch(layout, ts, events, 0, enc))
    return counts.stats(
        SCRIPT_SPEC,
        connected=True,
        gaps=0,
        missed=0,
        replayed=0,
        lost=0,
        restarts=0,
        replay_requests=0,
        last_seq=len(script) - 1 if script else None,
        last_message_at=0.0,
    )


def publish_script(script: Script) -> Mapping[str, MediumTotals]:
    """A script's media once counted (``script_stats``)."""
    return script_stats(script).media
