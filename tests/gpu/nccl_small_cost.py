"""Where the end-to-end cost of probing small NCCL messages goes (the +9 µs per 4 KiB send/recv
that the probe pair alone, +1.27 µs isolated, did not explain).

On the lent nvidia-h200-x2 machine, as root, under bcc:
    .gpu-bundle/with-bcc python3 tests/gpu/nccl_small_cost.py --out DIR

Two ranks (tests/gpu/nccl_peer.py) exchange 4 KiB messages; rounds rotate through, side by side:
  off         nothing attached
  noop_entry  a BPF program that returns at once, on ncclSend/ncclRecv entry (uprobe only)
  noop_pair   the same on entry and return (uprobe + uretprobe: kvwatch's shape, none of its work)
  kvwatch     kvwatch's transfer probes (all hooks, as the daemon attaches them)
  noop_at_symbol  the no-op entry probe at the symbol itself, on its endbr64 (single-stepped)
The no-op probes sit where kvwatch's do (past a leading endbr64).
The difference noop_pair - off is the kernel's uprobe mechanism in this process; kvwatch -
noop_pair is kvwatch's own programs. Also records how many probe hits kvwatch saw per message
(a hook firing more than once per call would explain a larger cost).

Diagnostic bench, not product code: it loads its no-op programs with bcc directly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from validate_nccl import Peer, close_peers, exchange, free_port

NOOP = b"int noop(void *ctx) { return 0; }"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--backend", choices=["torch", "stub"], default="torch")
    ap.add_argument("--lib", default="", help="the stub libnccl, with --backend stub (a dry run without GPUs)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from bcc import BPF

    from kvwatch.probes.libs import read_symbols
    from kvwatch.probes.transfer import TransferProbes

    port = free_port()
    peers = [Peer(r, port, args.backend, args.lib) for r in (0, 1)]
    result: dict[str, Any] = {"n_per_direction": args.n}
    try:
        for p in peers:
            p.wait_ready()
        probes = TransferProbes()
        probes.start()
        libs: dict[int, str] = {}
        for p in peers:  # the libnccl each rank mapped, as kvwatch resolves it
            att = probes.attach(p.proc.pid)
            libs[p.proc.pid] = next(lib.path for lib in att.libraries.values() if "nccl" in lib.path)
            probes.detach(p.proc.pid)
        probes.settle()
        result["libnccl"] = sorted(set(libs.values()))
        result["entry_bytes"] = {
            sym: read_symbols(path).entry_bytes.get(sym, b"").hex()
            for path in set(libs.values())
            for sym in ("ncclSend", "ncclRecv")
        }

        noop: BPF | None = None

        def attach(variant: str) -> None:
            nonlocal noop
            if variant == "kvwatch":
                for p in peers:
                    probes.attach(p.proc.pid)
            elif variant.startswith("noop"):
                noop = BPF(text=NOOP)
                for pid, path in libs.items():
                    table = read_symbols(path)
                    for sym in ("ncclSend", "ncclRecv"):
                        # where kvwatch probes (past endbr64), or the symbol itself (noop_at_symbol)
                        addr = table.address(sym) if variant == "noop_at_symbol" else table.probe_address(sym)
                        kw = {"name": path.encode(), "addr": addr, "fn_name": b"noop", "pid": pid}
                        noop.attach_uprobe(**kw)
                        if variant == "noop_pair":
                            noop.attach_uretprobe(**kw)

        def detach(variant: str) -> None:
            nonlocal noop
            if variant == "kvwatch":
                for p in peers:
                    probes.detach(p.proc.pid)
                probes.settle()
            elif noop is not None:
                noop.cleanup()
                noop = None

        exchange(peers, 200, 4096, 200, 4096)  # warm
        variants = ["off", "noop_entry", "noop_pair", "kvwatch", "noop_at_symbol"]
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        hits_per_message: list[dict[str, float]] = []
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                attach(v)
                h0 = probes.sample().hits if v == "kvwatch" else {}
                rep = exchange(peers, args.n, 4096, args.n, 4096)
                if v == "kvwatch":
                    h1 = probes.sample().hits
                    hits_per_message.append(
                        {k: (h1[k] - h0.get(k, 0)) / (2 * args.n) for k in h1 if h1[k] != h0.get(k, 0)}
                    )
                detach(v)
                seconds[v].append(max(x["seconds"] for x in rep))
        us = {v: 1e6 * statistics.median(s) / (2 * args.n) for v, s in seconds.items()}
        result |= {
            "rounds": args.rounds,
            "raw_seconds": seconds,
            "us_per_message_median": us,
            "delta_us_vs_off": {v: us[v] - us["off"] for v in variants},
            "wins_vs_off": {v: sum(a > b for a, b in zip(seconds[v], seconds["off"], strict=True)) for v in variants},
            "kvwatch_hits_per_message": hits_per_message,
        }
        probes.close()
    finally:
        close_peers(peers)
    (args.out / "nccl_small_cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("us_per_message_median", "delta_us_vs_off", "wins_vs_off")}))
    print(json.dumps(result.get("kvwatch_hits_per_message", [])[:2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
