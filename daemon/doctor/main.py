"""``kvwatch doctor``: prerequisites, then a canary per probe that makes it fire and checks the count.

One line per check with a fix hint; exit 1 when a required check fails.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from kvwatch.daemon.config import Config
from kvwatch.daemon.doctor.checks import FAIL, INFO, OK, SKIP, WARN, Check
from kvwatch.daemon.doctor.cuda import cuda_canaries
from kvwatch.daemon.doctor.engines import engine_canaries
from kvwatch.daemon.doctor.selfcost import self_cost_checks
from kvwatch.daemon.doctor.transfer import transfer_canaries
from kvwatch.daemon.host.procfs import ProcFS
from kvwatch.daemon.lab.memcg import CgroupUnavailable, MemoryCgroup
from kvwatch.daemon.lab.workloads import MIB, PAGE, Workload, drop_file_cache, make_files, read_files
from kvwatch.daemon.wiring import memory_options
from kvwatch.probes import tracefs
from kvwatch.probes.memory import MemoryProbes, kernel_dev
from kvwatch.probes.records import (
    HookState,
    OomKill,
    ProcessExec,
    ProcessExited,
    ProcessForked,
    ProcessRenamed,
)

CANARY_PAGES = 23
CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN = 39, 38, 21


def _caps(procfs: ProcFS) -> int:
    value = procfs.status_value("self", "CapEff")
    return int(value, 16) if value else 0


def check_privileges(procfs: ProcFS) -> Check:
    caps = _caps(procfs)

    def has(cap: int) -> bool:
        return bool(caps >> cap & 1)

    if os.geteuid() == 0 and has(CAP_SYS_ADMIN):
        return Check("privileges", OK, "root with CAP_SYS_ADMIN")
    if has(CAP_BPF) and has(CAP_PERFMON):
        return Check("privileges", WARN, "CAP_BPF + CAP_PERFMON without root: bcc may still need CAP_SYS_ADMIN")
    return Check("privileges", FAIL, "not root and no CAP_BPF/CAP_PERFMON", "run as root (sudo kvwatch doctor)")


def check_bcc() -> Check:
    from kvwatch.probes import bpf  # noqa: PLC0415

    if not bpf.bcc_available():
        return Check("bcc", FAIL, "cannot import bcc", "apt install python3-bpfcc; use /usr/bin/python3 or its venv")
    return Check("bcc", OK, f"bcc {bpf.bcc_version()}")


def check_tracefs() -> Check:
    root = tracefs.tracefs_root()
    if root is None:
        return Check("tracefs", FAIL, "not mounted", "mount -t tracefs tracefs /sys/kernel/tracing")
    return Check("tracefs", OK, str(root))


def check_btf(procfs: ProcFS) -> Check:
    btf = procfs.kernel_btf()
    if btf is not None:
        return Check("btf", OK, str(btf))
    return Check("btf", INFO, "no BTF: fine, kvwatch's programs read tracepoint fields only")


def check_headers() -> Check:
    build = Path(f"/lib/modules/{platform.release()}/build")
    if not (build / "include").exists():
        return Check(
            "kernel headers",
            FAIL,
            f"{build} missing",
            "deploy/setup.sh installs the distribution's headers and links them",
        )
    target = os.path.realpath(build)
    uts = build / "include/generated/utsrelease.h"
    version = uts.read_text().split('"')[1] if uts.exists() else Path(target).name
    if platform.release() in (version, Path(target).name.removeprefix("linux-headers-")):
        return Check("kernel headers", OK, f"matching ({target})")
    return Check(
        "kernel headers",
        OK,
        f"not matching ({version} for {platform.release()}): safe, the probes read no kernel struct layout",
    )


def check_kprobes() -> Check:
    root = tracefs.tracefs_root()
    if root is not None and (root / "kprobe_events").exists():
        return Check("kprobes", INFO, "available (kvwatch does not need them)")
    return Check("kprobes", INFO, "not available: fine, kvwatch uses tracepoints and uprobes only")


# --- canaries ------------------------------------------------------------------------------


class Canaries:
    def __init__(self, config: Config, oom: bool) -> None:
        self.config = config
        self.oom = oom
        self.probes = MemoryProbes(memory_options(config))
        self.me = os.getpid()

    def _hits(self) -> dict[str, int]:
        return self.probes.sample().hits

    def _events(self, wait: float = 0.5) -> list[object]:
        deadline = time.monotonic() + wait
        events: list[object] = []
        while time.monotonic() < deadline:
            self.probes.poll(50)
            events += self.probes.take_events().events
        return events

    def run(self) -> list[Check]:
        out: list[Check] = []
        statuses = self.probes.start()
        for st in statuses:
            if st.state is HookState.DISABLED:
                out.append(Check(f"probe {st.name}", SKIP, "off in config"))
            elif st.state is not HookState.ATTACHED:
                status = FAIL if st.required else WARN
                out.append(
                    Check(
                        f"probe {st.name}",
                        status,
                        f"{st.state.value}: {st.reason}",
                        "see kvwatch_probe_attached",
                    )
                )
        attached = {s.name for s in statuses if s.state is HookState.ATTACHED}
        self.probes.watch(self.me)
        canaries: list[tuple[set[str], Callable[[], list[Check]]]] = [
            ({"page_free"}, self.page_free),
            ({"task_newtask", "process_exec", "process_exit"}, self.lifecycle),
            ({"task_rename"}, self.rename),
            ({"pagecache_add", "pagecache_delete"}, self.pagecache),
            ({"memcg_reclaim_begin", "memcg_reclaim_end"}, self.memcg_reclaim),
            ({"oom_victim"}, self.oom_kill),
        ]
        for needs, fn in canaries:
            if not needs & attached:
                continue
            try:
                out += fn()
            except Exception as err:
                out.append(Check(f"canary {fn.__name__}", FAIL, f"{type(err).__name__}: {err}"))
        if {"direct_reclaim_begin", "direct_reclaim_end"} <= attached:
            out.append(Check("canary direct_reclaim", SKIP, "attached; firing it needs node-wide memory pressure"))
        self.probes.close()
        return out

    def page_free(self) -> list[Check]:
        """A child releases exactly CANARY_PAGES pages (after a warm-up pass); the probe
        must charge them to the child. A child, not this process: reading the maps
        here allocates and frees Python memory of our own."""
        with Workload("pages", str(CANARY_PAGES)) as child:
            self.probes.watch(child.pid)
            got = 0
            for attempt in range(3):
                before = self.probes.sample().processes.get(child.pid)
                child.step("go", "done")
                after = self.probes.sample().processes.get(child.pid)
                got = (after.page_free_pages if after else 0) - (before.page_free_pages if before else 0)
                if attempt > 0 and CANARY_PAGES <= got <= CANARY_PAGES + 8:  # page tables may go too
                    self.probes.unwatch(child.pid)
                    return [Check("canary page_free", OK, f"{got} pages counted for {CANARY_PAGES} released")]
            self.probes.unwatch(child.pid)
        return [Check("canary page_free", FAIL, f"{got} pages counted for {CANARY_PAGES} released")]

    def lifecycle(self) -> list[Check]:
        child = subprocess.Popen(["/bin/true"])
        child.wait()
        evs = self._events()
        fork = any(isinstance(e, ProcessForked) and e.child_pid == child.pid for e in evs)
        exe = any(isinstance(e, ProcessExec) and e.pid == child.pid for e in evs)
        ext = any(isinstance(e, ProcessExited) and e.tgid == child.pid for e in evs)
        self.probes.unwatch(child.pid)
        return [
            Check(
                "canary task_newtask",
                OK if fork else FAIL,
                f"fork of pid {child.pid} {'seen' if fork else 'missed'}",
            ),
            Check("canary process_exec", OK if exe else FAIL, f"exec of /bin/true {'seen' if exe else 'missed'}"),
            Check(
                "canary process_exit",
                OK if ext else FAIL,
                f"exit of pid {child.pid} {'seen' if ext else 'missed'}",
            ),
        ]

    def rename(self) -> list[Check]:
        code = "import ctypes; ctypes.CDLL(None).prctl(15, b'kvw-canary', 0, 0, 0)"
        child = subprocess.run([sys.executable, "-c", code], check=False)
        evs = self._events()
        seen = any(isinstance(e, ProcessRenamed) and e.new_comm == "kvw-canary" for e in evs)
        return [
            Check(
                "canary task_rename",
                OK if seen else WARN,
                f"rename {'seen' if seen else 'missed'} ({child.returncode})",
            )
        ]

    def pagecache(self) -> list[Check]:
        with tempfile.TemporaryDirectory(prefix="kvwatch-doctor-", dir="/var/tmp") as d:
            directory = Path(d)
            (f,) = make_files(directory, 1, CANARY_PAGES * PAGE)
            st = f.stat()
            learned = self.probes.learn_device(directory)
            dev = learned or kernel_dev(st.st_dev)
            self.probes.set_kv_inode(dev, st.st_ino, 0)
            t0 = self.probes.sample().tiers.get(0)
            drop_file_cache([f])
            read_files([f])
            t1 = self.probes.sample().tiers.get(0)
            self.probes.remove_kv_inode(dev, st.st_ino)
        policy = (t1.policy_pages if t1 else 0) - (t0.policy_pages if t0 else 0)
        added = (t1.added_pages if t1 else 0) - (t0.added_pages if t0 else 0)
        how = "canary" if learned else "st_dev"
        return [
            Check(
                "canary pagecache_delete",
                OK if policy == CANARY_PAGES else FAIL,
                f"{policy} policy evictions for {CANARY_PAGES} pages dropped (device from {how})",
            ),
            Check(
                "canary pagecache_add",
                OK if added >= CANARY_PAGES else FAIL,
                f"{added} pages added for {CANARY_PAGES} read back",
            ),
        ]

    def memcg_reclaim(self) -> list[Check]:
        try:
            cg = MemoryCgroup(f"kvwatch-doctor-{self.me}", 48 * MIB).create()
        except CgroupUnavailable as err:
            return [Check("canary memcg_reclaim", SKIP, str(err))]
        try:
            with tempfile.TemporaryDirectory(prefix="kvwatch-doctor-", dir="/var/tmp") as d:
                files = make_files(Path(d), 6, 16 * MIB)
                drop_file_cache(files)
                for f in files:
                    st = f.stat()
                    self.probes.set_kv_inode(kernel_dev(st.st_dev), st.st_ino, 1)
                h0, t0 = self._hits(), self.probes.sample().tiers.get(1)
                with Workload("read", *map(str, files)) as child:
                    cg.add(child.pid)
                    child.step("go", "read")
                h1, t1 = self._hits(), self.probes.sample().tiers.get(1)
                for f in files:
                    st = f.stat()
                    self.probes.remove_kv_inode(kernel_dev(st.st_dev), st.st_ino)
        finally:
            cg.remove()
        n = h1.get("memcg_reclaim_begin", 0) - h0.get("memcg_reclaim_begin", 0)
        evicted = (t1.reclaim_pages if t1 else 0) - (t0.reclaim_pages if t0 else 0)
        return [
            Check("canary memcg_reclaim", OK if n > 0 else FAIL, f"{n} reclaim windows in a 48 MiB cgroup"),
            Check(
                "canary reclaim eviction",
                OK if evicted > 0 else FAIL,
                f"{evicted} KV pages evicted with cause=reclaim",
            ),
        ]

    def oom_kill(self) -> list[Check]:
        if not self.oom:
            return [Check("canary oom_victim", SKIP, "--no-oom-canary")]
        try:
            cg = MemoryCgroup(f"kvwatch-doctor-oom-{self.me}", 32 * MIB).create()
        except CgroupUnavailable as err:
            return [Check("canary oom_victim", SKIP, str(err))]
        try:
            with Workload("oom") as child:
                cg.add(child.pid)
                child.send("go")
                child.proc.wait(30)
            evs = self._events(1.0)
        finally:
            cg.remove()
        seen = any(isinstance(e, OomKill) and e.victim_pid == child.pid for e in evs)
        return [
            Check(
                "canary oom_victim",
                OK if seen else FAIL,
                f"OOM kill of pid {child.pid} in a 32 MiB cgroup {'seen' if seen else 'missed'}",
            )
        ]


def run_doctor(config: Config, *, as_json: bool = False, oom_canary: bool = True) -> int:
    procfs = ProcFS()  # the doctor's own /proc and /sys: its canaries are its own children
    checks = [
        check_privileges(procfs),
        check_bcc(),
        check_tracefs(),
        check_btf(procfs),
        check_headers(),
        check_kprobes(),
    ]
    blocking = any(c.status == FAIL for c in checks)
    if not blocking:
        try:
            checks += Canaries(config, oom_canary).run()
            checks += cuda_canaries(config)
            checks += transfer_canaries(config)
            checks += engine_canaries(config)
            checks += self_cost_checks(config, procfs)
        except Exception as err:
            checks.append(
                Check(
                    "probes",
                    FAIL,
                    f"{type(err).__name__}: {err}",
                    "run kvwatch run --ebpf to see the program",
                )
            )
    failed = any(c.status == FAIL for c in checks)
    if as_json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        for c in checks:
            line = f"[{c.status.upper():>4}] {c.name}: {c.detail}"
            if c.fix and c.status in (FAIL, WARN):
                line += f"  — fix: {c.fix}"
            print(line)
        print("doctor: " + ("FAILED" if failed else "all required checks passed"))
    return 1 if failed else 0
