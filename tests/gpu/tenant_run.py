"""The processes, tenants and phases of the tenant validation (``validate_tenants.py``): kvwatch
with its tenant config, one vLLM server (LoRA adapters when it serves them), the independent
subscriber, each tenant's closed-loop load, the recorders.

Every tenant has one ``Load`` (its requests carry its ``cache_salt``, or name its adapter as the
model); a phase is a plan, tenant -> workload: a tenant whose workload stays the same from one
phase to the next keeps running across the boundary, the others stop or start at it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import hmac
import json
import shutil
import sys
import tarfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gpu import tenant_lora
from tests.gpu.vllm_harness import (
    KVWATCH_KEEP,
    WORK,
    Poller,
    State,
    alive,
    engine_env,
    get_text,
    kvwatch_argv,
    kvwatch_ready,
    kvwatch_samples,
    kvwatch_url,
    parse,
    start_session,
    stop,
    value,
    wait_until,
)
from tests.gpu.vllm_load import Client, Load, Run, Workload, summary

TOPIC, PORT, KV_PORT = "kv", 8000, 5557
SERVED = "tiny"
SETS = (
    "detectors.tenant_thrash.warmup_seconds=30",
    "detectors.tenant_thrash.baseline_min_seconds=20",
    "detectors.tenant_thrash.baseline_half_life_seconds=60",
    "detectors.tenant_thrash.window_seconds=10",
    "detectors.tenant_thrash.floor_regretted_per_second=1",
    "discovery.interval_seconds=1",
)


@dataclass(frozen=True)
class Tenant:
    name: str  # the label kvwatch must export (the subscriber's placeholder for an unnamed salt)
    salt: str | None = None
    adapter: str | None = None
    named: bool = True  # in kvwatch's [[engines.tenants]]
    by_sha256: bool = False  # named there by the salt's SHA-256, not the salt


TENANTS = {
    "a": Tenant("tenant-a", salt="salt-tenant-a"),
    "b": Tenant("tenant-b", salt="salt-tenant-b"),
    "c": Tenant("salt-*", salt="salt-tenant-c", named=False),
    "x": Tenant("adapter-x", adapter="lora-x"),
    "y": Tenant("lora:lora-y", adapter="lora-y", named=False),
}
ADAPTERS = ("x", "y")
# issue 36: three salted tenants, one named by its salt's SHA-256 and two unnamed, no adapters
TENANTS_36 = {
    "a": Tenant("tenant-a", salt="salt-tenant-a", by_sha256=True),
    "c": Tenant("salt-*", salt="salt-tenant-c", named=False),
    "d": Tenant("salt-*", salt="salt-tenant-d", named=False),
}


A_HOT = Workload("hot", clients=4, hot=32)  # 640 blocks of hot prefixes, reused every ~second
C_LIGHT = Workload("hot", clients=1, hot=2)
ADAPTER = Workload("hot", clients=1, hot=2)
B_FLOOD = Workload("unique", clients=24, unique_tokens=1024)  # 64 blocks each, never reused
A_SELF = Workload("hot", clients=8, hot=160)  # 3,200 blocks of prefixes: more than the pool
# the phases' plans: tenant -> workload
SOLO = {"a": A_HOT, "c": C_LIGHT, "x": ADAPTER, "y": ADAPTER}
NOISY = {**SOLO, "b": B_FLOOD}
RECOVER = {"a": A_HOT}
SELFTHRASH = {"a": A_SELF}
C_HOT = Workload("hot", clients=2, hot=16)  # issue 36's second steady hot tenant
D_FLOOD = Workload("unique", clients=24, unique_tokens=1024)  # issue 36's flooder
PLANS = {
    "issue24": {"solo": SOLO, "noisy": NOISY, "recover": RECOVER, "selfthrash": SELFTHRASH},
    "issue36": {
        "solo": {"a": A_HOT, "c": C_HOT},
        "noisy": {"a": A_HOT, "c": C_HOT, "d": D_FLOOD},
        "recover": {"a": A_HOT, "c": C_HOT},
        "selfthrash": SELFTHRASH,
    },
    # issue 36's regret after a flood longer than the old memory: c parks through the flood (its
    # hot set evicted in the flood's first seconds) and comes back after it
    "issue36park": {
        "solo": {"a": A_HOT, "c": C_HOT},
        "noisy": {"a": A_HOT, "d": D_FLOOD},
        "recover": {"a": A_HOT, "c": C_HOT},
        "selfthrash": SELFTHRASH,
    },
}
AGGRESSOR = {"issue24": "b", "issue36": "d", "issue36park": "d"}


def known(path: str) -> bool:
    """Whether kvwatch's config (this tree's) has the dotted key."""
    import msgspec

    from kvwatch.daemon.config import Config

    model: Any = Config
    for part in path.split("."):
        if not (isinstance(model, type) and issubclass(model, msgspec.Struct)):
            return False
        fields = {f.name: f.type for f in msgspec.structs.fields(model)}
        if part not in fields:
            return False
        model = fields[part]
    return True


def config_toml(tenants: dict[str, Tenant], key_file: Path) -> str:
    lines = ["[engines]", "tenant_top_k = 8", f'tenant_key_file = "{key_file}"', ""]
    for t in tenants.values():
        if t.named:
            which = f'salt = "{t.salt}"' if t.salt else f'lora = "{t.adapter}"'
            if t.by_sha256 and t.salt:
                which = f'salt_sha256 = "{hashlib.sha256(t.salt.encode()).hexdigest()}"'
            lines += ["[[engines.tenants]]", f'name = "{t.name}"', which, ""]
    return "\n".join(lines)


class RssSampler(threading.Thread):
    """The daemon's resident memory (VmRSS, RssAnon, KiB) every ``every`` seconds, from /proc."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        super().__init__(name="rss", daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.every):
            try:
                fields = dict(
                    ln.split(":", 1) for ln in Path(f"/proc/{self.pid}/status").read_text().splitlines() if ":" in ln
                )
            except OSError:
                return
            kib = [int(fields.get(k, "0 kB").split()[0]) for k in ("VmRSS", "RssAnon")]
            self.samples.append((time.monotonic(), kib[0], kib[1]))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)

    def summary(self, marks: list[dict[str, Any]]) -> dict[str, Any]:
        """Peak RSS and anonymous memory (MiB) over the run and in each phase."""

        def peak(rows: list[tuple[float, int, int]]) -> dict[str, float]:
            return {
                "rss_mib": round(max((r[1] for r in rows), default=0) / 1024, 1),
                "anon_mib": round(max((r[2] for r in rows), default=0) / 1024, 1),
            }

        out: dict[str, Any] = {"run": peak(self.samples), "samples": len(self.samples)}
        for m in marks:
            if m["name"].endswith("_start"):
                end = next((e["mono"] for e in marks if e["name"] == m["name"][:-6] + "_end"), float("inf"))
                out[m["name"][:-6]] = peak([r for r in self.samples if m["mono"] <= r[0] <= end])
        return out


class TenantRun:
    def __init__(self, args: argparse.Namespace, seconds: Mapping[str, float], reserve: float) -> None:
        self.args, self.t, self.reserve = args, seconds, reserve
        self.out: Path = args.out
        self.t0 = time.monotonic()
        self.st = State(engine=args.engine)
        self.all_tenants = TENANTS_36 if args.scenario.startswith("issue36") else TENANTS
        self.tenants = {k: t for k, t in self.all_tenants.items() if args.lora or k not in ADAPTERS}
        self.labels: dict[str, str] = {}  # tenant key -> kvwatch's label
        self.results: dict[str, Any] = {"phases": {}, "lora": {"requested": args.lora}, "config": {}}
        self.pid = self.sub_pid = 0
        self.loads: dict[str, Load] = {}
        self.running: dict[str, tuple[Workload, Run]] = {}
        self.pollers: list[Poller] = []
        self.rss: RssSampler | None = None

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{PORT}{path}"

    # --- processes ----------------------------------------------------------------------------
    def start(self) -> None:
        self.start_kvwatch()
        self.start_subscriber()
        self.start_vllm()
        api = str(self.pid)

        def tapped() -> bool:
            kv = kvwatch_samples()
            return (value(kv, "kvwatch_kv_event_stream_connected", pid=api) >= 1
                    and value(kv, "kvwatch_engine_scrapes_total", pid=api, result="ok") > 0)  # fmt: skip

        seconds = round(wait_until(tapped, 120, "kvwatch tapped the server"), 1)
        self.st.mark("tapped", seconds=seconds, subscriber_batches=self.counts().get("batches", 0))
        self.probe_adapters()  # after the tap: kvwatch sees every batch the subscriber does
        for k, t in self.tenants.items():
            extra = {"cache_salt": t.salt} if t.salt else None
            self.loads[k] = Load("127.0.0.1", PORT, t.adapter or SERVED, seed=self.args.seed + ord(k), extra=extra)

    def start_kvwatch(self) -> None:
        wanted = [x for x in SETS if x.startswith("discovery.")] if self.args.defaults else list(SETS)
        sets = [s for s in wanted if known(s.split("=", 1)[0])]
        dropped = [s for s in wanted if s not in sets]
        if dropped:
            self.st.note(f"kvwatch's config has no {', '.join(s.split('=')[0] for s in dropped)}: not set")
        toml = WORK / "kvwatch.toml"
        if known("engines.tenants"):
            toml.write_text(config_toml(self.tenants, WORK / "tenant.key"))
        else:
            self.st.note("kvwatch's config has no engines.tenants: no tenant named")
            toml.write_text("")
        self.results["config"] = {
            "sets": sets,
            "dropped": dropped,
            "named": {k: t.name for k, t in self.tenants.items()},
        }
        argv = [*kvwatch_argv(sets=tuple(sets)), "--config", str(toml)]
        self.st.pids["kvwatch"] = pid = start_session(argv, WORK / "kvwatch.log", cwd=WORK)
        self.st.mark("kvwatch_ready", pid=pid, seconds=round(wait_until(kvwatch_ready, 120, "kvwatch /readyz"), 1))

    def unnamed_labels(self) -> dict[str, str]:
        """Each unnamed salt's placeholder (``salt-*`` and its tenant's key) -> the label kvwatch
        gives it by its documented rule ("salt-" and 8 hex of HMAC-SHA256(node key, salt)), from
        the key kvwatch made when it first saw a salt: so each unnamed salt is counted apart."""
        try:
            key = (WORK / "tenant.key").read_bytes()
        except OSError as err:
            self.st.note(f"no tenant key to name unnamed salts with: {err!r}")
            return {}
        return {
            f"salt-*{k}": "salt-" + hmac.new(key, t.salt.encode(), hashlib.sha256).hexdigest()[:8]
            for k, t in self.tenants.items()
            if t.salt and not t.named
        }

    def start_subscriber(self) -> None:
        apart = self.args.scenario.startswith("issue36")  # several unnamed salts: each its own placeholder
        unnamed = {t.salt: f"salt-*{k}" for k, t in self.tenants.items() if apart and t.salt and not t.named}
        names = {
            "salts": {**{t.salt: t.name for t in self.tenants.values() if t.salt and t.named}, **unnamed},
            "loras": {t.adapter: t.name for t in self.tenants.values() if t.adapter and t.named},
        }
        (WORK / "names.json").write_text(json.dumps(names))
        sim = self.args.engine == "sim"
        argv = [sys.executable if sim else "python3", str(Path(__file__).with_name("tenant_subscriber.py"))]
        argv += ["--endpoint", f"tcp://127.0.0.1:{KV_PORT}", "--topic", TOPIC, "--out", str(WORK / "subscriber")]
        argv += ["--names", str(WORK / "names.json"), "--thrash-seconds", str(self.thrash_seconds())]
        if self.args.kv_events_py:
            argv += ["--kv-events-py", self.args.kv_events_py]
        env = None if sim else engine_env(self.args.vllm_site)
        self.st.pids["subscriber"] = self.sub_pid = start_session(argv, WORK / "subscriber.log", env=env)

    def thrash_seconds(self) -> float:
        from kvwatch.daemon.config import Config

        return float(Config().engines.thrash_seconds)

    def serve_argv(self, lora: bool) -> list[str]:
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_PORT}", "topic": TOPIC}
        argv = [
            "serve", self.args.model, "--load-format", "dummy", "--served-model-name", SERVED,
            "--enable-prefix-caching", "--block-size", "16", "--num-gpu-blocks-override", str(self.args.gpu_blocks),
            "--max-model-len", "2048", "--max-num-seqs", "40", "--gpu-memory-utilization", "0.3",
            "--enforce-eager", "--seed", "0", "--kv-events-config", json.dumps(kv, separators=(",", ":")),
            "--host", "127.0.0.1", "--port", str(PORT), "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.args.cpu_tier > 0:  # vLLM's OffloadingConnector: a CPU tier of this many GiB
            argv += ["--kv-offloading-size", str(self.args.cpu_tier), "--kv-offloading-backend", "native"]
        if lora:
            mods = [f"{self.tenants[k].adapter}={WORK / 'loras' / str(self.tenants[k].adapter)}" for k in ADAPTERS]
            argv += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *mods]
        if self.args.engine == "sim":
            script = WORK / "bin" / "vllm"
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(f"#!{sys.executable}\nfrom kvwatch.daemon.lab.engine_sim_cli import main\n\nmain()\n")
            script.chmod(0o755)
            return [str(script), *argv, "--serve-until-signal"]
        return ["python3", "-m", "vllm.entrypoints.cli.main", *argv]

    def start_vllm(self) -> None:
        lora = any(k in self.tenants for k in ADAPTERS)
        if lora and self.args.engine == "vllm":
            try:
                for i, k in enumerate(ADAPTERS):
                    tenant_lora.write(Path(self.args.model), WORK / "loras", str(self.tenants[k].adapter), seed=i + 1)
            except (OSError, ValueError, KeyError) as err:
                self.results["lora"]["failure"] = f"writing the adapters: {err!r}"
                self.drop_adapters()
                lora = False
        env = engine_env(self.args.vllm_site) if self.args.engine == "vllm" else None
        for attempt in (lora, False) if lora else (False,):
            self.st.pids["vllm"] = self.pid = start_session(self.serve_argv(attempt), WORK / "vllm.log", env=env)
            self.st.mark("vllm_start", pid=self.pid, lora=attempt)
            if self.wait_healthy():
                self.results["lora"]["served"] = attempt
                self.st.mark("vllm_ready", lora=attempt)
                return
            why = self.log_tail(WORK / "vllm.log")
            self.st.note(f"vLLM (lora={attempt}) did not start: {why[-600:]}")
            if attempt:
                self.results["lora"]["failure"] = why
                self.drop_adapters()
        raise RuntimeError("vLLM did not start")

    def wait_healthy(self) -> bool:
        def up() -> bool:
            try:
                get_text(self.url("/health"), timeout=2)
            except OSError:
                return not alive(self.pid)
            return True

        try:
            wait_until(up, max(60.0, min(330.0, self.left() - self.reserve - 60)), "vLLM /health")
        except TimeoutError as err:
            self.st.note(str(err))
        if alive(self.pid) and up():
            return True
        stop(self.pid, 10)
        return False

    def probe_adapters(self) -> None:
        """One request per adapter: an adapter vLLM does not serve is dropped, its answer kept."""
        for k in [k for k in ADAPTERS if k in self.tenants]:
            c = Client("127.0.0.1", PORT, str(self.tenants[k].adapter), timeout=60)
            try:
                c.complete(list(range(100, 148)), 2, False)
            except Exception as err:
                self.results["lora"]["failure"] = f"{self.tenants[k].adapter}: {err}"
                self.st.note(f"adapter {self.tenants[k].adapter} not served: {err}")
                self.drop_adapters()
                return
            finally:
                c.close()

    def drop_adapters(self) -> None:
        for k in ADAPTERS:
            self.tenants.pop(k, None)

    @staticmethod
    def log_tail(path: Path, lines: int = 40) -> str:
        text = path.read_text(errors="replace") if path.exists() else ""
        tail = text.splitlines()[-lines:]
        errors = [ln for ln in tail if "Error" in ln or "error" in ln]
        return "\n".join(errors[-8:] or tail[-8:])

    def stop_all(self) -> None:
        self.stop_loads()
        stop(self.pid, 60)
        stop(self.sub_pid, 20)
        stop(self.st.pids.get("kvwatch", 0), 30)

    # --- load ---------------------------------------------------------------------------------
    def phase(self, name: str, plan: dict[str, Workload], seconds: float) -> None:
        seconds = min(seconds, self.left() - self.reserve)
        if seconds < 15:
            self.st.note(f"phase {name} skipped: {self.left():.0f} s of this call left")
            return
        plan = {k: w for k, w in plan.items() if k in self.tenants}
        before = self.engine()
        self.st.mark(f"{name}_start", engine=before, tenants=sorted(plan))
        t0 = time.monotonic()
        leaving = [k for k, (w, _) in self.running.items() if plan.get(k) != w]
        for k in leaving:
            self.running[k][1].stop(wait=False)
        for k in leaving:
            self.running.pop(k)[1].stop()
        for k, w in plan.items():
            if k not in self.running:
                self.running[k] = (w, self.loads[k].start(name, w))
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        t1 = time.monotonic()
        after = self.engine()
        self.st.mark(f"{name}_end", engine=after)
        per = {self.tenants[k].name: {**summary(run, (t0, t1)), "phase": name} for k, (_, run) in self.running.items()}
        delta = {k: after[k] - before[k] for k in ("queries", "hits", "preemptions") if k in before and k in after}
        if delta.get("queries"):
            delta["hit_ratio"] = delta["hits"] / delta["queries"]
        self.results["phases"][name] = {"seconds": round(t1 - t0, 2), "tenants": per, "vllm": delta}

    def stop_loads(self) -> None:
        for _, run in self.running.values():
            run.stop(wait=False)
        for _, run in self.running.values():
            run.stop()
        self.running.clear()

    def engine(self) -> dict[str, float]:
        """vLLM's own prefix-cache counters now (the phase marks carry them)."""
        try:
            vl = parse(get_text(self.url("/metrics"), timeout=3))
        except OSError:
            return {}
        return {
            "queries": value(vl, "vllm:prefix_cache_queries_total"),
            "hits": value(vl, "vllm:prefix_cache_hits_total"),
            "preemptions": value(vl, "vllm:num_preemptions_total"),
            "usage": max((v for n, _, v in vl if n == "vllm:kv_cache_usage_perc"), default=0.0),
        }

    # --- readings -----------------------------------------------------------------------------
    def counts(self) -> dict[str, Any]:
        f = WORK / "subscriber" / "tenant_counts.json"
        return json.loads(f.read_text()) if f.exists() else {}

    def tick(self) -> int:
        return int(json.loads(get_text(kvwatch_url("/api/v1/top")))["header"]["tick"])

    def secret_salts(self) -> dict[str, str]:
        return {t.name if t.named else f"tenant-{k}": t.salt for k, t in self.all_tenants.items() if t.salt}

    # --- outputs ------------------------------------------------------------------------------
    def start_pollers(self) -> None:
        keep = (*KVWATCH_KEEP, "kvwatch_kv_tenant", "kvwatch_kv_regret", "kvwatch_kv_event_")
        vkeep = ("vllm:prefix_cache", "vllm:kv_cache_usage", "vllm:num_preemptions", "vllm:num_requests", "vllm:lora")
        self.pollers = [
            Poller(kvwatch_url("/metrics"), self.out / "kvwatch_timeline.jsonl.gz", 1.0,
                   lambda text: [s for s in parse(text) if s[0].startswith(keep)]),
            Poller(self.url("/metrics"), self.out / "vllm_metrics.jsonl.gz", 1.0,
                   lambda text: "\n".join(ln for ln in text.splitlines() if ln.startswith(vkeep))),
            Poller(kvwatch_url("/api/v1/top"), self.out / "top_alerts.jsonl.gz", 1.0,
                   lambda text: json.loads(text).get("alerts")),
        ]  # fmt: skip
        for p in self.pollers:
            p.start()
        self.rss = RssSampler(self.st.pids["kvwatch"])
        self.rss.start()

    def stop_pollers(self) -> None:
        for p in self.pollers:
            p.stop()
        if self.rss is not None:
            self.rss.stop()
            self.results["daemon_memory"] = self.rss.summary(self.st.marks)

    def save(self) -> None:
        self.results.update(marks=self.st.marks, notes=self.st.notes, pids=self.st.pids)
        (self.out / "validation.json").write_text(json.dumps(self.results, indent=1, default=str))

    def pack(self) -> None:
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            for p in [*sorted(WORK.glob("*.log")), WORK / "state.json", WORK / "kvwatch.toml"]:
                if p.exists():
                    tar.add(p, arcname=p.name)
        with gzip.open(self.out / "requests.jsonl.gz", "wt") as f:
            for k, load in self.loads.items():
                for r in load.dump():
                    f.write(json.dumps({"tenant": self.labels.get(k, self.all_tenants[k].name), **r}) + "\n")
        src = WORK / "subscriber" / "stream.jsonl.gz"
        if src.exists():
            shutil.copy(src, self.out / "stream.jsonl.gz")
