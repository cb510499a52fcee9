"""``kvwatch doctor``'s self-cost checks: the canary that prices a probed call (every call
trapped), the kernel's BPF statistics counting the canary's runs exactly, and a drill of the
cost budget's circuit breaker on the CUDA canary child (this machine's runtime or the stub):
copies back to back priced against the child's CPU time, the copy API's probes shed (no copy
counted, every allocation still counted), attached again, and exactly 23 more copies counted."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvwatch.daemon.config import Config
from kvwatch.daemon.doctor.checks import FAIL, OK, SKIP, WARN, Check
from kvwatch.daemon.doctor.cuda import find_cuda_runtime
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.lab.stublib import StubBuildError, build
from kvwatch.daemon.lab.workloads import Workload
from kvwatch.probes.canary import BpfStats, CanaryResult, UprobeCanary
from kvwatch.probes.cuda import CudaProbeOptions, CudaProbes
from kvwatch.probes.errors import ProbeError

DRILL_CALLS = 23
SPIN_SECONDS = 1.0
COPY = "cudaMemcpyAsync"


def self_cost_checks(config: Config, procfs: ProcFS) -> list[Check]:
    stats = BpfStats()
    on = stats.enable()
    try:
        try:
            result = UprobeCanary().measure()
        except (ProbeError, OSError) as err:
            return [Check("self-cost canary", FAIL, f"the canary uprobe did not run: {err}")]
        checks = [_canary(result), _stats(result, on, stats.error)]
        if config.probes.cuda:
            checks.append(_drill(config, procfs, result.call_ns))
        return checks
    finally:
        stats.close()


def _canary(r: CanaryResult) -> Check:
    return Check(
        "self-cost canary",
        OK if r.exact else FAIL,
        f"a probed call costs its caller {r.call_ns:.0f} ns here (two traps and a minimal program; the call "
        f"itself {r.plain_ns:.0f} ns through ctypes); {r.entries} entries and {r.returns} returns trapped "
        f"for {r.calls} calls",
    )


def _stats(r: CanaryResult, on: bool, error: str) -> Check:
    if not on:
        return Check("BPF statistics", WARN, f"cannot turn them on ({error}): kvwatch_probe_run_seconds stays empty")
    ok = r.bpf_runs == 2 * r.calls
    per_run = r.bpf_ns / r.bpf_runs if r.bpf_runs else 0.0
    return Check(
        "BPF statistics",
        OK if ok else FAIL,
        f"the kernel counted {r.bpf_runs} runs of the canary's programs for {2 * r.calls} expected, "
        f"{per_run:.0f} ns per run (self_cost.bpf_stats turns them on while kvwatch runs)",
    )


def _drill(config: Config, procfs: ProcFS, call_ns: float) -> Check:
    probes = CudaProbes(CudaProbeOptions(driver_api=config.probes.cuda_driver_api))
    try:
        probes.start()
    except ProbeError as err:
        return Check("self-cost breaker", FAIL, str(err))
    with tempfile.TemporaryDirectory(prefix="kvwatch-doctor-cost-") as tmp:
        lib = find_cuda_runtime()
        try:
            lib = lib or build(Path(tmp)) / "libcudart.so.12"
        except StubBuildError as err:
            probes.close()
            return Check("self-cost breaker", SKIP, f"no CUDA runtime found, and {err}")
        try:
            return _run_drill(probes, lib, procfs, call_ns, config.self_cost.budget)
        finally:
            probes.close()


def _calls(probes: CudaProbes, pid: int, api: str) -> int:
    s = probes.sample().processes.get(pid)
    return s.calls_by_api().get(api, 0) if s else 0


def _copies(probes: CudaProbes, pid: int) -> int:
    return _calls(probes, pid, COPY)


def _run_drill(probes: CudaProbes, lib: Path, procfs: ProcFS, call_ns: float, budget: float) -> Check:
    tck = os.sysconf("SC_CLK_TCK")
    with Workload("cudacalls", "--lib", str(lib)) as child:
        child.expect("ready")
        probes.attach(child.pid)
        cpu0 = procfs.stat(child.pid).cpu_ticks / tck
        child.send(f"spin {SPIN_SECONDS}")
        child.reply()
        spun = _copies(probes, child.pid)
        cpu = procfs.stat(child.pid).cpu_ticks / tck - cpu0
        ratio = spun * call_ns / 1e9 / cpu if cpu > 0 else float("inf")
        probes.shed(child.pid, [COPY])  # the busy API only
        probes.settle(30.0)
        before, mallocs = _copies(probes, child.pid), _calls(probes, child.pid, "cudaMalloc")
        child.send(f"copy 1 {DRILL_CALLS} 4096")
        child.reply()
        child.send(f"call {DRILL_CALLS}")
        child.reply()
        while_shed = _copies(probes, child.pid) - before
        kept = _calls(probes, child.pid, "cudaMalloc") - mallocs
        probes.unshed(child.pid)  # attached again
        child.send(f"copy 1 {DRILL_CALLS} 4096")
        child.reply()
        after = _copies(probes, child.pid) - before - while_shed
    ok = while_shed == 0 and kept == after == DRILL_CALLS and spun > 0
    return Check(
        "self-cost breaker",
        OK if ok else FAIL,
        f"{spun} copies in {SPIN_SECONDS:.0f} s through {lib.name} cost the process {ratio:.1%} of its CPU "
        f"({'over' if ratio > budget else 'within'} the {budget:.0%} budget); {COPY} shed: {while_shed} of "
        f"{DRILL_CALLS} copies counted, {kept} of {DRILL_CALLS} cudaMalloc still counted; attached again: "
        f"{after} of {DRILL_CALLS}",
    )
