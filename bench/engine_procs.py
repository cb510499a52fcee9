"""What bench/bench_engine_cost.py reads from the kernel: the engine's CPU time from /proc, the BPF
programs loaded on the machine, the uprobes in tracefs, and the proofs built from them that
kvwatch was really off (or really attached) for a round.

CPU: a uprobe's trap and program run in the probed thread, so their cost is charged to the
probed process as CPU time (user + system, /proc/PID/stat fields 14-15); children it reaped are in
fields 16-17. The engine is the server process and every descendant (vLLM: the API server and
its EngineCore child).

Off means: the daemon's process is gone and reaped (a zombie still holds nothing, but a pid that
is not reaped could still be a live daemon to a reader of /proc), none of the BPF programs it held
is loaded any more (by id, so no name is trusted), no uprobe in tracefs carries its pid (bcc names
the uprobes it creates through tracefs ``p_<path>_0x<offset>_bcc_<pid>``; those it creates through
the perf uprobe PMU are perf events that close with the process), and no program named like
kvwatch's (``kvw_*``) is loaded (with ``tolerate_others``, for a machine where other kvwatch daemons run, such as a
developer's test runs: none that no other live process holds; those others may probe the engine too,
so the proof then says less).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import shutil
import struct
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PROC = Path("/proc")
CLK = os.sysconf("SC_CLK_TCK")
UPROBE_EVENTS = (Path("/sys/kernel/tracing/uprobe_events"), Path("/sys/kernel/debug/tracing/uprobe_events"))
PROGRAM_PREFIX = "kvw_"  # every kvwatch BPF program (probes/*.bpf.c): the kernel keeps 15 characters


# --- CPU time of a process tree -----------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, float, float, str] | None:
    """(ppid, start time in ticks, own CPU s, reaped children's CPU s, comm), None when gone."""
    return _stat_path(PROC / str(pid) / "stat")


def _stat_path(path: Path) -> tuple[int, int, float, float, str] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    f = text[text.rindex(")") + 2 :].split()  # f[0] is field 3 (state)
    return int(f[1]), int(f[19]), (int(f[11]) + int(f[12])) / CLK, (int(f[13]) + int(f[14])) / CLK, comm


def tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    parent: dict[int, int] = {}
    for d in PROC.iterdir():
        if d.name.isdigit() and (s := _stat(int(d.name))) is not None:
            parent[int(d.name)] = s[0]
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        if p in parent:
            out.append(p)
            todo += [c for c, pp in parent.items() if pp == p]
    return sorted(out)


CpuSnapshot = dict[int, tuple[int, float, float, str]]  # pid -> (start, own, children, comm)


def cpu_snapshot(root: int) -> CpuSnapshot:
    out: CpuSnapshot = {}
    for pid in tree(root):
        if (s := _stat(pid)) is not None:
            out[pid] = (s[1], s[2], s[3], s[4])
    return out


def cpu_between(a: CpuSnapshot, b: CpuSnapshot) -> dict[str, Any]:
    """CPU seconds each process used from snapshot ``a`` to ``b`` (own + children it reaped
    meanwhile); a process new in ``b`` counts whole. Processes gone by ``b`` are listed: what they
    used after ``a`` is counted only where their parent reaped them."""
    per: dict[int, float] = {}
    for pid, (start, own, kids, _comm) in b.items():
        before = a.get(pid)
        if before is not None and before[0] == start:
            per[pid] = own - before[1] + kids - before[2]
        else:
            per[pid] = own + kids
    return {
        "total": sum(per.values()),
        "per_pid": {str(p): round(v, 3) for p, v in per.items()},
        "comm": {str(p): b[p][3] for p in per},
        "gone": sorted(set(a) - set(b)),
    }


ThreadSnapshot = dict[int, tuple[str, float]]  # tid -> (thread name, CPU s)


def thread_snapshot(pids: list[int]) -> ThreadSnapshot:
    """Every thread of ``pids``: its name (comm) and CPU seconds so far."""
    out: ThreadSnapshot = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for t in (PROC / str(pid) / "task").iterdir():
                if (s := _stat_path(t / "stat")) is not None:
                    out[int(t.name)] = (s[4], s[2])
    return out


def threads_between(a: ThreadSnapshot, b: ThreadSnapshot) -> dict[str, float]:
    """CPU seconds per thread name from ``a`` to ``b`` (threads of one name summed; a thread new in
    ``b`` counts whole, one gone by ``b`` is left out)."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in b.items():
        out[name] = out.get(name, 0.0) + cpu - (a[tid][1] if tid in a else 0.0)
    return {k: round(v, 3) for k, v in sorted(out.items())}


def process_cpu(pid: int) -> float:
    s = _stat(pid)
    return s[2] if s is not None else 0.0


def comm(pid: int) -> str:
    s = _stat(pid)
    return s[4] if s is not None else ""


# --- BPF programs -------------------------------------------------------------------------------------
_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_PROG_GET_NEXT_ID, _PROG_GET_FD_BY_ID, _OBJ_GET_INFO_BY_FD = 11, 13, 15
_NAME = slice(64, 80)  # struct bpf_prog_info: name[16] after type, id, tag, lengths, pointers, uid, maps


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_uint8]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    nr = _SYS_BPF[platform.machine()]
    rc = int(libc.syscall(ctypes.c_long(nr), ctypes.c_long(cmd), ctypes.byref(attr), ctypes.c_long(len(attr))))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


_RUN_TIME, _RUN_CNT = 192, 200  # struct bpf_prog_info: run_time_ns, run_cnt (kernel 5.1+)


def _prog_info(prog_id: int) -> bytes | None:
    """struct bpf_prog_info of program ``prog_id`` (256 bytes), None when it is gone."""
    attr = (ctypes.c_uint8 * 128)()
    struct.pack_into("I", attr, 0, prog_id)
    try:
        fd = _bpf(_PROG_GET_FD_BY_ID, attr)
    except OSError as err:
        if err.errno == errno.ENOENT:  # unloaded meanwhile
            return None
        raise
    try:
        info = (ctypes.c_uint8 * 256)()
        attr = (ctypes.c_uint8 * 128)()
        struct.pack_into("IIQ", attr, 0, fd, len(info), ctypes.addressof(info))
        _bpf(_OBJ_GET_INFO_BY_FD, attr)
        return bytes(info)
    finally:
        os.close(fd)


def _name(info: bytes) -> str:
    return info[_NAME].split(b"\0")[0].decode(errors="replace")


def _programs_by_syscall() -> dict[int, str]:
    out: dict[int, str] = {}
    next_id = 0
    while True:
        attr = (ctypes.c_uint8 * 128)()
        struct.pack_into("I", attr, 0, next_id)
        try:
            _bpf(_PROG_GET_NEXT_ID, attr)
        except OSError as err:
            if err.errno == errno.ENOENT:
                return out
            raise
        next_id = struct.unpack_from("I", attr, 4)[0]
        info = _prog_info(next_id)
        if info is not None:
            out[next_id] = _name(info)


ProgramStats = dict[int, tuple[str, int, int]]  # program id -> (name, run_time_ns, run_cnt)


def program_stats(ids: Iterable[int]) -> ProgramStats:
    """The kernel's run time and run count of each program in ``ids`` that is still loaded; they
    advance only while BPF statistics are on (``kernel.bpf_stats_enabled``, BPF_ENABLE_STATS)."""
    out: ProgramStats = {}
    for i in ids:
        info = _prog_info(i)
        if info is not None:
            ns, cnt = struct.unpack_from("QQ", info, _RUN_TIME)
            out[i] = (_name(info), ns, cnt)
    return out


def stats_between(a: ProgramStats, b: ProgramStats) -> dict[str, dict[str, int]]:
    """Per program name (programs of one name summed: one a process or an attach point), its runs
    and run time from ``a`` to ``b``; a program loaded in between counts from zero."""
    out: dict[str, dict[str, int]] = {}
    for i, (name, ns, cnt) in b.items():
        _, ns0, cnt0 = a.get(i, (name, 0, 0))
        d = out.setdefault(name, {"run_ns": 0, "runs": 0})
        d["run_ns"] += ns - ns0
        d["runs"] += cnt - cnt0
    return out


_ENABLE_STATS = 32  # BPF_ENABLE_STATS, type BPF_STATS_RUN_TIME (0)


def enable_bpf_stats() -> int:
    """BPF run-time statistics on while the returned descriptor is open (the kernel turns them off
    when its last holder closes, a crash included)."""
    return _bpf(_ENABLE_STATS, (ctypes.c_uint8 * 128)())


def bpf_programs() -> tuple[dict[int, str], str]:
    """Every BPF program loaded on the machine, id -> name, and how it was listed: the bpf(2)
    syscall (root), else ``bpftool prog`` where installed."""
    try:
        return _programs_by_syscall(), "bpf syscall"
    except (OSError, KeyError, AttributeError) as err:
        tool = shutil.which("bpftool")
        if tool is None:
            raise RuntimeError(f"cannot list BPF programs: {err}, and no bpftool") from err
    out = subprocess.run([tool, "-j", "prog", "show"], capture_output=True, text=True, check=True, timeout=30)
    return {int(p["id"]): str(p.get("name", "")) for p in json.loads(out.stdout or "[]")}, "bpftool"


def held_programs(pid: int) -> set[int]:
    """Ids of the BPF programs process ``pid`` holds a descriptor of."""
    out: set[int] = set()
    fds = PROC / str(pid) / "fd"
    with contextlib.suppress(OSError):
        for fd in fds.iterdir():
            with contextlib.suppress(OSError):
                if str(fd.readlink()) != "anon_inode:bpf-prog":
                    continue
                for line in (PROC / str(pid) / "fdinfo" / fd.name).read_text().splitlines():
                    if line.startswith("prog_id:"):
                        out.add(int(line.split()[1]))
    return out


def holders(ids: set[int]) -> dict[int, list[int]]:
    """Program id -> the processes holding a descriptor of it (a scan of every /proc/PID/fd)."""
    out: dict[int, list[int]] = {}
    for d in PROC.iterdir():
        if d.name.isdigit():
            for i in held_programs(int(d.name)) & ids:
                out.setdefault(i, []).append(int(d.name))
    return out


def uprobe_events(pid: int | None = None) -> list[str]:
    """tracefs uprobes bcc created (``..._bcc_<pid>``), of ``pid`` or of any process."""
    tag = f"_bcc_{pid}" if pid is not None else "_bcc_"
    for path in UPROBE_EVENTS:
        with contextlib.suppress(OSError):
            return [ln for ln in path.read_text().splitlines() if tag in ln.split()[0]]
    return []


def reaped(pid: int) -> bool:
    """No process (not even a zombie) with this pid: reap it first where it is our child."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)
    return not (PROC / str(pid)).exists()


def prove_off(
    pid: int | None, held: Iterable[int], timeout: float = 30.0, tolerate_others: bool = False
) -> dict[str, Any]:
    """Waits (up to ``timeout``) until kvwatch daemon ``pid`` is gone by every test in the module
    doc; returns what each test found at the end, ``clean`` when all passed."""
    t0 = time.monotonic()
    held = set(held)
    while True:
        gone = pid is None or reaped(pid)
        progs, source = bpf_programs()
        left = sorted(held & set(progs))
        kvw = {i for i, n in progs.items() if n.startswith(PROGRAM_PREFIX)}
        others = holders(kvw) if kvw else {}
        orphans = sorted(kvw - set(others))
        uprobes = uprobe_events(pid) if pid is not None else []
        bcc_any = uprobe_events()
        clean = gone and not left and not uprobes and not (orphans if tolerate_others else kvw)
        if clean or time.monotonic() - t0 > timeout:
            return {
                "clean": clean,
                "daemon_reaped": gone,
                "programs_it_held": len(held),
                "programs_it_held_left": left,
                "kvw_programs_loaded": len(kvw),
                "kvw_programs_held_by_other_processes": sorted({p for ps in others.values() for p in ps}),
                "kvw_programs_unheld": orphans,
                "others_tolerated": tolerate_others,
                "uprobe_events_of_daemon": len(uprobes),
                "uprobe_events_bcc_any": len(bcc_any),
                "programs_listed_by": source,
                "programs_loaded": len(progs),
                "seconds": round(time.monotonic() - t0, 2),
            }
        time.sleep(0.25)
