"""GPU memory per process from NVML, read once a tick (a source: ``daemon/sources.py``): the CUDA
family's observations take it beside the allocator's own numbers, and the snapshot shows it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvwatch.daemon.host.nvml import Nvml
from kvwatch.daemon.logs import ErrorBook
from kvwatch.daemon.model.cuda import GpuUse
from kvwatch.daemon.model.snapshot import ProbeView
from kvwatch.daemon.tracker import Tracked


class GpuMemory:
    name = "nvml"

    def __init__(self, nvml: Nvml | None, errors: ErrorBook) -> None:
        self.nvml = nvml
        self.errors = errors
        self.used: dict[int, int] = {}  # bytes of device memory by pid, as of this tick
        self.device_total = float(max(nvml.device_memory_total(), default=0)) if nvml is not None else 0.0

    def start(self) -> None:
        return None

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()

    def sample(self, tracked: Sequence[Tracked], now: float) -> None:
        if self.nvml is None:
            return
        try:
            self.used = self.nvml.used_by_pid()
        except Exception as err:
            self.errors.record("nvml", "NVML query failed", err)

    def observe(self, t: Tracked) -> None:
        """The process's GPU memory, taken with the CUDA family's observations of it."""
        t.gpu = GpuUse(self.device_total, float(self.used.get(t.pid, 0)))

    def lost(self) -> Mapping[str, int]:
        return {}

    def not_ready(self) -> tuple[str, ...]:
        return ()

    def probe_views(self) -> list[ProbeView]:
        return []
