"""The probe cost of one NCCL call, isolated from the GPU: ncclSend/ncclRecv with no
communicator return ncclInvalidArgument at once; time them with kvwatch's transfer
probes attached to this very process vs detached, rounds alternating.

    .gpu-bundle/with-bcc python3 tests/gpu/nccl_call_cost.py LIBNCCL [OUT_DIR]
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

from kvwatch.probes.transfer import TransferProbes

lib = ctypes.CDLL(sys.argv[1])
vp, sz = ctypes.c_void_p, ctypes.c_size_t
for name in ("ncclSend", "ncclRecv"):
    getattr(lib, name).argtypes = (vp, sz, ctypes.c_int, ctypes.c_int, vp, vp)
N = 20000


def loop() -> float:
    t0 = time.perf_counter()
    for _ in range(N):
        lib.ncclSend(None, 1024, 6, 0, None, None)
    return (time.perf_counter() - t0) / N * 1e9


probes = TransferProbes()
probes.start()
off, on = [], []
for r in range(7):
    for state in ("off", "on") if r % 2 == 0 else ("on", "off"):
        if state == "on":
            probes.attach(os.getpid())
            on.append(loop())
            probes.detach(os.getpid())
            probes.settle()
        else:
            off.append(loop())
res = {"ns_per_call_off": statistics.median(off), "ns_per_call_on": statistics.median(on)}
res["overhead_ns"] = res["ns_per_call_on"] - res["ns_per_call_off"]
print(json.dumps(res))
if len(sys.argv) > 2:
    Path(sys.argv[2], "nccl_call_cost.json").write_text(json.dumps({**res, "off": off, "on": on}, indent=1))
probes.close()
