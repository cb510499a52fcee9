"""What kvwatch costs a running inference engine, measured by the engine's own benchmark client:
rounds of the same load with kvwatch on and off, paired and interleaved (root, real kernel).

    # on the H200 (vLLM 0.26.0 started here; one device call: tests/gpu/run_engine_cost_on_device.sh)
    python3 bench/bench_engine_cost.py --engine vllm --client vllm --out OUT
    # dry run without a GPU: a stand-in vLLM (tests/support/vllm_bench_standin.py) and an HTTP load
    sudo .venv/bin/python bench/bench_engine_cost.py --engine standin --client http --pairs 4 --round-seconds 8

The load is vLLM's own client (``vllm bench serve``, imported once: ``engine_clients.py``) with
``--dataset prefix_repetition`` or ``random``; every round's requests are sampled before the
rounds (each round its own seed), while the engine starts when ``--num-prompts`` fixes their
number, after the calibration round otherwise. Rounds run in ABBA pairs (off on | on off | ...,
``pairstats.py``); before every round the same ``--settle`` seconds pass with nothing running,
counted from the moment its mode was proven: for "on", kvwatch's /readyz and its /metrics showing
the engine's processes watched, CUDA probes attached in every EngineCore and the KV event stream
connected; for "off", the daemon stopped, reaped, and none of its BPF programs or uprobes left
(``engine_procs.prove_off``). A fresh daemon starts at each off -> on switch; consecutive rounds of
one mode keep the state.

Per round: vLLM's result (request and output-token throughput, TTFT and TPOT median and p99), and
the engine's CPU seconds from /proc (the server process and every descendant: a uprobe's cost is
charged to the process it traps in) over the client's run, per 1,000 completed requests; with
kvwatch on, kvwatch's own meter over the same round (``kvwatch_uprobe_cost_seconds_total`` of the
engine's processes) and the daemon's own CPU. Each figure's on/off ratio of means comes with a
bootstrap 95 % interval over the pairs; the measured CPU difference stands beside the meter.

Writes OUT/engine_cost.json (every round), OUT/engine_cost.md (the tables), OUT/engine_cost_logs.tar.gz.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import engine_cost_report
from engine_clients import Client, HttpClient, Load, VllmClient
from engine_procs import (
    comm,
    cpu_between,
    cpu_snapshot,
    enable_bpf_stats,
    held_programs,
    process_cpu,
    program_stats,
    prove_off,
    stats_between,
    thread_snapshot,
    threads_between,
    tree,
)
from pairstats import abba

from tests.gpu.vllm_harness import (
    HTTP_PORT,
    KV_PORT,
    KVWATCH_PORT,
    Sample,
    alive,
    cmdline,
    engine_env,
    kvwatch_argv,
    kvwatch_ready,
    kvwatch_samples,
    start_session,
    stop,
    value,
    vllm_argv,
    wait_until,
)

METER = "kvwatch_uprobe_cost_seconds_total"


class Kvwatch:
    """The daemon under test: started fresh, proven attached, stopped, proven gone."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.cmd = shlex.split(args.kvwatch_cmd) if args.kvwatch_cmd else kvwatch_argv()[:3]
        self.port, self.sets, self.logs = args.kvwatch_port, tuple(args.kvwatch_set), logs
        self.tolerate = args.tolerate_other_kvwatch
        self.pin = args.pin
        self.pid: int | None = None
        self.held: set[int] = set()
        self.starts = 0

    def samples(self) -> list[Sample]:
        return kvwatch_samples(self.port)

    def tapped(self, api: int, cores: list[int]) -> dict[str, Any]:
        s = self.samples()
        seen = {lab["pid"] for _, lab, _ in s if lab.get("pid")}
        cuda = {str(p): value(s, "kvwatch_cuda_probes_attached", pid=str(p)) for p in (api, *cores)}
        stream = value(s, "kvwatch_kv_event_stream_connected", pid=str(api))
        shed = sum(value(s, "kvwatch_uprobes_shed", pid=str(p)) for p in (api, *cores))
        watched = [p for p in (api, *cores) if str(p) in seen]
        ok = len(watched) == 1 + len(cores) and all(cuda[str(c)] > 0 for c in cores) and stream >= 1 and not shed
        return {"ok": ok, "watched": watched, "cuda_probes": cuda, "stream_connected": stream, "shed": shed}

    def start(self, api: int, cores: list[int]) -> dict[str, Any]:
        t0 = time.monotonic()
        self.starts += 1
        if port_taken(self.port):  # its /metrics would be read as this daemon's
            raise RuntimeError(f"something already listens on 127.0.0.1:{self.port}: pick --kvwatch-port")
        argv = pinned([*self.cmd, *kvwatch_argv(self.port, self.sets)[3:]], self.pin, 2)
        log = self.logs / f"kvwatch-{self.starts}.log"
        pid = self.pid = start_session(argv, log, cwd=self.logs)
        wait_until(lambda: kvwatch_ready(self.port) or not alive(pid), 120, "kvwatch /readyz")
        if not alive(pid):
            raise RuntimeError(f"kvwatch exited during start:\n{log.read_text()[-3000:]}")
        ready = time.monotonic() - t0
        with contextlib.suppress(TimeoutError):  # recorded below: the round is flagged, not skipped
            wait_until(lambda: self.tapped(api, cores)["ok"], 90, "kvwatch tapped the engine", 0.25)
        self.held = held_programs(pid)
        tap = self.tapped(api, cores)
        return {"action": "start", "pid": pid, "ready_s": round(ready, 2),
                "tapped_s": round(time.monotonic() - t0, 2), "programs_held": len(self.held), **tap}  # fmt: skip

    def stop(self) -> dict[str, Any]:
        pid, t0 = self.pid, time.monotonic()
        if pid:  # the programs it loaded since its start too (a process attached later)
            self.held |= held_programs(pid)
        on_term = stop(pid, 30) if pid else True
        self.pid = None
        proof = prove_off(pid, self.held, tolerate_others=self.tolerate)
        return {"action": "stop", "pid": pid, "exited_on_sigterm": on_term,
                "stop_s": round(time.monotonic() - t0, 2), **proof}  # fmt: skip

    def ensure(self, on: bool, api: int, cores: list[int]) -> dict[str, Any]:
        if on:
            return self.start(api, cores) if self.pid is None else {"action": "kept", **self.tapped(api, cores)}
        if self.pid is not None:
            return self.stop()
        return {"action": "kept", **prove_off(None, self.held, tolerate_others=self.tolerate)}

    def meter(self, pids: list[int]) -> dict[str, float]:
        s = self.samples()
        return {str(p): value(s, METER, pid=str(p)) for p in pids}


def pinned(argv: list[str], pin: str | None, part: int) -> list[str]:
    """``argv`` under ``taskset`` on part ``part`` of ``--pin ENGINE:CLIENT:DAEMON`` (CPU lists): the
    engine's processes and threads, the bench's client and kvwatch's daemon each on their own CPUs, so
    that neither the client nor the daemon takes the engine's cores from it."""
    return ["taskset", "-c", pin.split(":")[part], *argv] if pin else argv


def pin_self(pin: str | None) -> None:
    """This process (the client) on its CPUs, every thread it has and will start."""
    if pin:
        cpus = {c for span in pin.split(":")[1].split(",") for c in cpu_span(span)}
        for tid in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid.name), cpus)


def cpu_span(span: str) -> range:
    lo, _, hi = span.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return int(r.status) == 200
    except OSError:
        return False


def start_engine(args: argparse.Namespace, work: Path) -> int:
    """The server, on --port and --kv-port (vllm_argv's command line otherwise): a port already
    taken would have the bench measure someone else's server."""
    if args.engine == "external":
        return int(args.server_pid)
    for port in (args.port, args.kv_port):
        if port_taken(port):
            raise RuntimeError(f"something already listens on 127.0.0.1:{port}: pick --port / --kv-port")
    argv = vllm_argv("vllm", args.model, sleep_mode=False)
    argv[argv.index("--port") + 1] = str(args.port)
    kv = argv.index("--kv-events-config") + 1
    argv[kv] = argv[kv].replace(f":{KV_PORT}", f":{args.kv_port}")
    env = engine_env(args.vllm_site if args.engine == "vllm" else None)
    if args.engine == "standin":
        from tests.support.vllm_bench_standin import install

        argv = [str(install(work)), *argv[3:]]
    return start_session(pinned(argv, args.pin, 0), work / "engine.log", env=env)


def engine_cores(api: int, wait: float) -> list[int]:
    def cores() -> list[int]:  # the title vLLM sets: in comm, or only in the command line
        return [p for p in tree(api) if comm(p).startswith("VLLM::Engine") or cmdline(p).startswith("VLLM::Engine")]

    try:
        wait_until(lambda: bool(cores()), wait, "the EngineCore process")
    except TimeoutError:
        return []
    return cores()


def make_client(args: argparse.Namespace, logs: Path) -> Client:
    base = f"http://127.0.0.1:{args.port}"
    if args.client == "vllm":
        return VllmClient(base, args.served_model_name, args.tokenizer or args.model, logs / "client.log")
    return HttpClient(base, args.served_model_name)


def per_1000(seconds: float, completed: float) -> float:
    return 1000.0 * seconds / completed if completed else float("nan")


def round_load(ctx: dict[str, Any], pair: int) -> Load:
    """Both rounds of a pair send the same requests (the pair's own seed): a pair's ratio then
    compares the same work, and only the rounds' order and the machine differ."""
    load: Load = ctx["load"]
    return load.with_(seed=ctx["args"].seed + 1 + pair)


def one_round(ctx: dict[str, Any], pair: int, on: bool, index: int, bpf_stats: bool = False) -> dict[str, Any]:
    kv: Kvwatch = ctx["kvwatch"]
    api, cores = ctx["api"], ctx["cores"]
    t_round = time.monotonic()
    toggle = kv.ensure(on, api, cores)
    time.sleep(ctx["args"].settle)  # the same after every proof, on or off
    row: dict[str, Any] = {"round": index, "pair": pair, "kvwatch": on, "toggle": toggle}
    if on:
        row["tapped_before"] = kv.tapped(api, cores)
        m0, d0 = kv.meter([api, *cores]), process_cpu(kv.pid or 0)
    load = round_load(ctx, pair)
    ids = kv.held | held_programs(kv.pid) if bpf_stats and kv.pid else set()
    p0 = program_stats(ids)
    c0, th0, t0 = cpu_snapshot(api), thread_snapshot(cores), time.monotonic()
    res = ctx["client"].run(load)
    c1, th1, wall = cpu_snapshot(api), thread_snapshot(cores), time.monotonic() - t0
    if ids:  # every program's kernel-side time over the client's run, whichever process it ran in
        row["bpf_programs"] = stats_between(p0, program_stats(ids | held_programs(kv.pid or 0)))
    row["core_threads_cpu_s"] = threads_between(th0, th1)  # where in the EngineCore a difference lands
    cpu = cpu_between(c0, c1)
    core_s = sum(v for p, v in cpu["per_pid"].items() if int(p) in cores)
    api_s = cpu["per_pid"].get(str(api), 0.0)
    done = float(res.get("completed") or 0)
    row.update(seed=load.seed, num_prompts=load.num_prompts, wall_s=round(wall, 2), result=res, cpu=cpu)
    row.update(cpu_s_per_1000=per_1000(cpu["total"], done), cpu_api_s_per_1000=per_1000(api_s, done))
    row["cpu_core_s_per_1000"] = per_1000(core_s, done)
    # cores kept busy over the client's run: an EngineCore near 1.0 is CPU-bound (its loop is one thread),
    # and its CPU per request is then the inverse of its throughput
    row.update(cpu_cores_busy=cpu["total"] / wall if wall else float("nan"))
    row.update(core_cores_busy=core_s / wall if wall else float("nan"))
    if on:
        time.sleep(2.5)  # the daemon's ticks after the last request: every trapped call accounted
        m1 = kv.meter([api, *cores])
        meter = row["meter_s"] = {p: m1[p] - m0.get(p, 0.0) for p in m1}
        row["meter_s_per_1000"] = per_1000(sum(meter.values()), done)
        row["meter_api_s_per_1000"] = per_1000(meter[str(api)], done)
        row["meter_core_s_per_1000"] = per_1000(sum(meter[str(c)] for c in cores), done)
        row["daemon_cpu_s_per_1000"] = per_1000(process_cpu(kv.pid or 0) - d0, done)
        row["tapped_after"] = kv.tapped(api, cores)
    row["elapsed_s"] = round(time.monotonic() - t_round, 2)  # toggle + settle + client + meter wait
    print(engine_cost_report.round_line(row), flush=True)
    return row


def attribution_round(ctx: dict[str, Any], out: dict[str, Any]) -> None:
    """One more on round, after the pairs and in none of the ratios, with the kernel's BPF
    statistics on: each of kvwatch's programs' runs and run time over the load, which names the
    probe a cost difference comes from (the statistics add two clock reads to every run, so they
    stay off in the measured rounds). A uprobe's traps are not in them: the meter has those."""
    fd = enable_bpf_stats()
    try:
        out["attribution"] = one_round(ctx, 0, True, len(out["rounds"]), bpf_stats=True)
    finally:
        os.close(fd)


def calibrate(ctx: dict[str, Any]) -> dict[str, Any]:
    """An unmeasured round with kvwatch off (it warms the engine); the prompts per round that make
    a round last --round-seconds at the throughput it reached."""
    args = ctx["args"]
    proof = prove_off(None, set(), tolerate_others=args.tolerate_other_kvwatch)
    res = ctx["client"].run(warmup_load(ctx))
    n = args.num_prompts or max(50, round(args.round_seconds * float(res["request_throughput"]) / 10) * 10)
    ctx["load"] = ctx["load"].with_(num_prompts=n)
    return {"warmup": res, "num_prompts": n, "off_before": proof}


def warmup_load(ctx: dict[str, Any]) -> Load:
    load: Load = ctx["load"]
    return load.with_(num_prompts=ctx["args"].warmup_prompts, seed=ctx["args"].seed)


def presample(ctx: dict[str, Any], out: dict[str, Any]) -> None:
    """Every round's requests, sampled before the rounds (each round its own seed): a round then
    pays only for its requests. With --num-prompts this runs while the engine starts."""
    client: Client = ctx["client"]
    t0 = time.monotonic()
    for pair in range(ctx["args"].pairs):
        client.prepare(round_load(ctx, pair))
    out["presample_s"] = round(out.get("presample_s", 0.0) + time.monotonic() - t0, 1)


def run(args: argparse.Namespace, out: dict[str, Any], ctx: dict[str, Any]) -> None:
    """Fills ``out`` as it goes (what was measured before a failure is still written); leaves the
    engine running (``ctx["api"]``): the caller writes the results first."""
    t0 = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    out.update(args={k: str(v) for k, v in vars(args).items()}, rounds=[], notes=[])
    api = ctx["api"] = start_engine(args, args.work)
    ctx.update(args=args, kvwatch=Kvwatch(args, args.work))
    try:
        ctx["client"] = make_client(args, args.work)  # vLLM's import overlaps the server's start
        out["client_import_s"] = round(getattr(ctx["client"], "import_seconds", 0.0), 1)
        ctx["load"] = Load(args.dataset, args.num_prompts, args.concurrency, args.prefix_len, args.suffix_len,
                           args.num_prefixes, args.input_len, args.output_len, args.seed)  # fmt: skip
        if args.num_prompts:  # the rounds' size is known: sample them while the engine starts
            ctx["client"].prepare(warmup_load(ctx))
            presample(ctx, out)
        wait_until(lambda: healthy(args.port) or not alive(api), 330, "the engine's /health")
        if not alive(api):
            raise RuntimeError("the engine exited during start: see engine.log in the logs")
        out["engine_ready_s"] = round(time.monotonic() - t0, 1)
        ctx["cores"] = engine_cores(api, 0 if args.engine == "external" else 60)
        out["engine"] = {"api": api, "cores": ctx["cores"]}
        out["calibration"] = calibrate(ctx)
        if not args.num_prompts:
            presample(ctx, out)
        rounds(ctx, out, t0)
        if args.bpf_stats_round:
            attribution_round(ctx, out)
    finally:
        if ctx["kvwatch"].pid is not None:
            out["final_stop"] = ctx["kvwatch"].stop()
        out["total_s"] = round(time.monotonic() - t0, 1)


def rounds(ctx: dict[str, Any], out: dict[str, Any], t0: float) -> None:
    """Pairs while the deadline leaves time for them, two at a time (a whole ABBA block, so that
    drift cancels), each as long as the longest so far."""
    args, longest = ctx["args"], 0.0
    for pair in range(args.pairs):
        pair_s = longest or 2 * (args.round_seconds + args.settle) + 40
        # a whole ABBA block ahead at its start, and the statistics round (half a pair) after the last
        need = pair_s * (2 if pair % 2 == 0 else 1) + (pair_s / 2 if args.bpf_stats_round else 0)
        if args.deadline - (time.monotonic() - t0) < need + 20:
            per = "per two pairs (one ABBA block)" if pair % 2 == 0 else "per pair"
            out["notes"].append(f"stopped after {pair} pairs: {need:.0f} s needed {per}, deadline near")
            break
        tp = time.monotonic()
        if not alive(ctx["api"]):
            raise RuntimeError("the engine exited: see engine.log in the logs")
        for p, on in abba(args.pairs)[2 * pair : 2 * pair + 2]:
            out["rounds"].append(one_round(ctx, p, on, len(out["rounds"])))
        longest = max(longest, time.monotonic() - tp)


def options() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "engine_cost_run")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvw-engine-cost"), help="logs, the stand-in's script")
    ap.add_argument("--engine", choices=["vllm", "standin", "external"], default="vllm")
    ap.add_argument("--server-pid", type=int, help="--engine external: the server's pid (on --port)")
    ap.add_argument("--client", choices=["vllm", "http"], default="vllm")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--round-seconds", type=float, default=20.0, help="round length, by calibrated prompts")
    ap.add_argument("--num-prompts", type=int, default=0, help="prompts per round (0: calibrate)")
    ap.add_argument("--warmup-prompts", type=int, default=300)
    ap.add_argument("--settle", type=float, default=3.0, help="idle seconds after every mode is proven")
    ap.add_argument("--dataset", choices=["prefix_repetition", "random"], default="prefix_repetition")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--num-prefixes", type=int, default=10)
    ap.add_argument("--input-len", type=int, default=512, help="--dataset random")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pin",
        help="ENGINE:CLIENT:DAEMON CPU lists (taskset -c syntax, e.g. 0-7:8-11:12-15): each on its own CPUs",
    )
    ap.add_argument(
        "--bpf-stats-round",
        action="store_true",
        help="after the pairs, one on round with the kernel's BPF statistics on: each program's run time",
    )
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds this run may take")
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--served-model-name", default="tiny")
    ap.add_argument("--tokenizer", help="default: --model")
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--port", type=int, default=HTTP_PORT, help="the engine's HTTP port")
    ap.add_argument("--kv-port", type=int, default=KV_PORT, help="the engine's KV event port")
    ap.add_argument("--kvwatch-cmd", help="command that runs `python -m kvwatch.daemon` (default: this Python)")
    ap.add_argument("--kvwatch-port", type=int, default=KVWATCH_PORT)
    ap.add_argument("--kvwatch-set", action="append", default=[], help="KEY=VALUE for the daemon, repeatable")
    ap.add_argument(
        "--tolerate-other-kvwatch",
        action="store_true",
        help="off is clean although other kvwatch daemons (test runs) hold kvw_* programs (they may probe the engine)",
    )
    return ap.parse_args()


def main() -> None:
    args = options()
    if args.pin and len(args.pin.split(":")) != 3:
        raise SystemExit(f"--pin {args.pin!r}: ENGINE:CLIENT:DAEMON, three CPU lists")
    pin_self(args.pin)
    # SIGTERM (the device call's end, a kill) unwinds through the finally blocks: results written,
    # kvwatch and the engine stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    ctx: dict[str, Any] = {}
    try:
        run(args, result, ctx)
    finally:
        result["summary"] = engine_cost_report.summarize(result.get("rounds", []))
        (args.out / "engine_cost.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "engine_cost.md").write_text(engine_cost_report.render(result))
        with tarfile.open(args.out / "engine_cost_logs.tar.gz", "w:gz") as tar:
            for p in sorted(args.work.glob("*.log")):
                tar.add(p, arcname=p.name)
        if ctx.get("api") and args.engine != "external":
            stop(ctx["api"], 60)
    print((args.out / "engine_cost.md").read_text())


if __name__ == "__main__":
    main()
