"""kvwatch on a real vLLM 0.26.0 (the lent H200): closure against vLLM's own numbers, the
detectors on a real engine, and the cost — one repeatable validation in two device calls.

kvwatch starts first, then the independent subscriber (vLLM's own classes decode the KV
event stream; ``vllm_subscriber.py``), then ``vllm serve`` with prefix caching, a 2,048-block
GPU pool, the OffloadingConnector's CPU tier, KV events over ZMQ, sleep mode and dev mode.
Each runs in its own session so that the second call finds them (``vllm_harness.State``).

``--plan first`` (scenarios 1-3):
  1. steady   — 24 shared 320-token prefixes + a unique block, 8 clients, until kvwatch's
                detectors are warm (≥ 60 s): no alert of any kind;
  2. pressure — unique 900-token prompts, 32 clients (45 s), then the hot prefixes again
                (30 s) and steady (45 s): KVEvictionBurst on medium GPU, cause pressure or
                thrash, active within 3 s of the hot prefixes missing, cleared after;
  3. preempt  — unique prompts generating 1,100 tokens, 32 clients: the pool (2,048 blocks)
                cannot hold them and vLLM preempts; the alert's cause is thrash; then steady.
``--plan second`` (scenarios 4-5, closure):
  4. intentional — POST /reset_prefix_cache, then sleep level 1 and wake-up, with steady
                load around them: no KVEvictionBurst, no KVCacheReuseCollapse; the sleep /
                wake driver calls (vLLM's CuMem allocator) counted by kind;
  5. offload  — over the whole run: kvwatch's batched-copy bytes for the engine core (d2h,
                h2d) against vLLM's kv_offload_{store,load}_bytes;
  closure     — at quiescence: kvwatch_kv_blocks_{stored,removed}_total per medium and the
                resets against the subscriber, exactly; every engine counter kvwatch
                re-exports against vLLM's /metrics;
``--plan cost`` (a third call; vLLM still runs): interleaved rounds, kvwatch attached (daemon
  started, probes attached, stream subscribed, /metrics scraped) or not, each mode after the
  same idle settle and a short unmeasured warm-up: throughput, p50/p99 of the steady and
  pressure loads.
``--plan all`` runs the three in one process (the dry run here: ``--engine sim`` drives the
simulated vLLM through the same command line, ``--quick`` shortens phases and warm-ups).

Writes into --out: validation.json (every number), validation.md, kvwatch_timeline.jsonl.gz
(kvwatch's alerts and counters every second), vllm_metrics.jsonl.gz (vLLM's /metrics every
second), requests.jsonl.gz, logs.tar.gz — suffixed by call (_1, _2, _3; at most 8 files come
back from a call); the second call adds stream.jsonl.gz and raw_frames.json (the recorded event
stream, for the CI-side replay); the third writes validation.json and validation.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import vllm_checks as checks
from tests.gpu.vllm_harness import (
    TOPIC,
    WORK,
    Poller,
    State,
    alive,
    children,
    cmdline,
    comm,
    cuda_maps,
    engine_env,
    kvwatch_argv,
    kvwatch_extract,
    kvwatch_ready,
    kvwatch_samples,
    kvwatch_url,
    post,
    start_session,
    stop,
    value,
    vllm_argv,
    vllm_healthy,
    vllm_url,
    wait_until,
)
from tests.gpu.vllm_load import PREEMPT, PRESSURE, STEADY, Load, summary

FULL = {"noprefix": 120, "steady": 75, "warm_after_start": 170, "pressure": 45, "hot": 30, "recover": 45, "preempt": 40,
        "recover2": 40, "before_reset": 10, "after_reset": 35, "asleep": 8, "after_wake": 35,
        "round_settle": 15, "round_warm": 4, "round_steady": 12, "round_pressure": 12}  # fmt: skip
QUICK = {"noprefix": 30, "steady": 30, "warm_after_start": 30, "pressure": 15, "hot": 12, "recover": 25, "preempt": 15,
         "recover2": 25, "before_reset": 5, "after_reset": 15, "asleep": 3, "after_wake": 15,
         "round_settle": 3, "round_warm": 2, "round_steady": 4, "round_pressure": 4}  # fmt: skip
# The tiny model's KV pool is 1 GiB (2,048 blocks) on a 141 GB GPU: below the default 10 % that
# tells KVCacheReuseCollapse the pool is allocated, it would never be warm, and "no alert through
# sleep and wake-up" would prove nothing. The pool marker is lowered for this run; all else default.
AUDIT_SETS = (  # the metric-truth audit in 10 s windows (3 in a row fire), the kernel's BPF statistics on
    "detectors.engine_metric_divergence.window_seconds=10",
    "self_cost.bpf_stats=true",
)
FULL_SETS = ("detectors.reuse_collapse.kv_pool_fraction=0.005", *AUDIT_SETS)
QUICK_SETS = (  # the dry run: detectors warm in seconds, not minutes
    *AUDIT_SETS,
    "detectors.eviction_burst.warmup_seconds=10",
    "detectors.eviction_burst.baseline_min_seconds=10",
    "detectors.eviction_burst.quiet_after_reset_seconds=20",
    "detectors.reuse_collapse.warmup_seconds=10",
    "detectors.reuse_collapse.baseline_min_seconds=10",
    "discovery.interval_seconds=1",
)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.t = QUICK if args.quick else FULL
        self.sets = QUICK_SETS if args.quick else FULL_SETS
        self.t0 = time.monotonic()
        self.results: dict[str, Any] = {}
        self.pollers: list[Poller] = []
        self.load = Load("127.0.0.1", 8000, "tiny", seed=args.seed)

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0)

    # --- processes ------------------------------------------------------------------------------
    def start_kvwatch(self, st: State) -> None:
        pid = start_session(kvwatch_argv(sets=self.sets), WORK / "kvwatch.log", cwd=WORK)  # appends
        st.pids["kvwatch"] = pid
        took = wait_until(kvwatch_ready, 120, "kvwatch /readyz")
        st.mark("kvwatch_ready", pid=pid, seconds=round(took, 1))

    def start_subscriber(self, st: State) -> None:
        argv = [sys.executable if self.args.engine == "sim" else "python3"]
        argv += [str(Path(__file__).with_name("vllm_subscriber.py")), "--endpoint", "tcp://127.0.0.1:5557"]
        argv += ["--topic", TOPIC, "--out", str(WORK / "subscriber")]
        if self.args.kv_events_py:
            argv += ["--kv-events-py", self.args.kv_events_py]
        env = engine_env(self.args.vllm_site) if self.args.engine == "vllm" else None
        st.pids["subscriber"] = start_session(argv, WORK / "subscriber.log", env=env)
        try:
            wait_until(lambda: "subscribed" in (WORK / "subscriber.log").read_text(), 90, "subscriber connected")
        except TimeoutError:  # the run goes on: kvwatch's counts then lack their reference
            st.note("the independent subscriber did not start: see subscriber.log")

    def start_vllm(self, st: State) -> None:
        env = engine_env(self.args.vllm_site if self.args.engine == "vllm" else None)
        if self.args.engine == "sim":
            env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        for sleep_mode in (True, False):
            st.sleep_mode = sleep_mode
            pid = start_session(vllm_argv(self.args.engine, self.args.model, sleep_mode), WORK / "vllm.log", env=env)
            st.pids["vllm"] = pid
            st.mark("vllm_start", pid=pid, sleep_mode=sleep_mode)
            try:
                wait_until(lambda pid=pid: vllm_healthy() or not alive(pid), 330, "vLLM /health")
            except TimeoutError:
                st.note("vLLM did not answer /health in 330 s")
                raise
            if vllm_healthy():
                st.mark("vllm_ready")
                return
            st.note(f"vLLM exited during start-up with sleep_mode={sleep_mode}: see vllm.log")
        raise RuntimeError("vLLM did not start")

    def find_engine_core(self, st: State) -> None:
        def core() -> int:
            for c in children(st.pids["vllm"]):
                if comm(c).startswith("VLLM::Engine") or cmdline(c).startswith("VLLM::EngineCore"):
                    return c
            return 0

        if self.args.engine == "vllm":
            wait_until(lambda: core() > 0, 60, "the engine core process")
        st.engine_core_pid = core()

    def wait_tapped(self, st: State) -> None:
        api = str(st.pids["vllm"])

        def tapped() -> bool:
            s = kvwatch_samples()
            ok = value(s, "kvwatch_kv_event_stream_connected", pid=api) >= 1
            ok = ok and value(s, "kvwatch_engine_scrapes_total", pid=api, result="ok") > 0
            if st.engine_core_pid:
                ok = ok and value(s, "kvwatch_cuda_probes_attached", pid=str(st.engine_core_pid)) > 0
            return ok

        took = wait_until(tapped, 90, "kvwatch tapped the engine (stream, /metrics, CUDA probes)")
        st.mark("tapped", seconds=round(took, 1), engine_core=st.engine_core_pid, maps=cuda_maps(st.engine_core_pid))

    def start_pollers(self, suffix: str) -> None:
        self.pollers = [
            Poller(vllm_url("/metrics"), self.out / f"vllm_metrics{suffix}.jsonl.gz", 1.0),
            Poller(kvwatch_url("/metrics"), self.out / f"kvwatch_timeline{suffix}.jsonl.gz", 1.0, kvwatch_extract),
        ]
        for p in self.pollers:
            p.start()

    def stop_pollers(self) -> None:
        for p in self.pollers:
            p.stop()
        self.results.setdefault("pollers", []).extend(
            {"file": p.out.name, "samples": p.count, "errors": p.errors} for p in self.pollers
        )

    # --- load phases ----------------------------------------------------------------------------------
    def phase(self, st: State, name: str, workload: Any, seconds: float, *, abort: bool = False) -> dict[str, Any]:
        if self.left() < seconds + 25:
            st.note(f"phase {name} skipped: {self.left():.0f} s of this call left")
            return {}
        api = str(st.pids["vllm"])
        st.mark(f"{name}_start", engine=checks.engine_snapshot(api))
        run = self.load.start(name, workload)
        time.sleep(max(0.0, seconds))
        if abort:
            run.abort()
        else:
            run.stop()
        st.mark(f"{name}_end", engine=checks.engine_snapshot(api))
        s = summary(run, (run.started, run.stopped))
        self.results.setdefault("phases", {})[name] = s
        return s

    def save(self, name: str, st: State) -> None:
        self.results["marks"] = st.marks
        self.results["notes"] = st.notes
        self.results["pids"] = {**st.pids, "engine_core": st.engine_core_pid}
        (self.out / name).write_text(json.dumps(self.results, indent=1, default=str))

    def dump_requests(self, name: str) -> None:
        with gzip.open(self.out / name, "wt") as f:
            for r in self.load.dump():
                f.write(json.dumps(r) + "\n")

    def pack_logs(self, name: str, extra: tuple[Path, ...] = ()) -> None:
        with tarfile.open(self.out / name, "w:gz") as tar:
            for p in (WORK / "kvwatch.log", WORK / "vllm.log", WORK / "subscriber.log", WORK / "state.json", *extra):
                if p.exists():
                    tar.add(p, arcname=p.name)


def gpu_facts() -> str:
    try:
        q = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        return subprocess.run(q, capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except OSError:
        return "no nvidia-smi"


def stop_all(st: State) -> None:
    for name in ("vllm", "subscriber", "kvwatch"):
        stop(st.pids.get(name, 0), 30)


def plan_first(r: Run) -> State:
    stop_all(State.load())  # what an earlier, failed attempt left running
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    st = State(engine=r.args.engine)
    st.mark("begin", gpu=gpu_facts())
    try:
        r.start_kvwatch(st)
        r.start_subscriber(st)
        r.start_vllm(st)
        r.find_engine_core(st)
        r.wait_tapped(st)
    except Exception:
        r.save("validation_1.json", st)
        r.pack_logs("logs_1.tar.gz")
        stop_all(st)
        raise
    r.start_pollers("_1")
    try:
        t = r.t
        ready = st.at("vllm_ready")["mono"]
        start = st.at("vllm_start")["mono"]
        steady = max(ready + t["steady"], start + t["warm_after_start"]) - time.monotonic()
        r.phase(st, "steady", STEADY, max(steady, 10))
        r.phase(st, "pressure", PRESSURE, t["pressure"])
        r.phase(st, "hot", STEADY, t["hot"])
        r.phase(st, "recover", STEADY, t["recover"])
        if "preempt" not in r.args.skip:  # vLLM 0.26.0's offloading scheduler can die of an assertion here
            r.phase(st, "preempt", PREEMPT, t["preempt"], abort=True)
            r.phase(st, "recover2", STEADY, t["recover2"])
    finally:
        r.stop_pollers()
        r.results["alerts_1"] = checks.alerts(WORK / "kvwatch.log")
        r.results["ledger_1"] = checks.ledger(kvwatch_samples(), str(st.pids["vllm"]))
        r.results["trust_1"] = checks.trust(kvwatch_samples())
        r.dump_requests("requests_1.jsonl.gz")
        r.save("validation_1.json", st)
        r.pack_logs("logs_1.tar.gz")
    st.save()
    for name in ("requests_1.jsonl.gz", "validation_1.json"):  # the second call reads them here
        shutil.copy(r.out / name, WORK / name)
    return st


def intentional(r: Run, st: State) -> None:
    core = str(st.engine_core_pid)
    r.phase(st, "before_reset", STEADY, r.t["before_reset"])
    time.sleep(1.0)
    ok, tries = False, 0
    while not ok and tries < 20:  # vLLM refuses while blocks are held (offload stores in flight)
        tries += 1
        code, body = post(vllm_url("/reset_prefix_cache"), 30)
        ok = code == 200 and '"success":true' in body.replace(" ", "").lower()
        if not ok:
            time.sleep(0.5)
    st.mark("reset", success=ok, tries=tries)
    r.phase(st, "after_reset", STEADY, r.t["after_reset"])
    if not st.sleep_mode:
        st.note("sleep mode not enabled (vLLM did not start with it): the sleep/wake cycle was not run")
        return
    time.sleep(1.0)
    r.results["cuda_before_sleep"] = checks.cuda_counters(kvwatch_samples(), core)
    code, body = post(vllm_url("/sleep?level=1"), 120)
    st.mark("sleep", status=code, maps=cuda_maps(st.engine_core_pid))
    time.sleep(r.t["asleep"])
    r.results["cuda_asleep"] = checks.cuda_counters(kvwatch_samples(), core)
    code, _ = post(vllm_url("/wake_up"), 120)
    st.mark("wake", status=code)
    time.sleep(3.0)
    r.results["cuda_after_wake"] = checks.cuda_counters(kvwatch_samples(), core)
    r.phase(st, "after_wake", STEADY, r.t["after_wake"])


def quiesce(r: Run, st: State) -> dict[str, Any]:
    """No load; wait until the subscriber and kvwatch saw the same last batch, and kvwatch
    scraped vLLM at least twice since."""
    time.sleep(5.0)
    sub = WORK / "subscriber" / "subscriber_counts.json"
    api = str(st.pids["vllm"])

    def same() -> bool:
        c = json.loads(sub.read_text())
        return value(kvwatch_samples(), "kvwatch_kv_event_batches_total", pid=api) == c["batches"]

    try:
        wait_until(same, 60, "kvwatch counted every batch the subscriber did")
    except TimeoutError as err:  # the closure below then shows by how much
        st.note(str(err))
    if not sub.exists():
        return {"stored": {}, "removed": {}, "cleared": 0, "batches": 0, "gaps": 0, "missing": True}
    time.sleep(2 * 2.0 + 1.5)  # two scrapes at kvwatch's default interval
    counts: dict[str, Any] = json.loads(sub.read_text())
    return counts


def plan_second(r: Run, st: State) -> None:
    for name in ("kvwatch", "vllm", "subscriber"):
        if not alive(st.pids.get(name, 0)):
            st.note(f"{name} (pid {st.pids.get(name)}) is not running at the second call")
    r.start_pollers("_2")
    try:
        intentional(r, st)
        st.mark("quiesce")
        counts = quiesce(r, st)
        kv, vl = kvwatch_samples(), checks.vllm_samples()
        st.mark("closure")
        r.results["closure"] = checks.closure(counts, kv, vl, st)
    finally:
        r.stop_pollers()
    r.results["kvwatch_stop"] = checks.stop_kvwatch(st.pids["kvwatch"])
    stop(st.pids["subscriber"], 20)
    for name in ("stream.jsonl.gz", "raw_frames.json"):
        src = WORK / "subscriber" / name
        if src.exists():
            shutil.copy(src, r.out / name)
    r.results["scenarios"] = checks.scenarios(st, WORK / "kvwatch.log", WORK / "requests_1.jsonl.gz")
    r.results["vllm_log"] = checks.vllm_log_facts(WORK / "vllm.log")
    r.dump_requests("requests_2.jsonl.gz")
    r.save("validation_2.json", st)
    shutil.copy(r.out / "validation_2.json", WORK / "validation_2.json")
    r.pack_logs("logs_2.tar.gz")


NOPREFIX_SETS = (  # KVPrefixCacheIneffective judged within the call: a 20 s window after 20 s
    "detectors.prefix_cache_ineffective.warmup_seconds=20",
    "detectors.prefix_cache_ineffective.window_seconds=20",
    "detectors.prefix_cache_ineffective.min_queried_tokens=5000",
)


def plan_noprefix(r: Run, st: State) -> None:
    """A call after the first, instead of the second: vLLM restarted with
    --no-enable-prefix-caching under the shared-prefix load. Do its KV events still flow, and
    does KVPrefixCacheIneffective see an engine that never hits? kvwatch restarted with a short
    window for that detector; the subscriber keeps running (it reconnects)."""
    stop(st.pids.get("vllm", 0), 60)
    stop(st.pids.get("kvwatch", 0), 30)
    sub = WORK / "subscriber" / "subscriber_counts.json"
    before = json.loads(sub.read_text()) if sub.exists() else {}
    st.mark("noprefix_begin", subscriber=before)
    r.sets = (*r.sets, *NOPREFIX_SETS)
    r.start_kvwatch(st)
    env = engine_env(r.args.vllm_site if r.args.engine == "vllm" else None)
    if r.args.engine == "sim":
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    argv = vllm_argv(r.args.engine, r.args.model, False, prefix_caching=False)
    st.pids["vllm"] = start_session(argv, WORK / "vllm_noprefix.log", env=env)
    st.mark("vllm_start", pid=st.pids["vllm"], prefix_caching=False)
    wait_until(lambda: vllm_healthy() or not alive(st.pids["vllm"]), 330, "vLLM /health")
    st.mark("vllm_ready")
    r.find_engine_core(st)
    r.wait_tapped(st)
    r.start_pollers("_np")
    try:
        r.phase(st, "noprefix", STEADY, min(r.t["noprefix"], r.left() - 40))
        time.sleep(3.0)
    finally:
        r.stop_pollers()
    api = str(st.pids["vllm"])
    kv = kvwatch_samples()
    after = json.loads(sub.read_text()) if sub.exists() else {}
    r.results["noprefix"] = {
        "subscriber_before": before,
        "subscriber_after": after,
        "kvwatch_stored": {m: value(kv, "kvwatch_kv_blocks_stored_total", pid=api, medium=m) for m in ("GPU", "CPU")},
        "kvwatch_restored": value(kv, "kvwatch_kv_blocks_restored_total", pid=api, medium="GPU"),
        "ledger": checks.ledger(kv, api),
        "alerts": [a for a in checks.alerts(WORK / "kvwatch.log") if a["onset"] >= st.at("noprefix_begin")["wall"]],
        "phase": checks.engine_snapshot(api),
    }
    stop(st.pids["vllm"], 60)
    for name in ("kvwatch", "subscriber"):
        stop(st.pids.get(name, 0), 30)
    r.save("validation_np.json", st)
    r.pack_logs("logs_np.tar.gz", (WORK / "vllm_noprefix.log",))


def plan_cost(r: Run, st: State) -> None:
    """The third call: vLLM still runs; kvwatch is started and stopped round by round."""
    try:
        r.results["cost"] = cost(r, st)
    finally:
        stop(st.pids["vllm"], 60)
        r.dump_requests("requests_3.jsonl.gz")
        r.save("validation.json", st)
        r.pack_logs("logs_3.tar.gz", tuple((WORK / "cost").glob("kvwatch-*.log")))
        (r.out / "validation.md").write_text(checks.report(r.results))


def kvwatch_for_round(st: State, i: int) -> int:
    """A fresh daemon, waited for until it has attached to the engine core and subscribed."""
    pid = start_session(kvwatch_argv(), WORK / "cost" / f"kvwatch-{i}.log", cwd=WORK)
    wait_until(kvwatch_ready, 60, "kvwatch ready (cost round)")
    core, api = str(st.engine_core_pid), str(st.pids["vllm"])

    def attached() -> bool:
        s = kvwatch_samples()
        probes = not st.engine_core_pid or value(s, "kvwatch_cuda_probes_attached", pid=core) > 0
        return probes and value(s, "kvwatch_kv_event_stream_connected", pid=api) >= 1

    wait_until(attached, 60, "kvwatch attached (cost round)")
    return pid


def cost(r: Run, st: State) -> dict[str, Any]:
    """Rounds alternating kvwatch off/on (order swapped every round): steady then pressure.
    Every mode starts alike: the same idle settle (whether or not a daemon was being started
    in it: the engine finishes the previous pressure phase's offload meanwhile) and a short
    unmeasured steady load that brings the hot prefixes back."""
    rounds: list[dict[str, Any]] = []
    per_round = r.t["round_settle"] + r.t["round_warm"] + r.t["round_steady"] + r.t["round_pressure"]
    for i in range(r.args.rounds):
        for on in (False, True) if i % 2 == 0 else (True, False):
            if r.left() < per_round + 40:
                st.note(f"cost: stopped after {len(rounds)} modes, device time nearly up")
                return {"rounds": rounds}
            t_settle = time.monotonic()
            pid = kvwatch_for_round(st, i) if on else 0
            time.sleep(max(0.0, t_settle + r.t["round_settle"] - time.monotonic()))
            warm = r.load.start(f"cost{i}-warm", STEADY)
            time.sleep(r.t["round_warm"])
            warm.stop()
            entry: dict[str, Any] = {"round": i, "kvwatch": on}
            loads = (("steady", STEADY, r.t["round_steady"]), ("pressure", PRESSURE, r.t["round_pressure"]))
            for name, w, secs in loads:
                run = r.load.start(f"cost{i}-{'on' if on else 'off'}-{name}", w)
                time.sleep(secs)
                run.stop()
                entry[name] = summary(run, (run.started, run.stopped))
            if pid:
                stop(pid, 30)
            rounds.append(entry)
            time.sleep(1.0)
    return {"rounds": rounds, "ratios": checks.cost_ratios(rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan", choices=["first", "second", "cost", "noprefix", "all"], required=True)
    ap.add_argument(
        "--skip", action="append", default=[], choices=["preempt"], help="leave a phase of the first plan out"
    )
    ap.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--kv-events-py", help="dry run: vLLM's kv_events.py, for the subscriber")
    ap.add_argument("--quick", action="store_true", help="dry run: short phases and warm-ups")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds this call may take")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # fresh unique prompts in each call: an earlier call's would hit what it left cached
    args.seed += {"second": 1, "cost": 2, "noprefix": 3}.get(args.plan, 0)
    r = Run(args)
    if args.plan in ("first", "all"):
        st = plan_first(r)
    if args.plan in ("second", "all"):
        if args.plan == "second":
            st = State.load()
            first = WORK / "validation_1.json"
            r.results = json.loads(first.read_text()) if first.exists() else {}
        plan_second(r, st)
    if args.plan == "noprefix":
        st = State.load()
        plan_noprefix(r, st)
    if args.plan in ("cost", "all"):
        if args.plan == "cost":
            st = State.load()
            second = WORK / "validation_2.json"
            r.results = json.loads(second.read_text()) if second.exists() else {}
        plan_cost(r, st)
    print(json.dumps({"left_seconds": round(r.left()), "out": str(args.out)}), flush=True)


if __name__ == "__main__":
    main()
