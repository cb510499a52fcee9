"""``kvwatch doctor``'s transfer canary: the stub NIXL / UCX / verbs / NCCL libraries (built
here: needs a C compiler) make 23 transfers of each kind, and the probes must count
exactly those — posts paired with completions, bytes, registrations."""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvwatch.daemon.config import Config
from kvwatch.daemon.doctor.checks import FAIL, OK, SKIP, Check
from kvwatch.daemon.lab.stublib import StubBuildError, build_transfer
from kvwatch.daemon.lab.workloads import Workload
from kvwatch.probes.errors import ProbeError
from kvwatch.probes.records import HookState
from kvwatch.probes.transfer import TransferProbes

CANARY = 23
MIB = 1 << 20


def transfer_canaries(config: Config) -> list[Check]:
    if not config.probes.transfer:
        return [Check("canary transfer", SKIP, "transfer probes off in config")]
    probes = TransferProbes()
    try:
        probes.start()
    except ProbeError as err:
        return [Check("probe transfer", FAIL, str(err), "run kvwatch run --ebpf to see the program")]
    try:
        with tempfile.TemporaryDirectory(prefix="kvwatch-doctor-xfer-") as tmp:
            try:
                lib_dir = build_transfer(Path(tmp))
            except StubBuildError as err:
                return [Check("canary transfer", SKIP, str(err))]
            return _run(probes, lib_dir)
    finally:
        probes.close()


def _run(probes: TransferProbes, lib_dir: Path) -> list[Check]:
    with Workload("xferstub", "--lib-dir", str(lib_dir)) as child:
        child.expect("ready")
        att = probes.attach(child.pid)
        for h in range(1, CANARY + 1):
            child.step(f"post {h} {MIB} 1 5", "ok 1")  # in progress...
            child.step(f"status {h} 0", "ok 0")  # ...then done
        for _ in range(CANARY):
            child.step(f"reg {MIB}", "ok 1")
            child.step("nccl send 1000 7", "ok 0")
        sample = probes.sample().processes.get(child.pid)
    refused = [f"{s.api}: {s.reason}" for s in att.symbols if s.state is not HookState.ATTACHED]
    checks = [
        Check(
            "probe transfer attach",
            FAIL if refused else OK,
            f"{att.attached} symbols attached in the stub libraries"
            + (f"; not: {'; '.join(refused)}" if refused else ""),
        )
    ]
    nixl = sample.xfers.get(("nixl", "write")) if sample else None
    nccl = sample.xfers.get(("nccl", "send")) if sample else None
    ok = (
        nixl is not None
        and (nixl.calls, nixl.completed, nixl.bytes) == (CANARY, CANARY, CANARY * MIB)
        and nccl is not None
        and (nccl.calls, nccl.bytes) == (CANARY, CANARY * 4000)
        and sample is not None
        and (sample.reg_calls, sample.reg_bytes) == (CANARY, CANARY * MIB)
    )
    detail = (
        f"nixl {nixl.completed if nixl else 0}/{CANARY} transfers paired, {nixl.bytes if nixl else 0} bytes; "
        f"nccl {nccl.bytes if nccl else 0} bytes; verbs {sample.reg_calls if sample else 0} registrations"
    )
    checks.append(Check("canary transfer", OK if ok else FAIL, detail))
    return checks
