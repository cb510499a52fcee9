"""A PyTorch caching-allocator workload, made watchable.

    python3 torch_alloc_harness.py MODE [--steps N] [--sleep S] [--pool-fraction F] [--tag T]

Modes: cached, emptycache, nocache, expandable. So that a monitor's counts can be
compared exactly: it creates the CUDA context and a
"KV pool" tensor first (like an engine at start-up), prints "ready", waits for a
line on stdin (the monitor reads its own counters meanwhile), runs the loop, and
prints one JSON line with the deltas of PyTorch's own counters over exactly the
loop, and their totals since the process started: segment.all.allocated /
segment.all.freed are the cudaMalloc / cudaFree calls the caching allocator
made; reserved_bytes.all.current is what it holds from the device (cudaMalloc'd,
or with expandable segments cuMemCreate'd); "tensors" is how many tensors the
loop created (with caching disabled PyTorch keeps no statistics, and every
tensor is one cudaMalloc and one cudaFree).
"""

import argparse
import json
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["cached", "emptycache", "nocache", "expandable"])
p.add_argument("--steps", type=int, default=200)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--pool-fraction", type=float, default=0.15)
p.add_argument("--tag", default="")
p.add_argument("--rounds", type=int, default=1)
a = p.parse_args()

KEYS = (
    "segment.all.allocated",
    "segment.all.freed",
    "num_alloc_retries",
    "allocation.all.allocated",
    "reserved_bytes.all.current",
)
torch.cuda.init()
torch.empty(1, device="cuda")  # context
total = torch.cuda.get_device_properties(0).total_memory
pool = torch.empty(int(total * a.pool_fraction), dtype=torch.uint8, device="cuda")  # the "KV pool"
torch.cuda.synchronize()
before = torch.cuda.memory_stats()
print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
sizes = [(1 << 20) * (1 + (i * 7) % 23) for i in range(200)]


def loop() -> float:
    t0 = time.time()
    for step in range(a.steps):
        tensors = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes[step % 50 : step % 50 + 20]]
        del tensors
        if a.mode == "emptycache":
            torch.cuda.empty_cache()
        if a.sleep:
            time.sleep(a.sleep)
    torch.cuda.synchronize()
    return time.time() - t0


if a.rounds > 1:  # overhead measurement: the monitor attaches and detaches between rounds
    for r in range(a.rounds):
        sys.stdin.readline()
        print(json.dumps({"round": r, "seconds": round(loop(), 5)}), flush=True)
    sys.exit(0)
sys.stdin.readline()
seconds = loop()
after = torch.cuda.memory_stats()
delta = {k: after.get(k, 0) - before.get(k, 0) for k in KEYS}
absolute = {f"total.{k}": after.get(k, 0) for k in KEYS}
tensors = sum(len(sizes[s % 50 : s % 50 + 20]) for s in range(a.steps))
print(
    json.dumps(
        {
            "pid": os.getpid(),
            "mode": a.mode,
            "seconds": round(seconds, 4),
            "tensors": tensors,
            **delta,
            **absolute,
        }
    ),
    flush=True,
)
sys.stdin.readline()  # stay alive until the monitor has read its counters
