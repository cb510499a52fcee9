"""Transfer probe cost, measured side by side in one run (root, real kernel, no GPU).

    sudo .venv/bin/python bench/bench_transfer.py [--rounds 5] [--out FILE]

1. Per call, through the stub libraries from a C loop (bench/xfer_loop.c): a NIXL post
   that completes at once (its UCX put beneath is probed too), and a direct ucp_put_nbx;
   unwatched vs watched, rounds interleaved.
2. Real NIXL (nixl-cu12, DRAM over UCX on loopback): 64 MiB transfers, the same process
   alternating rounds with the probes attached and detached; throughput compared.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvwatch.daemon.lab.stublib import build_transfer
from kvwatch.probes.transfer import TransferProbes


def loop(exe: Path, lib_dir: Path, mode: str, n: int, probes: TransferProbes | None) -> float:
    p = subprocess.Popen(
        [str(exe), str(lib_dir), mode, str(n), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdin and p.stdout
    time.sleep(0.15)
    if probes is not None:
        probes.attach(p.pid)
    p.stdin.write("go\n")
    p.stdin.flush()
    calls, ns = map(int, p.stdout.read().split())
    p.wait()
    if probes is not None:
        probes.detach(p.pid)
        probes.settle()  # really gone before timing
    return ns / calls


def per_call(rounds: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        lib_dir = build_transfer(tmp / "stub")
        exe = tmp / "xfer_loop"
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(HERE / "xfer_loop.c"), "-ldl"], check=True)
        probes = TransferProbes()
        probes.start()
        try:
            for mode in ("post", "put"):
                off, on = [], []
                for _ in range(rounds):
                    off.append(loop(exe, lib_dir, mode, 100_000, None))
                    on.append(loop(exe, lib_dir, mode, 100_000, probes))
                out[f"{mode}_ns_unprobed"] = statistics.median(off)
                out[f"{mode}_overhead_ns"] = statistics.median(on) - statistics.median(off)
        finally:
            probes.close()
    return out


def nixl_throughput(rounds: int, transfers: int) -> dict[str, float] | str:
    try:
        from kvwatch.daemon.lab.nixl_peer import NixlPeer, _nixl

        _nixl()
    except ImportError as err:
        return f"not run: {err}"
    size = 64 << 20
    with tempfile.TemporaryDirectory() as t:
        meta = Path(t) / "meta.json"
        target = NixlPeer("target", meta, size)
        init = NixlPeer("initiator", meta, size)
        probes = TransferProbes()
        probes.start()
        try:
            init.ask("burst 20")  # warm-up
            on: list[float] = []
            off: list[float] = []
            for r in range(2 * rounds):
                attached = r % 2 == 1
                if attached:
                    probes.attach(init.pid)
                reply = init.ask(f"burst {transfers}")
                seconds = sum(reply["durations_ns"]) / 1e9
                (on if attached else off).append(reply["bytes"] / seconds)
                if attached:
                    probes.detach(init.pid)
                    probes.settle()  # really gone before timing
        finally:
            probes.close()
            init.close()
            target.close()
    return {
        "transfer_mib": 64,
        "transfers_per_round": transfers,
        "gib_per_s_detached": statistics.median(off) / 2**30,
        "gib_per_s_attached": statistics.median(on) / 2**30,
        "slowdown_pct": 100 * (statistics.median(off) / statistics.median(on) - 1),
        "slowdown_pct_best_rounds": 100 * (max(off) / max(on) - 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transfers", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    calls = per_call(args.rounds)
    nixl = nixl_throughput(args.rounds, args.transfers)
    lines = [
        f"# kvwatch transfer probe cost — {time.strftime('%Y-%m-%d %H:%M')} — kernel {platform.release()}, {os.cpu_count()} CPUs",
        f"medians of {args.rounds} interleaved rounds",
        "",
        "| measurement | value |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in calls.items()]
    if isinstance(nixl, str):
        lines.append(f"| nixl throughput | {nixl} |")
    else:
        lines += [f"| nixl.{k} | {v:.3f} |" for k, v in nixl.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
