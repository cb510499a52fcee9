"""A diagnostic: the resident memory each part of kvwatch's start costs on this machine (run as
root, with bcc importable): product imports, NVML, the CUDA libraries' symbol tables, each BPF
program's compile. Prints one line per step: RSS by kind of mapping, MiB."""

from __future__ import annotations

import glob
import re
import sys


def kinds() -> dict[str, float]:
    out: dict[str, int] = {}
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
            elif line.startswith(("Rss:", "Anonymous:")):
                kb = int(line.split()[1])
                kind = (
                    "llvm" if ("libLLVM" in name or "libclang" in name) else ("file" if name.startswith("/") else name)
                )
                key = kind + (".anon" if line.startswith("Anonymous") else "")
                out[key] = out.get(key, 0) + kb
    total = sum(v for k, v in out.items() if not k.endswith(".anon"))
    anon = sum(v for k, v in out.items() if k.endswith(".anon"))
    return {
        "rss": round(total / 1024, 1),
        "anon": round(anon / 1024, 1),
        **{k: round(v / 1024, 1) for k, v in out.items() if v > 512},
    }


def step(label: str) -> None:
    from kvwatch.probes.bpf import release_compiler_memory

    release_compiler_memory()
    print(f"{label:24s} {kinds()}", flush=True)


def main() -> None:
    step("python")
    import kvwatch.daemon.agent
    import kvwatch.daemon.cli
    import kvwatch.daemon.wiring  # noqa: F401

    step("kvwatch imported")
    from kvwatch.daemon.host.nvml import Nvml

    nv, why = Nvml.open()
    if nv is not None:
        nv.processes()
        nv.device_memory_total()
    step(f"nvml {'open' if nv else why[:30]}")
    from kvwatch.probes.libs import SymbolCache

    cache = SymbolCache()
    for pattern in sys.argv[1:]:
        for path in glob.glob(pattern):  # noqa: PTH207 - absolute patterns from the command line
            try:
                n = len(cache.get(path).functions)
            except Exception as err:
                n = -1
                print(path, err)
            step(f"symbols {path.rsplit('/', 1)[-1][:14]} ({n})")
    from kvwatch.probes.cuda import CudaProbes
    from kvwatch.probes.memory import MemoryProbes
    from kvwatch.probes.transfer import TransferProbes

    keep = []
    for cls in (MemoryProbes, CudaProbes, TransferProbes):
        p = cls()
        p.start()
        keep.append(p)
        step(f"compiled {cls.__name__}")


if __name__ == "__main__":
    main()
