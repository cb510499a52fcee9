"""kvwatch's live self-cost meter against the benchmarks' side-by-side measurement, in one run
(root, real kernel, no GPU).

    sudo .venv/bin/python bench/bench_live_cost.py [--rounds 5] [--out FILE]

Each round runs the same two workloads with `kvwatch run` stopped, with a fresh one started
(`[self_cost] bpf_stats = true`, `budget = 0`: never shed), the page workload also with one whose
statistics are off (the default; what their accounting adds), and stopped again, so machine
noise and drift hit watched and unwatched alike:

1. CUDA path: bench/cuda_loop.c's cudaMalloc+cudaFree loop through the stub runtime, held open
   after its loop (so the daemon's next tick sees every call). Benchmark: ns per call watched
   (a discovery rule matches it) - unwatched (daemon stopped), as bench/bench_cuda.py computes
   it. Live, from the daemon's /metrics in the same round: the per-call cost estimate
   (kvwatch_uprobe_call_cost_seconds{family="cuda"}: canary + the family's mean BPF time per
   call), the canary's number (kvwatch_uprobe_canary_call_seconds), the BPF programs' own time
   per call of the API exercised (kvw_enter/return_cudaMalloc/cudaFree run_seconds over runs),
   and the process's estimated cost (kvwatch_uprobe_cost_seconds_total) against calls x the
   benchmark's per-call cost.
2. Page-free path: bench/munmap_loop.c (as bench/bench_memory.py). Benchmark: ns per page
   watched - off, as bench_memory's probe path computes it, by the loop's wall time and by its
   CPU time (user + sys: the probe runs in its context, waiting for the CPU does not count). Live:
   the kernel's run time per run of kvw_page_free over the round
   (kvwatch_probe_run_seconds_total / kvwatch_probe_runs_total).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_memory import ITERS, PAGES, run_workload
from bench_memory import build as build_munmap_loop

from kvwatch.daemon.lab.stublib import build as build_stub
from tests.support.daemon import DaemonProcess, wait_until

PAIRS = 200_000  # cudaMalloc+cudaFree pairs per run: 400,000 probed calls
TICK = 0.25
WORKLOAD_CPU = 1 if (os.cpu_count() or 1) > 1 else 0
DAEMON_CPU = 0
CUDA_APIS = ("cudaMalloc", "cudaFree")
PAGE_PROGRAM = "kvw_page_free"
PAGE_RUNS = 3  # munmap loop runs per phase

# cuda_loop.c's main, renamed at compile time, then held open after it printed its numbers until
# stdin closes: an exited process is no longer accounted, so its last tick's calls would be lost
HOLD_C = r"""
#include <stdio.h>
int kvw_cuda_loop_main(int, char **);
int main(int argc, char **argv) {
    char b[8];
    int rc = kvw_cuda_loop_main(argc, argv);
    fflush(stdout);
    if (!fgets(b, sizeof b, stdin)) return rc;
    return rc;
}
"""

Metrics = dict[str, list[tuple[dict[str, str], float]]]


def build_cuda_loop(tmp: Path) -> Path:
    obj, hold, exe = tmp / "cuda_loop.o", tmp / "hold.c", tmp / "live_cuda_loop"
    hold.write_text(HOLD_C)
    subprocess.run(
        ["gcc", "-O2", "-c", "-Dmain=kvw_cuda_loop_main", "-o", str(obj), str(HERE / "cuda_loop.c")], check=True
    )
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(hold), str(obj), "-ldl"], check=True)
    return exe


class HeldLoop:
    """bench_cuda's Loop, pinned to the workload CPU and kept alive after its loop until closed."""

    def __init__(self, exe: Path, lib: str, pairs: int) -> None:
        self.p = subprocess.Popen(
            ["taskset", "-c", str(WORKLOAD_CPU), str(exe), lib, str(pairs), "wait", "malloc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.15)

    def go(self) -> tuple[int, int]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        calls, ns = map(int, self.p.stdout.readline().split())
        return calls, ns

    def close(self) -> None:
        assert self.p.stdin
        self.p.stdin.close()
        self.p.wait(10)


def pin(pid: int, cpu: int) -> None:
    """Every thread of the daemon onto one CPU (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), {cpu})


def other_daemons() -> int:
    """kvwatch daemons running on this machine (called while ours is stopped: a CI run's, say)."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvwatch.daemon" in argv and b"run" in argv:
            n += 1
    return n


def config(cuda_exe: Path, pages_exe: Path, bpf_stats: bool = True) -> str:
    rules = ", ".join(f"{{ engine = \"bench\", cmdline = '^{re.escape(str(e))}' }}" for e in (cuda_exe, pages_exe))
    return (
        f"[daemon]\ntick_seconds = {TICK}\n"
        f"[discovery]\ninterval_seconds = {TICK}\nrules = [{rules}]\n"
        "[probes]\ncuda_rescan_seconds = 0.5\ntransfer = false\n"
        f"[self_cost]\nbpf_stats = {str(bpf_stats).lower()}\nbudget = 0\n"
    )


def start_daemon(tmp: Path, toml: str, bpf_stats: bool = True) -> DaemonProcess:
    d = DaemonProcess(tmp, toml)
    try:
        d.wait_ready()
        pin(d.proc.pid, DAEMON_CPU)
        wait_until(lambda: d.value("kvwatch_uprobe_canary_call_seconds") > 0, 60, "the canary timed")
        assert d.value("kvwatch_bpf_stats_enabled") == bpf_stats, f"BPF statistics not {'on' if bpf_stats else 'off'}"
    except BaseException:
        d.stop()
        sys.stderr.write(d.log.read_text()[-4000:])
        raise
    return d


def run_stats(m: Metrics, family: str, program: str) -> tuple[float, float]:
    v = DaemonProcess.value_in(m)
    return (
        v("kvwatch_probe_run_seconds_total", family=family, program=program),
        v("kvwatch_probe_runs_total", family=family, program=program),
    )


def page_run(exe: Path, watch: Callable[[int], None] | None = None) -> tuple[int, float, float]:
    """bench_memory's munmap loop once: (pages, wall ns per page, CPU ns per page). The CPU time
    (user + sys, from the reaped child's rusage) leaves out the time the loop waited for its CPU
    while other work ran on it; a page-free program runs in the loop's own context, so it is in."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    pages, ns, _pid = run_workload(exe, watch=watch, cpu=WORKLOAD_CPU)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e9
    return pages, ns / pages, cpu / pages


def pages_watched(d: DaemonProcess, exe: Path) -> dict[str, float]:
    """The munmap loop watched, PAGE_RUNS times; the kernel's run time of kvw_page_free over them."""
    before: list[tuple[float, float]] = []

    def watch(pid: int) -> None:
        wait_until(
            lambda: any(lab.get("pid") == str(pid) for lab, _ in d.metrics().get("kvwatch_page_free_pages_total", [])),
            10,
            "the page workload watched",
            0.02,
        )
        if not before:
            before.append(run_stats(d.metrics(), "memory", PAGE_PROGRAM))

    per_page, cpu_per_page, pages = [], [], 0
    for _ in range(PAGE_RUNS):
        n, wall, cpu = page_run(exe, watch)
        per_page.append(wall)
        cpu_per_page.append(cpu)
        pages += n
    time.sleep(4 * TICK)  # the daemon reads the statistics once a tick
    s1, r1 = run_stats(d.metrics(), "memory", PAGE_PROGRAM)
    s0, r0 = before[0]
    return {
        "ns_per_page": statistics.median(per_page),
        "cpu_ns_per_page": statistics.median(cpu_per_page),
        "pages": pages / PAGE_RUNS,
        "live_ns_per_run": (s1 - s0) * 1e9 / max(r1 - r0, 1),
        "share": min(pages / max(r1 - r0, 1), 1.0),
    }


def cuda_watched(d: DaemonProcess, exe: Path, lib: str) -> dict[str, float]:
    loop = HeldLoop(exe, lib, PAIRS)
    pid = str(loop.p.pid)
    try:

        def attached() -> float:
            return d.value("kvwatch_cuda_probes_attached", pid=pid)

        def loop_apis_attached() -> bool:  # the only CUDA process this daemon watches
            m = DaemonProcess.value_in(d.metrics())
            return all(m("kvwatch_probe_attached", family="cuda", probe=a, state="attached") == 1 for a in CUDA_APIS)

        # the probes attach one symbol after another (the driver's, then the runtime's)
        wait_until(loop_apis_attached, 60, "cudaMalloc and cudaFree probed")
        d.settled(attached, ticks=4, timeout=60)
        m0 = d.metrics()
        calls, ns = loop.go()

        def cost() -> float:
            return d.value("kvwatch_uprobe_cost_seconds_total", pid=pid, family="cuda")

        d.settled(cost, ticks=4, timeout=30)  # held open: every call accounted once it stops moving
        m1 = d.metrics()
    finally:
        loop.close()
    v0, v1 = DaemonProcess.value_in(m0), DaemonProcess.value_in(m1)
    prog_ns = prog_runs = 0.0
    for api in CUDA_APIS:
        for kind in ("enter", "return"):
            s0, _ = run_stats(m0, "cuda", f"kvw_{kind}_{api}")
            s1, _ = run_stats(m1, "cuda", f"kvw_{kind}_{api}")
            prog_ns += (s1 - s0) * 1e9
        prog_runs += run_stats(m1, "cuda", f"kvw_enter_{api}")[1] - run_stats(m0, "cuda", f"kvw_enter_{api}")[1]
    return {
        "ns_per_call": ns / calls,
        "calls": calls,
        "trapped": prog_runs,
        "live_call_ns": v1("kvwatch_uprobe_call_cost_seconds", family="cuda") * 1e9,
        "canary_ns": v1("kvwatch_uprobe_canary_call_seconds") * 1e9,
        "bpf_ns_per_call": prog_ns / max(prog_runs, 1),
        "live_cost_s": v1("kvwatch_uprobe_cost_seconds_total", pid=pid, family="cuda")
        - v0("kvwatch_uprobe_cost_seconds_total", pid=pid, family="cuda"),
    }


def cuda_unwatched(exe: Path, lib: str) -> float:
    loop = HeldLoop(exe, lib, PAIRS)
    try:
        calls, ns = loop.go()
    finally:
        loop.close()
    return ns / calls


def measure(tmp: Path, rounds: int) -> tuple[list[dict[str, float]], int, list[float]]:
    cuda_exe = build_cuda_loop(tmp)
    pages_exe = build_munmap_loop(tmp)
    lib = str(build_stub(tmp / "stub"))
    toml = config(cuda_exe, pages_exe)
    toml_no_stats = config(cuda_exe, pages_exe, bpf_stats=False)
    out: list[dict[str, float]] = []
    beside = 0
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        row: dict[str, float] = {}
        off_pages: list[float] = []
        off_cpu: list[float] = []
        off_cuda: list[float] = []

        def off(
            off_pages: list[float] = off_pages, off_cpu: list[float] = off_cpu, off_cuda: list[float] = off_cuda
        ) -> None:
            for _ in range(PAGE_RUNS):
                _n, wall, cpu = page_run(pages_exe)
                off_pages.append(wall)
                off_cpu.append(cpu)
                off_cuda.append(cuda_unwatched(cuda_exe, lib))

        def on(row: dict[str, float] = row) -> None:
            d = start_daemon(tmp, toml)
            try:
                p = pages_watched(d, pages_exe)
                for _ in range(3):
                    c = cuda_watched(d, cuda_exe, lib)
                    if c["trapped"] == c["calls"]:
                        break
                    print(f"  CUDA loop: {c['trapped']:.0f} of {c['calls']} calls trapped, run again", flush=True)
                else:
                    raise AssertionError("the CUDA loop's calls were not all trapped in 3 runs")
            finally:
                d.stop()
            row.update({f"pages_{k}": v for k, v in p.items()})
            row.update({f"cuda_{k}": v for k, v in c.items()})

        seen = other_daemons() > 0

        def on_no_stats(row: dict[str, float] = row) -> None:
            """The page workload watched with the BPF statistics off (kvwatch's default): what their
            own accounting adds to each run."""
            d = start_daemon(tmp, toml_no_stats, bpf_stats=False)
            try:
                p = pages_watched(d, pages_exe)
            finally:
                d.stop()
            row["pages_no_stats_ns_per_page"] = p["ns_per_page"]
            row["pages_no_stats_cpu_ns_per_page"] = p["cpu_ns_per_page"]

        # off on both sides of the watched phases, whose order alternates: drift hits all alike
        watched = (on, on_no_stats) if r % 2 == 0 else (on_no_stats, on)
        for phase in (off, *watched, off):
            phase()
            seen = seen or other_daemons() > 0
            loads.append(os.getloadavg()[0])
        beside += seen
        row["pages_off_ns"] = statistics.median(off_pages)
        row["pages_off_cpu_ns"] = statistics.median(off_cpu)
        row["cuda_off_ns"] = statistics.median(off_cuda)
        out.append(row)
        print(
            f"round {r + 1}: CUDA {row['cuda_ns_per_call'] - row['cuda_off_ns']:.0f} ns/call measured, "
            f"{row['cuda_live_call_ns']:.0f} live; page-free {row['pages_ns_per_page'] - row['pages_off_ns']:.1f} "
            f"ns/event measured ({row['pages_cpu_ns_per_page'] - row['pages_off_cpu_ns']:.1f} by CPU time), "
            f"{row['pages_live_ns_per_run']:.1f} live",
            flush=True,
        )
    return out, beside, loads


def med(rows: list[dict[str, float]], key: str | Callable[[dict[str, float]], float]) -> float:
    return statistics.median(key(r) if callable(key) else r[key] for r in rows)


def render(rows: list[dict[str, float]], beside: int, loads: list[float]) -> str:
    n = len(rows)
    calls = int(rows[0]["cuda_calls"])
    # the benchmarks' way: median watched - median unwatched
    cuda_bench = med(rows, "cuda_ns_per_call") - med(rows, "cuda_off_ns")
    cuda_live, canary, bpf = (
        med(rows, "cuda_live_call_ns"),
        med(rows, "cuda_canary_ns"),
        med(rows, "cuda_bpf_ns_per_call"),
    )
    cost_bench_ms = calls * cuda_bench / 1e6
    cost_live_ms = med(rows, "cuda_live_cost_s") * 1e3
    page_bench = med(rows, "pages_ns_per_page") - med(rows, "pages_off_ns")
    page_bench_cpu = med(rows, "pages_cpu_ns_per_page") - med(rows, "pages_off_cpu_ns")
    page_no_stats = med(rows, "pages_no_stats_ns_per_page") - med(rows, "pages_off_ns")
    page_no_stats_cpu = med(rows, "pages_no_stats_cpu_ns_per_page") - med(rows, "pages_off_cpu_ns")
    page_live = med(rows, "pages_live_ns_per_run")
    share = 100 * med(rows, "pages_share")

    def ratio(live: float, bench: float) -> str:
        return f"{live / bench:.2f}" if bench > 0 else "n/a (benchmark ≤ 0)"

    lines = [
        f"# kvwatch self-cost, measured live vs measured in the benchmark — {time.strftime('%Y-%m-%d %H:%M')} — "
        f"kernel {platform.release()}, {os.cpu_count()} CPUs",
        f"medians of {n} interleaved rounds, each: the workloads with kvwatch stopped, with a fresh `kvwatch run` "
        "(`[self_cost] bpf_stats = true`, `budget = 0`), the munmap loop also with one with `bpf_stats = false` "
        "(the two in alternating order), stopped again; the munmap loop "
        f"({PAGES} pages x {ITERS}) {PAGE_RUNS} times per phase; workloads pinned to CPU "
        f"{WORKLOAD_CPU}, the daemon to CPU {DAEMON_CPU}; 1-minute load average {min(loads):.2f}-{max(loads):.2f} "
        f"(this benchmark's own workload adds ~1); another kvwatch daemon (not this benchmark's) was running in "
        f"{beside} of {n} rounds",
        "",
        "| measurement | benchmark (watched - unwatched) | live (CUDA: canary + BPF programs; page-free: BPF run "
        "time) | live / benchmark | canary (traps + minimal program) | BPF programs |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| CUDA call, one uprobe pair (stub cudaMalloc+cudaFree, {calls:,} calls), ns per call | {cuda_bench:.0f} | "
        f"{cuda_live:.0f} | {ratio(cuda_live, cuda_bench)} | {canary:.0f} | {bpf:.0f} |",
        f"| CUDA process cost of that loop (kvwatch_uprobe_cost_seconds_total vs calls x benchmark), ms | "
        f"{cost_bench_ms:.1f} | {cost_live_ms:.1f} | {ratio(cost_live_ms, cost_bench_ms)} | — | — |",
        f"| page-free event ({PAGE_PROGRAM}, {int(rows[0]['pages_pages']):,} pages a run), ns per event (live: per run) | "
        f"{page_bench:.1f} | {page_live:.1f} | {ratio(page_live, page_bench)} | — | {page_live:.1f} |",
        f"| page-free event, the benchmark by the loop's CPU time instead of wall time, ns per event | "
        f"{page_bench_cpu:.1f} | {page_live:.1f} | {ratio(page_live, page_bench_cpu)} | — | {page_live:.1f} |",
        f"| page-free event, the benchmark with the BPF statistics off (kvwatch's default), ns per event "
        f"(by CPU time: {page_no_stats_cpu:.1f}) | {page_no_stats:.1f} | — | — | — | — |",
        "",
        "Per round (ns):",
        "",
        "| round | CUDA unwatched per call | CUDA watched - unwatched | CUDA live estimate | canary | BPF per call "
        "| calls trapped | page off per page | page watched - off | same, CPU time | same, statistics off "
        "| kvw_page_free per run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['cuda_off_ns']:.1f} | {r['cuda_ns_per_call'] - r['cuda_off_ns']:.0f} | "
            f"{r['cuda_live_call_ns']:.0f} | {r['cuda_canary_ns']:.0f} | {r['cuda_bpf_ns_per_call']:.0f} | "
            f"{int(r['cuda_trapped']):,} of {int(r['cuda_calls']):,} | {r['pages_off_ns']:.1f} | "
            f"{r['pages_ns_per_page'] - r['pages_off_ns']:.1f} | "
            f"{r['pages_cpu_ns_per_page'] - r['pages_off_cpu_ns']:.1f} | "
            f"{r['pages_no_stats_ns_per_page'] - r['pages_off_ns']:.1f} | {r['pages_live_ns_per_run']:.1f} |"
        )
    lines += [
        "",
        "What each number includes:",
        "",
        "* benchmark, CUDA: the loop's wall time per call watched minus unwatched (daemon stopped), same binary, "
        "same round: everything a probed call costs its caller — the entry trap and the return trampoline, the "
        "uprobe dispatch, both BPF programs, and the kernel's BPF statistics' own accounting (on while watched).",
        '* live, CUDA: `kvwatch_uprobe_call_cost_seconds{family="cuda"}` = the canary\'s traps (the canary less its '
        "own two minimal programs) + the family's mean BPF program time per call (entry + return run). The canary "
        "is timed once at daemon start in kvwatch's own "
        "process (libc `basename` through ctypes, probed - plain): the two traps and a minimal program, under "
        "whatever load the machine had in that second. The BPF column is the kernel's run time over runs of "
        "kvw_enter/return_cudaMalloc and _cudaFree in the round, per call: the program bodies only, not the trap "
        "or the dispatch.",
        "* process cost: `kvwatch_uprobe_cost_seconds_total{family=\"cuda\"}` for the loop's process (each tick's "
        "probed calls x the per-call estimate of that tick) against calls x the benchmark's per-call cost; the "
        "process is held open after its loop so the daemon's last tick counts every call.",
        "* benchmark, page-free: the munmap loop's time per page watched minus off (no kvwatch loaded), as "
        "bench_memory.py computes it: the tracepoint dispatch, the program, the BPF statistics' accounting, and "
        "whatever the running daemon takes from the machine. The CPU-time row takes the loop's user + sys time "
        "(its reaped rusage) instead of its wall time: the probe runs in the loop's context so it is counted, "
        "while time spent waiting for the CPU behind other work is not. The statistics-off row is the same "
        "workload watched by a daemon with `bpf_stats = false` in the same round: the difference from the "
        "statistics-on row is what the kernel's run-time accounting itself adds to every run.",
        "* live, page-free: `kvwatch_probe_run_seconds_total / kvwatch_probe_runs_total` of kvw_page_free over "
        "the round: the program body only, without the tracepoint dispatch or the BPF statistics' own "
        "accounting (both in the benchmark), averaged over every page freed on "
        f"the node in that window (the workload's pages were {share:.0f} % of the runs; the rest, other "
        "processes', take the cheaper unwatched path).",
    ]

    def spread(f: Callable[[dict[str, float]], float]) -> str:
        v = [f(r) for r in rows]
        return f"{min(v):.0f} to {max(v):.0f}"

    lines.append(
        "* Spread between rounds: CUDA benchmark "
        f"{spread(lambda r: r['cuda_ns_per_call'] - r['cuda_off_ns'])} ns per call, live estimate "
        f"{spread(lambda r: r['cuda_live_call_ns'])}; page-free benchmark "
        f"{spread(lambda r: r['pages_ns_per_page'] - r['pages_off_ns'])} ns per event (statistics off: "
        f"{spread(lambda r: r['pages_no_stats_ns_per_page'] - r['pages_off_ns'])}), live "
        f"{spread(lambda r: r['pages_live_ns_per_run'])} ns per run. A page-free event is a few percent of the "
        f"loop's {med(rows, 'pages_off_ns'):.0f} ns per page, and the loop's own time moves by about as much from "
        "run to run, so the page-free benchmark numbers are the least certain here."
    )
    if beside or max(loads) > 1.5:
        lines.append(
            f"* Noise: the machine was not quiet (load average up to {max(loads):.2f}; another kvwatch daemon, "
            f"a test run's, in {beside} of {n} rounds, whose page-free program then runs on every page free "
            'in "off" and "watched" alike, and whose BPF statistics may be on in "off").'
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "live_cost.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    if shutil.which("gcc") is None or shutil.which("taskset") is None:
        sys.exit("needs gcc and taskset (apt install gcc util-linux)")
    with tempfile.TemporaryDirectory() as t:
        rows, beside, loads = measure(Path(t), args.rounds)
    text = render(rows, beside, loads)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
