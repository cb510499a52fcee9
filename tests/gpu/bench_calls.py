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

from kvwatch.probes.cuda import CUDA_APIS, CudaProbes
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
    rt, drv = libraries_of_torch()
    report: dict[str, object] = {"runtime": rt, "driver": drv, "prologues": {}}
    for path in (rt, drv):
        t = read_symbols(path)
        for api in CUDA_APIS:
            if (api.lib == "cudart") == (path == rt) and t.address(api.symbol) is not None:
                report["prologues"][f"{Path(path).name}:{api.symbol}"] = t.entry_bytes.get(
                    api.symbol, b""
                ).hex()  # type: ignore[index]
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
        probes = CudaProbes()
        probes.start()
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}

        def run(attach: bool) -> float:
            p = subprocess.Popen(
                [str(exe), rt, "20000", "wait"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            time.sleep(0.3)
            if attach:
                probes.attach(p.pid)
            p.stdin.write("go\n")
            p.stdin.flush()
            calls, ns = map(int, p.stdout.read().split())
            p.wait()
            if attach:
                c = probes.sample().processes.get(p.pid)
                report.setdefault("counted", []).append(
                    c.apis["cudaMalloc"].ok if c and "cudaMalloc" in c.apis else 0
                )  # type: ignore[union-attr]
                probes.detach(p.pid)
            return ns / calls

        off, on = [], []
        for _ in range(5):
            off.append(run(False))
            on.append(run(True))
        probes.close()
        report["bench"] = {
            "ns_per_call_unwatched": off,
            "ns_per_call_watched": on,
            "median_overhead_ns_per_call": statistics.median(on) - statistics.median(off),
            "median_unwatched_ns": statistics.median(off),
        }
    (out / "cuda_calls.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
