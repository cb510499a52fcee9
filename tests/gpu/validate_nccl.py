"""NCCL probes on two GPUs: kvwatch's per-process byte counts against what the application
moved, and the cost, attached vs not, side by side in one run.

On the lent nvidia-h200-x2 machine, as root, under bcc (tests/gpu/run_nccl_on_device.sh):

    .gpu-bundle/with-bcc python3 tests/gpu/validate_nccl.py --out DIR

1. Two ranks (tests/gpu/nccl_peer.py, one GPU each) set up torch.distributed over NCCL
   and exchange once before anyone watches.
2. kvwatch's transfer probes attach to both processes (the libnccl.so.2 each mapped).
3. Exactness: rank 0 sends 23 tensors of 8 MiB, rank 1 sends 7 of 2 MiB back (asymmetric
   on purpose: the per-process counts must tell the ranks apart). kvwatch's ncclSend /
   ncclRecv bytes and calls per process must equal what each rank moved.
4. Cost: rounds alternating detached / attached (the order swapped every round): large
   messages (throughput) and 4 KiB messages (per-call cost).

Writes DIR/nccl_validation.json and DIR/nccl_validation.md. ``--backend stub --lib
PATH`` runs the same orchestration against a stub libnccl (no GPU) to check it here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Peer:
    def __init__(self, rank: int, port: int, backend: str, lib: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
        env["PYTHONPATH"] = os.environ.get("PEER_PYTHONPATH", "")
        env["NCCL_NVLS_ENABLE"] = "0"
        cmd = [sys.executable, str(HERE / "nccl_peer.py"), "--rank", str(rank), "--port", str(port)]
        cmd += ["--backend", backend, "--lib", lib]
        self.rank = rank
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.reply: dict[str, Any] = {}

    def wait_ready(self) -> None:
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank {self.rank} exited {self.proc.wait()}")
        self.info = json.loads(line)
        assert self.info["ready"] == self.proc.pid

    def send(self, line: str) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank {self.rank} exited {self.proc.wait()}")
        self.reply = json.loads(line)
        return self.reply


def close_peers(peers: list[Peer]) -> None:
    """Ask each rank to quit; kill one that does not within 30 s."""
    for p in peers:
        try:
            p.send("quit")
            p.proc.wait(30)
        except Exception:
            p.proc.kill()


def exchange(peers: list[Peer], n: int, a: int, m: int, b: int) -> list[dict[str, Any]]:
    for p in peers:
        p.send(f"xfer {n} {a} {m} {b}")
    out: list[dict[str, Any]] = [{}, {}]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, peers[i].read())) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def counts(probes: Any, pid: int) -> dict[str, tuple[int, int, int]]:
    c = probes.sample().processes.get(pid)
    if c is None:
        return {}
    return {op: (v.calls, v.errors, v.bytes) for (lib, op), v in c.xfers.items() if lib == "nccl"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", choices=["torch", "stub"], default="torch")
    ap.add_argument("--lib", default="")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from kvwatch.probes.records import HookState
    from kvwatch.probes.transfer import TransferProbes

    result: dict[str, Any] = {"backend": args.backend}
    t_start = time.monotonic()
    port = free_port()
    peers = [Peer(r, port, args.backend, args.lib) for r in (0, 1)]
    try:
        for p in peers:
            p.wait_ready()
        result["ranks"] = {str(p.rank): p.info for p in peers}
        result["setup_seconds"] = round(time.monotonic() - t_start, 1)
        probes = TransferProbes()
        probes.start()

        def attach_all() -> None:
            for p in peers:
                att = probes.attach(p.proc.pid)
                states = {s.api: s.state for s in att.symbols}
                for api in ("ncclSend", "ncclRecv"):
                    if states.get(api) is not HookState.ATTACHED:
                        raise RuntimeError(f"rank {p.rank}: {api} {states.get(api)} ({att.libraries})")
                result.setdefault("libraries", {})[str(p.rank)] = [lib.path for lib in att.libraries.values()]

        def detach_all() -> None:
            for p in peers:
                probes.detach(p.proc.pid)
            probes.settle()  # the kernel has really released them before anything is timed

        attach_all()
        # --- exactness ---------------------------------------------------------------------
        n, a, m, b = 23, 8 * MIB, 7, 2 * MIB
        replies = exchange(peers, n, a, m, b)
        exact: dict[str, Any] = {}
        ok = True
        for p, rep in zip(peers, replies, strict=True):
            got = counts(probes, p.proc.pid)
            want = {"send": (rep["sends"], 0, rep["sent_bytes"]), "recv": (rep["recvs"], 0, rep["recv_bytes"])}
            exact[str(p.rank)] = {"pid": p.proc.pid, "application": want, "kvwatch": got}
            ok &= all(got.get(op) == want[op] for op in ("send", "recv"))
        result["exact"] = exact
        result["exact_ok"] = ok
        (args.out / "nccl_validation.json").write_text(
            json.dumps(result, indent=1)
        )  # in case the rest runs out of time
        print(json.dumps({"exact_ok": ok, "exact": exact}), flush=True)
        # --- cost: detached vs attached, alternating -------------------------------------------
        cost: dict[str, dict[str, list[float]]] = {"large": {"off": [], "on": []}, "small": {"off": [], "on": []}}
        big_n, small_n = 64, 2000
        for r in range(args.rounds):
            for state in ("off", "on") if r % 2 == 0 else ("on", "off"):
                if state == "off":
                    detach_all()
                else:
                    attach_all()
                rep = exchange(peers, big_n, 64 * MIB, big_n, 64 * MIB)
                cost["large"][state].append(max(x["seconds"] for x in rep))
                rep = exchange(peers, small_n, 4096, small_n, 4096)
                cost["small"][state].append(max(x["seconds"] for x in rep))
        detach_all()
        med = {k: {s: statistics.median(v) for s, v in d.items()} for k, d in cost.items()}
        large_bytes = 2 * big_n * 64 * MIB
        result["cost"] = {
            "rounds": args.rounds,
            "raw_seconds": cost,
            "large_GiB_per_s_off": large_bytes / med["large"]["off"] / (1 << 30),
            "large_GiB_per_s_on": large_bytes / med["large"]["on"] / (1 << 30),
            "large_slowdown_pct": 100 * (med["large"]["on"] / med["large"]["off"] - 1),
            "small_us_per_call_off": 1e6 * med["small"]["off"] / (2 * small_n),
            "small_us_per_call_on": 1e6 * med["small"]["on"] / (2 * small_n),
            "overhead_us_per_call": 1e6 * (med["small"]["on"] - med["small"]["off"]) / (2 * small_n),
        }
        probes.close()
    finally:
        close_peers(peers)
    result["total_seconds"] = round(time.monotonic() - t_start, 1)
    (args.out / "nccl_validation.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# NCCL probes, two ranks ({args.backend}) — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| rank | pid | op | application: calls, bytes | kvwatch: calls, errors, bytes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rank, e in result.get("exact", {}).items():
        for op in ("send", "recv"):
            app = e["application"][op]
            lines.append(f"| {rank} | {e['pid']} | {op} | {app[0]}, {app[2]} | {e['kvwatch'].get(op)} |")
    c = result.get("cost", {})
    if c:
        lines += [
            "",
            f"exact: {result['exact_ok']}; cost, medians of {c['rounds']} alternating rounds:",
            "",
            "| measure | detached | attached |",
            "| --- | --- | --- |",
            f"| 64 MiB messages, GiB/s | {c['large_GiB_per_s_off']:.2f} | {c['large_GiB_per_s_on']:.2f} |",
            f"| 4 KiB messages, µs per send/recv | {c['small_us_per_call_off']:.2f} | {c['small_us_per_call_on']:.2f} |",
            "",
            f"overhead per call: {c['overhead_us_per_call']:.2f} µs; large-message slowdown {c['large_slowdown_pct']:.2f} %",
        ]
    (args.out / "nccl_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result.get("exact_ok") else 1


if __name__ == "__main__":
    sys.exit(main())
