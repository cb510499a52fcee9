"""What every workload process shares (``workloads.py`` and the CUDA and transfer workloads it
starts): sizes, and the one-line phase report its parent waits for."""

from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE
MIB = 1024 * 1024


def say(tag: str) -> None:
    print(tag, flush=True)
