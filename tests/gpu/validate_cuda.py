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
        return [
            (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        return sum(
            v for n, lab, v in self.samples() if n == name and all(lab.get(k) == w for k, w in labels.items())
        )

    def alerts(self, pid: int) -> list[dict[str, str]]:
        return [
            lab
            for n, lab, v in self.samples()
            if n == "kvwatch_alert_active" and lab.get("pid") == str(pid) and v == 1
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
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env(env)
        )
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


def validate_mode(kvw: Kvwatch, args: argparse.Namespace, mode: str) -> dict[str, object]:
    h = Harness(args.backend, mode, "watched", args.steps, args.sleep, args.stub)
    attached = wait_for(lambda: kvw.value("kvwatch_cuda_probes_attached", pid=str(h.pid)) > 0, 30)
    time.sleep(args.quiet)  # the quiet baseline
    torch_counts = h.go()
    time.sleep(1.5)  # a tick publishes the last calls
    pid = str(h.pid)

    def calls(api: str, result: str = "ok", fam: str = "kvwatch_cuda_alloc_calls_total") -> float:
        return kvw.value(fam, pid=pid, api=api, result=result)

    alerts = kvw.alerts(h.pid)
    row: dict[str, object] = {
        "mode": mode,
        "pid": h.pid,
        "attached": attached,
        "torch_segment_allocated": torch_counts["segment.all.allocated"],
        "torch_segment_freed": torch_counts["segment.all.freed"],
        "torch_alloc_retries": torch_counts["num_alloc_retries"],
        "kvwatch_cudaMalloc_ok": calls("cudaMalloc"),
        "kvwatch_cudaMalloc_error": calls("cudaMalloc", "error"),
        "kvwatch_cudaFree_ok": calls("cudaFree", fam="kvwatch_cuda_free_calls_total"),
        "kvwatch_cuMemCreate_ok": calls("cuMemCreate"),
        "kvwatch_cuMemRelease_ok": calls("cuMemRelease", fam="kvwatch_cuda_free_calls_total"),
        "kvwatch_cuMemMap": kvw.value("kvwatch_cuda_vmm_map_calls_total", pid=pid, api="cuMemMap"),
        "kvwatch_cuMemAlloc_ok": calls("cuMemAlloc"),
        "outstanding_device": kvw.value("kvwatch_cuda_outstanding_bytes", pid=pid, kind="device"),
        "alerts": [(a["alert"], a["cause"]) for a in alerts],
        "loop_seconds": torch_counts["seconds"],
    }
    expected_cause = MODES[mode][1]
    collapse = [c for a, c in row["alerts"] if a == "KVCacheReuseCollapse"]  # type: ignore[union-attr]
    if mode == "expandable":
        row["counts_match"] = row["kvwatch_cudaMalloc_ok"] == 0 and float(row["kvwatch_cuMemCreate_ok"]) > 0
    else:
        row["counts_match"] = (
            row["kvwatch_cudaMalloc_ok"] == row["torch_segment_allocated"]
            and row["kvwatch_cudaFree_ok"] == row["torch_segment_freed"]
        )
    row["alert_ok"] = (collapse == [expected_cause]) if expected_cause else not collapse
    h.finish()
    return row


def overhead(kvw: Kvwatch, args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    for mode in ("cached", "emptycache"):
        on: list[float] = []
        off: list[float] = []
        for _ in range(args.rounds):
            for tag, bucket in (("watched", on), ("unwatched", off)):
                h = Harness(args.backend, mode, tag, args.steps, 0.0, args.stub)
                if tag == "watched":
                    wait_for(lambda h=h: kvw.value("kvwatch_cuda_probes_attached", pid=str(h.pid)) > 0, 30)
                else:
                    time.sleep(1.0)  # same pause, nobody attaches
                bucket.append(float(h.go()["seconds"]))
                h.finish()
        out[mode] = {
            "watched_seconds": on,
            "unwatched_seconds": off,
            "median_watched": statistics.median(on),
            "median_unwatched": statistics.median(off),
            "slowdown_pct": 100 * (statistics.median(on) / statistics.median(off) - 1),
        }
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
        results["overhead"] = overhead(kvw, args)
        print(json.dumps(results["overhead"]), flush=True)
    finally:
        results["kvwatch_exit_code"] = kvw.stop()
    (args.out / "cuda_validation.json").write_text(json.dumps(results, indent=2))
    lines = [
        "| mode | PyTorch cudaMalloc / cudaFree | kvwatch cudaMalloc / cudaFree | cuMemCreate | match | alerts | alert ok |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["modes"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['mode']} | {r['torch_segment_allocated']:.0f} / {r['torch_segment_freed']:.0f} | "
            f"{r['kvwatch_cudaMalloc_ok']:.0f} / {r['kvwatch_cudaFree_ok']:.0f} | {r['kvwatch_cuMemCreate_ok']:.0f} | "
            f"{r['counts_match']} | {r['alerts']} | {r['alert_ok']} |"
        )
    lines.append("")
    for mode, o in results["overhead"].items():  # type: ignore[union-attr]
        lines.append(
            f"overhead {mode}: watched {o['median_watched']:.3f} s vs unwatched {o['median_unwatched']:.3f} s "
            f"({o['slowdown_pct']:+.2f} %), rounds {o['watched_seconds']} / {o['unwatched_seconds']}"
        )
    (args.out / "cuda_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
