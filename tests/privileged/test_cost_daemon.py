"""`kvwatch run`'s self-cost meter and circuit breaker on the real kernel, with the stub CUDA
runtime: copies back to back cost the process far more than a 1 % budget (each probed call
~1.5 us of traps against ~0.1 us of work), so the CUDA uprobes are shed for it, KVWatchProbeShed
fires, and they come back after the back-off; while attached, every call is counted exactly.
The kernel's BPF statistics are on (self_cost.bpf_stats) and count the same calls."""

from __future__ import annotations

from pathlib import Path

from kvwatch.daemon.lab.workloads import workload_rule
from tests.support.daemon import DaemonProcess, daemon, wait_attached, wait_until
from tests.support.kernel import Child

STUB_ENGINE = rf"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{workload_rule("stubengine", "cudacalls")}]
[probes]
memory = ["lifecycle"]
cuda_rescan_seconds = 1
transfer = false
"""
CONFIG = (
    STUB_ENGINE
    + """[self_cost]
bpf_stats = true
budget = 0.01
window_seconds = 1
windows = 2
backoff_seconds = 3
"""
)
COPY = "cudaMemcpyAsync"


def call(w: Child, line: str) -> str:
    w.send(line)
    return w.reply()


def copies(d: DaemonProcess, pid: int) -> float:
    return d.value("kvwatch_cuda_copy_calls_total", pid=str(pid), api=COPY)


def shed(d: DaemonProcess, pid: int) -> float:
    return d.value("kvwatch_uprobes_shed", pid=str(pid), family="cuda")


def test_shed_over_budget_then_attached_again_counting_exactly(tmp_path: Path, stub: Path) -> None:
    with daemon(tmp_path, CONFIG) as d, Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        pid = str(w.pid)
        symbols = wait_attached(d, w.pid)
        wait_until(lambda: d.value("kvwatch_uprobe_canary_call_seconds") > 0, 30, "canary timed")
        assert d.value("kvwatch_bpf_stats_enabled") == 1
        assert call(w, "copy 1 23 4096") == "done 23 0"
        assert d.settled(lambda: copies(d, w.pid)) == 23

        w.send("spin 20")  # ~1.5 us of traps per call: far over 1 %
        wait_until(
            lambda: shed(d, w.pid) == 1 and d.value("kvwatch_cuda_probes_attached", pid=pid) < symbols, 30, "shed"
        )
        scrape = d.metrics()
        m = DaemonProcess.value_in(scrape)
        assert m("kvwatch_uprobe_cost_ratio", pid=pid) > 0.01
        assert m("kvwatch_cuda_probes_attached", pid=pid) == symbols - 1  # the busy copy API only
        assert m("kvwatch_uprobe_sheds_total", family="cuda") >= 1
        assert m("kvwatch_alert_active", alert="KVWatchProbeShed", pid=pid, cause="cuda") == 1
        states = {lab["state"] for lab, _v in scrape["kvwatch_probe_attached"] if lab["probe"] == COPY}
        assert states == {"shed"}  # the only process with CUDA probes had them shed
        spun = int(w.reply().split()[1])
        counted = d.settled(lambda: copies(d, w.pid))
        assert 23 < counted < 23 + spun  # counted until shed (and while attached again in between)
        # only the busy copy API was shed: allocations are counted whatever the breaker does
        assert call(w, "call 5") == "done 5 0"
        mallocs = d.settled(lambda: d.value("kvwatch_cuda_alloc_calls_total", pid=pid, api="cudaMalloc"))
        assert mallocs == 5

        # the spin is over: attached again after the back-off, and it stays attached
        wait_until(
            lambda: shed(d, w.pid) == 0 and d.value("kvwatch_cuda_probes_attached", pid=pid) == symbols, 60, "back"
        )
        before = d.settled(lambda: copies(d, w.pid))
        assert call(w, "copy 1 29 4096") == "done 29 0"
        assert d.settled(lambda: copies(d, w.pid)) == before + 29
        m = DaemonProcess.value_in(d.metrics())
        assert m("kvwatch_uprobes_shed", pid=pid, family="cuda") == 0
        assert m("kvwatch_alert_active", alert="KVWatchProbeShed", pid=pid) == 0
        assert m("kvwatch_alerts_fired_total", alert="KVWatchProbeShed") >= 1
        # the kernel ran the entry program once per counted call and knows how long it took
        runs = m("kvwatch_probe_runs_total", family="cuda", program=f"kvw_enter_{COPY}")
        assert runs >= before + 29 and m("kvwatch_probe_run_seconds_total", family="cuda") > 0
        assert m("kvwatch_uprobe_cost_seconds_total", pid=pid, family="cuda") > 0


FIXED = (
    STUB_ENGINE
    + """[self_cost]
calibrate = false
call_cost_ns = 1000
budget = 0
"""
)


def test_the_meter_counts_every_trapped_call_the_driver_beneath_the_runtime_too(tmp_path: Path, stub: Path) -> None:
    """The stub runtime calls the driver beneath each call, as cudart does. With the runtime probed,
    the driver's allocation functions are left unprobed, but its copy functions are probed and
    trapped beneath the runtime's copies (counted once, as nested). At a fixed 1 us a probed call
    (entry and return), 23 cudaMalloc + 23 cudaFree + 29 copies with the 29 driver copies beneath
    them cost 104 us."""
    with daemon(tmp_path, FIXED) as d, Child("cudacalls", "--lib", str(stub / "libcudart.so.12")) as w:
        w.expect("ready")
        pid = str(w.pid)
        wait_attached(d, w.pid)
        cost = "kvwatch_uprobe_cost_seconds_total"
        # the meter's first tick of the process is its baseline: calls after it are all counted
        wait_until(lambda: any(lab.get("pid") == pid for lab, _v in d.metrics().get(cost, [])), 30, "metered")
        assert call(w, "call 23") == "done 23 0"
        assert call(w, "copy 1 29 4096") == "done 29 0"
        got = d.settled(lambda: d.value(cost, pid=pid, family="cuda"))
        assert abs(got - (23 + 23 + 29 + 29) * 1e-6) < 1e-12
