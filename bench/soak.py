"""Soak: `kvwatch run` under a mixed workload for a long time, sampled every 10 s.

    sudo .venv/bin/python bench/soak.py --minutes 30 --out bench/results/soak.md

Not part of CI (it takes half an hour). The workload, ~1k probe events/s in all, with
processes coming and going:

* a long-lived watched process releasing ~500 pages/s (kmem:mm_page_free);
* a watched process on the stub CUDA runtime, allocator churn at ~150 steps/s
  (cudaMalloc/cudaFree uprobe pairs, ledger inserts and deletes);
* every 2 s a short-lived watched process (fork, exec, exit), living 4-6 s; every
  tenth maps the CUDA runtime (attach and detach of its uprobes);
* every 5 s a KV-tier file written, read, and deleted (page-cache add/delete hooks,
  inode set updates).

Recorded over time: the daemon's RSS, CPU share (scheduler runtime, not tick-sampled
times), open file descriptors, entries of each of its BPF maps (bpftool, when installed),
watched processes and tick duration. Targets: RSS growth < 5 MB, no descriptor growth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.daemon.lab.stublib import build
from kvwatch.daemon.lab.workloads import workload_pattern

PY = sys.executable
RULE = workload_pattern("pages", "cuda")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runtime_ns(pid: int) -> int:
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((t / "schedstat").read_text().split()[0])
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def map_entries(pid: int) -> dict[str, int]:
    """Entries per BPF map the daemon holds (bpftool), empty when bpftool is missing."""
    if not shutil.which("bpftool"):
        return {}
    try:
        maps = json.loads(subprocess.run(["bpftool", "-j", "map", "show"], capture_output=True, check=True).stdout)
    except (subprocess.CalledProcessError, json.JSONDecodeError):
        return {}
    out: dict[str, int] = {}
    for m in maps:
        if not any(p.get("pid") == pid for p in m.get("pids", [])):
            continue
        if m.get("type") not in ("hash", "lru_hash"):
            continue
        res = subprocess.run(["bpftool", "-j", "map", "dump", "id", str(m["id"])], capture_output=True, check=False)
        with contextlib.suppress(json.JSONDecodeError):
            out[m.get("name", str(m["id"]))] = out.get(m.get("name", ""), 0) + len(json.loads(res.stdout or b"[]"))
    return out


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Workload:
    def __init__(self, stub: Path, kvdir: Path, spawn_every: float = 2.0, file_every: float = 5.0) -> None:
        self.stub, self.kvdir = stub, kvdir
        self.spawn_every, self.file_every = spawn_every, file_every
        self.procs: list[tuple[subprocess.Popen[str], float]] = []
        self.spawned = 0
        self.pages = self._start("pages", "125")  # 125 pages x 4 go/s = 500 pages/s
        self.cuda = self._start("cuda", "--lib-dir", str(stub), "--prealloc", "0")
        assert self.cuda.stdin
        self.cuda.stdin.write("uncached 150 100000\n")
        self.cuda.stdin.flush()
        self.next_spawn = self.next_file = self.next_pages = time.monotonic()

    @staticmethod
    def _start(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [PY, "-m", "kvwatch.daemon.lab.workloads", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )

    def step(self) -> None:
        now = time.monotonic()
        if now >= self.next_pages:
            assert self.pages.stdin
            self.pages.stdin.write("go\n")
            self.pages.stdin.flush()
            self.next_pages += 0.25
        if now >= self.next_spawn:
            # every 2 s a watched process comes and goes; every 10th maps the CUDA runtime
            # (attach + detach of its ~30 uprobes: releasing a uprobe costs the kernel ~0.1 s)
            if self.spawned % 10 == 0:
                p = self._start("cuda", "--lib-dir", str(self.stub), "--prealloc", "2")
            else:
                p = self._start("pages", "64")
                assert p.stdin
                p.stdin.write("go\n")
                p.stdin.flush()
            self.procs.append((p, now + random.uniform(4, 6)))  # noqa: S311 - a lifetime, not a secret
            self.spawned += 1
            self.next_spawn += self.spawn_every
        for p, until in list(self.procs):
            if now >= until:
                with contextlib.suppress(OSError):
                    p.stdin.close()  # type: ignore[union-attr]
                p.wait(10)
                self.procs.remove((p, until))
        if now >= self.next_file:
            f = self.kvdir / f"kv-{int(now * 1000)}.bin"
            f.write_bytes(os.urandom(1 << 20))
            f.read_bytes()
            f.unlink()
            self.next_file += self.file_every

    def close(self) -> None:
        for p in [self.pages, self.cuda, *(p for p, _ in self.procs)]:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--sample-seconds", type=float, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.md"))
    ap.add_argument("--spawn-seconds", type=float, default=2.0, help="a short-lived watched process every N s")
    ap.add_argument("--file-seconds", type=float, default=5.0, help="a KV-tier file written and deleted every N s")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwatch-soak-", dir="/var/tmp"))
    stub = work / "stub"
    stub.mkdir()
    build(stub)
    kvdir = work / "kv"
    kvdir.mkdir()
    port = free_port()
    cfg = work / "kvwatch.toml"
    cfg.write_text(
        f'[daemon]\nlisten = "127.0.0.1:{port}"\n[discovery]\ninterval_seconds = 1\n'
        f"rules = [{{ engine = \"soak\", cmdline = '{RULE}' }}]\n"
        f'[kv_tiers]\ndirs = [{{ path = "{kvdir}", name = "soak" }}]\nrescan_seconds = 2\n'
    )
    log = (work / "kvwatch.log").open("w")
    d = subprocess.Popen(
        [PY, "-m", "kvwatch.daemon", "run", "--config", str(cfg), "--log-format", "json"], stdout=log, stderr=log
    )
    rows: list[dict[str, float]] = []
    try:
        for _ in range(120):
            with contextlib.suppress(OSError):
                if metrics(port).get("kvwatch_ready", 0) == 1:
                    break
            time.sleep(0.5)
        w = Workload(stub, kvdir, args.spawn_seconds, args.file_seconds)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_sample = t0
        last_rt, last_t = runtime_ns(d.pid), time.monotonic()
        while time.monotonic() < end and d.poll() is None:
            w.step()
            now = time.monotonic()
            if now >= next_sample:
                rt = runtime_ns(d.pid)
                m = metrics(port)
                row = {
                    "t_s": round(now - t0),
                    "rss_mib": round(rss_kib(d.pid) / 1024, 1),
                    "cpu_pct": round(100 * (rt - last_rt) / 1e9 / max(now - last_t, 1e-9), 2),
                    "fds": sum(1 for _ in Path(f"/proc/{d.pid}/fd").iterdir()),
                    "threads": sum(1 for _ in Path(f"/proc/{d.pid}/task").iterdir()),
                    "watched": m.get("kvwatch_watched_processes", 0),
                    "tick_ms": round(1000 * m.get("kvwatch_loop_duration_seconds", 0), 1),
                    "lost": m.get("kvwatch_events_lost_total", 0),
                    "errors": m.get("kvwatch_errors_total", 0),
                    "page_events": m.get("kvwatch_page_free_pages_total", 0),
                    "cuda_calls": m.get("kvwatch_cuda_alloc_calls_total", 0)
                    + m.get("kvwatch_cuda_free_calls_total", 0),
                    "spawned": w.spawned,
                    "uprobe_releases_pending": m.get("kvwatch_uprobe_releases_pending", 0),
                }
                row |= {f"map_{k}": v for k, v in map_entries(d.pid).items()}
                rows.append(row)
                print(json.dumps(row), flush=True)
                last_rt, last_t = rt, now
                next_sample += args.sample_seconds
            time.sleep(0.02)
        w.close()
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            rc = d.wait(120)
        except subprocess.TimeoutExpired:
            d.kill()
            rc = d.wait()
        log.close()
    write_report(args.out, rows, args.minutes, rc)
    if os.environ.get("SOAK_KEEP"):
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def write_report(out: Path, rows: list[dict[str, float]], minutes: float, rc: int) -> None:
    if not rows:
        out.write_text("# soak: no samples\n")
        return
    warm = [r for r in rows if r["t_s"] >= 60] or rows  # after the first minute: compiler memory returned
    first, last = warm[0], rows[-1]
    keys = sorted({k for r in rows for k in r})
    lines = [
        f"# kvwatch soak — {time.strftime('%Y-%m-%d %H:%M')} — {minutes:g} min, kernel {os.uname().release}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| RSS after 1 min → end | {first['rss_mib']} → {last['rss_mib']} MiB (growth {last['rss_mib'] - first['rss_mib']:+.1f} MiB) |",
        f"| RSS max | {max(r['rss_mib'] for r in rows)} MiB |",
        f"| open descriptors after 1 min → end | {first['fds']} → {last['fds']} |",
        f"| CPU, median of samples | {sorted(r['cpu_pct'] for r in warm)[len(warm) // 2]} % of a core |",
        f"| CPU, max sample | {max(r['cpu_pct'] for r in warm)} % |",
        f"| processes spawned and reaped | {last['spawned']} |",
        f"| page events counted | {int(last['page_events'])} |",
        f"| CUDA calls counted | {int(last['cuda_calls'])} |",
        f"| events lost / errors | {int(last['lost'])} / {int(last['errors'])} |",
        f"| exit code on SIGTERM | {rc} |",
        "",
        "Samples every 10 s (bench/soak.py):",
        "",
        "| " + " | ".join(keys) + " |",
        "| " + " | ".join("---" for _ in keys) + " |",
    ]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
