"""CUDA probe cost per call, measured side by side in one run (root, real kernel, no GPU).

    sudo .venv/bin/python bench/bench_cuda.py [--rounds 5] [--out FILE]

A C loop (bench/cuda_loop.c) calls the runtime through the stub libraries (every call
succeeds, ~4 ns unprobed) and through the real libcudart.so.12 (calls fail fast without
a GPU). Modes, interleaved by round: unwatched; watched with cuda_driver_api=auto (one
probe pair per runtime call); watched with =all (the driver beneath probed too); and an
unwatched process calling the same library while another process is watched (pid=
filtering: it must pay nothing). Cost per call = watched - unwatched. Batched copies
(cuMemcpyBatchAsync, vLLM's KV offload path) are timed per call for 1, 912 and 29,184
copies: the probe reads the whole sizes array.
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

from kvwatch.daemon.lab.stublib import build
from kvwatch.probes.cuda import CudaProbeOptions, CudaProbes


def real_cudart() -> str | None:
    try:
        import nvidia.cuda_runtime

        lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib" / "libcudart.so.12"
        return str(lib) if lib.exists() else None
    except ImportError:
        return None


class Loop:
    def __init__(self, exe: Path, lib: str, n: int, mode: str) -> None:
        self.p = subprocess.Popen(
            [str(exe), lib, str(n), "wait", mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.15)

    def go(self) -> float:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        calls, ns = map(int, self.p.stdout.read().split())
        self.p.wait()
        return ns / calls


def measure(exe: Path, lib: str, mode: str, rounds: int) -> dict[str, float]:
    n = 200_000 if mode == "free0" else 100_000
    if mode.startswith("batch:"):  # a call per KV transfer: fewer, and the larger, the fewer
        n = max(200, 2_000_000 // max(int(mode[6:]), 1))
    auto = CudaProbes(CudaProbeOptions(driver_api="auto"))
    full = CudaProbes(CudaProbeOptions(driver_api="all"))
    auto.start()
    full.start()
    res: dict[str, list[float]] = {"off": [], "auto": [], "all": [], "bystander": []}
    try:
        for _ in range(rounds):
            res["off"].append(Loop(exe, lib, n, mode).go())
            for name, probes in (("auto", auto), ("all", full)):
                loop = Loop(exe, lib, n, mode)
                probes.attach(loop.p.pid)
                res[name].append(loop.go())
                probes.detach(loop.p.pid)
                probes.settle()  # really gone before timing
            # a process using the same library while another one is watched
            watched = Loop(exe, lib, 1, mode)
            auto.attach(watched.p.pid)
            res["bystander"].append(Loop(exe, lib, n, mode).go())
            watched.go()
            auto.detach(watched.p.pid)
            auto.settle()  # really gone before timing
    finally:
        auto.close()
        full.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "ns_per_call_unprobed": med["off"],
        "overhead_ns_auto": med["auto"] - med["off"],
        "overhead_ns_all": med["all"] - med["off"],
        "overhead_ns_unwatched_bystander": med["bystander"] - med["off"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        exe = tmp / "cuda_loop"
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(HERE / "cuda_loop.c"), "-ldl"], check=True)
        stub = str(build(tmp / "stub"))
        rows = {
            "stub cudaFree(NULL)": measure(exe, stub, "free0", args.rounds),
            "stub cudaMalloc+cudaFree": measure(exe, stub, "malloc", args.rounds),
        }
        # vLLM's KV offload: one cuMemcpyBatchAsync per transfer job; the tiny model on the H200
        # sent 912 entries (57 blocks x 16 layers) per prompt, up to ~29k in a pressure step
        for entries in (1, 912, 29_184):
            rows[f"stub cuMemcpyBatchAsync, {entries:,} copies"] = measure(exe, stub, f"batch:{entries}", args.rounds)
        real = real_cudart()
        if real:
            rows["real libcudart.so.12, error path (no GPU)"] = measure(exe, real, "malloc", args.rounds)
    lines = [
        f"# kvwatch CUDA probe cost — {time.strftime('%Y-%m-%d %H:%M')} — kernel {platform.release()}, {os.cpu_count()} CPUs",
        f"medians of {args.rounds} interleaved rounds; ns per runtime call",
        "",
        "| call | unprobed | + auto (one pair) | + all (driver beneath too) | unwatched process, same library |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['ns_per_call_unprobed']:.0f} | {r['overhead_ns_auto']:.0f} | {r['overhead_ns_all']:.0f} | "
            f"{r['overhead_ns_unwatched_bystander']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
