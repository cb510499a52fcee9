"""Per-call cost of the CUDA probes on the GPU machine's real libraries (run as root under bcc).

Compiles bench/cuda_loop.c, runs it against the machine's libcudart (cudaMalloc 2 MiB +
cudaFree, on the GPU) unwatched and with kvwatch's CUDA probes attached to it, rounds
interleaved; and reports the first bytes of each probed function in the runtime and
driver (endbr64 is skipped; other non-emulated first instructions are single-stepped).
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvwatch.probes.cuda import CUDA_APIS, CudaProbeOptions, CudaProbes
from kvwatch.probes.libs import CUDART, LIBCUDA, matching, read_maps, read_symbols

ROOT = Path(__file__).resolve().parents[2]


def libraries_of_torch() -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, sys; torch.empty(1, device='cuda'); print('up', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    p.stdout.readline()
    libs = read_maps(p.pid)
    rt = matching(libs, CUDART)[0].path
    drv = matching(libs, LIBCUDA)[0].path
    p.stdin.write("\n")
    p.stdin.close()
    p.wait()
    return rt, drv


def main() -> None:
    out = Path(sys.argv[1])
    # a runtime given on the command line (the stub, for a dry run) or the one torch loads
    rt, drv = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else libraries_of_torch()
    report: dict[str, object] = {"runtime": rt, "driver": drv, "prologues": {}}
    for path in (rt, drv):
        t = read_symbols(path)
        for api in CUDA_APIS:
            if (api.lib == "cudart") == (path == rt) and t.address(api.symbol) is not None:
                report["prologues"][f"{Path(path).name}:{api.symbol}"] = t.entry_bytes.get(api.symbol, b"").hex()  # type: ignore[index]
    exe = Path("/tmp/cuda_loop")
    cc = subprocess.run(
        ["gcc", "-O2", "-o", str(exe), str(ROOT / "bench" / "cuda_loop.c"), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    if cc.returncode != 0:
        report["bench"] = f"gcc failed: {cc.stderr[-500:]}"
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
        for driver_api in ("auto", "all"):
            probes = CudaProbes(CudaProbeOptions(driver_api=driver_api))
            probes.start()

            def run(attach: bool, mode: str, probes: CudaProbes = probes, driver_api: str = driver_api) -> float:
                n = "200000" if mode == "free0" else "20000"
                p = subprocess.Popen(
                    [str(exe), rt, n, "wait", mode],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                assert p.stdin is not None and p.stdout is not None
                time.sleep(0.3)
                if attach:
                    probes.attach(p.pid)
                p.stdin.write("go\n")
                p.stdin.flush()
                calls, ns = map(int, p.stdout.read().split())
                p.wait()
                if attach:
                    c = probes.sample().processes.get(p.pid)
                    api = "cudaFree" if mode == "free0" else "cudaMalloc"
                    counted = c.apis[api].ok if c is not None and api in c.apis else 0
                    report.setdefault(f"counted_{driver_api}_{mode}", []).append(counted)  # type: ignore[union-attr]
                    probes.detach(p.pid)
                    probes.settle()  # really gone before timing
                return ns / calls

            for mode in ("free0", "malloc"):
                off, on = [], []
                for _ in range(5):
                    off.append(run(False, mode))
                    on.append(run(True, mode))
                report[f"bench_{driver_api}_{mode}"] = {
                    "ns_per_call_unwatched": off,
                    "ns_per_call_watched": on,
                    "median_overhead_ns_per_call": statistics.median(on) - statistics.median(off),
                    "min_overhead_ns_per_call": min(on) - min(off),
                    "median_unwatched_ns": statistics.median(off),
                }
            probes.close()
    (out / "cuda_calls.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
