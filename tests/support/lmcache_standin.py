"""A stand-in for vLLM with LMCache in process, as kvwatch sees one: run as a console script named
``vllm`` (``vllm serve MODEL --host H --port P``: discovery's vLLM rule matches its command line)
with ``LMCACHE_CONFIG_FILE`` in its environment. Its disk tier behaves as
LMCache 0.5.3's ``LocalDiskBackend`` does: one file per 256-token chunk named
``<model>@<world>@<worker>@<hash>@<dtype>.pt``, written with ``open(path, "wb").write`` (no sync),
read back whole with ``readinto``, the oldest deleted with ``os.remove`` at the size limit.

Commands on stdin, one answer line each on stdout:
  write N MIB       N chunk files of MIB MiB          -> written
  reads on|off      read random chunks back, without pause, in a thread -> ok
  hog MIB RATE      hold MIB MiB more of anonymous memory, grown at RATE MiB/s -> held
  free              let the held memory go            -> freed
  evict K           delete the K oldest chunk files   -> evicted
  quit
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
import time
from pathlib import Path

MIB = 1 << 20


def disk_dir() -> Path:
    text = Path(os.environ["LMCACHE_CONFIG_FILE"]).read_text()
    m = re.search(r"^local_disk:\s*\"?file://([^\"\s]+)", text, re.MULTILINE)
    if m is None:
        raise SystemExit("no local_disk in the config")
    return Path(m.group(1))


class Tier:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: list[Path] = []
        self.deleted = 0
        self.lock = threading.Lock()
        self.reading = threading.Event()
        self.busy = threading.Lock()  # held through each read: "reads off" answers once none is left
        threading.Thread(target=self._reader, daemon=True).start()

    def write(self, n: int, mib: int) -> None:
        data = os.urandom(mib * MIB)
        for _ in range(n):
            with self.lock:
                path = self.root / f"tiny@1@0@{len(self.files) + self.deleted:016x}@bfloat16.pt"
            with open(path, "wb") as f:
                f.write(data)
            with self.lock:
                self.files.append(path)

    def evict(self, k: int) -> None:
        with self.lock:
            gone, self.files = self.files[:k], self.files[k:]
            self.deleted += len(gone)
        for p in gone:
            os.remove(p)  # noqa: PTH107 - what LMCache calls

    def reads(self, on: bool) -> None:
        if on:
            self.reading.set()
            return
        self.reading.clear()
        with self.busy:
            pass

    def _reader(self) -> None:
        buf = bytearray(64 * MIB)
        while True:
            self.reading.wait()
            with self.busy:
                if not self.reading.is_set():
                    continue
                with self.lock:
                    path = random.choice(self.files) if self.files else None
                if path is None:
                    time.sleep(0.01)
                    continue
                try:
                    with open(path, "rb") as f:
                        f.readinto(memoryview(buf)[: os.fstat(f.fileno()).st_size])
                except FileNotFoundError:
                    pass


def hog(held: list[bytearray], mib: int, rate: int) -> None:
    t0, done = time.monotonic(), 0
    while done < mib:
        b = bytearray(MIB)
        b[::4096] = b"\x01" * len(b[::4096])  # every page written: every page charged
        held.append(b)
        done += 1
        wait = t0 + done / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)


def main() -> None:
    tier = Tier(disk_dir())
    held: list[bytearray] = []
    say = {"write": "written", "reads": "ok", "hog": "held", "free": "freed", "evict": "evicted"}
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "write":
            tier.write(int(args[0]), int(args[1]))
        elif cmd == "reads":
            tier.reads(args[0] == "on")
        elif cmd == "hog":
            hog(held, int(args[0]), int(args[1]))
        elif cmd == "free":
            held.clear()
        elif cmd == "evict":
            tier.evict(int(args[0]))
        elif cmd == "quit":
            return
        print(say.get(cmd, "?"), flush=True)


if __name__ == "__main__":
    main()
