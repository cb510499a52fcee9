"""Processes, cgroup and ground truths of the LMCache validation (``validate_lmcache.py``).

vLLM serves the tiny model through ``LMCacheConnectorV1`` with a pinned CPU pool and a local
disk tier on a disk-backed file system (the tier must be reclaimable: tmpfs and overlay are
refused), the whole server inside one memory cgroup that starts without a limit. kvwatch runs
with no KV directory configured: it must find the tier in the engine's ``LMCACHE_CONFIG_FILE``.

The squeeze: the cgroup's limit set to what it holds, then a memory hog started inside it (its
``oom_score_adj`` 1000: if anything is killed, it is the hog). With no swap, the kernel can only
take page cache, and most of the cgroup's page cache is the disk tier's chunk files, which vLLM
reads back as it serves. The ground truth of what the kernel evicted is ``mincore`` over the
tier's files; the cgroup's own ``workingset_refault_file`` stands beside kvwatch's refaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.gpu.vllm_harness import WORK, engine_env, get_text, parse, start_session, value

PORT = 8000
SERVED = "tiny"
CGROUP = "kvwatch-lmcache-engine"
DISK_CANDIDATES = ("/var/tmp", "/root", "/opt", "/home", "/srv", "/mnt")
DISK_FS = ("ext4", "xfs", "btrfs", "ext3", "f2fs")
GIB = 1 << 30
MIB = 1 << 20

HOG = r"""
import os, signal, sys, time
open("/proc/self/oom_score_adj", "w").write("1000")
target, rate = int(sys.argv[1]), int(sys.argv[2])
held, chunks, t0 = 0, [], time.monotonic()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while held < target:
    n = min(16 << 20, target - held)
    b = bytearray(n)
    b[::4096] = b"\x01" * len(b[::4096])  # one write per page: every page charged
    chunks.append(b)
    held += n
    wait = t0 + held / rate - time.monotonic()
    if wait > 0:
        time.sleep(wait)
print(f"held {held} in {time.monotonic() - t0:.2f} s", flush=True)
while True:
    time.sleep(60)
"""


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file-system type) of the mount holding ``path``."""
    best = ("/", "")
    real = os.path.realpath(path)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        point = left.split()[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/") or point == "/"
        if inside and len(point) >= len(best[0]):
            best = (point, right.split()[0])
    return best


def pick_disk_dir(need: int = 8 * GIB) -> tuple[Path, dict[str, Any]]:
    """A directory on a disk-backed file system with room for the tier."""
    seen: dict[str, Any] = {}
    for c in DISK_CANDIDATES:
        if not Path(c).is_dir():
            continue
        point, fs = mount_of(c)
        st = os.statvfs(c)
        free = st.f_bavail * st.f_frsize
        seen[c] = {"mount": point, "fs": fs, "free_gib": round(free / GIB, 1)}
        if fs in DISK_FS and free >= need:
            return Path(c) / "lmcache-disk", seen
    raise RuntimeError(f"no disk-backed directory for the tier: {seen}")


def lmcache_yaml(disk: Path, disk_gib: float, cpu_gib: float) -> str:
    return "\n".join(
        [
            "chunk_size: 256",
            "local_cpu: true",
            f"max_local_cpu_size: {cpu_gib}",
            f'local_disk: "file://{disk}/"',
            f"max_local_disk_size: {disk_gib}",
            "local_disk_path_sharding: by_gpu",
            "save_unfull_chunk: false",
            "",
        ]
    )


class Cgroup:
    """The engine's memory cgroup through kvwatch's lab helper (v1, v2 or hybrid)."""

    def __init__(self) -> None:
        from kvwatch.daemon.lab.memcg import MemoryCgroup

        self.cg = MemoryCgroup(CGROUP, None)
        with contextlib.suppress(OSError):
            self.cg.remove()
        self.cg.create()
        if self.cg.version == 2:
            with contextlib.suppress(OSError):
                (self.cg.path / "memory.swap.max").write_text("0")
        else:
            with contextlib.suppress(OSError):
                (self.cg.path / "memory.swappiness").write_text("0")

    @classmethod
    def existing(cls) -> Cgroup:
        from kvwatch.daemon.lab.memcg import MemoryCgroup

        self = cls.__new__(cls)
        self.cg = MemoryCgroup(CGROUP, None)
        return self

    def procs_files(self) -> list[str]:
        files = [str(self.cg.path / "cgroup.procs")]
        if self.cg.unified is not None and self.cg.unified != self.cg.path:
            files.append(str(self.cg.unified / "cgroup.procs"))
        return files

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the cgroup (the shell moves itself in, then execs)."""
        script = "for f in " + " ".join(self.procs_files()) + '; do echo $$ > "$f"; done; exec "$@"'
        return ["sh", "-c", script, "sh", *argv]

    def usage(self) -> int:
        return self.cg.usage()

    def limit(self, limit: int | None) -> None:
        v2 = self.cg.version == 2
        name = "memory.max" if v2 else "memory.limit_in_bytes"
        text = ("max" if v2 else "-1") if limit is None else str(limit)
        (self.cg.path / name).write_text(text)

    def stat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.cg.path / "memory.stat").read_text().splitlines():
                k, v = line.split()
                out[k] = int(v)
        for name in ("memory.events", "memory.pressure"):
            with contextlib.suppress(OSError):
                out[name] = (self.cg.path / name).read_text()  # type: ignore[assignment]
        return out

    def refaults(self) -> int:
        s = self.stat()
        return int(s.get("workingset_refault_file", s.get("workingset_refault", 0)))

    def info(self) -> dict[str, Any]:
        return {"version": self.cg.version, "path": str(self.cg.path), "unified": str(self.cg.unified)}


def serve_argv(model: str, gpu_blocks: int) -> list[str]:
    return [
        "python3", "-m", "vllm.entrypoints.cli.main", "serve", model, "--load-format", "dummy",
        "--served-model-name", SERVED, "--enable-prefix-caching", "--block-size", "16",
        "--num-gpu-blocks-override", str(gpu_blocks), "--max-model-len", "2048", "--max-num-seqs", "32",
        "--gpu-memory-utilization", "0.3", "--enforce-eager", "--seed", "0",
        "--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
        "--host", "127.0.0.1", "--port", str(PORT), "--enable-prompt-tokens-details",
    ]  # fmt: skip


def start_vllm(cg: Cgroup | None, vllm_site: str, model: str, gpu_blocks: int, config: Path) -> int:
    env = engine_env(vllm_site)
    prom = WORK / "prom-mp"
    prom.mkdir(parents=True, exist_ok=True)
    env.update(
        LMCACHE_CONFIG_FILE=str(config),
        LMCACHE_TRACK_USAGE="false",
        PROMETHEUS_MULTIPROC_DIR=str(prom),  # LMCache's families reach /metrics only with it
    )
    argv = serve_argv(model, gpu_blocks)
    return start_session(cg.wrap(argv) if cg else argv, WORK / "vllm.log", env=env)


def start_hog(cg: Cgroup, target: int, rate: int, name: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    return start_session(cg.wrap(["python3", "-c", HOG, str(target), str(rate)]), WORK / f"{name}.log", env=env)


def hog_held(name: str) -> bool:
    p = WORK / f"{name}.log"
    return p.exists() and "held" in p.read_text()


def tier_files(disk: Path) -> list[Path]:
    out: list[Path] = []
    for root, _, names in os.walk(disk):
        out += [Path(root) / n for n in names]
    return out


def residency(disk: Path) -> dict[str, int]:
    """Files, bytes and resident pages of the tier now (files that vanish while read are skipped)."""
    from kvwatch.daemon.lab.workloads import resident_pages

    files = size = pages = 0
    for f in tier_files(disk):
        with contextlib.suppress(OSError):
            s = f.stat().st_size
            r = resident_pages(f)
            files, size, pages = files + 1, size + s, pages + r
    return {"files": files, "bytes": size, "resident_pages": pages}


def vllm_metrics() -> str:
    return get_text(f"http://127.0.0.1:{PORT}/metrics", timeout=5)


def histogram_mean(text: str, name: str) -> tuple[float, float]:
    s = parse(text)
    return value(s, f"{name}_sum"), value(s, f"{name}_count")


def run_cmd(argv: list[str], timeout: float = 30) -> str:
    try:
        r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{argv[0]}: {err}"


def machine_facts() -> dict[str, Any]:
    swaps = Path("/proc/swaps").read_text().splitlines()[1:]
    return {
        "kernel": os.uname().release,
        "swaps": swaps,
        "meminfo": {
            k: v.strip() for k, v in (ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines()[:8])
        },
        "psi": run_cmd(["cat", "/proc/pressure/memory"]),
    }


def save_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def wait_for(pred: Any, timeout: float, every: float = 0.5) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(Exception):
            if pred():
                return True
        time.sleep(every)
    return False
