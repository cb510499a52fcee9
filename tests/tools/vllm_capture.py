"""Capture vLLM's KV event wire format from vLLM's own publisher, as ground truth.

Downloads a vLLM wheel (``pip download vllm==VERSION --no-deps``), extracts only
``vllm/distributed/kv_events.py`` into a cache directory, loads it with small
stand-ins for the three vLLM imports it needs (logger, config dataclass, network
helpers) and runs its real ``ZmqEventPublisher``: the engine's own msgspec
structs, encoder, PUB socket, sequence numbers and ROUTER replay. A ZMQ
subscriber here records every frame off the wire, then asks the replay endpoint
for batches from sequence 2 and records that exchange too.

Output: ``tests/fixtures/kv_events/vllm-VERSION.json`` — the script of batches
published (fields as given to vLLM's classes), the frames in hex, and the counts
the script itself implies. Nothing from vLLM's source is stored, only bytes its
code produced.

    .venv/bin/python tests/tools/vllm_capture.py 0.9.2 0.11.0 0.33.0
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import json
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

import zmq

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "kv_events"
CACHE = Path.home() / ".cache" / "kvwatch-vllm"
TS0 = 1764400000.25
TOPIC = "kv@test"


def extract(version: str) -> Path:
    dest = CACHE / version / "kv_events.py"
    if dest.exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", f"vllm=={version}", "--no-deps", "-d", tmp], check=True
        )
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read("vllm/distributed/kv_events.py")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return dest


@dataclasses.dataclass
class _KVEventsConfig:  # stand-in: only constructed by the publisher, never encoded
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _stand_ins() -> None:
    def module(name: str, **attrs: Any) -> None:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    import logging

    module("vllm")
    module("vllm.config", KVEventsConfig=_KVEventsConfig)
    module("vllm.config.kv_events", KVEventsConfig=_KVEventsConfig)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.v1")
    module("vllm.v1.core")
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    module("vllm.utils")
    module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda p: ("tcp", p.rsplit(":", 1)[0][6:], p.rsplit(":", 1)[1]),
    )


def load(version: str) -> types.ModuleType:
    return load_path(extract(version))


def load_path(path: Path) -> types.ModuleType:
    """vLLM's ``kv_events.py`` from a file, with stand-ins for the vLLM modules it imports."""
    _stand_ins()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"vllm_kv_events_{digest}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def script() -> list[dict[str, Any]]:
    """The batches, as keyword arguments for vLLM's classes (unknown fields dropped per version)."""
    tokens = [128000, 128006, 9125, 128007, 271, 0, 1, 127, 128, 255, 256, 65535, 65536, 128255, 42, 2]
    more = list(range(100, 116))

    def stored(
        hashes: list[Any], parent: Any, toks: list[int], medium: str | None = "GPU", **kw: Any
    ) -> dict[str, Any]:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": toks,
            "block_size": 16,
            "lora_id": kw.pop("lora_id", None),
            "medium": medium,
            "lora_name": kw.pop("lora_name", None),
            **kw,
        }

    def removed(hashes: list[Any], medium: str | None = "GPU", **kw: Any) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **kw}

    return [
        {"events": [stored([0xDEADBEEF12345678, 0xFFFFFFFFFFFFFFFF], None, tokens + more, group_idx=0)]},
        {
            "events": [
                stored([7, 8, 9], 0xFFFFFFFFFFFFFFFF, more * 3, medium="CPU"),
                removed([0xDEADBEEF12345678], group_idx=0),
            ]
        },
        {"events": [removed([0x8000000000000001, 5])]},
        {"events": [{"type": "AllBlocksCleared"}]},
        {
            "events": [
                stored([11, 12], None, tokens + more, lora_id=3, lora_name="adapter", extra_keys=[["salt-1"], None]),
                removed([11], medium="CPU"),
                removed([12, 7, 8]),
            ]
        },
        {"events": [stored([bytes(range(32))], bytes(range(100, 132)), tokens, medium="GPU")], "bytes_hashes": True},
        {"events": [removed([bytes(range(32))]), stored([21], None, tokens, medium="STORAGE")], "bytes_hashes": True},
    ]


def build(mod: types.ModuleType, spec: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """vLLM event objects for one scripted batch, and the fields actually given."""
    classes = {n: getattr(mod, n) for n in ("BlockStored", "BlockRemoved", "AllBlocksCleared")}
    out, given = [], []
    for ev in spec["events"]:
        cls = classes[ev["type"]]
        fields = set(cls.__struct_fields__)
        kw = {k: v for k, v in ev.items() if k in fields}
        if "extra_keys" in kw and kw["extra_keys"] is not None:
            kw["extra_keys"] = [tuple(x) if x is not None else None for x in kw["extra_keys"]]
        out.append(cls(**kw))
        given.append({"type": ev["type"], **{k: v for k, v in ev.items() if k in fields}})
    return out, given


def expected(batches: list[dict[str, Any]]) -> dict[str, Any]:
    stored: dict[str, int] = {}
    removed: dict[str, int] = {}
    cleared = 0
    for b in batches:
        for ev in b["events"]:
            medium = ev.get("medium") or "GPU"  # events without a medium came from the GPU block pool
            if ev["type"] == "BlockStored":
                stored[medium] = stored.get(medium, 0) + len(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                removed[medium] = removed.get(medium, 0) + len(ev["block_hashes"])
            else:
                cleared += 1
    return {"stored": stored, "removed": removed, "cleared": cleared, "batches": len(batches)}


def _jsonable(x: Any) -> Any:
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x


def capture(version: str, port: int) -> dict[str, Any]:
    mod = load(version)
    cls = mod.ZmqEventPublisher
    has_rank = "data_parallel_rank" in inspect.signature(cls.__init__).parameters
    rank = 1 if has_rank else 0
    kw: dict[str, Any] = {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 10}", "topic": TOPIC}
    if has_rank:
        kw["data_parallel_rank"] = rank  # the publisher binds port + rank
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port + rank}")
    pub = cls(**kw)
    time.sleep(0.5)  # slow joiner
    batches: list[dict[str, Any]] = []
    hashes_bytes_ok = "ExternalBlockHash" in Path(inspect.getfile(mod)).read_text()
    for i, spec in enumerate(script()):
        if spec.get("bytes_hashes") and not hashes_bytes_ok:
            continue
        events, given = build(mod, spec)
        ts = TS0 + i * 0.5
        pub.publish(mod.KVEventBatch(ts=ts, events=events))
        batches.append({"ts": ts, "events": given})
    frames = []
    while sub.poll(2000):
        frames.append([f.hex() for f in sub.recv_multipart()])
        if len(frames) == len(batches):
            break
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port + 10 + rank}")
    start = 2
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replay = []
    while dealer.poll(2000):
        msg = dealer.recv_multipart()
        replay.append([f.hex() for f in msg])
        if msg[-1] == b"" and msg[-2] == (-1).to_bytes(8, "big", signed=True):
            break
    pub.shutdown()
    sub.close(0)
    dealer.close(0)
    src = inspect.getfile(mod)
    return {
        "vllm_version": version,
        "kv_events_py_sha256": hashlib.sha256(Path(src).read_bytes()).hexdigest(),
        "topic": TOPIC,
        "data_parallel_rank": rank if has_rank else None,
        "batches": _jsonable(batches),
        "frames": frames,
        "replay_start": start,
        "replay_frames": replay,
        "expected": expected(batches),
    }


def main(argv: list[str]) -> int:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for i, version in enumerate(argv or ["0.33.0"]):
        out = capture(version, 25557 + 100 * i)
        path = FIXTURES / f"vllm-{version}.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"{path}: {len(out['frames'])} batches, {len(out['replay_frames'])} replay messages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
