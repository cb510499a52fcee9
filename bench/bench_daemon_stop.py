"""How long ``kvwatch run`` takes to stop (SIGTERM to exit) with CUDA uprobes attached (root, real kernel).

    sudo .venv/bin/python bench/bench_daemon_stop.py --processes 2 --rounds 3

Each round starts a fresh daemon watching ``--processes`` stub CUDA workloads (the stub runtime
and driver of ``kvwatch.daemon.lab.stublib``, every CUDA API probed), waits until their probes
are attached and have stopped growing, then sends SIGTERM and times the daemon's exit. A stop is
mostly the kernel releasing the daemon's uprobes (bench/bench_uprobe_release.py), so the line
says how many were attached and how they were attached (the uprobe family's attach mode, from the
daemon's log).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvwatch.daemon.lab.stublib import build
from kvwatch.daemon.lab.workloads import workload_rule
from tests.support.daemon import DaemonProcess, wait_attached
from tests.support.kernel import Child

CONFIG = f"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{workload_rule("stubengine", "cuda")}]
[probes]
cuda_rescan_seconds = 1
cuda_driver_api = "all"
"""


def attach_mode(d: DaemonProcess) -> str:
    for e in d.log_events():
        if e.get("event") == "uprobe attach mode":
            return str(e.get("mode"))
    return "perf_event (not logged)"


def one_round(tmp: Path, stub: Path, processes: int) -> str:
    with contextlib.ExitStack() as stack:
        children = [stack.enter_context(Child("cuda", "--lib-dir", str(stub))) for _ in range(processes)]
        for c in children:
            c.expect("ready")
        d = DaemonProcess(tmp, CONFIG)
        try:
            d.wait_ready()
            probes = sum(wait_attached(d, c.pid) for c in children)
            mode = attach_mode(d)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            d.proc.wait(120)
            took = time.monotonic() - t0
        finally:
            d.stop()
    return f"{processes} processes, {int(probes)} CUDA APIs probed (an entry and a return uprobe each, {mode}): SIGTERM to exit {took:.2f} s (exit {d.proc.returncode})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvwatch-stop-") as t:
        tmp = Path(t)
        stub = tmp / "stub"
        stub.mkdir()
        build(stub)
        for i in range(args.rounds):
            run = tmp / f"round{i}"
            run.mkdir()
            print(one_round(run, stub, args.processes), flush=True)


if __name__ == "__main__":
    main()
