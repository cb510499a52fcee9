"""Does kvwatch see the synchronous cudaMemcpy vLLM's sleep mode makes (weights backed up to
pinned memory and restored)? The real-vLLM run counted none. This replays that call path
in isolation on the GPU: torch initialises CUDA, the library is found the way vLLM's
CudaRTLibrary finds it (first mapping named libcudart.*), a pinned tensor is allocated with
torch, then cudaMemcpy(kind=cudaMemcpyDefault) through ctypes — 23 times each way.

    .gpu-bundle/with-bcc python3 tests/gpu/memcpy_probe_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

N = 23
CHILD = textwrap.dedent(
    f"""
    import ctypes, json, sys, torch
    torch.cuda.init(); torch.zeros(1, device="cuda")
    maps = [l.split()[-1] for l in open("/proc/self/maps") if "libcudart" in l]
    path = next(p for p in maps if p.rsplit("/", 1)[-1].startswith(("libcudart.", "libcudart-")))
    rt = ctypes.CDLL(path)
    f = rt.cudaMemcpy
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    print(json.dumps({{"ready": True, "found": path, "libcudart_maps": sorted(set(maps))}}), flush=True)
    sys.stdin.readline()
    rcs = []
    for _ in range({N}):
        host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        rcs.append(f(host.data_ptr(), dev.data_ptr(), 64 << 20, 4))
        rcs.append(f(dev.data_ptr(), host.data_ptr(), 64 << 20, 4))
    torch.cuda.synchronize()
    print(json.dumps({{"rcs": sorted(set(rcs))}}), flush=True)
    sys.stdin.readline()
    """
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    child = subprocess.Popen(
        ["python3", "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdin and child.stdout
    first = json.loads(child.stdout.readline())
    from kvwatch.probes.cuda import CudaProbes

    p = CudaProbes()
    p.start()
    att = p.attach(child.pid)
    child.stdin.write("go\n")
    child.stdin.flush()
    second = json.loads(child.stdout.readline())
    p.poll(50)
    s = p.sample()
    c = s.processes.get(child.pid)
    out = {
        **first,
        **second,
        "attached_libraries": [lib.path for lib in att.libraries.values()],
        "symbols": {x.api: x.state.value for x in att.symbols if "Memcpy" in x.api},
        "counts": {k: [v.ok, v.err, v.bytes] for k, v in (c.apis.items() if c else [])},
        "nested": c.nested if c else None,
        "hits": {k: v for k, v in s.hits.items() if "Memcpy" in k or "HostAlloc" in k},
        "lost": s.lost,
    }
    child.stdin.write("bye\n")
    child.stdin.flush()
    child.wait(30)
    p.close()
    print(json.dumps(out, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memcpy_probe_check.json").write_text(json.dumps(out, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
