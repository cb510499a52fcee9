"""Kernel-memory probe overhead, measured side by side in one run (root, real kernel).

    sudo .venv/bin/python bench/bench_memory.py [--rounds 5] [--seconds 20] [--out FILE]

Reports:
1. the page-free path's cost per event: a munmap-heavy C workload (mmap, touch,
   munmap 2048 pages, repeated) timed with nothing loaded, with the probes loaded
   and the workload watched, and with the probes loaded but the workload not
   watched; rounds interleaved so machine noise hits every mode alike; cost per
   event = (watched - off) / page-free events counted by the probe itself;
2. the same workload's slowdown with the whole daemon (`kvwatch run`) on vs off;
3. the daemon's CPU share and RSS idle, and while the workload drives page
   events at full speed (about 1M/s on one core here).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvwatch.probes.memory import MemoryProbeOptions, MemoryProbes
from tests.support.daemon import DaemonProcess, wait_until

CLK = os.sysconf("SC_CLK_TCK")
ITERS, PAGES = 400, 2048


def build(tmp: Path) -> Path:
    exe = tmp / "munmap_loop"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(HERE / "munmap_loop.c")], check=True)
    return exe


def run_workload(exe: Path, watch: object = None, cpu: int = 1) -> tuple[int, int, int]:
    """(pages, ns, pid). ``watch(pid)`` is called before the workload starts its loop."""
    p = subprocess.Popen(
        ["taskset", "-c", str(cpu), str(exe), str(ITERS), str(PAGES), "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin and p.stdout
    if watch is not None:
        watch(p.pid)  # type: ignore[operator]
    p.stdin.write("go\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=300)
    pages, ns = map(int, out.split())
    return pages, ns, p.pid


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench_probe_path(exe: Path, rounds: int) -> dict[str, float]:
    probes = MemoryProbes(MemoryProbeOptions())
    probes.start()
    times: dict[str, list[float]] = {"off": [], "watched": [], "unwatched": []}
    per_event: list[float] = []
    try:
        for _ in range(rounds):
            # "off": detach everything by closing, then re-load for the "on" modes
            probes.close()
            pages, ns, _ = run_workload(exe)
            times["off"].append(ns / pages)
            off_ns = ns
            probes = MemoryProbes(MemoryProbeOptions())
            probes.start()
            pages, ns, pid = run_workload(exe, watch=probes.watch)
            times["watched"].append(ns / pages)
            counted = probes.sample().processes[pid].page_free_pages
            per_event.append((ns - off_ns) / max(counted, 1))
            probes.unwatch(pid)
            pages, ns, _ = run_workload(exe)
            times["unwatched"].append(ns / pages)
    finally:
        probes.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ns_per_page_off": med["off"],
        "ns_per_page_watched": med["watched"],
        "ns_per_page_unwatched": med["unwatched"],
        "cost_per_event_watched_ns": med["watched"] - med["off"],
        "cost_per_event_unwatched_ns": med["unwatched"] - med["off"],
        "cost_per_event_paired_ns": statistics.median(per_event),
        "slowdown_watched_pct": 100 * (med["watched"] / med["off"] - 1),
        "slowdown_unwatched_pct": 100 * (med["unwatched"] / med["off"] - 1),
    }


def bench_daemon(exe: Path, rounds: int, seconds: float, tmp: Path) -> dict[str, float]:
    """Whole daemon on vs off, interleaved by round; CPU and RSS idle and loaded."""
    rule = f'{{ engine = "bench", cmdline = "^{exe}" }}'
    toml = f"[discovery]\nrules = [{rule}]\ninterval_seconds = 5\n"
    out: dict[str, float] = {}
    off: list[float] = []
    on: list[float] = []
    loaded_cpu: list[float] = []
    rates: list[float] = []
    for r in range(rounds):
        d = DaemonProcess(tmp, toml)
        try:
            d.wait_ready()
            pid = d.proc.pid
            if r == 0:
                time.sleep(3)
                c0, t0 = proc_cpu_seconds(pid), time.monotonic()
                time.sleep(seconds)
                out["daemon_idle_cpu_pct"] = 100 * (proc_cpu_seconds(pid) - c0) / (time.monotonic() - t0)
                out["daemon_idle_rss_mib"] = proc_rss_mib(pid)

            def discovered(wpid: int, d: DaemonProcess = d) -> None:
                wait_until(
                    lambda: any(
                        lab.get("pid") == str(wpid) for lab, _ in d.metrics().get("kvwatch_page_free_pages_total", [])
                    ),
                    10,
                    "workload watched",
                    0.02,
                )

            h0 = d.value("kvwatch_probe_hits_total", probe="page_free")
            c0, t0 = proc_cpu_seconds(pid), time.monotonic()
            busy = 0.0
            while time.monotonic() - t0 < seconds / rounds:
                pages, ns, _ = run_workload(exe, watch=discovered)
                on.append(ns / pages)
                busy += ns / 1e9
            elapsed = time.monotonic() - t0
            time.sleep(1.2)
            loaded_cpu.append(100 * (proc_cpu_seconds(pid) - c0) / elapsed)
            rates.append((d.value("kvwatch_probe_hits_total", probe="page_free") - h0) / busy)
            out["daemon_loaded_rss_mib"] = proc_rss_mib(pid)
        finally:
            d.stop()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds / rounds:
            pages, ns, _ = run_workload(exe)
            off.append(ns / pages)
    out["daemon_loaded_cpu_pct"] = statistics.median(loaded_cpu)
    out["page_events_per_second_while_loaded"] = statistics.median(rates)
    out["ns_per_page_daemon_off"] = statistics.median(off)
    out["ns_per_page_daemon_on"] = statistics.median(on)
    out["slowdown_daemon_pct"] = 100 * (out["ns_per_page_daemon_on"] / out["ns_per_page_daemon_off"] - 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    if shutil.which("gcc") is None or shutil.which("taskset") is None:
        sys.exit("needs gcc and taskset (apt install gcc util-linux)")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        exe = build(tmp)
        results = {
            "probe": bench_probe_path(exe, args.rounds),
            "daemon": bench_daemon(exe, args.rounds, args.seconds, tmp),
        }
    lines = [
        f"# kvwatch kernel-memory overhead — {time.strftime('%Y-%m-%d %H:%M')} — kernel {platform.release()}, "
        f"{os.cpu_count()} CPUs",
        f"workload: mmap/touch/munmap {PAGES} pages x {ITERS}, pinned to CPU 1; medians of {args.rounds} interleaved rounds",
        "",
        "| measurement | value |",
        "| --- | --- |",
    ]
    for section, values in results.items():
        for k, v in values.items():
            lines.append(f"| {section}.{k} | {v:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
