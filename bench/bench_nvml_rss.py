"""What NVML costs a process in resident memory and time, held open or opened per query.

Run on a machine with an NVIDIA driver (``python3 bench/bench_nvml_rss.py [QUERIES]``). Each mode
runs in a fresh child process with the daemon's allocator settings (``daemon/host/allocator.py``):

* ``held``: ``nvmlInit`` once, then QUERIES process-memory queries (what the daemon did);
* ``cycle``: for each query ``nvmlInit``, the query, ``nvmlShutdown``;
* ``held-a1``: ``held`` with one malloc arena for all threads.

Prints, per mode, the RSS by kind of mapping before NVML, at its largest and at the end, the
threads, and the time per query. pynvml comes from the nvidia-ml-py package, or its wheel in
``.whl/`` (a zip is importable as it is).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

QUERIES = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 50


def _kinds() -> dict[str, float]:
    out: dict[str, float] = {}
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                kind = "dev" if name.startswith("/dev/") else ("file" if name.startswith("/") else name)
                out[kind] = out.get(kind, 0.0) + int(line.split()[1]) / 1024
    out["rss"] = sum(v for k, v in out.items())
    with open("/proc/self/status") as f:
        out["threads"] = float(next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:")))
    return {k: round(v, 1) for k, v in out.items() if v >= 0.1}


def _anon_maps() -> list[str]:
    """Anonymous mappings with at least 512 KiB resident: 'size/rss KiB' with their range."""
    out, head = [], ""
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                head = parts[0] if len(parts) <= 5 else ""
            elif line.startswith("Rss:") and head:
                kb = int(line.split()[1])
                lo, hi = (int(x, 16) for x in head.split("-"))
                if kb >= 512:
                    out.append(f"{head} {(hi - lo) >> 10}/{kb} KiB")
    return out


def _tune(arenas: int) -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    for param, value in ((-8, arenas), (-3, 128 << 10), (-1, 4 << 20)):  # the daemon's mallopt settings
        libc.mallopt(param, value)


def child(mode: str) -> None:
    _tune(1 if mode.endswith("-a1") else 2)
    mode = mode.removesuffix("-a1")
    for whl in (Path(__file__).parent.parent / ".whl").glob("nvidia_ml_py-*.whl"):
        sys.path.append(str(whl))
    import pynvml

    report: dict[str, object] = {"mode": mode, "before": _kinds()}
    before_maps = _anon_maps()
    peak: dict[str, float] = {}
    took: list[float] = []

    def query() -> int:
        n = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            n += len(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
            n += len(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h))
        return n

    if mode == "held":
        t = time.perf_counter()
        pynvml.nvmlInit()
        report["init_s"] = round(time.perf_counter() - t, 4)
    for _ in range(QUERIES):
        t = time.perf_counter()
        if mode == "cycle":
            pynvml.nvmlInit()
        query()
        if mode == "cycle":
            now = _kinds()  # inside the cycle: what it holds while open
            pynvml.nvmlShutdown()
        took.append(time.perf_counter() - t)
        if mode == "held":
            now = _kinds()
        if now["rss"] > peak.get("rss", 0):
            peak = now
        time.sleep(0.02)
    report["peak"] = peak
    report["end"] = _kinds()
    report["grown"] = [m for m in _anon_maps() if m not in before_maps][:8]
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    report["after_trim"] = _kinds()
    took.sort()
    report["query_ms"] = {"median": round(took[len(took) // 2] * 1e3, 2), "max": round(took[-1] * 1e3, 2)}
    print(json.dumps(report), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[2].removesuffix("-a1") in ("held", "cycle"):
        child(sys.argv[2])
        return
    for mode in ("held", "cycle", "held-a1"):
        out = subprocess.run(
            [sys.executable, __file__, str(QUERIES), mode], check=False, capture_output=True, text=True
        )
        print(out.stdout.strip() or out.stderr.strip()[-2000:], flush=True)


if __name__ == "__main__":
    main()
