"""Build the stand-in libraries (``stubs/*.c``) for machines without a GPU, NIXL or RDMA.

The files are named exactly like the real ones (``libcudart.so.12``, ``libcuda.so.1``,
``libnixl.so``, ``libucp.so.0``, ``libibverbs.so.1``, ``libnccl.so.2``) because kvwatch
resolves libraries by exact file name. Needs a C compiler (``cc``); used by the tests
and ``kvwatch demo`` only.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "stubs" / "cudastub.c"
TRANSFER_SOURCE = SOURCE.with_name("transferstub.c")
VERBS_VERSIONS = """IBVERBS_1.0 { global: ibv_dereg_mr; local: *; };
IBVERBS_1.1 { global: ibv_dereg_mr; } IBVERBS_1.0;
IBVERBS_1.8 { global: ibv_reg_mr_iova2; } IBVERBS_1.1;
IBVERBS_1.12 { global: ibv_reg_dmabuf_mr; kvwstub_reg_fail; } IBVERBS_1.8;
"""
RUNTIME = "libcudart.so.12"
DRIVER = "libcuda.so.1"


class StubBuildError(Exception):
    pass


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise StubBuildError("no C compiler found (apt install gcc) to build the stub libraries")
    return cc


# Prologues like the real libraries': endbr64 then push %rbp (frame pointers, no tail
# calls, so an outer call makes its inner call from inside its own frame). kvwatch probes
# after the endbr64, on the push, which uprobes emulate; most other instructions are
# single-stepped instead, at ~16 us per hit in a VM (docs/performance.md).
CFLAGS = [
    "-shared",
    "-fPIC",
    "-O2",
    "-fcf-protection=full",
    "-fno-omit-frame-pointer",
    "-mno-omit-leaf-frame-pointer",
    "-fno-optimize-sibling-calls",
]


def _run(cmds: list[list[str]]) -> None:
    for cmd in cmds:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise StubBuildError(f"{' '.join(cmd)}: {out.stderr.strip()}")


def build_transfer(dest: Path) -> Path:
    """libnixl.so (calling libucp.so.0 beneath), libibverbs.so.1, libnccl.so.2 in ``dest``."""
    cc = _compiler()
    dest.mkdir(parents=True, exist_ok=True)
    src = str(TRANSFER_SOURCE)
    versions = dest / "ibverbs.map"
    versions.write_text(VERBS_VERSIONS)
    ucp = dest / "libucp.so.0"
    _run(
        [
            [cc, *CFLAGS, "-DKVWSTUB_UCP", "-Wl,-soname,libucp.so.0", "-o", str(ucp), src],
            [
                cc,
                *CFLAGS,
                "-DKVWSTUB_NIXL",
                "-Wl,-soname,libnixl.so",
                "-o",
                str(dest / "libnixl.so"),
                src,
                str(ucp),
                f"-Wl,-rpath,{dest}",
            ],
            [
                cc,
                *CFLAGS,
                "-DKVWSTUB_VERBS",
                "-Wl,-soname,libibverbs.so.1",
                f"-Wl,--version-script={versions}",
                "-o",
                str(dest / "libibverbs.so.1"),
                src,
            ],
            [cc, *CFLAGS, "-DKVWSTUB_NCCL", "-Wl,-soname,libnccl.so.2", "-o", str(dest / "libnccl.so.2"), src],
        ]
    )
    return dest


def build(dest: Path, *, old_runtime: bool = False) -> Path:
    """Compile into ``dest`` (created); returns the runtime library's path.

    ``old_runtime`` leaves out cudaMallocAsync/cudaFreeAsync, like a CUDA 10 runtime."""
    cc = _compiler()
    dest.mkdir(parents=True, exist_ok=True)
    driver, runtime = dest / DRIVER, dest / RUNTIME
    _run(
        [
            [cc, *CFLAGS, "-DKVWSTUB_DRIVER", f"-Wl,-soname,{DRIVER}", "-o", str(driver), str(SOURCE)],
            [
                cc,
                *CFLAGS,
                *(["-DKVWSTUB_OLD_RUNTIME"] if old_runtime else []),
                f"-Wl,-soname,{RUNTIME}",
                "-o",
                str(runtime),
                str(SOURCE),
                str(driver),
                f"-Wl,-rpath,{dest}",
            ],
        ]
    )
    return runtime
