"""``kvwatch demo``: the daemon plus built-in workloads that reproduce each failure for real.

* host-tier: a pretend engine with a disk KV tier (files read into the page
  cache) is squeezed by its own memory cgroup: the kernel evicts the tier while
  the engine keeps reading it back → KVHostTierEvictionUnderPressure.
* reuse-collapse: a pretend engine allocates GPU memory through a stand-in CUDA
  runtime (built here; no GPU needed) first from its cache, then as if
  ``torch.cuda.empty_cache()`` ran every step → KVCacheReuseCollapse.
* eviction-burst: a simulated vLLM (its KV event stream and /metrics, started as a
  ``vllm serve`` console script) serves hot prefixes from its cache, then running
  requests take 95 % of its KV pool: cached prefixes are evicted and the prefix-hit
  ratio collapses → KVEvictionBurst cause=pressure.
* prefix-cache: the simulated vLLM's prefix cache breaks while it serves shared
  prefixes: its lookups all miss and it stores the same blocks again →
  KVPrefixCacheIneffective cause=not_hit.
* preemption-livelock: the simulated vLLM keeps preempting requests while the tokens
  it generates per second fall to a fortieth → KVPreemptionLivelock.
* oom: a pretend engine in a small cgroup allocates until the OOM killer takes
  it → InferenceProcessOOMKilled.

Needs root (BPF, cgroups). Everything it creates is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvwatch.daemon.config import Config
from kvwatch.daemon.config.base import parse
from kvwatch.daemon.demo_scenarios import DEMO_SCENARIOS
from kvwatch.daemon.lab.engine_sim_cli import SimulatedEngineProcess
from kvwatch.daemon.lab.memcg import CgroupUnavailable, MemoryCgroup
from kvwatch.daemon.lab.netlab import veth_pair
from kvwatch.daemon.lab.nixl_peer import NixlPeer
from kvwatch.daemon.lab.stublib import StubBuildError, build, build_transfer
from kvwatch.daemon.lab.workloads import MIB, Workload, drop_file_cache, make_files, workload_pattern
from kvwatch.daemon.model.snapshot import Snapshot

DEMO_RULES = [
    {"engine": "demo", "cmdline": workload_pattern("engine", "oom", "cuda", "xferstub")},
    {"engine": "demo", "cmdline": workload_pattern("initiator", module="nixl_peer")},
]
KV_FILES, KV_FILE_MB = 32, 16
CGROUP_MB, SQUEEZE_MB = 768, 640


def demo_config(base: Config, kv_dir: Path, listen: str) -> Config:
    data = msgspec.to_builtins(base, enc_hook=str)
    data["daemon"]["listen"] = listen
    data["discovery"]["rules"] = [*data["discovery"]["rules"], *DEMO_RULES]
    data["discovery"]["interval_seconds"] = 1.0
    data["kv_tiers"]["dirs"] = [{"path": kv_dir, "name": "demo-disk-tier"}]
    data["kv_tiers"]["rescan_seconds"] = 2.0
    ht = data["detectors"]["host_tier_eviction"]
    ht.update(warmup_seconds=0.0, window_seconds=2.0, floor_bytes_per_second=32 * MIB)
    data["detectors"]["reuse_collapse"].update(warmup_seconds=1.0, baseline_min_seconds=2.0)
    data["probes"]["cuda_rescan_seconds"] = 1.0
    data["probes"]["transfer_rescan_seconds"] = 1.0
    data["detectors"]["transfer_collapse"].update(
        warmup_seconds=0.0, baseline_min_seconds=3.0, window_seconds=3.0, min_transfers=10, peer_grace_seconds=1.0
    )
    data["engines"]["scrape_interval_seconds"] = 0.5
    data["detectors"]["eviction_burst"].update(warmup_seconds=0.0, baseline_min_seconds=4.0, window_seconds=3.0)
    data["detectors"]["prefix_cache_ineffective"].update(
        warmup_seconds=0.0, window_seconds=1.5, min_queried_tokens=500.0, min_stored_blocks=20.0, confirm_windows=1
    )
    data["detectors"]["preemption_livelock"].update(
        warmup_seconds=0.0, baseline_min_seconds=3.0, window_seconds=2.0, confirm_windows=1
    )
    return parse(Config, data)


def _say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


def _wait_for(get: Callable[[], Snapshot], pred: Callable[[Snapshot], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(get()):
            return True
        time.sleep(0.1)
    return False


def _firing(name: str) -> Callable[[Snapshot], bool]:
    return lambda s: any(a.alert == name for a in s.alerts)


def _watching(pid: int) -> Callable[[Snapshot], bool]:
    return lambda s: any(p.pid == pid and p.alive for p in s.processes)


def _engine(args: list[str], cg: MemoryCgroup) -> Workload:
    child = Workload(*args)
    cg.add(child.pid)
    return child


def scenario_host_tier(get: Callable[[], Snapshot], work: Path) -> bool:
    kv = work / "kv"
    _say(f"writing a {KV_FILES * KV_FILE_MB} MiB disk KV tier in {kv}")
    files = make_files(kv, KV_FILES, KV_FILE_MB * MIB)
    drop_file_cache(files)
    with MemoryCgroup("kvwatch-demo-engine", CGROUP_MB * MIB) as cg:
        child = _engine(
            [
                "engine",
                "--kv-dir",
                str(kv),
                "--squeeze-mb",
                str(SQUEEZE_MB),
                "--rate-mb",
                "200",
                "--seconds",
                "15",
            ],
            cg,
        )
        try:
            if not _wait_for(get, _watching(child.pid), 10):
                _say("the engine was not discovered")
                return False
            _say(f"engine pid {child.pid} discovered; warming its tier (reads every file)")
            child.step("warm", "warm")
            time.sleep(3)
            _say(
                f"squeezing: the engine allocates {SQUEEZE_MB} MiB in its {CGROUP_MB} MiB cgroup"
                " while it keeps serving from the tier"
            )
            t0 = time.monotonic()
            child.send("squeeze")
            ok = _wait_for(get, _firing("KVHostTierEvictionUnderPressure"), 30)
            if ok:
                a = next(a for a in get().alerts if a.alert == "KVHostTierEvictionUnderPressure")
                _say(
                    f"ALERT KVHostTierEvictionUnderPressure cause={a.cause} "
                    f"after {time.monotonic() - t0:.1f} s: {a.summary}"
                )
            else:
                _say("no host-tier alert within 30 s")
            child.send("exit")
            return ok
        finally:
            child.close()


def scenario_reuse_collapse(get: Callable[[], Snapshot], work: Path) -> bool | None:
    try:
        lib_dir = build(work / "stubcuda").parent
    except StubBuildError as err:
        _say(f"reuse-collapse skipped: {err}")
        return None
    with Workload("cuda", "--lib-dir", str(lib_dir)) as child:
        child.expect("ready")

        def attached(s: Snapshot) -> bool:
            return any(p.pid == child.pid and p.cuda and p.cuda.symbols_attached for p in s.processes)

        if not _wait_for(get, attached, 10):
            _say("the CUDA engine was not attached")
            return False
        _say(f"engine pid {child.pid}: CUDA probes attached; 4 s of a warm allocator cache (no cudaMalloc)")
        child.step("cached 1 4", "done")
        _say("now every step frees its segments and allocates them again, like empty_cache() in the loop")
        t0 = time.monotonic()
        child.send("emptycache 40 8")
        ok = _wait_for(get, _firing("KVCacheReuseCollapse"), 8)
        if ok:
            a = next(a for a in get().alerts if a.alert == "KVCacheReuseCollapse")
            _say(f"ALERT KVCacheReuseCollapse cause={a.cause} after {time.monotonic() - t0:.1f} s: {a.summary}")
        else:
            _say("no reuse-collapse alert within 8 s")
        child.expect("done")
        return ok


def _nixl_available() -> bool:
    import importlib.util  # noqa: PLC0415

    return shutil.which("ip") is not None and any(
        importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13", "nixl")
    )


def scenario_transfer_collapse(get: Callable[[], Snapshot], work: Path) -> bool | None:
    if _nixl_available():
        return _transfer_collapse_nixl(get, work)
    return _transfer_collapse_stub(get, work)


def _transfer_collapse_nixl(get: Callable[[], Snapshot], work: Path) -> bool:
    """Two real NIXL agents in network namespaces over UCX/TCP; the veth link is throttled."""
    size, tcp = 2 * MIB, {"UCX_TLS": "tcp"}
    with veth_pair("kvd", 96) as link:
        target = NixlPeer(
            "target", work / "nixl-meta.json", size, netns=link.b, env={**tcp, "UCX_NET_DEVICES": link.dev_b}
        )
        init = NixlPeer(
            "initiator",
            work / "nixl-meta.json",
            size,
            handles=64,
            netns=link.a,
            env={**tcp, "UCX_NET_DEVICES": link.dev_a},
        )
        try:
            if not _wait_for(get, _transfers_attached(init.pid), 15):
                _say("the NIXL initiator was not attached")
                return False
            _say(f"NIXL initiator pid {init.pid} in netns {link.a} writes 2 MiB KV blocks to its peer, 20 a second")
            init.ask("rate 20 6")
            _say("throttling the link to 100 Mbit/s (tc tbf) while demand stays at 20 transfers/s")
            link.throttle("100mbit")
            t0 = time.monotonic()
            done: dict[str, object] = {}
            runner = threading.Thread(target=lambda: done.update(init.ask("rate 20 8")))
            runner.start()
            ok = _wait_for(get, _firing("KVTransferBandwidthCollapse"), 10)
            _report("KVTransferBandwidthCollapse", get, ok, t0)
            runner.join(60)
            link.release()
            return ok
        finally:
            init.close()
            target.close()


def _transfer_collapse_stub(get: Callable[[], Snapshot], work: Path) -> bool | None:
    """Without NIXL installed: the stub NIXL library, transfers that take 5 ms, then 200 ms."""
    try:
        lib_dir = build_transfer(work / "xferstub")
    except StubBuildError as err:
        _say(f"transfer-collapse skipped: {err}")
        return None
    _say(
        "NIXL is not installed (pip install --no-deps nixl-cu12 numpy for the real thing): "
        "using the stub NIXL library, where transfers take as long as the demo says"
    )
    with Workload("xferstub", "--lib-dir", str(lib_dir)) as child:
        child.expect("ready")
        if not _wait_for(get, _transfers_attached(child.pid), 10):
            _say("the stub engine was not attached")
            return False
        handle = 0
        firing = _firing("KVTransferBandwidthCollapse")
        for ms, seconds in ((5, 6.0), (200, 8.0)):
            if ms == 200:
                _say("each 2 MiB transfer now takes 200 ms instead of 5 ms")
                t0 = time.monotonic()
            end = time.monotonic() + seconds
            while time.monotonic() < end and not (ms == 200 and firing(get())):
                handle += 1
                child.step(f"xfer {handle} {2 * MIB} {ms}", "ok 0")
                time.sleep(0.045)
        ok = firing(get())
        _report("KVTransferBandwidthCollapse", get, ok, t0)
        return ok


def _transfers_attached(pid: int) -> Callable[[Snapshot], bool]:
    return lambda s: any(p.pid == pid and p.transfers and p.transfers.symbols_attached for p in s.processes)


def _report(name: str, get: Callable[[], Snapshot], ok: bool, t0: float) -> None:
    if ok:
        a = next(a for a in get().alerts if a.alert == name)
        _say(f"ALERT {name} cause={a.cause} after {time.monotonic() - t0:.1f} s: {a.summary}")
    else:
        _say(f"no {name} alert")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tapped(sim: SimulatedEngineProcess) -> Callable[[Snapshot], bool]:
    def tapped(s: Snapshot) -> bool:
        return any(
            p.pid == sim.pid and p.engine and any(x.connected for x in p.engine.streams) and p.engine.scrape
            for p in s.processes
        )

    return tapped


def _simulated_vllm(work: Path, get: Callable[[], Snapshot]) -> SimulatedEngineProcess | None:
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{_free_port()}"}
    sim = SimulatedEngineProcess(work / "bin", http_port=_free_port(), kv_events=kv, capacity=2000)
    if not _wait_for(get, _tapped(sim), 15):
        _say("the simulated vLLM's KV event stream was not tapped")
        sim.close()
        return None
    return sim


@dataclass(frozen=True)
class SimScenario:
    """A failure of the simulated vLLM: calm load for ``calm_seconds``, then the onset."""

    alert: str
    calm: str  # what the engine does first
    calm_commands: tuple[str, ...]
    calm_seconds: float
    onset: str  # what goes wrong
    onset_commands: tuple[str, ...]


SIM_SCENARIOS = {
    "eviction-burst": SimScenario(
        "KVEvictionBurst",
        "serving 40 req/s from 100 hot prefixes",
        ("traffic 40 100 8 0",),
        9,
        "running requests now hold 95 % of the KV pool: the cached prefixes must go",
        ("active 1900",),
    ),
    "prefix-cache": SimScenario(
        "KVPrefixCacheIneffective",
        "20 req/s sharing 10 prefixes, served from its prefix cache",
        ("traffic 20 10 4 0",),
        5,
        "its prefix cache breaks: every lookup misses, the same blocks are stored again",
        ("broken 1",),
    ),
    "preemption-livelock": SimScenario(
        "KVPreemptionLivelock",
        "generating 2000 tokens/s without preemption",
        ("traffic 20 250 8 0", "decode 2000"),
        6,
        "it now preempts 5 requests/s and generates 50 tokens/s",
        ("preempting 5", "decode 50"),
    ),
}


def scenario_simulated_vllm(get: Callable[[], Snapshot], work: Path, sc: SimScenario) -> bool:
    sim = _simulated_vllm(work, get)
    if sim is None:
        return False
    with sim:
        _say(f"simulated vLLM pid {sim.pid} tapped (KV events + /metrics); {sc.calm}")
        for cmd in sc.calm_commands:
            sim.do(cmd)
        time.sleep(sc.calm_seconds)
        _say(sc.onset)
        t0 = time.monotonic()
        for cmd in sc.onset_commands:
            sim.do(cmd)
        ok = _wait_for(get, _firing(sc.alert), 20)
        _report(sc.alert, get, ok, t0)
        return ok


def scenario_oom(get: Callable[[], Snapshot]) -> bool:
    with MemoryCgroup("kvwatch-demo-oom", 64 * MIB) as cg:
        child = _engine(["oom"], cg)
        try:
            if not _wait_for(get, _watching(child.pid), 10):
                _say("the OOM engine was not discovered")
                return False
            _say(f"engine pid {child.pid} discovered; allocating until its 64 MiB cgroup runs out")
            t0 = time.monotonic()
            child.send("go")
            ok = _wait_for(get, _firing("InferenceProcessOOMKilled"), 20)
            if ok:
                a = next(a for a in get().alerts if a.alert == "InferenceProcessOOMKilled")
                _say(f"ALERT InferenceProcessOOMKilled after {time.monotonic() - t0:.1f} s: {a.summary}")
            else:
                _say("no OOM alert within 20 s")
            return ok
        finally:
            child.close()


def run_demo(base: Config, args: argparse.Namespace) -> int:
    from kvwatch.daemon.wiring import Daemon  # noqa: PLC0415 - bcc only when the demo runs

    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    config = demo_config(base, work / "kv", args.listen)
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    runner = threading.Thread(target=daemon.serve, name="kvwatch-demo-daemon", daemon=True)
    runner.start()

    def get() -> Snapshot:
        return daemon.agent.snapshot

    results: dict[str, bool] = {}
    try:
        if not _wait_for(get, lambda s: s.tick > 0, 30):
            _say("daemon did not start")
            return 1
        host, port = daemon.server.address
        _say(f"daemon up: http://{host}:{port}/metrics (ready={get().ready})")
        scenarios = args.scenario or list(DEMO_SCENARIOS)
        try:
            if "host-tier" in scenarios:
                results["host-tier"] = scenario_host_tier(get, work)
            if "transfer-collapse" in scenarios:
                transfer = scenario_transfer_collapse(get, work)
                if transfer is not None:
                    results["transfer-collapse"] = transfer
            if "reuse-collapse" in scenarios:
                collapse = scenario_reuse_collapse(get, work)
                if collapse is not None:
                    results["reuse-collapse"] = collapse
            for name, sc in SIM_SCENARIOS.items():
                if name in scenarios:
                    results[name] = scenario_simulated_vllm(get, work, sc)
            if "oom" in scenarios:
                results["oom"] = scenario_oom(get)
        except CgroupUnavailable as err:
            _say(f"cannot run: {err}")
            return 1
    finally:
        daemon.stop.set()
        runner.join(15)
        shutil.rmtree(work, ignore_errors=True)
    for name, ok in results.items():
        _say(f"{name}: {'alert fired' if ok else 'NO ALERT'}")
    return 0 if results and all(results.values()) else 1
