"""kvwatch run against the simulated vLLM serving three tenants by cache salt: a noisy neighbour
(tenant B floods unique prompts while tenant A reuses hot prefixes) named by KVTenantThrash
during the flood and cleared after it; every per-tenant count exact against an independent count
of the same stream (a second subscriber, ``tests/support/tenant_reference.py``); an unnamed
salt exported as a keyed hash, and no salt anywhere in what kvwatch publishes or logs.

Kernel probes are off (engine taps need no BPF), so it needs no root."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import zmq

from kvwatch.daemon.engines.wire import parse_frames
from tests.support.daemon import DaemonProcess, daemon, wait_until
from tests.support.engine_sim import engine, engines_only, quiesce, tapped
from tests.support.tenant_reference import FIELDS, TenantReference

SALTS = {"a": "salt-tenant-a-7f3c", "b": "salt-tenant-b-91d2", "c": "salt-tenant-c-0a44"}
NAMES = {SALTS["a"]: "tenant-a", SALTS["b"]: "tenant-b"}  # c is not named: kvwatch hashes it
THRASH = "KVTenantThrash"


def config(tmp_path: Path) -> str:
    return (
        engines_only()
        + f"""
[engines]
scrape_interval_seconds = 1.0
tenant_key_file = "{tmp_path / "state" / "tenant.key"}"
tenants = [
  {{ name = "tenant-a", salt = "{SALTS["a"]}" }},
  {{ name = "tenant-b", salt_sha256 = "{_sha(SALTS["b"])}" }},
]
[detectors.tenant_thrash]
warmup_seconds = 0
baseline_min_seconds = 8
window_seconds = 4
confirm_windows = 2
clear_windows = 2
floor_regretted_per_second = 2
min_stored_blocks = 20
"""
    )


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


@contextmanager
def second_subscriber(endpoint: str) -> Iterator[list[tuple[int, bytes]]]:
    """Every (seq, payload) of the stream, read by a subscriber of our own."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    got: list[tuple[int, bytes]] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if sub.poll(100):
                _, seq, payload = parse_frames(sub.recv_multipart())
                got.append((seq, payload))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield got
    finally:
        stop.set()
        t.join(5)
        sub.close(0)
        ctx.term()


def thrash(d: DaemonProcess, pid: int) -> dict[str, str] | None:
    for labels, v in d.metrics().get("kvwatch_alert_active", []):
        if labels.get("alert") == THRASH and labels.get("pid") == str(pid) and v == 1:
            return labels
    return None


def test_a_noisy_neighbour_named_and_every_tenant_count_exact(tmp_path: Path) -> None:
    with daemon(tmp_path, config(tmp_path)) as kvwatch, engine(tmp_path, capacity=1200) as sim:
        port = json.loads(str(sim.proc.args[-1]))["endpoint"].rsplit(":", 1)[1]  # --kv-events-config
        with second_subscriber(f"tcp://127.0.0.1:{port}") as got:
            tapped(kvwatch, sim.pid)
            sim.do("subscribers 2")  # kvwatch and ours: both receive every batch from here on
            sim.do(f"tenant {SALTS['a']} 20 60 6 0")  # A: 60 hot prefixes of 6 blocks, 360 blocks
            sim.do(f"tenant {SALTS['c']} 2 4 4 0")  # C, unnamed: a few hot prefixes
            kvwatch.run_for(14)  # the pool holds A's prefixes: no regrets, nothing to say
            assert thrash(kvwatch, sim.pid) is None
            sim.do(f"tenant {SALTS['b']} 60 1 6 1")  # B floods unique prompts: 420 blocks/s
            wait_until(lambda: thrash(kvwatch, sim.pid) is not None, 30, "KVTenantThrash during the flood")
            labels = thrash(kvwatch, sim.pid)
            assert labels is not None and (labels["tenant"], labels["aggressor"]) == ("tenant-a", "tenant-b")
            assert labels["cause"] == "noisy_neighbour"
            sim.do(f"tenant {SALTS['b']} 0 0 0 0")  # the flood stops: A's prefixes come back
            wait_until(lambda: thrash(kvwatch, sim.pid) is None, 40, "KVTenantThrash to clear")
            for salt in (SALTS["a"], SALTS["c"]):
                sim.do(f"tenant {salt} 0 0 0 0")
            st = quiesce(sim, kvwatch)
        assert sorted(s for s, _ in got) == list(range(st["batches"])), "our subscriber missed batches"
        _exact(kvwatch, sim.pid, got)
        _no_salt_anywhere(kvwatch, tmp_path)


def _exact(kvwatch: DaemonProcess, pid: int, got: list[tuple[int, bytes]]) -> None:
    hashed: list[str] = []

    def name(salt: str | None, lora: str | None) -> str:
        return NAMES.get(salt or "", "salt-unnamed")

    ref = TenantReference(name, 10.0)  # engines.thrash_seconds' default
    for _, payload in sorted(got):
        ts, events, _rank = msgspec.msgpack.decode(payload)
        ref.batch(ts, events)
    metrics = kvwatch.metrics()
    mine: dict[tuple[str, str], dict[str, float]] = {}
    families = {f: f"kvwatch_kv_tenant_blocks_{f}_total" for f in FIELDS if f not in ("regret_tokens", "cleared")}
    families["regret_tokens"] = "kvwatch_kv_tenant_regret_recomputed_tokens_total"
    for field, family in families.items():
        for labels, v in metrics.get(family, []):
            if labels.get("pid") == str(pid):
                mine.setdefault((labels["medium"], labels["tenant"]), {})[field] = v
                if labels["tenant"].startswith("salt-"):
                    hashed.append(labels["tenant"])
    assert len(set(hashed)) == 1 and len(hashed[0]) == 13  # tenant C: salt- and 8 hex
    for (medium, tenant), counts in ref.counts.items():
        label = hashed[0] if tenant == "salt-unnamed" else tenant
        want = {f: float(counts[f]) for f in families}
        assert mine.get((medium, label)) == want, (medium, tenant)
    assert mine[("GPU", "tenant-a")]["regretted"] > 0 and mine[("GPU", "tenant-b")]["stored"] > 1000
    resident = {
        labels["tenant"]: v
        for labels, v in metrics.get("kvwatch_kv_tenant_blocks_resident", [])
        if labels.get("pid") == str(pid) and labels["medium"] == "GPU" and v
    }
    assert resident == {hashed[0] if k == "salt-unnamed" else k: v for k, v in ref.resident("GPU").items()}
    assert kvwatch.value("kvwatch_kv_tenants", pid=str(pid), state="labelled") == 3


def _no_salt_anywhere(kvwatch: DaemonProcess, tmp_path: Path) -> None:
    texts = [kvwatch.get("/metrics")[1], kvwatch.get("/api/v1/top")[1]]
    texts += [p.read_text(errors="replace") for p in tmp_path.rglob("*.log")]
    texts += [p.read_text(errors="replace") for p in tmp_path.rglob("*.jsonl")]
    for salt in SALTS.values():
        assert all(salt not in t for t in texts), salt
