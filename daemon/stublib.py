"""Build the stand-in CUDA libraries (``stubs/cudastub.c``) for machines without a GPU.

The files are named exactly like the real ones (``libcudart.so.12``,
``libcuda.so.1``) because kvwatch resolves CUDA libraries by exact file name.
Needs a C compiler (``cc``); used by the tests and ``kvwatch demo`` only.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "stubs" / "cudastub.c"
RUNTIME = "libcudart.so.12"
DRIVER = "libcuda.so.1"


class StubBuildError(Exception):
    pass


def build(dest: Path, *, old_runtime: bool = False) -> Path:
    """Compile into ``dest`` (created); returns the runtime library's path.

    ``old_runtime`` leaves out cudaMallocAsync/cudaFreeAsync, like a CUDA 10 runtime."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise StubBuildError("no C compiler found (apt install gcc) to build the stub CUDA library")
    dest.mkdir(parents=True, exist_ok=True)
    driver, runtime = dest / DRIVER, dest / RUNTIME
    # Prologues like the real libraries': endbr64 then push %rbp (frame pointers, no tail
    # calls, so the runtime calls the driver from inside its own frame). kvwatch probes
    # after the endbr64, on the push, which uprobes emulate; most other instructions are
    # single-stepped instead, at ~16 us per hit in a VM (docs/performance.md).
    common = [
        cc,
        "-shared",
        "-fPIC",
        "-O2",
        "-fcf-protection=full",
        "-fno-omit-frame-pointer",
        "-mno-omit-leaf-frame-pointer",
        "-fno-optimize-sibling-calls",
    ]
    cmds = [
        [*common, "-DKVWSTUB_DRIVER", f"-Wl,-soname,{DRIVER}", "-o", str(driver), str(SOURCE)],
        [
            *common,
            *(["-DKVWSTUB_OLD_RUNTIME"] if old_runtime else []),
            f"-Wl,-soname,{RUNTIME}",
            "-o",
            str(runtime),
            str(SOURCE),
            str(driver),
            f"-Wl,-rpath,{dest}",
        ],
    ]
    for cmd in cmds:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise StubBuildError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return runtime
