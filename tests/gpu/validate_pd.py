"""kvwatch under vLLM 0.26.0 prefill/decode disaggregation over NIXL (issue 26), on the one lent H200, in
one device call (``run_pd_on_device.sh all``; the vLLM bundle and NIXL are unpacked into /tmp/vsite first).

kvwatch starts first, then the prefill instance, then (prefill answering /health) the decode instance, then
``pd_proxy.py`` (``pd_run.py`` has the processes). Checked before load: kvwatch discovered both instances
with roles prefill/decode, and its NIXL/UCX probes attached in decode's processes. Then ``kvwatch record``
and the phases, closed-loop clients through the proxy with unique prompts of ``--prompt-tokens`` (<= 1008:
at most 63 blocks, 1,008 descriptors, below NIXL's 1,024 thread split) so every request reads all its blocks:

``steady``    ``--clients`` clients: KVTransferBandwidthCollapse must stay silent.
``slow``      the same demand, plus a process looping device-to-device copies of ``--hog-gib`` GiB tensors
              on the same GPU (started before the phase's mark, killed at its end): the alert should fire
              on decode's process.
``recover``   the copies gone: the alert clears.
``starve``    the same demand, decode's processes capped at ``--starve-cores`` of CPU (a cgroup v2 ``cpu.max``):
              UCX's tcp/lo transport, the one that ran on the H200 (no cuda_ipc in its sandbox), is
              CPU-driven, so the NIXL progress starves with nothing else on the GPU: the alert should fire
              on decode's process.
``recover2``  the cap removed: the alert clears.
``lowdemand`` one client: demand drops, the alert must stay silent.

At quiescence, the closure: per request from the proxy's log (prompt tokens -> (ceil(N/16) - 0) x 524,288 B,
and the prefill_done -> decode_first_byte span) against decode's ``vllm:nixl_*`` histograms and kvwatch's
transfer families for decode's processes: counts and bytes equal or not, latency p50/p99 from both
histograms. kvwatch's NIXL bytes reading 0 with UCX bytes beside them is nixl_notes.md's thread-split
finding, reported rather than failed. Writes into --out (7 files): validation.json,
kvwatch_timeline.jsonl.gz, vllm_metrics.jsonl.gz, pd_requests.jsonl.gz, requests.jsonl.gz,
record_trace.json.gz, logs.tar.gz.

    with-bcc python3 tests/gpu/validate_pd.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu import pd_run as pd
from tests.gpu.tenant_checks import alerts, by_phase
from tests.gpu.vllm_harness import (
    WORK,
    Poller,
    State,
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

ALERT = "KVTransferBandwidthCollapse"
KEEP = ("kvwatch_transfer_", "kvwatch_rdma_", "kvwatch_alert_active", "kvwatch_alerts_fired_total",
        "kvwatch_watched_processes", "kvwatch_probe_attached", "kvwatch_events_lost_total")  # fmt: skip
VKEEP = ("vllm:nixl_", "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
         "vllm:external_prefix_cache", "vllm:num_requests", "vllm:kv_cache_usage")  # fmt: skip
PHASES = ("steady", "slow", "recover", "starve", "recover2", "lowdemand")


class PDRun:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out, self.t0 = args, args.out, time.monotonic()
        self.st = State()
        self.res: dict[str, Any] = {"phases": {}, "args": {k: str(v) for k, v in vars(args).items()}}
        self.load = Load("127.0.0.1", pd.PROXY_PORT, pd.SERVED, seed=args.seed)
        self.busy = Workload("unique", args.clients, max_tokens=args.max_tokens, unique_tokens=args.prompt_tokens)
        self.low = Workload("unique", 1, max_tokens=args.max_tokens, unique_tokens=args.prompt_tokens)
        self.run: Run | None = None
        self.pollers: list[Poller] = []
        self.capped: dict[int, str] = {}

    def left(self) -> float:
        return self.args.deadline - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.res.update(marks=self.st.marks, notes=self.st.notes, pids=self.st.pids)
        pd.save_json(self.out / "validation.json", self.res)
        self.st.save()

    def kvwatch_sets(self) -> tuple[str, ...]:
        sets = ["discovery.interval_seconds=1"]
        if self.args.transfer_warmup >= 0:  # the default (120 s) leaves too little steady load in one call
            sets.append(f"detectors.transfer_collapse.warmup_seconds={self.args.transfer_warmup:g}")
        self.res["kvwatch_sets"] = sets
        return tuple(sets)

    # --- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        a = self.args
        self.res["machine"] = pd.machine_facts()
        (WORK / "kvwatch.toml").write_text("")
        argv = [*kvwatch_argv(sets=self.kvwatch_sets()), "--config", str(WORK / "kvwatch.toml")]
        self.st.pids["kvwatch"] = start_session(argv, WORK / "kvwatch.log", cwd=WORK)
        self.st.mark("kvwatch_ready", seconds=round(wait_until(kvwatch_ready, 120, "kvwatch /readyz"), 1))
        for role in ("prefill", "decode"):  # one after the other: vLLM's profiling must not see a neighbour start
            pid = pd.start_instance(role, a.vllm_site, a.model, a.gpu_blocks, a.util, a.proto_info)
            self.st.pids[role] = pid
            self.st.mark(f"{role}_launch", pid=pid)
            secs = wait_until(lambda r=role, p=pid: pd.healthy(r, p), a.engine_timeout, f"{role} /health")
            self.st.mark(f"{role}_ready", seconds=round(secs, 1))
        self.st.pids["proxy"] = pd.start_proxy()
        url = f"http://127.0.0.1:{pd.PROXY_PORT}/health"
        self.st.mark("proxy_ready", seconds=round(wait_until(lambda: bool(get_text(url, 2)), 30, "proxy /health"), 1))

    def watch_checks(self) -> None:
        """kvwatch sees both roles, and its transfer probes are attached in decode's processes."""

        def roles() -> set[str]:
            return {p["role"] for p in pd.processes(kvwatch_samples())}

        w: dict[str, Any] = {}
        with contextlib.suppress(TimeoutError):
            w["roles_seconds"] = round(wait_until(lambda: {"prefill", "decode"} <= roles(), 60, "roles"), 1)

        def attached() -> bool:
            return pd.kvwatch_nixl(kvwatch_samples())["symbols_attached"] > 0

        with contextlib.suppress(TimeoutError):
            w["attached_seconds"] = round(wait_until(attached, 60, "decode transfer probes"), 1)
        w.update(pd.watch_facts(kvwatch_samples()))
        self.res["watch"] = w
        self.st.mark("watch_checked", roles=w["roles_ok"], attached=w["attached_ok"])

    def start_pollers(self) -> None:
        o = self.out
        self.pollers = [
            Poller(kvwatch_url("/metrics"), o / "kvwatch_timeline.jsonl.gz", 1.0,
                   lambda text: [s for s in parse(text) if s[0].startswith(KEEP)]),
            Poller(f"http://127.0.0.1:{pd.DECODE_PORT}/metrics", o / "vllm_metrics.jsonl.gz", 1.0,
                   lambda text: "\n".join(ln for ln in text.splitlines() if ln.startswith(VKEEP))),
        ]  # fmt: skip
        for p in self.pollers:
            p.start()

    def stop_pollers(self) -> None:
        for p in self.pollers:
            p.stop()
        self.res["pollers"] = {p.out.name: {"count": p.count, "errors": p.errors} for p in self.pollers}

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            snap["vllm"] = pd.vllm_nixl(pd.engine_samples("decode"))
        with contextlib.suppress(Exception):
            snap["prefill"] = {"kv_expired_reqs": pd.vllm_nixl(pd.engine_samples("prefill"))["kv_expired_reqs"]}
        with contextlib.suppress(Exception):
            snap["kvwatch"] = pd.kvwatch_nixl(kvwatch_samples())
        return snap

    # --- phases ---------------------------------------------------------------------------------
    def phase(self, name: str, w: Workload, seconds: float, before: Any = None, after: Any = None) -> None:
        try:
            if before is not None:
                before()
            seconds = min(seconds, self.left() - self.args.reserve)
            if seconds < 10:
                self.st.note(f"phase {name} skipped: {self.left():.0f} s left")
                return
            if self.run is not None and self.run.workload != w:
                self.run.stop()
                self.run = None
            if self.run is None:
                self.run = self.load.start(name, w)
            a = self.snapshot()
            self.st.mark(f"{name}_start")
            t0 = time.monotonic()
            time.sleep(seconds)
            t1 = time.monotonic()
            b = self.snapshot()
            self.st.mark(f"{name}_end")
            row: dict[str, Any] = {"seconds": round(t1 - t0, 1), "load": summary(self.run, (t0, t1))}
            for k in ("vllm", "kvwatch", "prefill"):
                if k in a and k in b:
                    row[k] = pd.delta(a[k], b[k])
            row["proxy"] = pd.requests_in(pd.proxy_records(), t0, t1)
            self.res["phases"][name] = row
        except Exception as err:
            self.st.note(f"phase {name} failed: {err!r}")
        finally:
            if after is not None:
                with contextlib.suppress(Exception):
                    after()
            self.save()

    def hog_start(self) -> None:
        a = self.args
        pid = pd.start_hog(a.vllm_site, int(a.hog_gib * (1 << 30)), a.hog_streams)
        self.st.pids["hog"] = pid
        self.st.mark("hog_launch", pid=pid)
        self.st.mark("hog_copying", seconds=round(wait_until(lambda: pd.hog_copying(pid), 90, "copy hog"), 1))

    def hog_stop(self) -> None:
        kill(self.st.pids.get("hog", 0))
        self.st.mark("hog_killed")

    def starve_start(self) -> None:
        pids = [int(p["pid"]) for p in pd.processes(kvwatch_samples()) if p["role"] == "decode"]
        self.capped = pd.cap_cpu(pids, self.args.starve_cores)
        self.st.mark("cpu_capped", cores=self.args.starve_cores, pids=sorted(self.capped))

    def starve_stop(self) -> None:
        pd.uncap_cpu(self.capped)
        self.st.mark("cpu_uncapped")

    def stop_load(self) -> None:
        if self.run is not None:
            self.run.stop()
            self.run = None

    def quiesce(self) -> None:
        self.stop_load()

        def counts() -> tuple[Any, ...]:
            s = self.snapshot()
            n = len(pd.proxy_records())
            return n, s.get("vllm", {}).get("xfer_time_seconds_count"), s.get("kvwatch", {}).get("completed")

        still = pd.wait_still(counts, 4.0, 40)
        self.st.mark("quiesce", still=still)

    # --- outputs --------------------------------------------------------------------------------
    def judge(self) -> None:
        found = by_phase(alerts(WORK / "kvwatch.log"), self.st.marks)
        self.res["alerts"] = found
        self.res["verdict"] = verdict(self.res, found)

    def pack(self) -> None:
        pd.pack(self.out, self.load.dump())


def closure() -> dict[str, Any]:
    """At quiescence: the proxy's log, decode's vllm:nixl_* and kvwatch's decode-side transfer families."""
    recs = pd.proxy_records()
    ok = [r for r in recs if r.get("status") == 200 and r.get("kv_transfer_params")]
    exp = sum(pd.expected_bytes(r) or 0 for r in ok)
    vs, ks = pd.engine_samples("decode"), kvwatch_samples()
    v, k = pd.vllm_nixl(vs), pd.kvwatch_nixl(ks, "decode")
    blocks_match = sum(1 for r in ok if r.get("remote_blocks") == math.ceil((r.get("prompt_tokens") or 0) / pd.BLOCK))
    vcount = v["xfer_time_seconds_count"]
    count = {"proxy_ok": len(ok), "vllm": vcount, "vllm_bytes_count": v["bytes_transferred_count"],
             "kvwatch_completed": k["completed"], "kvwatch_posts_ok": k["posts_ok"],
             "kvwatch_posts_error": k["posts_error"]}  # fmt: skip
    count["equal"] = len(ok) == vcount == k["completed"] == k["posts_ok"]
    count["kvwatch_equals_vllm"] = vcount == k["completed"]
    bytes_ = {"expected": exp, "vllm": v["bytes_transferred_sum"], "kvwatch_nixl": k["nixl_bytes"],
              "kvwatch_ucx": k["ucx_bytes"], "vllm_equals_expected": v["bytes_transferred_sum"] == exp,
              "kvwatch_equals_vllm": k["nixl_bytes"] == v["bytes_transferred_sum"]}  # fmt: skip
    if k["nixl_bytes"] == 0 and k["ucx_bytes"] > 0:
        bytes_["note"] = "kvwatch's NIXL bytes are 0, UCX bytes beside them: the thread-split finding"
    desc = v["num_descriptors_sum"] / vcount if vcount else None
    latency = {
        "vllm_xfer_mean": v["xfer_time_seconds_sum"] / vcount if vcount else None,
        "vllm_post_mean": v["post_time_seconds_sum"] / v["post_time_seconds_count"]
        if v["post_time_seconds_count"] else None,
        "vllm_xfer": pd.quantiles(vs, "vllm:nixl_xfer_time_seconds"),
        "kvwatch_mean": k["duration_sum"] / k["duration_count"] if k["duration_count"] else None,
        "kvwatch": pd.quantiles(ks, "kvwatch_transfer_duration_seconds", role="decode", lib="nixl"),
        "proxy_prefill_done_to_decode_first_byte": pd.dist([s for r in ok if (s := pd.transfer_span(r)) is not None]),
    }  # fmt: skip
    prompts = pd.dist([float(r["prompt_tokens"]) for r in ok if r.get("prompt_tokens") is not None])
    return {"requests": {"logged": len(recs), "ok_with_kv": len(ok), "errors": sum(1 for r in recs if r.get("error")),
                         "remote_blocks_equal_ceil": blocks_match, "prompt_tokens": prompts},
            "count": count, "bytes": bytes_, "latency": latency, "mean_descriptors_after_merge": desc,
            "vllm_failed_transfers": v["failed_transfers"], "vllm_failed_notifications": v["failed_notifications"],
            "kvwatch_prefill": pd.kvwatch_nixl(ks, "prefill"), "decode_pids": k["pids"]}  # fmt: skip


def verdict(res: dict[str, Any], found: list[dict[str, Any]]) -> dict[str, Any]:
    mine = [a for a in found if a["alert"] == ALERT]

    def fired(phase: str) -> list[dict[str, Any]]:
        return [a for a in mine if a["phase"] == phase]

    c = res.get("closure") or {}
    w = res.get("watch") or {}
    decode = set(c.get("decode_pids") or w.get("decode_transfer", {}).get("pids") or [])
    slow, starve = fired("slow"), fired("starve")
    ran = set(res.get("phases", {}))
    out: dict[str, Any] = {
        "roles_discovered": bool(w.get("roles_ok")),
        "decode_probes_attached": bool(w.get("attached_ok")),
        "silent_in_steady": not fired("steady") if "steady" in ran else None,
        "fired_in_slow": bool(slow) if "slow" in ran else None,
        "slow_onsets_on_decode": all(str(a["pid"]) in decode for a in slow) if slow else None,
        "slow_onset_after_start": min(a["after_phase_start"] for a in slow) if slow else None,
        "cleared_by_recover": all(a["cleared_in"] in ("slow", "recover") for a in slow) if slow else None,
        "fired_in_starve": bool(starve) if "starve" in ran else None,
        "starve_onsets_on_decode": all(str(a["pid"]) in decode for a in starve) if starve else None,
        "starve_onset_after_start": min(a["after_phase_start"] for a in starve) if starve else None,
        "cleared_by_recover2": all(a["cleared_in"] in ("starve", "recover2") for a in starve) if starve else None,
        "silent_in_lowdemand": not fired("lowdemand") if "lowdemand" in ran else None,
        "count_equal": (c.get("count") or {}).get("equal"),
        "bytes_vllm_equal_expected": (c.get("bytes") or {}).get("vllm_equals_expected"),
        "bytes_kvwatch_equal_vllm": (c.get("bytes") or {}).get("kvwatch_equals_vllm"),
        "other_alerts": sorted({f"{a['alert']}@{a['phase']}" for a in found if a["alert"] != ALERT}),
        "phases_run": sorted(ran, key=PHASES.index),
    }
    # The copy hog time-slices the whole GPU: prefill, decode and the reads all stall, so the transfer path is not
    # what is slow and the alert is not required there (reported); starving decode's CPU slows the tcp/lo reads alone.
    musts = ("roles_discovered", "decode_probes_attached", "silent_in_steady", "fired_in_starve",
             "starve_onsets_on_decode", "cleared_by_recover2", "silent_in_lowdemand", "count_equal")  # fmt: skip
    out["pass"] = all(out[m] is True for m in musts)
    return out


def run_all(r: PDRun) -> None:
    a = r.args
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    r.st.mark("begin")
    try:
        r.start()
        r.watch_checks()
        r.start_pollers()
        rec = [sys.executable, "-m", "kvwatch.daemon", "record", "--duration", str(int(r.left())),
               "--output", str(WORK / "trace.json"), "--url", kvwatch_url("")]  # fmt: skip
        r.st.pids["record"] = start_session(rec, WORK / "record.log", cwd=WORK)
        r.phase("steady", r.busy, a.steady)
        r.phase("slow", r.busy, a.slow, before=r.hog_start, after=r.hog_stop)
        r.phase("recover", r.busy, a.recover)
        if a.starve_cores > 0:
            r.phase("starve", r.busy, a.starve, before=r.starve_start, after=r.starve_stop)
            r.phase("recover2", r.busy, a.recover)
        r.phase("lowdemand", r.low, a.lowdemand)
        r.quiesce()
        r.res["closure"] = closure()
    except Exception as err:
        r.st.note(f"run failed: {err!r}")
    finally:
        finish(r)


def finish(r: PDRun) -> None:
    r.stop_load()
    kill(r.st.pids.get("hog", 0))
    with contextlib.suppress(Exception):
        pd.uncap_cpu(r.capped)
    stop(r.st.pids.get("record", 0), 60, sig=2)
    r.stop_pollers()
    with contextlib.suppress(Exception):
        r.res["transport"] = pd.transport_facts(r.args.vllm_site)
    with contextlib.suppress(Exception):
        r.judge()
    r.save()
    for name in ("proxy", "decode", "prefill", "kvwatch"):
        stop(r.st.pids.get(name, 0), 20)
        kill(r.st.pids.get(name, 0))
    r.pack()
    r.save()
    print(json.dumps({"verdict": r.res.get("verdict"), "notes": r.st.notes, "left_seconds": round(r.left())},
                     default=str), flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vllm-site", default="/tmp/vsite")
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--gpu-blocks", type=int, default=2048)
    ap.add_argument("--util", type=float, default=0.3, help="--gpu-memory-utilization of each instance")
    ap.add_argument("--engine-timeout", type=float, default=200, help="seconds for each instance's /health")
    ap.add_argument("--no-proto-info", dest="proto_info", action="store_false", help="no UCX_PROTO_INFO=y on decode")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=4)
    for flag, default in (("--steady", 75), ("--slow", 45), ("--recover", 40), ("--starve", 50),
                          ("--lowdemand", 35)):  # fmt: skip
        ap.add_argument(flag, type=float, default=default, help="phase seconds")
    ap.add_argument("--starve-cores", type=float, default=0.25, help="decode's CPU cap in the starve phase (0: none)")
    ap.add_argument("--hog-gib", type=float, default=1.0, help="size of each copied tensor")
    ap.add_argument("--hog-streams", type=int, default=2, help="copy streams (src/dst pairs) in the hog")
    ap.add_argument("--transfer-warmup", type=float, default=30,
                    help="detectors.transfer_collapse.warmup_seconds (-1: kvwatch's default, 120)")  # fmt: skip
    ap.add_argument("--deadline", type=float, default=560)
    ap.add_argument("--reserve", type=float, default=60, help="seconds kept for quiescence, closure, stops, pack")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.prompt_tokens > 1008:
        ap.error("--prompt-tokens above 1008 crosses NIXL's 1,024-descriptor thread split (nixl_notes.md (d))")
    args.out.mkdir(parents=True, exist_ok=True)
    run_all(PDRun(args))


if __name__ == "__main__":
    main()
