"""Processes and recorders of the real-engine validation (``validate_vllm.py``).

Each long-lived process — kvwatch, the vLLM server, the independent subscriber — starts
in a session of its own, so that it outlives one device call and the next call finds it
(the lent machine keeps what runs while it stays warm). ``State`` remembers their PIDs
and the run's marks in WORK/state.json between calls.

The watched workload never runs under bcc's libraries: ``engine_env`` drops the
bundle's LD_LIBRARY_PATH/PYTHONPATH and puts vLLM's site on PYTHONPATH instead.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORK = Path(os.environ.get("VVAL_WORK", "/tmp/vval"))
KV_PORT, HTTP_PORT, KVWATCH_PORT = 5557, 8000, 9740
TOPIC = "kv"
Sample = tuple[str, dict[str, str], float]


# --- small HTTP helpers ------------------------------------------------------------------------
def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def post(url: str, timeout: float = 120.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def parse(text: str) -> list[Sample]:
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))


def by_label(samples: list[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name and all(lab.get(k) == w for k, w in labels.items()):
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def wait_until(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.5) -> float:
    """Seconds it took; raises TimeoutError naming what never happened."""
    t0 = time.monotonic()
    while True:
        try:
            if pred():
                return time.monotonic() - t0
        except (OSError, ValueError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


# --- state kept between device calls ------------------------------------------------------------
@dataclass
class State:
    engine: str = "vllm"
    pids: dict[str, int] = field(default_factory=dict)  # kvwatch, vllm, subscriber
    marks: list[dict[str, Any]] = field(default_factory=list)  # phase marks: name, wall, mono
    notes: list[str] = field(default_factory=list)
    sleep_mode: bool = True
    engine_core_pid: int = 0

    def mark(self, name: str, **extra: Any) -> dict[str, Any]:
        m = {"name": name, "wall": time.time(), "mono": time.monotonic(), **extra}
        self.marks.append(m)
        print(f"[{time.strftime('%H:%M:%S')}] {name} {json.dumps(extra) if extra else ''}", flush=True)
        self.save()
        return m

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"NOTE {text}", flush=True)
        self.save()

    def save(self) -> None:
        WORK.mkdir(parents=True, exist_ok=True)
        (WORK / "state.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls) -> State:
        p = WORK / "state.json"
        return cls(**json.loads(p.read_text())) if p.exists() else cls()

    def at(self, name: str) -> dict[str, Any]:
        return next(m for m in reversed(self.marks) if m["name"] == name)


# --- processes --------------------------------------------------------------------------------------
def engine_env(vllm_site: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    if vllm_site:
        env["PYTHONPATH"] = vllm_site
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_NO_USAGE_STATS="1",
        VLLM_SERVER_DEV_MODE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_session(argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    """A process in its own session (it outlives this device call), output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        p = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    return p.pid


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with contextlib.suppress(OSError):  # a zombie of ours is not alive
        st = Path(f"/proc/{pid}/stat").read_text()
        return st.rsplit(")", 1)[1].split()[0] != "Z"
    return False


def stop(pid: int, timeout: float = 30.0, sig: int = signal.SIGTERM) -> bool:
    """SIGTERM (then SIGKILL after ``timeout``); True when it went on the first signal."""
    if not alive(pid):
        return True
    with contextlib.suppress(OSError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not alive(pid):
            return True
        time.sleep(0.2)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    return False


def kill(pid: int) -> None:
    """SIGKILL to the process's session (it was started in one of its own) and reap it."""
    if alive(pid):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def kvwatch_argv(port: int = KVWATCH_PORT, sets: tuple[str, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "kvwatch.daemon", "run", "--listen", f"127.0.0.1:{port}", "--log-format", "json"]
    for s in sets:
        argv += ["--set", s]
    return argv


def kvwatch_url(path: str, port: int = KVWATCH_PORT) -> str:
    return f"http://127.0.0.1:{port}{path}"


def kvwatch_samples(port: int = KVWATCH_PORT) -> list[Sample]:
    return parse(get_text(kvwatch_url("/metrics", port)))


def kvwatch_ready(port: int = KVWATCH_PORT) -> bool:
    try:
        with urllib.request.urlopen(kvwatch_url("/readyz", port), timeout=2) as r:
            return int(r.status) == 200
    except OSError:
        return False


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    """kvwatch's JSON log lines with this event name."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == event:
            out.append(d)
    return out


def vllm_argv(engine: str, model: str, sleep_mode: bool, prefix_caching: bool = True) -> list[str]:
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_PORT}", "topic": TOPIC}
    common = [
        "serve", model, "--load-format", "dummy", "--served-model-name", "tiny",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--block-size", "16", "--num-gpu-blocks-override", "2048", "--max-model-len", "2048",
        "--max-num-seqs", "32", "--gpu-memory-utilization", "0.3", "--enforce-eager", "--seed", "0",
        "--kv-events-config", json.dumps(kv, separators=(",", ":")),
        "--kv-offloading-size", "2", "--kv-offloading-backend", "native",
        "--host", "127.0.0.1", "--port", str(HTTP_PORT), "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if sleep_mode:
        common.append("--enable-sleep-mode")
    if engine == "sim":  # the simulated engine takes the same command line (what it knows of it),
        # run as a console script named vllm, as pip installs vLLM (discovery's rule for it)
        script = WORK / "bin" / "vllm"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(f"#!{sys.executable}\nfrom kvwatch.daemon.lab.engine_sim_cli import main\n\nmain()\n")
        script.chmod(0o755)
        return [str(script), *common, "--serve-until-signal"]
    return ["python3", "-m", "vllm.entrypoints.cli.main", *common]


def vllm_url(path: str) -> str:
    return f"http://127.0.0.1:{HTTP_PORT}{path}"


def vllm_healthy() -> bool:
    try:
        with urllib.request.urlopen(vllm_url("/health"), timeout=2) as r:
            return int(r.status) == 200
    except OSError:
        return False


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# --- recorders ---------------------------------------------------------------------------------------
class Poller(threading.Thread):
    """Reads ``url`` every ``every`` seconds into a gzip of JSON lines: monotonic and wall time
    and what ``extract`` keeps of the page (the whole text by default)."""

    def __init__(self, url: str, out: Path, every: float, extract: Callable[[str], Any] | None = None) -> None:
        super().__init__(name=f"poll-{out.name}", daemon=True)
        self.url, self.out, self.every, self.extract = url, out, every, extract
        self.stop_event = threading.Event()
        self.count = 0
        self.errors = 0
        self.last: Any = None

    def run(self) -> None:
        with gzip.open(self.out, "at", compresslevel=6) as f:
            while not self.stop_event.is_set():
                t0 = time.monotonic()
                try:
                    text = get_text(self.url, timeout=3)
                    data = self.extract(text) if self.extract else text
                    self.last = data
                    f.write(json.dumps({"mono": t0, "wall": time.time(), "data": data}) + "\n")
                    self.count += 1
                except Exception:
                    self.errors += 1
                self.stop_event.wait(max(0.0, self.every - (time.monotonic() - t0)))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


KVWATCH_KEEP = (
    "kvwatch_alert_active",
    "kvwatch_probe_hits_total",
    "process_cpu_seconds_total",
    "kvwatch_cuda_",
    "kvwatch_alerts_fired_total",
    "kvwatch_kv_blocks_stored_total",
    "kvwatch_kv_blocks_removed_total",
    "kvwatch_kv_blocks_removed_young_total",
    "kvwatch_kv_cache_resets_total",
    "kvwatch_kv_event_batches_total",
    "kvwatch_engine_",
    "kvwatch_watched_processes",
    "kvwatch_events_lost_total",
    "kvwatch_kv_lost_",
    "kvwatch_kv_block_bytes",
    "kvwatch_kv_blocks_regretted_total",
    "kvwatch_kv_blocks_restored_total",
    "kvwatch_uprobe",
    "kvwatch_probe_run",
    "kvwatch_bpf_stats_enabled",
)


def kvwatch_extract(text: str) -> list[Sample]:
    return [s for s in parse(text) if s[0].startswith(KVWATCH_KEEP)]


def cuda_maps(pid: int) -> list[str]:
    """The CUDA libraries a process mapped (which copy a loader that searches the maps finds)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({ln.split()[-1] for ln in lines if "libcuda" in ln and ln.split()[-1].startswith("/")})
