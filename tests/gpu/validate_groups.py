"""kvwatch on real vLLM 0.26.0 servers of the model shapes with KV cache groups (the lent H200):
closure per group against vLLM's own decoder, the detectors on each shape, and a recording of
the hybrid stream for the CI-side replay. One device call after the bundles are unpacked.

Three servers run side by side on the one GPU, each with prefix caching and KV events over ZMQ,
watched by one kvwatch daemon, each stream also read by an independent subscriber
(``vllm_subscriber.py``: vLLM's classes decode it, a plain multiset books it per group):

* ``hybrid``  — Gemma-3-style (five sliding-window layers of 256 tokens to one full-attention
  layer: six KV cache groups), the OffloadingConnector's CPU tier beside it;
* ``sliding`` — Mistral-style, every layer sliding-window: one group of kind sliding_window;
* ``full``    — the hybrid model again, every request asking for ``kv_cache_report_mode`` full:
  vLLM announces each prefix-cache hit's blocks again as BlockStored.

Phases, on all three at once: ``noshare`` (unique prompts at one client, from the servers'
start: the engine's normal is a workload that shares nothing — KVPrefixCacheIneffective
``not_shared``, info, and nothing else), ``steady`` (24 hot prefixes, 8 clients: no alert),
``pressure`` (unique 900-token prompts, 32 clients: KVEvictionBurst), ``hot`` and ``recover``
(the hot prefixes again: the burst clears). Then, at quiescence, every count per group against
the subscriber's, and the announced blocks against vLLM's own prefix-cache hit counter.

Writes into --out (at most 8 files come back): validation.json, kvwatch_timeline.jsonl.gz,
vllm_metrics.jsonl.gz, stream_{hybrid,sliding,full}.jsonl.gz, requests.jsonl.gz, logs.tar.gz.

    with-bcc python3 tests/gpu/validate_groups.py --out $OUT
    python3 tests/gpu/validate_groups.py --out /tmp/o --engine sim --quick     (dry run, no GPU)
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import vllm_checks as checks
from tests.gpu.vllm_harness import (
    WORK,
    Poller,
    State,
    alive,
    by_label,
    children,
    cmdline,
    comm,
    engine_env,
    get_text,
    kvwatch_argv,
    kvwatch_extract,
    kvwatch_ready,
    kvwatch_samples,
    kvwatch_url,
    parse,
    start_session,
    stop,
    value,
    wait_until,
)
from tests.gpu.vllm_load import NOSHARE, PRESSURE, STEADY, Load, summary

TOPIC = "kv"
FULL = {"noshare": 60, "steady": 60, "pressure": 40, "hot": 25, "recover": 35}
QUICK = {"noshare": 25, "steady": 25, "pressure": 15, "hot": 10, "recover": 25}
SETS = (
    "detectors.reuse_collapse.kv_pool_fraction=0.002",  # tiny models: their KV pools are small
    "detectors.prefix_cache_ineffective.warmup_seconds=30",
    "detectors.prefix_cache_ineffective.window_seconds=20",
    "detectors.prefix_cache_ineffective.min_queried_tokens=5000",
    "detectors.eviction_burst.warmup_seconds=30",
    "detectors.eviction_burst.baseline_min_seconds=30",
    "detectors.eviction_burst.baseline_half_life_seconds=60",
    "detectors.engine_metric_divergence.window_seconds=10",
    "discovery.interval_seconds=1",
)


@dataclass
class Server:
    name: str
    model: str  # under the models directory
    port: int
    kv_port: int
    gpu_blocks: int
    offload: bool = False
    xargs: dict[str, Any] | None = None
    fallback: str = ""  # a model to serve instead, should this one not start
    pid: int = 0
    core: int = 0
    sub_pid: int = 0
    load: Load | None = None
    notes: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def sub_dir(self) -> Path:
        return WORK / f"subscriber_{self.name}"


SERVERS = (
    Server("hybrid", "hybrid", 8000, 5557, 6144, offload=True),
    Server("sliding", "sliding", 8001, 5558, 2048, fallback="sliding_gemma"),
    Server("full", "hybrid", 8002, 5559, 6144, xargs={"kv_cache_report_mode": "full"}),
)


def serve_argv(s: Server, args: argparse.Namespace) -> list[str]:
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{s.kv_port}", "topic": TOPIC}
    argv = [
        "serve", str(Path(args.models) / s.model), "--load-format", "dummy", "--served-model-name", "tiny",
        "--enable-prefix-caching", "--block-size", "16", "--num-gpu-blocks-override", str(s.gpu_blocks),
        "--max-model-len", "2048", "--max-num-seqs", "32", "--gpu-memory-utilization", "0.12",
        "--enforce-eager", "--seed", "0", "--kv-events-config", json.dumps(kv, separators=(",", ":")),
        "--host", "127.0.0.1", "--port", str(s.port), "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if s.offload:
        argv += ["--kv-offloading-size", "2", "--kv-offloading-backend", "native"]
    if args.engine == "sim":
        script = WORK / "bin" / "vllm"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(f"#!{sys.executable}\nfrom kvwatch.daemon.lab.engine_sim_cli import main\n\nmain()\n")
        script.chmod(0o755)
        return [str(script), *argv, "--serve-until-signal"]
    return ["python3", "-m", "vllm.entrypoints.cli.main", *argv]


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.t = QUICK if args.quick else FULL
        self.t0 = time.monotonic()
        self.results: dict[str, Any] = {"servers": {}}
        self.st = State(engine=args.engine)
        keep = ("name", "model", "port", "kv_port", "gpu_blocks", "offload", "xargs", "fallback")
        self.servers = [Server(**{k: getattr(s, k) for k in keep}) for s in SERVERS]
        self.pollers: list[Any] = []

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0)

    def env(self) -> dict[str, str]:
        env = engine_env(self.args.vllm_site if self.args.engine == "vllm" else None)
        if self.args.engine == "sim":
            env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        return env

    # --- processes ----------------------------------------------------------------------------
    def start(self) -> None:
        st = self.st
        pid = start_session(kvwatch_argv(sets=SETS), WORK / "kvwatch.log", cwd=WORK)
        st.pids["kvwatch"] = pid
        st.mark("kvwatch_ready", pid=pid, seconds=round(wait_until(kvwatch_ready, 120, "kvwatch /readyz"), 1))
        for s in self.servers:
            argv = [
                sys.executable if self.args.engine == "sim" else "python3",
                str(Path(__file__).with_name("vllm_subscriber.py")),
            ]
            argv += ["--endpoint", f"tcp://127.0.0.1:{s.kv_port}", "--topic", TOPIC, "--out", str(s.sub_dir)]
            if self.args.kv_events_py:
                argv += ["--kv-events-py", self.args.kv_events_py]
            s.sub_pid = start_session(
                argv, WORK / f"subscriber_{s.name}.log", env=self.env() if self.args.engine == "vllm" else None
            )
            st.pids[f"subscriber_{s.name}"] = s.sub_pid
        for s in self.servers:
            s.pid = start_session(serve_argv(s, self.args), WORK / f"vllm_{s.name}.log", env=self.env())
            st.pids[f"vllm_{s.name}"] = s.pid
            st.mark("vllm_start", server=s.name, pid=s.pid, offload=s.offload)
            time.sleep(self.args.stagger)
        for s in list(self.servers):
            try:
                self.wait_healthy(s)
            except (RuntimeError, TimeoutError) as err:  # the others still run: this one is reported
                st.note(f"{s.name}: {err}")
                self.results["servers"][s.name] = {"failed": str(err), "notes": s.notes}
                stop(s.pid, 10)
                self.servers.remove(s)
        if not self.servers:
            raise RuntimeError("no vLLM server started")
        for s in self.servers:
            self.find_core(s)
        self.wait_tapped()

    def wait_healthy(self, s: Server) -> None:
        def up() -> bool:
            try:
                get_text(s.url("/health"), timeout=2)
            except OSError:
                return not alive(s.pid)
            return True

        wait_until(up, 330, f"vLLM {s.name} /health")
        if alive(s.pid):
            self.st.mark("vllm_ready", server=s.name)
            return
        if s.offload:  # the hybrid model with the CPU tier did not start: once more without it
            s.notes.append("did not start with the OffloadingConnector: see its log; started without")
            s.offload = False
        elif s.fallback:
            s.notes.append(f"model {s.model} did not start: see its log; served {s.fallback} instead")
            s.model, s.fallback = s.fallback, ""
        else:
            raise RuntimeError(f"vLLM {s.name} exited during start-up")
        self.st.note(f"{s.name}: {s.notes[-1]}")
        s.pid = start_session(serve_argv(s, self.args), WORK / f"vllm_{s.name}.log", env=self.env())
        self.st.pids[f"vllm_{s.name}"] = s.pid
        self.wait_healthy(s)

    def find_core(self, s: Server) -> None:
        def core() -> int:
            for c in children(s.pid):
                if comm(c).startswith("VLLM::Engine") or cmdline(c).startswith("VLLM::EngineCore"):
                    return c
            return 0

        if self.args.engine == "vllm":
            wait_until(lambda: core() > 0, 60, f"{s.name}: the engine core")
        s.core = core()

    def wait_tapped(self) -> None:
        def tapped() -> bool:
            kv = kvwatch_samples()
            for s in self.servers:
                api = str(s.pid)
                if value(kv, "kvwatch_kv_event_stream_connected", pid=api) < 1:
                    return False
                if value(kv, "kvwatch_engine_scrapes_total", pid=api, result="ok") <= 0:
                    return False
            return True

        self.st.mark("tapped", seconds=round(wait_until(tapped, 120, "kvwatch tapped every server"), 1))

    def stop_all(self) -> None:
        for s in self.servers:
            stop(s.pid, 60)
        for s in self.servers:
            stop(s.sub_pid, 20)
        stop(self.st.pids.get("kvwatch", 0), 30)

    # --- load ---------------------------------------------------------------------------------------
    def phase(self, name: str, workload: Any, seconds: float) -> None:
        if self.left() < seconds + 60:
            self.st.note(f"phase {name} skipped: {self.left():.0f} s of this call left")
            return
        self.st.mark(f"{name}_start", engine={s.name: self.engine(s) for s in self.servers})
        runs = []
        for s in self.servers:
            assert s.load is not None
            runs.append((s, s.load.start(name, workload)))
        time.sleep(seconds)
        for _, run in runs:
            run.stop(wait=False)
        for s, run in runs:
            run.stop()
            self.results["servers"][s.name].setdefault("phases", {})[name] = summary(run, (run.started, run.stopped))
        self.st.mark(f"{name}_end", engine={s.name: self.engine(s) for s in self.servers})

    def engine(self, s: Server) -> dict[str, float]:
        try:
            vl = parse(get_text(s.url("/metrics"), timeout=3))
        except OSError:
            return {}
        return {
            "queries": value(vl, "vllm:prefix_cache_queries_total"),
            "hits": value(vl, "vllm:prefix_cache_hits_total"),
            "preemptions": value(vl, "vllm:num_preemptions_total"),
            "usage": max((v for n, _, v in vl if n == "vllm:kv_cache_usage_perc"), default=0.0),
        }

    def phases(self) -> None:
        for s in self.servers:
            s.load = Load("127.0.0.1", s.port, "tiny", seed=self.args.seed + s.port, xargs=s.xargs)
            self.results["servers"][s.name] = {"pid": s.pid, "notes": s.notes}
        t = self.t
        self.phase("noshare", NOSHARE, t["noshare"])
        self.phase("steady", STEADY, t["steady"])
        self.phase("pressure", PRESSURE, t["pressure"])
        self.phase("hot", STEADY, t["hot"])
        self.phase("recover", STEADY, t["recover"])

    # --- closure ------------------------------------------------------------------------------------
    def quiesce(self) -> dict[str, dict[str, Any]]:
        time.sleep(3.0)
        counts: dict[str, dict[str, Any]] = {}

        def same() -> bool:
            kv = kvwatch_samples()
            for s in self.servers:
                f = s.sub_dir / "subscriber_counts.json"
                c = json.loads(f.read_text()) if f.exists() else {}
                if value(kv, "kvwatch_kv_event_batches_total", pid=str(s.pid)) != c.get("batches", -1):
                    return False
                counts[s.name] = c
            return True

        try:
            wait_until(same, 60, "kvwatch counted every batch each subscriber did")
        except TimeoutError as err:
            self.st.note(str(err))
        time.sleep(5.5)  # two scrapes of the engines at kvwatch's interval, and a tick
        for s in self.servers:
            f = s.sub_dir / "subscriber_counts.json"
            counts[s.name] = json.loads(f.read_text()) if f.exists() else {}
        return counts

    def closure(self, counts: dict[str, dict[str, Any]]) -> None:
        kv = kvwatch_samples()
        for s in self.servers:
            vl = parse(get_text(s.url("/metrics"), timeout=5))
            r = self.results["servers"][s.name]
            r.update(pid=s.pid, engine_core=s.core, offload=s.offload, model=s.model, xargs=s.xargs)
            r["closure"] = group_closure(counts.get(s.name, {}), kv, vl, str(s.pid))
            r["ledger"] = checks.ledger(kv, str(s.pid))
            r["engine_final"] = self.engine(s)

    # --- outputs ------------------------------------------------------------------------------------
    def start_pollers(self) -> None:
        self.pollers = [
            Poller(kvwatch_url("/metrics"), self.out / "kvwatch_timeline.jsonl.gz", 1.0, kvwatch_extract),
            EnginePoller(self.servers, self.out / "vllm_metrics.jsonl.gz"),
        ]
        for p in self.pollers:
            p.start()

    def save(self) -> None:
        self.results["marks"] = self.st.marks
        self.results["notes"] = self.st.notes
        self.results["pids"] = self.st.pids
        (self.out / "validation.json").write_text(json.dumps(self.results, indent=1, default=str))

    def pack(self) -> None:
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            for p in [*sorted(WORK.glob("*.log")), WORK / "state.json"]:
                if p.exists():
                    tar.add(p, arcname=p.name)
        with gzip.open(self.out / "requests.jsonl.gz", "wt") as f:
            for s in self.servers:
                for r in s.load.dump() if s.load else []:
                    f.write(json.dumps({"server": s.name, **r}) + "\n")
        for s in self.servers:
            src = s.sub_dir / "stream.jsonl.gz"
            if src.exists():
                shutil.copy(src, self.out / f"stream_{s.name}.jsonl.gz")


class EnginePoller(threading.Thread):
    """Every server's vLLM /metrics each second, the families kvwatch reads, into one file."""

    KEEP = ("vllm:prefix_cache", "vllm:kv_cache_usage", "vllm:num_preemptions", "vllm:kv_offload", "vllm:num_requests",
            "vllm:cache_config_info", "vllm:external_prefix_cache")  # fmt: skip

    def __init__(self, servers: list[Server], out: Path) -> None:
        super().__init__(name="poll-engines", daemon=True)
        self.servers, self.out = servers, out
        self.stop_event = threading.Event()
        self.count = self.errors = 0

    def run(self) -> None:
        with gzip.open(self.out, "at", compresslevel=6) as f:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                for s in self.servers:
                    try:
                        text = get_text(s.url("/metrics"), timeout=3)
                    except OSError:
                        self.errors += 1
                        continue
                    keep = [ln for ln in text.splitlines() if ln.startswith(self.KEEP) or ln.startswith("# TYPE vllm:")]
                    f.write(
                        json.dumps({"mono": t0, "wall": time.time(), "server": s.name, "data": "\n".join(keep)}) + "\n"
                    )
                    self.count += 1
                self.stop_event.wait(max(0.0, 1.0 - (time.monotonic() - t0)))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


def group_closure(c: dict[str, Any], kv: list[Any], vl: list[Any], api: str) -> dict[str, Any]:
    """Per (medium, group): kvwatch's counts against the subscriber's; logical counts against the
    reference group's; announced blocks x block size against vLLM's prefix-cache hit tokens."""
    pair = checks.pair
    out: dict[str, Any] = {"groups": {}, "logical": {}}
    books = c.get("groups", {})
    per = {
        what: {
            (lab.get("medium", ""), lab.get("group", "")): v
            for n, lab, v in kv
            if n == f"kvwatch_kv_group_blocks_{what}_total" and lab.get("pid") == api
        }
        for what in ("stored", "removed", "restored", "regretted", "announced")
    }
    resident = {
        (lab.get("medium", ""), lab.get("group", "")): v
        for n, lab, v in kv
        if n == "kvwatch_kv_group_blocks_resident" and lab.get("pid") == api
    }
    for key, book in sorted(books.items()):
        medium, group = key.split(":")
        k = (medium, group)
        if k not in per["stored"]:
            continue  # a medium with one group: its logical counts below are the group's
        out["groups"][key] = {
            "kind": book.get("kind"),
            "stored+announced": pair(per["stored"][k] + per["announced"].get(k, 0), c["group_stored"].get(key, 0)),
            "removed": pair(per["removed"].get(k, 0), c["group_removed"].get(key, 0)),
            "restored": pair(per["restored"].get(k, 0), book["restored"]),
            "regretted": pair(per["regretted"].get(k, 0), book["regretted"]),
            "announced": pair(per["announced"].get(k, 0), book["announced"]),
            "resident": pair(resident.get(k, 0), book["resident"]),
        }
    refs = {
        lab.get("medium"): lab.get("group")
        for n, lab, v in kv
        if n == "kvwatch_kv_cache_group_info" and lab.get("pid") == api and lab.get("reference") == "true"
    }
    for medium in sorted({k.split(":")[0] for k in books}):
        key = f"{medium}:{refs.get(medium, '0')}"
        book = books.get(key, {})
        logical = {
            what: value(kv, f"kvwatch_kv_blocks_{what}_total", pid=api, medium=medium)
            for what in ("stored", "removed", "restored", "regretted", "announced")
        }
        out["logical"][medium] = {
            "reference_group": key,
            "stored+announced": pair(logical["stored"] + logical["announced"], c.get("group_stored", {}).get(key, 0)),
            "removed": pair(logical["removed"], c.get("group_removed", {}).get(key, 0)),
            "restored": pair(logical["restored"], book.get("restored", 0)),
            "regretted": pair(logical["regretted"], book.get("regretted", 0)),
            "announced": pair(logical["announced"], book.get("announced", 0)),
        }
    hits = value(vl, "vllm:prefix_cache_hits_total")
    gpu = out["logical"].get("GPU", {}).get("announced", {}).get("kvwatch", 0.0)
    out["announced_vs_hits"] = {"announced_tokens": gpu * 16, "vllm_prefix_cache_hits": hits, "equal": gpu * 16 == hits}
    out["batches"] = pair(value(kv, "kvwatch_kv_event_batches_total", pid=api), c.get("batches", 0))
    out["gaps"] = pair(value(kv, "kvwatch_kv_event_gaps_total", pid=api), c.get("gaps", 0))
    out["decode_errors"] = by_label(kv, "kvwatch_kv_event_decode_errors_total", "kind", pid=api)
    out["subscriber"] = {k: v for k, v in c.items() if k not in ("groups",)}
    return out


def verdicts(r: Run) -> dict[str, Any]:
    """The alerts by phase: what each server raised, where."""
    marks = {m["name"]: m["wall"] for m in r.st.marks}
    alerts = checks.alerts(WORK / "kvwatch.log")
    out: dict[str, Any] = {}
    for s in r.servers:
        mine = [a for a in alerts if a["pid"] == str(s.pid)]
        phases = []
        for a in mine:
            phase = max((n[: -len("_start")] for n, w in marks.items() if n.endswith("_start") and w <= a["onset"]),
                        key=lambda n: marks[f"{n}_start"], default="before")  # fmt: skip
            phases.append(
                {**a, "phase": phase, "after_phase_start": a["onset"] - marks.get(f"{phase}_start", a["onset"])}
            )
        out[s.name] = phases
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--kv-events-py", help="dry run: vLLM's kv_events.py, for the subscribers")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stagger", type=float, default=8.0, help="seconds between the servers' starts")
    ap.add_argument("--deadline", type=float, default=560.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    r = Run(args)
    r.st.mark("begin")
    try:
        r.start()
        r.start_pollers()
        r.phases()
        r.st.mark("quiesce")
        r.closure(r.quiesce())
        r.results["alerts"] = verdicts(r)
    except Exception as err:
        r.st.note(f"run failed: {err!r}")
        raise
    finally:
        for p in r.pollers:
            p.stop()
        r.save()
        r.stop_all()
        r.pack()
        r.save()
    print(json.dumps({"left_seconds": round(r.left()), "out": str(args.out)}), flush=True)


if __name__ == "__main__":
    main()
