"""A no-GPU stand-in for torch_alloc_harness.py (same protocol and JSON), driving the stub
CUDA runtime, so validate_cuda.py's orchestration can be checked without a GPU."""

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["cached", "emptycache", "nocache", "expandable"])
p.add_argument("--stub", required=True)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--tag", default="")
a = p.parse_args()

rt = ctypes.CDLL(str(Path(a.stub) / "libcudart.so.12"))
drv = ctypes.CDLL(str(Path(a.stub) / "libcuda.so.1"))
counts = {
    "segment.all.allocated": 0,
    "segment.all.freed": 0,
    "num_alloc_retries": 0,
    "allocation.all.allocated": 0,
    "reserved_bytes.all.current": 0,
}


def malloc(size: int) -> int:
    ptr = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) == 0
    return int(ptr.value or 0)


cache = [malloc(20 << 20) for _ in range(4)]
print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
sys.stdin.readline()
t0 = time.time()
for step in range(a.steps):
    if a.mode in ("emptycache", "nocache"):
        ptrs = [malloc((1 + step % 20) << 20) for _ in range(15 if a.mode == "emptycache" else 20)]
        counts["segment.all.allocated"] += len(ptrs)
        for q in ptrs:
            rt.cudaFree(ctypes.c_void_p(q))
        counts["segment.all.freed"] += len(ptrs)
    elif a.mode == "expandable" and step % 10 == 0:
        h = ctypes.c_uint64()
        drv.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(2 << 20), None, ctypes.c_ulonglong(0))
    if a.sleep:
        time.sleep(a.sleep)
total = {f"total.{k}": v + (4 if k == "segment.all.allocated" else 0) for k, v in counts.items()}
if a.mode == "nocache":
    counts["segment.all.allocated"] = counts["segment.all.freed"] = 0  # like PyTorch: no statistics uncached
print(
    json.dumps(
        {
            "pid": os.getpid(),
            "mode": a.mode,
            "seconds": round(time.time() - t0, 4),
            "tensors": 20 * a.steps,
            **counts,
            **total,
        }
    ),
    flush=True,
)
sys.stdin.readline()
