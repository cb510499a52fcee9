"""Processes and ground truths of the prefill/decode validation (``validate_pd.py``, issue 26).

vLLM 0.26.0 twice on the one GPU, NixlConnector between them (``nixl_notes.md`` has the command lines and
why): the prefill instance (``kv_producer``, port 8100, side channel 5600) first, then, once it answers
/health, the decode instance (``kv_consumer``, port 8200, side channel 5601), each with
``--gpu-memory-utilization 0.3`` and ``UCX_MEM_CUDA_HOOK_MODE=reloc`` (UCX's default bistro hooks would
rewrite the CUDA entries kvwatch uprobes); then ``pd_proxy.py`` on 8000, logging every request with its
CLOCK_MONOTONIC marks. NIXL sits in the vLLM site (/tmp/vsite, ``install_nixl.sh``). KV events are off.

The ground truths: the proxy's log (prompt tokens and remote blocks per request: the bytes decode must read,
(ceil(N/16) - h) x 524,288 for the tiny model), decode's own ``vllm:nixl_*`` histograms (NIXL's per-request
telemetry) and prefill's ``vllm:nixl_num_kv_expired_reqs``. The slow-down: a process that loops
device-to-device copies of 1 GiB tensors on the same GPU, competing with the cuda_ipc reads.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from tests.gpu.vllm_harness import HERE, WORK, Sample, alive, engine_env, get_text, parse, start_session, value

SERVED = "tiny"
PREFILL_PORT, DECODE_PORT, PROXY_PORT = 8100, 8200, 8000
SIDE_PORTS = {"prefill": 5600, "decode": 5601}
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
PORTS = {"prefill": PREFILL_PORT, "decode": DECODE_PORT}
BLOCK = 16
BLOCK_BYTES = 524_288  # 16 layers x 2 x 16 tokens x 8 heads x 64 x 2 B (nixl_notes.md (e))
PROXY_LOG = WORK / "pd_requests.jsonl"
UCX_ENV = {"UCX_MEM_CUDA_HOOK_MODE": "reloc"}
V_NIXL = ("xfer_time_seconds", "post_time_seconds", "bytes_transferred", "num_descriptors")

HOG = r"""
import signal, sys, time
import torch
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
n, streams = int(sys.argv[1]), int(sys.argv[2])
pairs = [(torch.empty(n, dtype=torch.uint8, device="cuda:0"), torch.empty(n, dtype=torch.uint8, device="cuda:0"))
         for _ in range(streams)]
ss = [torch.cuda.Stream() for _ in range(streams)]
torch.cuda.synchronize()
print(f"copying {streams} x {n} B", flush=True)
k, t0 = 0, time.monotonic()
while True:
    for s, (a, b) in zip(ss, pairs):
        with torch.cuda.stream(s):
            b.copy_(a)
    k += 1
    if k % 200 == 0:
        torch.cuda.synchronize()
        dt = time.monotonic() - t0
        print(f"{k} rounds, {k * streams * n / dt / 1e9:.0f} GB/s copied", flush=True)
"""


# --- processes ------------------------------------------------------------------------------------
def serve_argv(model: str, role: str, gpu_blocks: int, util: float) -> list[str]:
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": ROLES[role]}, separators=(",", ":"))
    argv = [
        "python3", "-m", "vllm.entrypoints.cli.main", "serve", model, "--load-format", "dummy",
        "--served-model-name", SERVED, "--enable-prefix-caching", "--block-size", str(BLOCK),
        "--num-gpu-blocks-override", str(gpu_blocks), "--max-model-len", "2048", "--max-num-seqs", "32",
        "--gpu-memory-utilization", str(util), "--enforce-eager", "--seed", "0",
        "--kv-transfer-config", kv,
    ]  # fmt: skip
    if role == "decode":
        argv += ["--enable-prompt-tokens-details", "--enable-per-request-metrics"]
    return [*argv, "--host", "127.0.0.1", "--port", str(PORTS[role])]


def pd_env(vllm_site: str, role: str, proto_info: bool) -> dict[str, str]:
    env = engine_env(vllm_site)
    env.pop("VLLM_SERVER_DEV_MODE", None)  # nixl_notes.md's command lines do not set it
    env.update(UCX_ENV, VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_PORTS[role]))
    if proto_info and role == "decode":
        env["UCX_PROTO_INFO"] = "y"  # UCX logs the protocol/transport it picks (once per endpoint config)
    return env


def start_instance(role: str, vllm_site: str, model: str, gpu_blocks: int, util: float, proto_info: bool) -> int:
    argv = serve_argv(model, role, gpu_blocks, util)
    return start_session(argv, WORK / f"{role}.log", env=pd_env(vllm_site, role, proto_info), cwd=WORK)


def healthy(role: str, pid: int) -> bool:
    if not alive(pid):
        tail = (WORK / f"{role}.log").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{role} exited: {tail}")
    get_text(f"http://127.0.0.1:{PORTS[role]}/health", timeout=2)
    return True


def start_proxy() -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    argv = [
        "python3", str(HERE / "pd_proxy.py"), "--prefill", f"http://127.0.0.1:{PREFILL_PORT}",
        "--decode", f"http://127.0.0.1:{DECODE_PORT}", "--port", str(PROXY_PORT), "--log", str(PROXY_LOG),
    ]  # fmt: skip
    return start_session(argv, WORK / "proxy.log", env=env, cwd=WORK)


def start_hog(vllm_site: str, nbytes: int, streams: int) -> int:
    env = engine_env(vllm_site)
    return start_session(["python3", "-c", HOG, str(nbytes), str(streams)], WORK / "hog.log", env=env)


def hog_copying(pid: int) -> bool:
    if not alive(pid):
        raise RuntimeError("copy hog exited: " + (WORK / "hog.log").read_text(errors="replace")[-800:])
    return "copying" in (WORK / "hog.log").read_text(errors="replace")


CPU_CG = Path("/sys/fs/cgroup/kvwatch-pd-starve")


def cap_cpu(pids: list[int], cores: float) -> dict[int, str]:
    """``pids`` (all their threads) into a cgroup v2 capped at ``cores`` CPUs; their old cgroups, to go back."""
    root = Path("/sys/fs/cgroup")
    if "cpu" not in (root / "cgroup.subtree_control").read_text().split():
        (root / "cgroup.subtree_control").write_text("+cpu")
    CPU_CG.mkdir(exist_ok=True)
    (CPU_CG / "cpu.max").write_text(f"{int(cores * 100_000)} 100000")
    orig: dict[int, str] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            orig[pid] = Path(f"/proc/{pid}/cgroup").read_text().strip().split("::", 1)[1]
            (CPU_CG / "cgroup.procs").write_text(str(pid))
    return orig


def uncap_cpu(orig: dict[int, str]) -> None:
    for pid, path in orig.items():
        with contextlib.suppress(OSError):
            (Path("/sys/fs/cgroup") / path.lstrip("/") / "cgroup.procs").write_text(str(pid))
    with contextlib.suppress(OSError):
        CPU_CG.rmdir()


# --- what the engines say -------------------------------------------------------------------------
def engine_samples(role: str) -> list[Sample]:
    return parse(get_text(f"http://127.0.0.1:{PORTS[role]}/metrics", timeout=5))


def vllm_nixl(s: list[Sample]) -> dict[str, float]:
    """Decode's NIXL telemetry totals (one observation per completed READ) and TTFT."""
    out = {f"{m}_{k}": value(s, f"vllm:nixl_{m}_{k}") for m in V_NIXL for k in ("sum", "count")}
    out["failed_transfers"] = value(s, "vllm:nixl_num_failed_transfers_total")
    out["failed_notifications"] = value(s, "vllm:nixl_num_failed_notifications_total")
    out["kv_expired_reqs"] = value(s, "vllm:nixl_num_kv_expired_reqs_total")
    out["ttft_sum"] = value(s, "vllm:time_to_first_token_seconds_sum")
    out["ttft_count"] = value(s, "vllm:time_to_first_token_seconds_count")
    out["external_hits"] = value(s, "vllm:external_prefix_cache_hits_total")
    return out


def kv_rows(kv: list[Sample], name: str, role: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [
        (lab, v)
        for n, lab, v in kv
        if n == name and lab.get("role") == role and all(lab.get(k) == w for k, w in labels.items())
    ]


def kvwatch_nixl(kv: list[Sample], role: str = "decode") -> dict[str, Any]:
    """kvwatch's transfer counters over the processes labelled ``role`` (all its pids summed)."""

    def total(name: str, **labels: str) -> float:
        return sum(v for _, v in kv_rows(kv, name, role, **labels))

    pids = sorted({lab.get("pid", "") for lab, _ in kv_rows(kv, "kvwatch_transfer_probes_attached", role)})
    return {
        "nixl_bytes": total("kvwatch_transfer_bytes_total", lib="nixl"),
        "ucx_bytes": total("kvwatch_transfer_bytes_total", lib="ucx"),
        "posts_ok": total("kvwatch_transfer_calls_total", lib="nixl", result="ok"),
        "posts_error": total("kvwatch_transfer_calls_total", lib="nixl", result="error"),
        "ucx_calls": total("kvwatch_transfer_calls_total", lib="ucx", result="ok"),
        "completed": total("kvwatch_transfer_completed_total", lib="nixl"),
        "duration_sum": total("kvwatch_transfer_duration_seconds_sum", lib="nixl"),
        "duration_count": total("kvwatch_transfer_duration_seconds_count", lib="nixl"),
        "symbols_attached": total("kvwatch_transfer_probes_attached"),
        "pids": pids,
    }


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: v - a.get(k, 0) for k, v in b.items() if isinstance(v, (int, float))}


def quantiles(s: list[Sample], name: str, qs: tuple[float, ...] = (0.5, 0.99), **labels: str) -> dict[str, Any]:
    """Quantiles of a Prometheus histogram (buckets summed over label sets, linear within a bucket)."""
    cum: dict[float, float] = {}
    for n, lab, v in s:
        if n == f"{name}_bucket" and all(lab.get(k) == w for k, w in labels.items()):
            le = float(lab["le"])
            cum[le] = cum.get(le, 0.0) + v
    if not cum or max(cum.values()) <= 0:
        return {f"p{round(q * 100)}": None for q in qs}
    les = sorted(cum)
    counts = [cum[le] for le in les]
    total = counts[-1]
    out: dict[str, Any] = {}
    for q in qs:
        rank = q * total
        i = bisect.bisect_left(counts, rank)
        hi = les[min(i, len(les) - 1)]
        lo = les[i - 1] if i > 0 else 0.0
        below = counts[i - 1] if i > 0 else 0.0
        inside = counts[min(i, len(les) - 1)] - below
        if math.isinf(hi):
            out[f"p{round(q * 100)}"] = lo  # above the last finite bucket: its bound (a lower bound)
        else:
            out[f"p{round(q * 100)}"] = lo + (hi - lo) * ((rank - below) / inside if inside > 0 else 1.0)
    return out


# --- the proxy's log --------------------------------------------------------------------------------
def proxy_records(path: Path = PROXY_LOG) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def expected_bytes(rec: dict[str, Any], hit_blocks: int = 0) -> int | None:
    """What decode reads for one request: (ceil(N/16) - h) x 524,288 (nixl_notes.md (e))."""
    n = rec.get("prompt_tokens")
    if n is None or not rec.get("kv_transfer_params"):
        return None
    return max(0, math.ceil(n / BLOCK) - hit_blocks) * BLOCK_BYTES


def transfer_span(rec: dict[str, Any]) -> float | None:
    """prefill_done -> decode_first_byte in seconds: the READ, decode's step and the decode itself."""
    m = rec.get("mono_ns") or {}
    if "prefill_done" in m and "decode_first_byte" in m:
        return (m["decode_first_byte"] - m["prefill_done"]) / 1e9
    return None


def requests_in(recs: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """The proxy's requests received inside [t0, t1] (monotonic seconds): count, errors, expected bytes."""
    inside = [r for r in recs if t0 <= (r.get("mono_ns") or {}).get("received", 0) / 1e9 <= t1]
    exp = [expected_bytes(r) for r in inside if r.get("status") == 200]
    return {"requests": len(inside), "errors": sum(1 for r in inside if r.get("error")),
            "expected_bytes": sum(e for e in exp if e)}  # fmt: skip


def dist(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": statistics.median(xs),
            "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max": xs[-1]}  # fmt: skip


# --- the transport ------------------------------------------------------------------------------------
LOG_RE = re.compile(r"cuda_ipc|cuda_copy|\btcp\b|\brc_(mlx5|verbs)\b|\bsysv\b|\bposix\b|UCX|NIXL|Nixl|Transfer plan|"
                    r"KV Transfer metrics|_log_failure|backend", re.I)  # fmt: skip


def transport_facts(vllm_site: str) -> dict[str, Any]:
    """UCX env, what decode's (and prefill's) log says about NIXL/UCX, and ucx_info -v if the wheel has it."""
    out: dict[str, Any] = {"ucx_env": dict(UCX_ENV), "side_ports": SIDE_PORTS}
    for role in ("decode", "prefill"):
        p = WORK / f"{role}.log"
        lines = p.read_text(errors="replace").splitlines() if p.exists() else []
        hits = [ln[-400:] for ln in lines if LOG_RE.search(ln)]
        out[f"{role}_log_lines"] = hits if len(hits) <= 90 else [*hits[:80], "...", *hits[-10:]]
        counts = {k: sum(k in ln for ln in lines) for k in ("cuda_ipc", "cuda_copy", "tcp", "rc_mlx5", "sysv")}
        out[f"{role}_transport_mentions"] = counts
    tools = sorted(str(p) for p in Path(vllm_site).glob("nixl*/**/ucx_info"))
    out["ucx_info"] = tools
    if tools:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            r = subprocess.run([tools[0], "-v"], capture_output=True, text=True, timeout=20, check=False)
            out["ucx_info_v"] = (r.stdout + r.stderr)[-2000:]
    return out


def processes(kv: list[Sample]) -> list[dict[str, str]]:
    """Every (pid, engine, role, component) kvwatch labels a series with."""
    seen: dict[str, dict[str, str]] = {}
    for _, lab, _v in kv:
        if lab.get("pid") and "role" in lab:
            seen.setdefault(lab["pid"], {k: lab.get(k, "") for k in ("pid", "engine", "role", "component")})
    return sorted(seen.values(), key=lambda d: (d["role"], d["pid"]))


def watch_facts(kv: list[Sample]) -> dict[str, Any]:
    """What kvwatch labels: the processes and roles, and its transfer probes in prefill and decode."""
    w: dict[str, Any] = {"processes": processes(kv)}
    w["roles_ok"] = {"prefill", "decode"} <= {p["role"] for p in w["processes"]}
    w["watched"] = {lab.get("engine", ""): v for n, lab, v in kv if n == "kvwatch_watched_processes"}
    w["decode_transfer"], w["prefill_transfer"] = kvwatch_nixl(kv, "decode"), kvwatch_nixl(kv, "prefill")
    w["transfer_probes"] = [
        {**lab, "value": v} for n, lab, v in kv if n == "kvwatch_probe_attached" and "transfer" in str(lab)
    ]
    w["attached_ok"] = w["decode_transfer"]["symbols_attached"] > 0
    return w


def pack(out: Path, requests: list[dict[str, Any]]) -> None:
    """logs.tar.gz, requests.jsonl.gz (the clients'), pd_requests.jsonl.gz and record_trace.json.gz."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for p in [*sorted(WORK.glob("*.log")), WORK / "state.json"]:
            if p.exists():
                tar.add(p, arcname=p.name)
    with gzip.open(out / "requests.jsonl.gz", "wt") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    for src, dst in ((PROXY_LOG, "pd_requests.jsonl.gz"), (WORK / "trace.json", "record_trace.json.gz")):
        if src.exists():
            with open(src, "rb") as s, gzip.open(out / dst, "wb") as d:
                shutil.copyfileobj(s, d)


def machine_facts() -> dict[str, Any]:
    def run(argv: list[str]) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
            return (r.stdout + r.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{argv[0]}: {err}"

    q = "--query-gpu=name,driver_version,memory.total,memory.used"
    return {"kernel": os.uname().release, "gpu": run(["nvidia-smi", q, "--format=csv,noheader"]),
            "python": sys.version.split()[0]}  # fmt: skip


def save_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def wait_still(read: Any, seconds: float, timeout: float) -> bool:
    """True once ``read()`` has returned the same value for ``seconds`` (polled every 0.5 s)."""
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            now = read()
        except Exception:
            now = None
        if now != last:
            last, since = now, time.monotonic()
        elif now is not None and time.monotonic() - since >= seconds:
            return True
        time.sleep(0.5)
    return False
