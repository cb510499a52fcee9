"""The whole daemon's CPU and RSS at idle and under load, side by side in one run.

    sudo .venv/bin/python bench/bench_daemon_load.py --out bench/results/daemon_load.md

`kvwatch run` (default config plus a rule for the workload) watches a C program that
releases pages at a steady 10k, 100k and 1M pages/s (kmem:mm_page_free events of a
watched process), and, separately, a process making CUDA allocation calls through the
stub runtime at ~10k calls/s (uprobe pairs, ledger updates). CPU is the scheduler's
runtime of every daemon thread (/proc/PID/task/*/schedstat), not tick-sampled times.
Page events are counted in the kernel, so the daemon's own cost barely moves with their
rate: that is the design, and this measures it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.daemon import DaemonProcess, wait_until

HERE = Path(__file__).resolve().parent
CONFIG = r"""
[discovery]
interval_seconds = 1
rules = [{ engine = "bench", cmdline = '(paced_pages|kvwatch\.daemon\.lab\.workloads\s+cuda)\b' }]
"""


def runtime_s(pid: int) -> float:
    return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(d: DaemonProcess, seconds: float) -> tuple[float, float]:
    r0, t0 = runtime_s(d.proc.pid), time.monotonic()
    time.sleep(seconds)
    return 100 * (runtime_s(d.proc.pid) - r0) / (time.monotonic() - t0), rss_mib(d.proc.pid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "daemon_load.md")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvwatch-bench-"))
    exe = tmp / "paced_pages"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(HERE / "paced_pages.c")], check=True)
    stub = tmp / "stub"
    stub.mkdir()
    from kvwatch.daemon.lab.stublib import build

    build(stub)
    rows: list[tuple[str, float, float, str]] = []
    d = DaemonProcess(tmp, CONFIG)
    try:
        d.wait_ready()
        time.sleep(5)  # start-up done, compiler memory returned
        cpu, rss = measure(d, args.seconds)
        rows.append(("idle (nothing watched)", cpu, rss, ""))
        for rate in (10_000, 100_000, 1_000_000):
            w = subprocess.Popen([str(exe), str(rate), str(args.seconds + 8)], stdout=subprocess.PIPE, text=True)
            wait_until(lambda w=w: d.value("kvwatch_page_free_pages_total", pid=str(w.pid)) > 0, 10, "watched")
            time.sleep(1)
            before = d.value("kvwatch_page_free_pages_total", pid=str(w.pid))
            t0 = time.monotonic()
            cpu, rss = measure(d, args.seconds)
            got = (d.value("kvwatch_page_free_pages_total", pid=str(w.pid)) - before) / (time.monotonic() - t0)
            w.wait()
            rows.append((f"{rate:,} page events/s (watched process)", cpu, rss, f"{got:,.0f} counted/s"))
        w2 = subprocess.Popen(
            [sys.executable, "-m", "kvwatch.daemon.lab.workloads", "cuda", "--lib-dir", str(stub), "--prealloc", "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert w2.stdin and w2.stdout
        w2.stdout.readline()
        wait_until(lambda: d.value("kvwatch_cuda_probes_attached", pid=str(w2.pid)) > 0, 15, "cuda attached")
        w2.stdin.write(f"uncached 5000 {args.seconds + 6}\n")
        w2.stdin.flush()
        time.sleep(2)
        before = d.value("kvwatch_cuda_alloc_calls_total", pid=str(w2.pid)) + d.value(
            "kvwatch_cuda_free_calls_total", pid=str(w2.pid)
        )
        t0 = time.monotonic()
        cpu, rss = measure(d, args.seconds)
        after = d.value("kvwatch_cuda_alloc_calls_total", pid=str(w2.pid)) + d.value(
            "kvwatch_cuda_free_calls_total", pid=str(w2.pid)
        )
        rows.append(
            (
                "CUDA alloc/free calls (uprobe pairs)",
                cpu,
                rss,
                f"{(after - before) / (time.monotonic() - t0):,.0f} calls/s",
            )
        )
        w2.kill()
        w2.wait()
    finally:
        d.stop()
    lines = [
        f"# kvwatch daemon under load — {time.strftime('%Y-%m-%d %H:%M')} — {args.seconds:g} s per row",
        "",
        "| load | daemon CPU (% of a core) | daemon RSS (MiB) | note |",
        "| --- | --- | --- | --- |",
        *(f"| {name} | {cpu:.2f} | {rss:.1f} | {note} |" for name, cpu, rss, note in rows),
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
