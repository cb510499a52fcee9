"""The daemon's own footprint with the default configuration: RSS and CPU with nothing to watch,
with one idle engine watched, and optionally beside an engine already running (``--pid``).

    sudo .venv/bin/python bench/bench_footprint.py --seconds 300 --out bench/results/footprint.md
    sudo .venv/bin/python bench/bench_footprint.py --pid 4242     # an engine that runs already

Each phase is a fresh ``kvwatch run`` with an empty TOML (every default). It waits until the
daemon is ready and the start-up has settled (probes compiled, the uprobe canary timed, the
compiler's memory given back), then measures over ``--seconds``: CPU as the scheduler's runtime
of every daemon thread over the wall time (bench_daemon_load.runtime_s), RSS sampled every
5 s (anonymous and file-backed apart), threads, whether numpy is mapped, and the kernel memory of
the daemon's BPF maps (bpftool's bytes_memlock: kernel memory, not part of RSS; only a ring
buffer's pages, mmapped to be read, show up in RSS, as ``anon_inode:bpf-map``).

"Nothing to watch" is the node as it is: a phase in which kvwatch watched a process anyway says so
in its note. The idle engine is tests/support/lmcache_standin.py run as a console script named
``vllm`` (discovery's vLLM rule matches it), with an LMCache disk tier and no traffic.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_daemon_load import runtime_s

from tests.support.daemon import DaemonProcess, wait_until

STANDIN = HERE.parent / "tests" / "support" / "lmcache_standin.py"
SAMPLE_SECONDS = 5.0


@dataclass
class Phase:
    name: str
    cpu_pct: float
    rss_mib: tuple[float, float, float]  # first sample, max, last
    anon_mib: float
    file_mib: float
    threads: int
    numpy: bool
    bpf_kernel_mib: float
    watched: int
    note: str = ""


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            out[key] = int(rest.split()[0])
    return out


def maps_numpy(pid: int) -> bool:
    return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()


def bpf_kernel_mib(pid: int) -> float:
    """The kernel's memlock figure summed over the BPF maps the daemon holds open (their fdinfo)."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if "bpf-map" in str(fd.readlink()):
                info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
                total += next((int(v.split()[1]) for v in info.splitlines() if v.startswith("memlock:")), 0)
    return total / 2**20


def watched(d: DaemonProcess) -> int:
    return int(sum(v for _, v in d.metrics().get("kvwatch_watched_processes", [])))


def settle(d: DaemonProcess, seconds: float) -> None:
    d.wait_ready()
    # the canary times itself in the background after start; then the compiler's memory goes back
    wait_until(lambda: d.value("kvwatch_uprobe_canary_call_seconds") > 0 or _canary_logged(d), 60, "canary")
    time.sleep(seconds)


def _canary_logged(d: DaemonProcess) -> bool:
    return any(str(e.get("event", "")).startswith("uprobe cost") for e in d.log_events())


def measure(d: DaemonProcess, name: str, seconds: float, note: str = "") -> Phase:
    pid = d.proc.pid
    seen = watched(d)
    r0, t0 = runtime_s(pid), time.monotonic()
    rss: list[float] = []
    while True:
        rss.append(status(pid)["VmRSS"] / 1024)
        left = seconds - (time.monotonic() - t0)
        if left <= 0:
            break
        time.sleep(min(SAMPLE_SECONDS, left))
    cpu = 100 * (runtime_s(pid) - r0) / (time.monotonic() - t0)
    seen = max(seen, watched(d))
    st = status(pid)
    return Phase(
        name,
        cpu,
        (rss[0], max(rss), rss[-1]),
        st["RssAnon"] / 1024,
        st["RssFile"] / 1024,
        st["Threads"],
        maps_numpy(pid),
        bpf_kernel_mib(pid),
        seen,
        note,
    )


@contextlib.contextmanager
def idle_engine(tmp: Path) -> Iterator[subprocess.Popen[str]]:
    """The LMCache stand-in as ``vllm serve``, started and left idle."""
    disk = tmp / "lmcache-disk"
    disk.mkdir()
    config = tmp / "lmcache.yaml"
    config.write_text(f'chunk_size: 256\nlocal_cpu: true\nlocal_disk: "file://{disk}/"\nmax_local_disk_size: 1.0\n')
    script = tmp / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f'#!{sys.executable}\nimport runpy\nrunpy.run_path("{STANDIN}", run_name="__main__")\n')
    script.chmod(0o755)
    env = {**os.environ, "LMCACHE_CONFIG_FILE": str(config), "PYTHONUNBUFFERED": "1"}
    argv = [str(script), "serve", "/tmp/tiny", "--host", "127.0.0.1", "--port", "1"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def phase(tmp: Path, name: str, seconds: float, settle_s: float, *extra: str, want: int = 0, toml: str = "") -> Phase:
    d = DaemonProcess(tmp, toml, *extra)
    try:
        settle(d, settle_s)
        if want:
            wait_until(lambda: watched(d) >= want, 30, "the engine watched")
        p = measure(d, name, seconds)
        if not want and p.watched:
            p.note = f"not idle: {p.watched} process(es) on this node were watched"
        return p
    finally:
        d.stop()


def render(phases: list[Phase], seconds: float, settle_s: float) -> str:
    return "\n".join(
        [
            f"# kvwatch daemon footprint — {time.strftime('%Y-%m-%d %H:%M')} — {seconds:g} s per phase",
            "",
            f"Default configuration; each phase a fresh `kvwatch run`, measured {settle_s:g} s after the "
            "uprobe canary was timed. CPU: the scheduler's runtime of every daemon thread over the wall time. "
            "RSS sampled every 5 s (first / max / last); anonymous and file-backed at the end. "
            "BPF maps: the kernel's memlock figure of the maps the daemon holds (kernel memory, not in RSS). "
            "A node that runs engines of its own is measured again with discovery's default rules off "
            "(nothing of it watched), and the stand-in then found by a rule of its own.",
            "",
            "| phase | CPU (% of a core) | RSS first / max / last (MiB) | anon / file (MiB) | threads "
            "| numpy mapped | BPF maps, kernel (MiB) | watched | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *(
                f"| {p.name} | {p.cpu_pct:.2f} | {p.rss_mib[0]:.1f} / {p.rss_mib[1]:.1f} / {p.rss_mib[2]:.1f} "
                f"| {p.anon_mib:.1f} / {p.file_mib:.1f} | {p.threads} | {'yes' if p.numpy else 'no'} "
                f"| {p.bpf_kernel_mib:.1f} | {p.watched} | {p.note} |"
                for p in phases
            ),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60, help="measured seconds per phase (60)")
    ap.add_argument("--settle", type=float, default=10, help="seconds after the canary before measuring (10)")
    ap.add_argument("--pid", type=int, action="append", default=[], help="also watch this running engine")
    ap.add_argument("--skip-idle-engine", action="store_true", help="no stand-in phase")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "footprint.md")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvwatch-footprint-"))
    phases = [phase(tmp, "nothing to watch", args.seconds, args.settle)]
    mine = ""  # the default rules, unless this node runs engines of its own
    if phases[0].watched:
        mine = f"[discovery]\ndefault_rules = false\nrules = [{{ engine = \"vllm\", cmdline = '{re.escape(str(tmp))}/bin/vllm serve' }}]\n"
        phases.append(phase(tmp, "nothing to watch (default rules off)", args.seconds, args.settle, toml=mine))
    if not args.skip_idle_engine:
        with idle_engine(tmp):
            name = "one idle engine (vllm stand-in)" + (", found by its own rule" if mine else "")
            phases.append(phase(tmp, name, args.seconds, args.settle, want=1, toml=mine))
    for pid in args.pid:
        phases.append(phase(tmp, f"engine pid {pid} (--pid)", args.seconds, args.settle, "--pid", str(pid), want=1))
    text = render(phases, args.seconds, args.settle)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
