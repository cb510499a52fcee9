"""``kvwatch doctor``'s CUDA canary: a child makes 23 cudaMalloc and 23 cudaFree calls through
a CUDA runtime found on this machine (or the stub, built when none is), and the probes
must count exactly those. Without a GPU the calls fail (error 35/100): they are
counted as failures, which proves attachment, arguments and return values all the same.
"""

from __future__ import annotations

import glob
import sys
import tempfile
from pathlib import Path

from kvwatch.daemon.config import Config
from kvwatch.daemon.doctor.checks import FAIL, OK, SKIP, Check
from kvwatch.daemon.lab.stublib import StubBuildError, build
from kvwatch.daemon.lab.workloads import Workload
from kvwatch.probes.cuda import CudaProbeOptions, CudaProbes
from kvwatch.probes.errors import ProbeError
from kvwatch.probes.libs import CUDART
from kvwatch.probes.records import HookState

CANARY_CALLS = 23
SEARCH = (
    "{prefix}/lib/python3*/site-packages/nvidia/*/lib/libcudart.so.*",
    "{prefix}/lib/python3*/site-packages/nvidia/*/*/lib/libcudart.so.*",
    "/usr/local/cuda*/lib64/libcudart.so.*",
    "/usr/lib/x86_64-linux-gnu/libcudart.so.*",
    "/usr/lib64/libcudart.so.*",
)


def find_cuda_runtime() -> Path | None:
    for pattern in SEARCH:
        for path in sorted(glob.glob(pattern.format(prefix=sys.prefix))):  # noqa: PTH207 - absolute patterns
            if CUDART.match(Path(path).name):
                return Path(path)
    return None


def cuda_canaries(config: Config) -> list[Check]:
    if not config.probes.cuda:
        return [Check("canary cuda", SKIP, "CUDA probes off in config")]
    probes = CudaProbes(CudaProbeOptions(driver_api=config.probes.cuda_driver_api))
    try:
        probes.start()
    except ProbeError as err:
        return [Check("probe cuda", FAIL, str(err), "run kvwatch run --ebpf to see the program")]
    with tempfile.TemporaryDirectory(prefix="kvwatch-doctor-cuda-") as tmp:
        lib = find_cuda_runtime()
        source = "this machine's runtime"
        if lib is None:
            try:
                lib = build(Path(tmp))
                source = "the stub runtime (no CUDA runtime found here)"
            except StubBuildError as err:
                probes.close()
                return [Check("canary cuda", SKIP, f"no CUDA runtime found, and {err}")]
        try:
            return _run(probes, lib, source)
        finally:
            probes.close()


def _run(probes: CudaProbes, lib: Path, source: str) -> list[Check]:
    with Workload("cudacalls", "--lib", str(lib)) as child:
        child.expect("ready")
        att = probes.attach(child.pid)
        child.send(f"call {CANARY_CALLS}")
        reply = child.reply().split()
        sample = probes.sample().processes.get(child.pid)
    missing = [s.api for s in att.symbols if s.state is HookState.MISSING]
    failed = [f"{s.api}: {s.reason}" for s in att.symbols if s.state is HookState.FAILED]
    checks = [
        Check(
            "probe cuda attach",
            FAIL if failed or not att.attached else OK,
            f"{att.attached} symbols attached in {lib.name}"
            + (f"; missing in this version: {', '.join(missing)}" if missing else "")
            + (f"; refused: {'; '.join(failed)}" if failed else ""),
        )
    ]
    m = sample.apis.get("cudaMalloc") if sample else None
    f = sample.apis.get("cudaFree") if sample else None
    got_m = (m.ok + m.err) if m else 0
    got_f = (f.ok + f.err) if f else 0
    rc = reply[2] if len(reply) > 2 else "?"
    ok = got_m == CANARY_CALLS and got_f == CANARY_CALLS
    checks.append(
        Check(
            "canary cuda",
            OK if ok else FAIL,
            f"{got_m} cudaMalloc and {got_f} cudaFree counted for {CANARY_CALLS} each through {source} "
            f"({lib}); ok {m.ok if m else 0}, first return code {rc}",
        )
    )
    return checks
