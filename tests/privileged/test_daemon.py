"""`kvwatch run` end to end on the real kernel: discovery, /metrics, alerts, lifecycle, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.daemon.lab.memcg import MemoryCgroup
from kvwatch.daemon.lab.workloads import MIB, drop_file_cache, make_files, resident_total, workload_rule
from kvwatch.probes.tracefs import bcc_probe_events_of
from tests.support.daemon import KVWATCH, DaemonProcess, daemon, wait_until, watched
from tests.support.kernel import FOREIGN_PAGE_SLACK, Child, PageFreeTruth

N_PAGES = 2311


TEST_RULE = workload_rule("testengine", "engine", "oom", "pages", "read")


def toml(kvdir: Path, extra: str = "", rules: str = TEST_RULE) -> str:
    return f"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
default_rules = true
rules = [{rules}]
[kv_tiers]
dirs = [{{ path = "{kvdir}", name = "test-tier" }}]
rescan_seconds = 1
[detectors.host_tier_eviction]
warmup_seconds = 0
window_seconds = 2
floor_bytes_per_second = 33554432
[detectors.oom]
active_seconds = 30
{extra}
"""


def test_page_free_through_metrics_and_clean_sigterm(tmp_path: Path, kvdir: Path) -> None:
    d = DaemonProcess(tmp_path, toml(kvdir))
    try:
        d.wait_ready()
        with Child("pages", str(N_PAGES)) as w:
            wait_until(lambda: watched(d, w.pid), 10, "workload discovered")
            w.step("go", "done")  # warm-up
            with PageFreeTruth(w.pid) as truth:
                before = d.settled(lambda: d.value("kvwatch_page_free_pages_total", pid=str(w.pid)))
                # node-wide, read once: an early read only widens the bound
                skipped0 = d.value("kvwatch_events_lost_total", source="page_free_skipped")
                truth.clear()  # the daemon has published everything up to here; the truth starts here
                w.step("go", "done")

                def delta() -> float:
                    return d.value("kvwatch_page_free_pages_total", pid=str(w.pid)) - before

                def skipped() -> float:
                    return d.value("kvwatch_events_lost_total", source="page_free_skipped") - skipped0

                expected = truth.pages()  # complete: the workload frees its pages before it answers
                # the kernel's own trace of the same tracepoint for the same task: exact unless the
                # kernel skipped page-free runs in the window (nested interrupts), then within them
                got, _ = d.wait_closes(delta, expected, skipped)
                assert got + skipped() >= N_PAGES and got <= N_PAGES + FOREIGN_PAGE_SLACK, got
            labels = next(lab for lab, _ in d.metrics()["kvwatch_page_free_pages_total"] if lab["pid"] == str(w.pid))
            assert labels["engine"] == "testengine"
        # the workload exited: its series leaves /metrics after the exit grace period
        wait_until(lambda: not watched(d, w.pid), 10, "exited process dropped")
        assert d.value("kvwatch_ready") == 1
        assert d.value("kvwatch_probe_attached", probe="page_free") == 1
        assert d.value("kvwatch_probe_hits_total", probe="page_free") > N_PAGES
    finally:
        code = d.stop(signal.SIGTERM)
    assert code == 0, d.log.read_text()
    assert bcc_probe_events_of(d.proc.pid) == []
    events = d.log_events()
    assert any(e.get("event") == "stopped: probes detached, alert sinks flushed" for e in events)
    assert all(e.get("level") != "error" for e in events), [e for e in events if e.get("level") == "error"]
    # restart at once works
    with daemon(tmp_path, toml(kvdir)) as d2:
        assert d2.value("kvwatch_ready") == 1


def ledger_matches_tier(d: DaemonProcess, pid: int) -> bool:
    """The engine's loss ledger row disk/reclaim equals the tier's reclaimed bytes, one scrape."""
    m = d.metrics()
    tier = sum(v for lab, v in m.get("kvwatch_pagecache_evicted_bytes_total", []) if lab["cause"] == "reclaim")
    lost = [
        v
        for lab, v in m.get("kvwatch_kv_lost_bytes_total", [])
        if (lab["pid"], lab["tier"], lab["cause"]) == (str(pid), "disk", "reclaim")
    ]
    return tier > 0 and lost == [tier]


def test_host_tier_squeeze_alerts_and_delete_does_not(tmp_path: Path, kvdir: Path) -> None:
    files = make_files(kvdir, 24, 16 * MIB)
    drop_file_cache(files)
    with daemon(tmp_path, toml(kvdir)) as d, MemoryCgroup(f"kvwatch-e2e-{os.getpid()}", 640 * MIB) as cg:
        wait_until(lambda: d.value("kvwatch_kv_tier_files", tier="test-tier") == 24, 10, "tier files tracked")
        with Child(
            "engine", "--kv-dir", str(kvdir), "--squeeze-mb", "560", "--rate-mb", "300", "--seconds", "12"
        ) as eng:
            cg.add(eng.pid)
            wait_until(lambda: watched(d, eng.pid), 10, "engine discovered")
            eng.step("warm", "warm")
            r0 = resident_total(files)
            reclaim0 = d.value("kvwatch_pagecache_evicted_bytes_total", tier="test-tier", cause="reclaim")
            eng.send("squeeze")

            def firing() -> bool:
                return d.value("kvwatch_alert_active", alert="KVHostTierEvictionUnderPressure") == 1

            wait_until(firing, 20, "KVHostTierEvictionUnderPressure")  # latency: bench/bench_detection.py
            active = next(
                lab
                for lab, _ in d.metrics()["kvwatch_alert_active"]
                if lab["alert"] == "KVHostTierEvictionUnderPressure"
            )
            assert active["tier"] == "test-tier" and active["pid"] == str(eng.pid) and active["engine"] == "testengine"
            assert active["cause"] in ("refault", "reclaim_stall", "psi")
            eng.expect("squeezed", 30)
            assert (
                d.value("kvwatch_pagecache_evicted_bytes_total", tier="test-tier", cause="reclaim") - reclaim0
                > r0 * 4096 * 0.2
            )
            assert d.value("kvwatch_pagecache_refault_pages_total", tier="test-tier") > 0
            assert d.value("kvwatch_direct_reclaim_seconds_total", pid=str(eng.pid), scope="memcg") > 0
            wait_until(lambda: ledger_matches_tier(d, eng.pid), 10, "the loss ledger's disk row")
            eng.send("exit")
        onset = [
            e
            for e in d.log_events()
            if e.get("event") == "alert firing" and e.get("alert") == "KVHostTierEvictionUnderPressure"
        ]
        assert len(onset) == 1 and onset[0]["values"]["evicted_bytes_per_second"] > 32 * MIB  # type: ignore[index]
        wait_until(
            lambda: d.value("kvwatch_alert_active", alert="KVHostTierEvictionUnderPressure") == 0,
            30,
            "alert clears",
        )
        fired = d.value("kvwatch_alerts_fired_total", alert="KVHostTierEvictionUnderPressure")
        # the engine deletes its tier: policy evictions, counted, never alerted. Every page cached
        # when the deletion began leaves by one of two paths: the deletion (policy) or, for a page
        # the kernel reclaimed first, reclaim.
        cached = resident_total(files)

        def evicted(cause: str) -> float:
            return d.value("kvwatch_pagecache_evicted_bytes_total", tier="test-tier", cause=cause)

        policy0, reclaim0 = evicted("policy"), evicted("reclaim")
        for f in files:
            f.unlink()
        wait_until(
            lambda: evicted("policy") - policy0 + evicted("reclaim") - reclaim0 >= cached * 4096,
            30,
            "every cached page counted as it left",
        )
        d.run_for(3)  # the windows of the deletion judged
        assert d.value("kvwatch_alerts_fired_total", alert="KVHostTierEvictionUnderPressure") == fired
        assert d.value("kvwatch_alert_active", alert="KVHostTierEvictionUnderPressure") == 0


def test_oom_kill_counted_and_alerted(tmp_path: Path, kvdir: Path) -> None:
    with daemon(tmp_path, toml(kvdir)) as d, MemoryCgroup(f"kvwatch-e2e-oom-{os.getpid()}", 48 * MIB) as cg:
        with Child("oom") as victim:
            cg.add(victim.pid)
            wait_until(lambda: watched(d, victim.pid), 10, "victim discovered")
            victim.send("go")
            victim.proc.wait(30)
            wait_until(lambda: d.value("kvwatch_oom_kills_total", engine="testengine") == 1, 20, "OOM counted")
            assert d.value("kvwatch_alert_active", alert="InferenceProcessOOMKilled", pid=str(victim.pid)) == 1
            assert d.value("kvwatch_alerts_fired_total", alert="InferenceProcessOOMKilled") == 1
    onset = [
        e for e in d.log_events() if e.get("alert") == "InferenceProcessOOMKilled" and e.get("event") == "alert firing"
    ]
    assert len(onset) == 1 and onset[0]["severity"] == "critical"


def test_children_of_watched_process_are_watched(tmp_path: Path, kvdir: Path) -> None:
    code = (
        "import os, sys, time\nsys.stdin.readline()\npid = os.fork()\n"
        "if pid == 0:\n    time.sleep(3); os._exit(0)\nprint(pid, flush=True)\nos.waitpid(pid, 0)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, "kvwatch-parent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdin and parent.stdout
    with daemon(tmp_path, toml(kvdir), "--pid", str(parent.pid)) as d:
        wait_until(lambda: watched(d, parent.pid), 10, "manual pid watched")
        parent.stdin.write("\n")
        parent.stdin.flush()
        child = int(parent.stdout.readline())
        wait_until(lambda: watched(d, child), 5, "child watched via fork event")
        lab = next(lab for lab, _ in d.metrics()["kvwatch_page_free_pages_total"] if lab["pid"] == str(child))
        assert lab["component"] == "child"
        parent.wait(10)


def test_hostile_process_names_keep_metrics_valid(tmp_path: Path, kvdir: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool missing: deploy/setup.sh test installs prometheus")
    code = "import ctypes, sys\nctypes.CDLL(None).prctl(15, b'a\"b\\\\c\\n{}', 0, 0, 0)\nsys.stdin.readline()\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    try:
        with daemon(tmp_path, toml(kvdir, rules='{ engine = "evil", comm = "^a" }')) as d:
            wait_until(lambda: watched(d, p.pid), 10, "renamed process watched")
            _, text = d.get("/metrics")
            out = subprocess.run(
                ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
            )
            assert out.returncode == 0, out.stdout + out.stderr
            assert not re.search(r"[{,]comm=", text)  # names never become labels; the engine label is the rule's
    finally:
        p.kill()
        p.wait()


def test_bad_config_reports_every_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[daemon]\nlisten = 'x'\nnope = 1\n[discovery]\ninterval_seconds = -3\n")
    out = subprocess.run(
        [*KVWATCH, "run", "--config", str(cfg)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2
    for key in ("daemon.listen", "daemon.nope", "discovery.interval_seconds"):
        assert key in out.stderr


def test_unusable_listen_address_is_a_clear_error(tmp_path: Path, kvdir: Path) -> None:
    with daemon(tmp_path, toml(kvdir)) as d:
        out = subprocess.run(
            [*KVWATCH, "run", "--listen", f"127.0.0.1:{d.port}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert out.returncode == 1
    assert "cannot listen" in out.stderr


def test_doctor_json_all_canaries_pass() -> None:
    out = subprocess.run([*KVWATCH, "doctor", "--json"], capture_output=True, text=True, timeout=150, check=False)
    report = json.loads(out.stdout)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert out.returncode == 0 and report["ok"], failed
    names = {c["name"] for c in report["checks"] if c["status"] == "ok"}
    for canary in (
        "canary page_free",
        "canary pagecache_delete",
        "canary pagecache_add",
        "canary memcg_reclaim",
        "canary reclaim eviction",
        "canary oom_victim",
        "canary task_newtask",
        "canary process_exit",
        "canary cuda",
        "probe cuda attach",
        "canary transfer",
        "probe transfer attach",
        "canary kv events",
        "canary engine metrics",
        "self-cost canary",
        "BPF statistics",
        "self-cost breaker",
    ):
        assert canary in names
    breaker = next(c for c in report["checks"] if c["name"] == "self-cost breaker")
    assert (
        "shed: 0 of 23 copies counted, 23 of 23 cudaMalloc still counted; attached again: 23 of 23" in breaker["detail"]
    )


def test_demo_fires_every_alert() -> None:
    out = subprocess.run(
        [*KVWATCH, "demo", "--log-format", "json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "ALERT KVHostTierEvictionUnderPressure" in out.stdout
    assert "ALERT InferenceProcessOOMKilled" in out.stdout
    assert "ALERT KVCacheReuseCollapse cause=empty_cache" in out.stdout
    assert "ALERT KVTransferBandwidthCollapse cause=bandwidth" in out.stdout
    assert "ALERT KVEvictionBurst cause=pressure" in out.stdout
    assert "ALERT KVPrefixCacheIneffective cause=not_hit" in out.stdout
    assert "ALERT KVPreemptionLivelock cause=livelock" in out.stdout
