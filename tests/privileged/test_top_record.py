"""`kvwatch top` in a real terminal (tmux) and as plain frames, `kvwatch record` against known
workloads: the stub CUDA runtime (exact allocation counts), two real NIXL peers (transfers with
the application's own durations), a KV-tier file deleted (pages counted against mincore)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvwatch.daemon.lab.nixl_peer import NixlPeer
from kvwatch.daemon.lab.workloads import MIB, PAGE, make_files, resident_total, workload_rule
from tests.support.daemon import KVWATCH, daemon, free_port, wait_attached
from tests.support.kernel import Child, wait_uprobes
from tests.support.trace_format import problems

CONFIG = r"""
[daemon]
tick_seconds = 0.5
listen = "127.0.0.1:{port}"
[discovery]
interval_seconds = 0.5
default_rules = false         # only this file's workloads: an engine elsewhere on the host is not ours
rules = [
  {cuda_rule},
  {nixl_rule},
]
[probes]
cuda_rescan_seconds = 1
transfer_rescan_seconds = 1
[kv_tiers]
dirs = [{{ path = "{kvdir}", name = "test-tier" }}]
rescan_seconds = 1
"""

HAVE_TMUX = shutil.which("tmux") is not None


def config(kvdir: Path, port: int = 0) -> str:
    cuda, nixl = workload_rule("stubengine", "cuda"), workload_rule("nixltest", "initiator", module="nixl_peer")
    return CONFIG.format(port=port or free_port(), kvdir=kvdir, cuda_rule=cuda, nixl_rule=nixl)


def top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVWATCH, "top", *args], capture_output=True, text=True, timeout=timeout, check=False)


def row(out: str, pid: int) -> list[str]:
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == [str(pid)]]
    assert len(rows) == 1, out
    return rows[0]


# columns of a row: PID ENGINE POD GPU ALLOC/s ALLOCMiB/s FREE/s DEV HOST PGFREE EVICT DEL STALL XFER EFF LINK KV ALERTS
ALLOC, FREE, DEV, HOST = 4, 6, 7, 8


def test_once_shows_the_known_workload(tmp_path: Path, kvdir: Path, stub: Path) -> None:
    with daemon(tmp_path, config(kvdir)) as d, Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        wait_attached(d, w.pid)
        w.step("growth 23 1", "done", timeout=30)  # 23 segments of 20 MiB, kept
        res = top("--once", "--url", d.url(""), "--interval", "0.5")
        assert res.returncode == 0, res.stderr
        r = row(res.stdout, w.pid)
        assert r[1] == "stubengine" and r[DEV] == f"{23 * 20:.1f}" and r[HOST] == "0.0"
        assert "Traceback" not in res.stderr
        w.send("uncached 100 9")  # ~100 segment allocations and frees a second
        d.run_for(6)  # past the 5 s rate window
        res = top("--once", "--url", d.url(""), "--interval", "0.5", "--sort", "pid")
        r = row(res.stdout, w.pid)
        assert 75 <= float(r[ALLOC]) <= 125 and 75 <= float(r[FREE]) <= 125, r
        assert "sort pid desc" in res.stdout.splitlines()[0]
        w.expect("done", timeout=30)


def test_empty_node_non_tty_and_unreachable_daemon(tmp_path: Path, kvdir: Path) -> None:
    with daemon(tmp_path, config(kvdir)) as d:
        url = d.url("")
        res = top("--url", url, "--interval", "0.3")  # stdout is a pipe: one frame and a note
        assert res.returncode == 0, res.stderr
        assert "stdout is not a terminal; printing one frame" in res.stderr
        lines = res.stdout.splitlines()
        assert lines[0].startswith("kvwatch top - ") and f"daemon {d.url('')}" in lines[0]
        assert lines[1].startswith("processes 0 (none)")
        assert lines[4] == "no inference processes watched (discovery rules: kvwatch doctor; or --pid)"
    res = top("--once", "--url", url, "--interval", "0.1")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().startswith(f"kvwatch top: {url} unreachable (")


def test_local_probes_when_no_daemon(tmp_path: Path, kvdir: Path, stub: Path) -> None:
    cfg = tmp_path / "kvwatch.toml"
    cfg.write_text(config(kvdir))  # nothing listens on that port
    with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        res = top("--once", "--config", str(cfg), "--interval", "3", timeout=120)
        assert res.returncode == 0, res.stderr
        assert "no daemon:" in res.stderr and "starting kvwatch's own probes" in res.stderr
        assert "own probes (no daemon reachable)" in res.stdout.splitlines()[0]
        assert row(res.stdout, w.pid)[1] == "stubengine"


class Tmux:
    def __init__(self, command: str, width: int = 220, height: int = 40) -> None:
        self.session = f"kvwtop{uuid.uuid4().hex[:8]}"
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height), "sh"],
            check=True,
        )
        # a fresh tmux server may size a window without clients to 80x24 first: fix the size,
        # then start the command in it, so it never sees another size
        subprocess.run(["tmux", "set-option", "-t", self.session, "window-size", "manual"], check=True)
        self.resize(width, height)
        # pytest's environment carries COLUMNS/LINES (80x24), which a terminal UI obeys over the pane
        self.keys("-l", f"unset COLUMNS LINES; {command}")
        self.keys("Enter")

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", self.session], capture_output=True, text=True, check=True
        ).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.session, *keys], check=True)

    def resize(self, width: int, height: int) -> None:
        subprocess.run(["tmux", "resize-window", "-t", self.session, "-x", str(width), "-y", str(height)], check=True)

    def wait_for(self, text: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.screen()
            if text in s:
                return s
            time.sleep(0.2)
        size = subprocess.run(
            ["tmux", "display", "-p", "-t", self.session, "#{window_width}x#{window_height}"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        raise AssertionError(f"{text!r} not on screen after {timeout}s ({size}):\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], check=False, capture_output=True)


@pytest.mark.skipif(not HAVE_TMUX, reason="tmux not installed")
def test_live_view_in_tmux(tmp_path: Path, kvdir: Path, stub: Path) -> None:
    with daemon(tmp_path, config(kvdir)) as d, Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
        w.expect("ready")
        wait_attached(d, w.pid)
        w.step("growth 23 1", "done", timeout=30)
        cmd = " ".join([*KVWATCH, "top", "--url", d.url(""), "--interval", "0.5"])
        t = Tmux(f"{cmd}; echo EXITED rc=$?; sleep 120")
        try:
            t.wait_for(str(w.pid))
            screen = t.wait_for("460.0")  # the snapshot after the last allocation
            (line,) = [ln for ln in screen.splitlines() if ln.split()[:1] == [str(w.pid)]]
            assert line.split()[DEV] == "460.0"
            assert "sort alloc desc" in screen
            t.wait_for("q quit")  # the key bar
            t.keys("s")
            t.wait_for("sort allocb desc")
            t.keys("r")
            t.wait_for("sort allocb asc")
            t.keys("/")
            # the box takes focus asynchronously: text typed before it has focus goes to the
            # table's key bindings ('-' = slower, 's' = sort), seen once in CI on a loaded machine
            t.wait_for("filter: text in any column")
            t.keys("-l", "no-such-engine")
            t.keys("Enter")
            t.wait_for("no process matches the filter")
            t.keys("Escape")
            t.wait_for(str(w.pid))
            t.resize(30, 6)  # a tiny terminal
            d.wait_ticks(3)  # new frames drawn at that size
            assert "Traceback" not in t.screen() and "EXITED" not in t.screen()
            t.resize(220, 40)
            t.wait_for(str(w.pid))
            d.stop()  # the daemon goes away mid-session
            screen = t.wait_for("unreachable")
            assert "showing the last frame" in screen and str(w.pid) in screen
            t.keys("q")
            screen = t.wait_for("EXITED rc=0")
            assert "Traceback" not in screen
        finally:
            t.close()


def test_record_known_workload(tmp_path: Path, kvdir: Path, stub: Path) -> None:
    cfg = tmp_path / "kvwatch.toml"
    cfg.write_text(config(kvdir))
    out = tmp_path / "trace.json"
    (tier_file,) = make_files(kvdir, 1, 8 * MIB)
    subprocess.run(["cat", str(tier_file)], stdout=subprocess.DEVNULL, check=True)  # into the page cache
    size = 8 * MIB
    meta = tmp_path / "meta.json"
    target = NixlPeer("target", meta, size)
    init = NixlPeer("initiator", meta, size)
    try:
        with Child("cuda", "--lib-dir", str(stub), "--prealloc", "0") as w:
            w.expect("ready")
            rec = subprocess.Popen(
                [*KVWATCH, "record", "--duration", "9", "--output", str(out), "--config", str(cfg)],
                stderr=subprocess.PIPE,
                text=True,
            )
            assert rec.stderr is not None
            assert "recording 9 s" in rec.stderr.readline()
            wait_uprobes(rec.pid, "libcudart", "nixl")  # discovered and attached (the tier: at start)
            w.step("growth 23 1", "done", timeout=30)
            reply = init.ask("burst 7")
            cached = resident_total([tier_file])
            tier_file.unlink()
            rec.wait(60)
            err = rec.stderr.read()
            assert rec.returncode == 0, err
            assert f"wrote {out}" in err and "dropped" not in err
    finally:
        init.close()
        target.close()
    trace = json.loads(out.read_text())
    assert problems(trace) == []
    ev = trace["traceEvents"]
    cuda = [e for e in ev if e["ph"] == "C" and e["name"] == "CUDA segments" and e["pid"] == w.pid]
    assert sum(e["args"]["allocs"] for e in cuda) == 23 and sum(e["args"]["frees"] for e in cuda) == 0
    assert sum(e["args"]["alloc_mib"] for e in cuda) == 23 * 20
    xfers = [e for e in ev if e["ph"] == "X" and e.get("cat") == "transfer" and e["pid"] == init.pid]
    assert len(xfers) == 7 and all(e["args"]["bytes"] == size for e in xfers)
    for e, theirs in zip(sorted(xfers, key=lambda e: e["ts"]), reply["durations_ns"], strict=True):
        assert e["dur"] * 1000 <= theirs + 100_000  # inside the application's timed region
    gaps = sorted(theirs / 1000 - e["dur"] for e, theirs in zip(xfers, reply["durations_ns"], strict=True))
    assert gaps[3] <= 500  # median within half a millisecond
    tier = [e for e in ev if e["ph"] == "C" and e["name"] == "KV tier test-tier pages"]
    policy = sum(e["args"]["deleted (policy)"] for e in tier)
    reclaim = sum(e["args"]["evicted (reclaim)"] for e in tier)
    # Each page mincore saw cached before the unlink left once during the recording: deleted
    # (policy) or, taken first by reclaim (kswapd, kdamond), evicted (reclaim). Reclaim may also
    # have taken pages before mincore looked, never more than the file had.
    assert 0 < policy <= cached <= policy + reclaim <= size // PAGE, (policy, reclaim, cached)
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert f"stubengine pid {w.pid}" in names and f"nixltest pid {init.pid}" in names
    assert trace["otherData"]["dropped"] == {} and trace["otherData"]["duration_seconds"] >= 8.5


def test_record_refuses_unwritable_output(tmp_path: Path) -> None:
    res = subprocess.run(
        [*KVWATCH, "record", "--duration", "1", "--output", "/proc/nope/trace.json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1 and "cannot write /proc/nope/trace.json" in res.stderr
    assert "Traceback" not in res.stderr
    assert sys.executable  # the same interpreter runs the command
