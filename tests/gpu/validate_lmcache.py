"""kvwatch's kernel side under a real LMCache disk tier (issue 25): vLLM 0.26.0 with
``LMCacheConnectorV1`` on the lent H200, the disk tier's page cache squeezed by the kernel.

Two device calls after the bundles are unpacked (``run_lmcache_on_device.sh``); the server,
kvwatch and the cgroup outlive the first:

``--step start``   kvwatch (no KV directory configured), vLLM with LMCache in a memory cgroup,
                   ``warm`` (64 hot 1,024-token prefixes, 8 clients: 2 GiB of chunk files) and
                   ``steady`` (the same for ``--steady`` seconds: no alert may fire).
``--step squeeze`` ``kvwatch record`` started; ``pre`` (load resumed), ``squeeze`` (the cgroup
                   limited to what it holds, a hog inside it: KVHostTierEvictionUnderPressure
                   must fire while vLLM reads its chunks back), ``quiet`` (load stopped, a
                   second hog: kvwatch's reclaim bytes against mincore's residency lost, exact),
                   ``release`` (hogs gone, limit lifted: the alert clears), ``sizelimit``
                   (unique prompts past LMCache's disk limit: LMCache deletes its own chunks,
                   ``policy``, no alert); then the closure at quiescence.

Ground truths: mincore over the tier's files, the files' sizes, LMCache's and vLLM's own
/metrics, the cgroup's memory.stat. Writes validation.json (and timelines) into --out.

    with-bcc python3 tests/gpu/validate_lmcache.py --step start --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import lmcache_checks as checks
from tests.gpu import lmcache_run as lr
from tests.gpu.tenant_checks import alerts, by_phase
from tests.gpu.vllm_harness import (
    WORK,
    Poller,
    State,
    alive,
    get_text,
    kill,
    kvwatch_argv,
    kvwatch_ready,
    kvwatch_samples,
    kvwatch_url,
    parse,
    start_session,
    stop,
    wait_until,
)
from tests.gpu.vllm_load import Load, Run, Workload, summary

HOT = Workload("hot", clients=8, hot=64, prefix_tokens=1024, max_tokens=4)
UNIQUE = Workload("unique", clients=8, unique_tokens=1024, max_tokens=4)
SETS = ("discovery.interval_seconds=1",)
KEEP = (
    "kvwatch_pagecache_",
    "kvwatch_kv_tier_files",
    "kvwatch_kv_lost_",
    "kvwatch_engine_kv_tier_",
    "kvwatch_alert_active",
    "kvwatch_alerts_fired_total",
    "kvwatch_direct_reclaim_",
    "kvwatch_memory_pressure",
    "kvwatch_watched_processes",
    "kvwatch_process_",
    "kvwatch_probe_run",
)
VKEEP = ("lmcache:", "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
         "vllm:prefix_cache", "vllm:num_requests")  # fmt: skip


class Residency(threading.Thread):
    """The tier's files, bytes, resident pages and the cgroup's memory every ``every`` seconds."""

    def __init__(self, disk: Path, cg: lr.Cgroup, out: Path, every: float = 2.0) -> None:
        super().__init__(name="residency", daemon=True)
        self.disk, self.cg, self.out, self.every = disk, cg, out, every
        self.stop_event = threading.Event()
        self.names: set[str] = set()

    def run(self) -> None:
        with gzip.open(self.out, "at") as f:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                r: dict[str, Any] = {"mono": t0, "wall": time.time(), **lr.residency(self.disk)}
                self.names.update(p.name for p in lr.tier_files(self.disk))
                with contextlib.suppress(OSError):
                    r["cg_usage"], r["cg_refaults"] = self.cg.usage(), self.cg.refaults()
                f.write(json.dumps(r) + "\n")
                self.stop_event.wait(max(0.0, self.every - (time.monotonic() - t0)))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=20)


class LMRun:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out, self.t0 = args, args.out, time.monotonic()
        self.st = State.load()
        rp = WORK / "results.json"
        self.res: dict[str, Any] = json.loads(rp.read_text()) if rp.exists() else {"phases": {}}
        self.disk = Path(self.res.get("disk", "/nonexistent"))
        self.load = Load("127.0.0.1", lr.PORT, lr.SERVED, seed=args.seed)
        self.run: Run | None = None
        self.pollers: list[Any] = []

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.res.update(marks=self.st.marks, notes=self.st.notes, pids=self.st.pids)
        lr.save_json(WORK / "results.json", self.res)
        lr.save_json(self.out / "validation.json", self.res)
        self.st.save()

    # --- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        self.res["machine"] = lr.machine_facts()
        self.disk, seen = lr.pick_disk_dir()
        self.res.update(disk=str(self.disk), disk_candidates=seen)
        shutil.rmtree(self.disk, ignore_errors=True)
        self.disk.mkdir(parents=True)
        cfg = WORK / "lmcache.yaml"
        cfg.write_text(lr.lmcache_yaml(self.disk, self.args.disk_gib, self.args.cpu_gib))
        self.res["lmcache_yaml"] = cfg.read_text()
        try:
            cg: lr.Cgroup | None = lr.Cgroup()
        except Exception as err:  # no writable memory cgroup: the run goes on without the squeeze
            cg = None
            self.st.note(f"no memory cgroup: {err!r}")
        self.res["cgroup"] = cg.info() if cg else None
        (WORK / "kvwatch.toml").write_text("")
        argv = [*kvwatch_argv(sets=SETS), "--config", str(WORK / "kvwatch.toml")]
        self.st.pids["kvwatch"] = start_session(argv, WORK / "kvwatch.log", cwd=WORK)
        self.st.mark("kvwatch_ready", seconds=round(wait_until(kvwatch_ready, 120, "kvwatch /readyz"), 1))
        pid = lr.start_vllm(cg, self.args.vllm_site, self.args.model, self.args.gpu_blocks, cfg)
        self.st.pids["vllm"] = pid
        self.st.mark("vllm_start", pid=pid)

        def up() -> bool:
            if not alive(pid):
                raise RuntimeError("vLLM exited: " + (WORK / "vllm.log").read_text()[-1500:])
            get_text(f"http://127.0.0.1:{lr.PORT}/health", timeout=2)
            return True

        self.st.mark("vllm_ready", seconds=round(wait_until(up, 330, "vLLM /health"), 1))
        tier = f"lmcache:{self.disk}"
        try:
            secs = wait_until(lambda: checks.tier_series(kvwatch_samples(), tier) is not None, 60, "tier found")
            self.st.mark("tier_found", seconds=round(secs, 1), tier=tier)
        except TimeoutError as err:
            self.st.note(str(err))
        self.res["tier"] = tier

    def start_pollers(self, suffix: str) -> None:
        o = self.out
        self.pollers = [
            Poller(kvwatch_url("/metrics"), o / f"kvwatch_timeline{suffix}.jsonl.gz", 1.0,
                   lambda text: [s for s in parse(text) if s[0].startswith(KEEP)]),
            Poller(f"http://127.0.0.1:{lr.PORT}/metrics", o / f"vllm_metrics{suffix}.jsonl.gz", 1.0,
                   lambda text: "\n".join(ln for ln in text.splitlines() if ln.startswith(VKEEP))),
            Residency(self.disk, lr.Cgroup.existing(), o / f"residency{suffix}.jsonl.gz"),
        ]  # fmt: skip
        for p in self.pollers:
            p.start()

    def stop_pollers(self) -> None:
        for p in self.pollers:
            p.stop()
        names = sorted(getattr(self.pollers[-1], "names", ())) if self.pollers else []
        self.res.setdefault("files_seen", {})[self.args.step] = len(names)

    # --- load -----------------------------------------------------------------------------------
    def phase(self, name: str, w: Workload | None, seconds: float, during: Any = None) -> None:
        seconds = min(seconds, self.left() - self.args.reserve)
        if self.left() - self.args.reserve < 10:
            self.st.note(f"phase {name} skipped: {self.left():.0f} s left")
            return
        before = checks.engine_now()
        self.st.mark(f"{name}_start", engine=before)
        if self.run is not None and (w is None or self.run.workload != w):
            self.run.stop()
            self.run = None
        if w is not None and self.run is None:
            self.run = self.load.start(name, w)
        t0 = time.monotonic()
        extra = during(t0 + seconds) if during else None
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        t1 = time.monotonic()
        after = checks.engine_now()
        self.st.mark(f"{name}_end", engine=after)
        row: dict[str, Any] = {"seconds": round(t1 - t0, 1), "engine": checks.engine_delta(before, after)}
        if self.run is not None:
            row["load"] = summary(self.run, (t0, t1))
        if extra:
            row.update(extra)
        self.res["phases"][name] = row
        self.save()

    def stop_load(self) -> None:
        if self.run is not None:
            self.run.stop()
            self.run = None

    # --- the squeeze ----------------------------------------------------------------------------
    def squeeze(self, until: float) -> dict[str, Any]:
        if not self.res.get("cgroup"):
            return {"skipped": "no memory cgroup"}
        cg = lr.Cgroup.existing()
        r = lr.residency(self.disk)
        usage = cg.usage()
        cg.limit(usage + 32 * lr.MIB)
        target = int(r["resident_pages"] * 4096 * self.args.hog_share)
        self.st.pids["hog1"] = lr.start_hog(cg, target, 256 * lr.MIB, "hog1")
        return {"limit": usage + 32 * lr.MIB, "usage_before": usage, "residency_before": r, "hog_bytes": target}

    def quiet(self) -> dict[str, Any]:
        """Load stopped: a second hog; kvwatch's reclaim bytes against mincore's residency lost."""
        self.stop_load()
        if not self.res.get("cgroup"):
            return {"skipped": "no memory cgroup"}
        tier = self.res["tier"]
        ok = wait_until(lambda: checks.counters_still(tier, 4.0), 40, "tier counters still")
        before = checks.at_rest(self.disk, tier)
        cg = lr.Cgroup.existing()
        target = int(before["residency"]["resident_pages"] * 4096 * 0.5)
        self.st.pids["hog2"] = lr.start_hog(cg, target, 256 * lr.MIB, "hog2")
        held = lr.wait_for(lambda: lr.hog_held("hog2") or not alive(self.st.pids["hog2"]), 30)
        wait_until(lambda: checks.counters_still(tier, 4.0), 40, "tier counters still")
        after = checks.at_rest(self.disk, tier)
        return {"still_seconds": ok, "hog2_bytes": target, "hog2_held": held, "hog2_alive": alive(self.st.pids["hog2"]),
                "closure": checks.squeeze_closure(before, after)}  # fmt: skip

    def release(self) -> None:
        for name in ("hog1", "hog2"):
            kill(self.st.pids.get(name, 0))
        if self.res.get("cgroup"):
            lr.Cgroup.existing().limit(None)

    # --- outputs ----------------------------------------------------------------------------------
    def judge(self) -> None:
        found = by_phase(alerts(WORK / "kvwatch.log"), self.st.marks)
        self.res["alerts"] = found
        self.res["verdict"] = checks.verdict(self.res, found)

    def pack(self) -> None:
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            for p in [*sorted(WORK.glob("*.log")), WORK / "state.json", WORK / "lmcache.yaml"]:
                if p.exists():
                    tar.add(p, arcname=p.name)
        with gzip.open(self.out / "requests.jsonl.gz", "wt") as f:
            for r in self.load.dump():
                f.write(json.dumps(r) + "\n")
        trace = WORK / "trace.json"
        if trace.exists():
            with open(trace, "rb") as src, gzip.open(self.out / "record_trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)


def step_start(r: LMRun, keep_polling: bool = False) -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    r.st, r.res = State.load(), {"phases": {}}
    r.st.mark("begin")
    r.start()
    r.start_pollers("_a")
    try:
        r.phase("warm", HOT, r.args.warm)
        r.phase("steady", HOT, r.args.steady)
        r.stop_load()
    finally:
        if not keep_polling:
            r.stop_pollers()
        r.res["files_after_steady"] = lr.residency(r.disk)
        r.judge()
        r.save()


def step_squeeze(r: LMRun, polling: bool = False) -> None:
    rec = [sys.executable, "-m", "kvwatch.daemon", "record", "--duration", str(int(r.args.record)),
           "--output", str(WORK / "trace.json"), "--url", kvwatch_url("")]  # fmt: skip
    r.st.pids["record"] = start_session(rec, WORK / "record.log", cwd=WORK)
    if not polling:
        r.start_pollers("_b")
    try:
        r.phase("pre", HOT, r.args.pre)
        r.phase("squeeze", HOT, r.args.squeeze, during=r.squeeze)
        r.phase("quiet", None, 1, during=lambda until: r.quiet())
        r.release()
        r.phase("release", HOT, r.args.release)
        r.phase("sizelimit", UNIQUE, r.args.sizelimit)
        r.stop_load()
        r.st.mark("quiesce")
        r.res["closure"] = checks.closure(r.disk, r.res["tier"], r.st.pids.get("vllm", 0))
    except Exception as err:
        r.st.note(f"run failed: {err!r}")
        raise
    finally:
        r.stop_load()
        r.release()
        r.stop_pollers()
        stop(r.st.pids.get("record", 0), 60, sig=2)
        r.res["residency_end"] = lr.residency(r.disk)
        r.judge()
        r.save()
        stop(r.st.pids.get("vllm", 0), 60)
        stop(r.st.pids.get("kvwatch", 0), 30)
        r.pack()
    print(json.dumps({"verdict": r.res.get("verdict"), "left_seconds": round(r.left())}, default=str), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", choices=["start", "squeeze", "all"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--gpu-blocks", type=int, default=1024)  # 16,384 tokens: a quarter of the hot set
    ap.add_argument("--disk-gib", type=float, default=3.0)  # the hot set is 2 GiB of chunk files
    ap.add_argument("--cpu-gib", type=float, default=0.125)
    ap.add_argument("--hog-share", type=float, default=0.6, help="hog size, share of the tier's resident bytes")
    ap.add_argument("--warm", type=float, default=60)
    ap.add_argument("--steady", type=float, default=300)
    ap.add_argument("--pre", type=float, default=25)
    ap.add_argument("--squeeze", type=float, default=45)
    ap.add_argument("--release", type=float, default=45)
    ap.add_argument("--sizelimit", type=float, default=60)
    ap.add_argument("--record", type=float, default=300, help="seconds kvwatch record runs")
    ap.add_argument("--deadline", type=float, default=560)
    ap.add_argument("--reserve", type=float, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    r = LMRun(args)
    if args.step == "all":  # one call: shorter phases (--steady), one set of recorders
        step_start(r, keep_polling=True)
        step_squeeze(r, polling=True)
    else:
        (step_start if args.step == "start" else step_squeeze)(r)
    if args.step == "start":
        print(json.dumps({"phases": r.res.get("phases"), "marks": len(r.st.marks), "notes": r.st.notes,
                          "left_seconds": round(r.left())}, default=str), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
