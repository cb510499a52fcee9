"""CUDA probes on a real GPU: kvwatch's counts against PyTorch's own, alerts, and overhead.

Run on the lent H200 (see tests/gpu/run_on_device.sh), as root, under bcc:

    .gpu-bundle/with-bcc python3 tests/gpu/validate_cuda.py --out DIR

1. Starts `kvwatch run` (a subprocess) with a rule that watches harness processes
   tagged "watched".
2. For each allocator mode (cached, emptycache, nocache, expandable): a harness
   allocates its context and KV pool, waits until kvwatch has attached, sits
   quiet for the baseline, runs the loop; then kvwatch's per-process cudaMalloc /
   cudaFree counts are compared with PyTorch's segment.all.allocated / freed over
   the same loop, and the KVCacheReuseCollapse alert state is recorded.
3. Overhead: the same loop with kvwatch attached vs in an unwatched harness,
   rounds interleaved, in this one run.

Writes DIR/cuda_validation.json and DIR/cuda_validation.md. ``--backend stub``
runs the same orchestration against the stub runtime (no GPU) to check it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
MODES = {
    "cached": ({}, None),
    "emptycache": ({}, "empty_cache"),
    "nocache": ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "uncached"),
    "expandable": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
}
CONFIG = r"""
[daemon]
tick_seconds = 0.5
[discovery]
interval_seconds = 0.5
rules = [{ engine = "harness", cmdline = '_alloc_harness\.py .*--tag watched' }]
[probes]
cuda_rescan_seconds = 1
[detectors.reuse_collapse]
warmup_seconds = 1
baseline_min_seconds = 2
window_seconds = 2
confirm_windows = 2
clear_windows = 2
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The watched workload runs with the machine's own libraries, not bcc's bundle."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(extra)
    return env


class Kvwatch:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        cfg = workdir / "kvwatch.toml"
        cfg.write_text(CONFIG)
        self.log = open(workdir / "kvwatch.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvwatch.daemon",
                "run",
                "--config",
                str(cfg),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--log-format",
                "json",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"kvwatch exited: {(workdir / 'kvwatch.log').read_text()[-3000:]}")
            time.sleep(0.3)
        raise SystemExit("kvwatch not ready")

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples() if n == name and all(lab.get(k) == w for k, w in labels.items()))

    def alerts(self, pid: int) -> list[dict[str, str]]:
        return [
            lab for n, lab, v in self.samples() if n == "kvwatch_alert_active" and lab.get("pid") == str(pid) and v == 1
        ]

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(30)
        self.log.close()
        return code


class Harness:
    def __init__(self, backend: str, mode: str, tag: str, steps: int, sleep: float, stub_dir: str) -> None:
        env, _ = MODES[mode]
        if backend == "torch":
            cmd = [sys.executable, str(HERE / "torch_alloc_harness.py"), mode]
        else:
            cmd = [sys.executable, str(HERE / "stub_alloc_harness.py"), mode, "--stub", stub_dir]
        cmd += ["--steps", str(steps), "--sleep", str(sleep), "--tag", tag]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env(env))
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"harness {mode} died before ready")
        self.pid = self.proc.pid

    def go(self) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def finish(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        self.proc.wait(60)


def wait_for(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


COUNTERS = {
    "malloc": ("kvwatch_cuda_alloc_calls_total", "cudaMalloc", "ok"),
    "malloc_err": ("kvwatch_cuda_alloc_calls_total", "cudaMalloc", "error"),
    "free": ("kvwatch_cuda_free_calls_total", "cudaFree", "ok"),
    "create": ("kvwatch_cuda_alloc_calls_total", "cuMemCreate", "ok"),
    "release": ("kvwatch_cuda_free_calls_total", "cuMemRelease", "ok"),
    "cumemalloc": ("kvwatch_cuda_alloc_calls_total", "cuMemAlloc", "ok"),
    "malloc_bytes": ("kvwatch_cuda_alloc_bytes_total", "cudaMalloc", ""),
    "free_bytes": ("kvwatch_cuda_freed_bytes_total", "cudaFree", ""),
    "create_bytes": ("kvwatch_cuda_alloc_bytes_total", "cuMemCreate", ""),
    "release_bytes": ("kvwatch_cuda_freed_bytes_total", "cuMemRelease", ""),
    "map_calls": ("kvwatch_cuda_vmm_map_calls_total", "cuMemMap", ""),
    "free_unknown": ("kvwatch_cuda_free_unknown_total", "cudaFree", ""),
}


def read_counters(kvw: Kvwatch, pid: int) -> dict[str, float]:
    samples = kvw.samples()
    out = {}
    for key, (name, api, result) in COUNTERS.items():
        out[key] = sum(
            v
            for n, lab, v in samples
            if n == name
            and lab.get("pid") == str(pid)
            and lab.get("api") == api
            and (not result or lab.get("result") == result)
        )
    return out


def validate_mode(kvw: Kvwatch, args: argparse.Namespace, mode: str) -> dict[str, object]:
    h = Harness(args.backend, mode, "watched", args.steps, args.sleep, args.stub)
    attached = wait_for(lambda: kvw.value("kvwatch_cuda_probes_attached", pid=str(h.pid)) > 0, 30)
    time.sleep(args.quiet)  # the quiet baseline
    c0 = read_counters(kvw, h.pid)  # nothing allocates between this read and "go"
    t = h.go()
    time.sleep(1.5)  # a tick publishes the last calls
    c1 = read_counters(kvw, h.pid)
    d = {k: c1[k] - c0[k] for k in c1}
    alerts = kvw.alerts(h.pid)
    row: dict[str, object] = {
        "mode": mode,
        "pid": h.pid,
        "attached": attached,
        "torch": {k: v for k, v in t.items() if k not in ("pid", "mode")},
        "kvwatch_delta": d,
        "kvwatch_total": c1,
        "alerts": [(a["alert"], a["cause"]) for a in alerts],
        "loop_seconds": t["seconds"],
    }
    seg_a, seg_f = t["segment.all.allocated"], t["segment.all.freed"]
    reserved = t["reserved_bytes.all.current"]
    checks: dict[str, bool] = {}
    if mode in ("cached", "emptycache"):
        checks["cudaMalloc == segment.all.allocated"] = d["malloc"] == seg_a
        checks["cudaFree == segment.all.freed"] = d["free"] == seg_f
        if d["free_unknown"] == 0:
            checks["malloc bytes - freed bytes == reserved bytes"] = d["malloc_bytes"] - d["free_bytes"] == reserved
        else:  # empty_cache freed a segment allocated before kvwatch attached: its size is unknown
            checks["malloc bytes - known freed bytes >= reserved bytes"] = (
                d["malloc_bytes"] - d["free_bytes"] >= reserved
            )
    elif mode == "nocache":
        checks["cudaMalloc == tensors"] = d["malloc"] == t["tensors"]
        checks["cudaFree == tensors"] = d["free"] == t["tensors"]
    elif mode == "expandable":
        checks["no cudaMalloc"] = d["malloc"] == 0
        checks["cuMemCreate seen"] = d["create"] > 0
        checks["cuMemCreate bytes - cuMemRelease bytes == reserved bytes"] = (
            d["create_bytes"] - d["release_bytes"] == reserved
        )
    checks["no failed cudaMalloc"] = d["malloc_err"] == 0
    row["checks"] = checks
    row["counts_match"] = all(checks.values())
    expected_cause = MODES[mode][1]
    collapse = [c for a, c in row["alerts"] if a == "KVCacheReuseCollapse"]  # type: ignore[union-attr]
    row["alert_ok"] = (collapse == [expected_cause]) if expected_cause else not collapse
    h.finish()
    return row


def overhead(args: argparse.Namespace) -> dict[str, object]:
    """The loop's wall time with the CUDA probes attached vs detached, alternating
    round by round inside one unwatched harness process (same GPU state, same
    process), so that the difference is the probes' and not a new process's."""
    from kvwatch.probes.cuda import CudaProbes

    probes = CudaProbes()
    probes.start()
    out: dict[str, object] = {}
    try:
        for mode in ("cached", "emptycache"):
            env, _ = MODES[mode]
            cmd = [
                sys.executable,
                str(HERE / "torch_alloc_harness.py"),
                mode,
                "--steps",
                str(args.overhead_steps),
                "--tag",
                "unwatched",
                "--rounds",
                str(2 * args.rounds + 1),
            ]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env(env))
            assert p.stdin is not None and p.stdout is not None
            p.stdout.readline()
            on: list[float] = []
            off: list[float] = []
            calls = 0
            for r in range(2 * args.rounds + 1):
                watched = r % 2 == 1
                if watched:
                    probes.attach(p.pid)
                p.stdin.write("\n")
                p.stdin.flush()
                seconds = float(json.loads(p.stdout.readline())["seconds"])
                if watched:
                    c = probes.sample().processes.get(p.pid)
                    calls += c.alloc_calls(("cudaMalloc",)) if c else 0
                    probes.detach(p.pid)
                    probes.settle()  # really gone before timing
                    on.append(seconds)
                elif r > 0:  # round 0 warms the process up
                    off.append(seconds)
            p.wait(60)
            out[mode] = {
                "attached_seconds": on,
                "detached_seconds": off,
                "median_attached": statistics.median(on),
                "median_detached": statistics.median(off),
                "slowdown_pct": 100 * (statistics.median(on) / statistics.median(off) - 1),
                "slowdown_pct_of_minima": 100 * (min(on) / min(off) - 1),
                "cudaMalloc_calls_counted_while_attached": calls,
            }
    finally:
        probes.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backend", choices=["torch", "stub"], default="torch")
    ap.add_argument("--stub", default="")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.01)
    ap.add_argument("--quiet", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overhead-steps", type=int, default=2000)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    kvw = Kvwatch(args.out)
    results: dict[str, object] = {
        "backend": args.backend,
        "modes": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        for mode in MODES:
            row = validate_mode(kvw, args, mode)
            print(json.dumps(row), flush=True)
            results["modes"].append(row)  # type: ignore[attr-defined]
        results["kvwatch_exit_code"] = kvw.stop()  # its NVML discovery would watch the overhead harness too
        if args.backend == "torch":
            results["overhead"] = overhead(args)
        print(json.dumps(results.get("overhead")), flush=True)
    finally:
        if kvw.proc.poll() is None:
            results["kvwatch_exit_code"] = kvw.stop()
    (args.out / "cuda_validation.json").write_text(json.dumps(results, indent=2))
    lines = [
        "| mode | PyTorch segments alloc / freed (tensors) | kvwatch cudaMalloc / cudaFree | cuMemCreate | "
        "reserved bytes (PyTorch / kvwatch) | checks | alerts | alert ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["modes"]:  # type: ignore[attr-defined]
        t, d = r["torch"], r["kvwatch_delta"]
        net = (
            d["create_bytes"] - d["release_bytes"] if r["mode"] == "expandable" else d["malloc_bytes"] - d["free_bytes"]
        )
        lines.append(
            f"| {r['mode']} | {t['segment.all.allocated']:.0f} / {t['segment.all.freed']:.0f} ({t['tensors']}) | "
            f"{d['malloc']:.0f} / {d['free']:.0f} | {d['create']:.0f} | {t['reserved_bytes.all.current']:.0f} / {net:.0f} | "
            f"{'all pass' if r['counts_match'] else r['checks']} | {r['alerts']} | {r['alert_ok']} |"
        )
    lines.append("")
    for mode, o in results.get("overhead", {}).items():  # type: ignore[union-attr]
        lines.append(
            f"overhead {mode}: probes attached {o['median_attached']:.4f} s vs detached {o['median_detached']:.4f} s "
            f"({o['slowdown_pct']:+.2f} %; of the fastest rounds {o['slowdown_pct_of_minima']:+.2f} %) "
            f"over {len(o['attached_seconds'])} alternating rounds; "
            f"attached {o['attached_seconds']} detached {o['detached_seconds']}"
        )
    (args.out / "cuda_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
