"""A diagnostic, never imported by the product: where a ``kvwatch run`` process's resident memory
goes. Put this directory on the daemon's PYTHONPATH and set KVW_MEMPROBE=PREFIX: every 2 s,
PREFIX.PID.jsonl gets the process's RSS by kind of mapping (heap, anonymous, libLLVM/libclang,
other files), glibc's mallinfo2 and Python's allocated blocks; every 15 s, PREFIX.PID.maps.txt the
largest file mappings and pymalloc's arena totals. KVW_TRACEMALLOC=N also starts tracemalloc with N frames and writes the top
allocation sites to PREFIX.PID.tm.txt every 15 s (tracemalloc itself costs memory: such a run's
RSS is not the daemon's).
"""

import ctypes
import json
import os
import re
import sys
import threading
import time

_PREFIX = os.environ.get("KVW_MEMPROBE", "")
try:
    _CMD = open("/proc/self/cmdline", "rb").read().split(b"\0")  # noqa: SIM115
except OSError:
    _CMD = []
_DAEMON = b"kvwatch.daemon" in _CMD and b"run" in _CMD


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _smaps() -> tuple[dict[str, int], dict[str, int]]:
    kinds: dict[str, int] = {}
    files: dict[str, int] = {}
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif line.startswith("Rss:"):
                kb = int(line.split()[1])
                kind = (
                    "llvm" if ("libLLVM" in name or "libclang" in name) else ("file" if name.startswith("/") else name)
                )
                kinds[kind] = kinds.get(kind, 0) + kb
                if name.startswith("/"):
                    files[name] = files.get(name, 0) + kb
    return kinds, files


def _pymalloc_summary() -> str:
    """The arena totals of ``sys._debugmallocstats`` (it prints to fd 2: captured in a file)."""
    import tempfile

    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    keep = (
        "arenas allocated current",
        "bytes/arena",
        "bytes in allocated blocks",
        "bytes in available blocks",
        "unused pools",
        "Total",
    )
    return "".join(line + "\n" for line in text.splitlines() if any(k in line for k in keep))


def _loop() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    t0 = time.time()
    with open(f"{_PREFIX}.{os.getpid()}.jsonl", "w") as out, open(f"{_PREFIX}.{os.getpid()}.maps.txt", "w") as maps:
        n = 0
        while True:
            kinds, files = _smaps()
            m = libc.mallinfo2()
            rec = {
                "t": round(time.time() - t0, 1),
                "cpu": round(time.process_time(), 2),
                "blocks": sys.getallocatedblocks(),
                "malloc_used_kib": m.uordblks >> 10,
                "malloc_free_kib": m.fordblks >> 10,
                "mmapped_kib": m.hblkhd >> 10,
                **{f"{k}_kib": v for k, v in kinds.items()},
            }
            out.write(json.dumps(rec) + "\n")
            out.flush()
            if n % 8 == 0:
                maps.write(f"=== t={rec['t']}\n")
                maps.write(_pymalloc_summary())
                for path, kb in sorted(files.items(), key=lambda kv: -kv[1])[:15]:
                    maps.write(f"{kb:8d} KiB {path}\n")
                maps.flush()
            n += 1
            time.sleep(2)


def _tm_loop(frames: int) -> None:
    import tracemalloc

    t0 = time.time()
    with open(f"{_PREFIX}.{os.getpid()}.tm.txt", "w") as out:
        while True:
            time.sleep(15)
            snap = tracemalloc.take_snapshot()
            cur, peak = tracemalloc.get_traced_memory()
            out.write(f"=== t={time.time() - t0:.0f} traced={cur >> 20} MiB peak={peak >> 20} MiB\n")
            for st in snap.statistics("lineno")[:30]:
                out.write(f"{st.size >> 10:8d} KiB {st.count:8d} {st.traceback}\n")
            out.flush()


if _PREFIX and _DAEMON:
    if os.environ.get("KVW_TRACEMALLOC"):
        import tracemalloc

        tracemalloc.start(int(os.environ["KVW_TRACEMALLOC"]))
        threading.Thread(
            target=_tm_loop, args=(int(os.environ["KVW_TRACEMALLOC"]),), daemon=True, name="kvw-tm"
        ).start()
    threading.Thread(target=_loop, daemon=True, name="kvw-memprobe").start()
