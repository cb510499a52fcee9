"""NVML (pynvml, from the nvidia-ml-py package): GPU processes and their memory.

Optional everywhere: no driver, no library, no GPU — ``Nvml.open`` returns None
with the reason, and kvwatch runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    device_index: int
    used_bytes: int


class Nvml:
    def __init__(self, module: Any) -> None:
        self._nv = module
        self.device_count = int(module.nvmlDeviceGetCount())
        self._handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(self.device_count)]
        self.errors = 0

    @classmethod
    def open(cls) -> tuple[Nvml | None, str]:
        try:
            import pynvml  # noqa: PLC0415 - optional dependency, loaded on demand
        except ImportError as err:
            return None, f"pynvml not importable: {err}"
        try:
            pynvml.nvmlInit()
            return cls(pynvml), ""
        except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return None, f"NVML unavailable: {err}"

    def device_memory_total(self) -> list[int]:
        out = []
        for h in self._handles:
            try:
                out.append(int(self._nv.nvmlDeviceGetMemoryInfo(h).total))
            except Exception:
                self.errors += 1
                out.append(0)
        return out

    def processes(self) -> list[GpuProcess]:
        out: list[GpuProcess] = []
        for i, h in enumerate(self._handles):
            for getter in (
                "nvmlDeviceGetComputeRunningProcesses",
                "nvmlDeviceGetGraphicsRunningProcesses",
            ):
                try:
                    procs = getattr(self._nv, getter)(h)
                except Exception:
                    self.errors += 1
                    continue
                for p in procs:
                    used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                    out.append(GpuProcess(int(p.pid), i, used))
        return out

    def pids(self) -> list[int]:
        return sorted({p.pid for p in self.processes()})

    def used_by_pid(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.processes():
            out[p.pid] = out.get(p.pid, 0) + p.used_bytes
        return out

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:
            self.errors += 1
