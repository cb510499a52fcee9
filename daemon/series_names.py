"""Every per-process (and per-tier) series kvwatch keeps, named once: who writes it, who reads it.

A tick's steps write what they measured into each watched process's ``SeriesSet`` (cumulative
counters and point-in-time gauges); the detectors, the audit and the snapshot read them back
over windows. The names below are that contract: code writes and reads the constants, never a
string of its own, and ``tests/unit/test_series_names.py`` holds every module to it (each name
written by its writer, read only by its readers, and read by someone). A name ending in ``:`` is
a prefix: the series is that prefix and a key (a medium, a family, ``tier:cause``).

Modules are named from ``kvwatch.daemon`` down (``engines.taps``). Exporters read no series:
they read the snapshot's typed fields (``model/snapshot.py``), which ``publish`` fills from these.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, GAUGE = "counter", "gauge"


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    kind: str  # counter (cumulative: read as deltas and rates over windows) / gauge (the latest value)
    writer: str
    readers: tuple[str, ...]
    doc: str


CATALOGUE: dict[str, Entry] = {}


def _declare(name: str, kind: str, writer: str, readers: tuple[str, ...], doc: str) -> str:
    if name in CATALOGUE:
        raise ValueError(f"series {name!r} declared twice")
    CATALOGUE[name] = Entry(name, kind, writer, readers, doc)
    return name


# --- kernel memory (families.memory), per process --------------------------------------------------
_MEM = "families.memory"
PAGE_FREE_PAGES = _declare("page_free_pages", COUNTER, _MEM, ("publish",), "pages the process released")
DIRECT_RECLAIM_SECONDS = _declare(
    "direct_reclaim_seconds", COUNTER, _MEM, ("detectors.host_tier", "publish"), "stalled in global direct reclaim"
)
DIRECT_RECLAIM_COUNT = _declare("direct_reclaim_count", COUNTER, _MEM, ("publish",), "global direct reclaim episodes")
MEMCG_RECLAIM_SECONDS = _declare(
    "memcg_reclaim_seconds", COUNTER, _MEM, ("detectors.host_tier", "publish"), "stalled in memcg-limit reclaim"
)
MEMCG_RECLAIM_COUNT = _declare("memcg_reclaim_count", COUNTER, _MEM, ("publish",), "memcg-limit reclaim episodes")

# --- kernel memory (families.memory), per KV tier (a directory of KV files) -----------------------------
_TIER_READERS = ("detectors.host_tier", "engines.losses", "families.memory")
RECLAIM_BYTES = _declare("reclaim_bytes", COUNTER, _MEM, _TIER_READERS, "tier page cache reclaimed by the kernel")
POLICY_BYTES = _declare("policy_bytes", COUNTER, _MEM, _TIER_READERS, "tier page cache dropped by file deletion")
RECLAIM_PAGES = _declare("reclaim_pages", COUNTER, _MEM, _TIER_READERS, "tier pages reclaimed")
POLICY_PAGES = _declare("policy_pages", COUNTER, _MEM, ("families.memory",), "tier pages dropped by deletion")
REFAULT_PAGES = _declare("refault_pages", COUNTER, _MEM, _TIER_READERS, "tier pages read back after reclaim")
ADDED_PAGES = _declare("added_pages", COUNTER, _MEM, ("families.memory",), "tier pages added to the page cache")
RECLAIMED_BYTES = _declare(
    "reclaimed_bytes:", COUNTER, _MEM, ("families.memory",), "+ reclaimer row (families.reclaimers): who reclaimed"
)

# --- CUDA (families.cuda) --------------------------------------------------------------------------------
_CUDA = "families.cuda"
_COPY_READERS = ("detectors.eviction_burst", "engines.taps")
CUDA_COPY_H2D_BYTES = _declare("cuda_copy_h2d_bytes", COUNTER, _CUDA, _COPY_READERS, "host-to-device bytes copied")
CUDA_COPY_D2H_BYTES = _declare("cuda_copy_d2h_bytes", COUNTER, _CUDA, _COPY_READERS, "device-to-host bytes copied")
GPU_DEVICE_TOTAL_BYTES = _declare(
    "gpu_device_total_bytes", GAUGE, "families.gpu", ("detectors.reuse_collapse",), "the largest GPU's memory (NVML)"
)
GPU_USED_BYTES = _declare(
    "gpu_used_bytes", GAUGE, "families.gpu", ("detectors.reuse_collapse",), "GPU memory held (NVML)"
)

# --- a uprobe family of the process (families.runner): "+ family" --------------------------------------------
_RUNNER = "families.runner"
UPROBE_CALLS = _declare("uprobe_calls:", COUNTER, _RUNNER, ("families.cost",), "probed calls of the family")
UPROBES_SHED = _declare(
    "uprobes_shed:", GAUGE, _RUNNER, ("detectors.probe_shed", "engines.taps"), "1 while the budget has them detached"
)
UPROBE_SYMBOLS = _declare("uprobe_symbols:", GAUGE, _RUNNER, ("engines.taps",), "the family's symbols attached")
UPROBE_COST_RATIO = _declare(
    "uprobe_cost_ratio", GAUGE, "families.cost", ("detectors.probe_shed",), "uprobes' cost over the process's CPU"
)

# --- KV transfers (families.transfer) -----------------------------------------------------------------------
_XFER = "families.transfer"
XFER_BYTES = _declare("xfer_bytes", COUNTER, _XFER, ("publish",), "bytes moved by every transfer library")

# --- the engine's processes, summed on the tapped one (engines.taps) -------------------------------------------
_TAPS = "engines.taps"
ENGINE_TREE_COPY_D2H_BYTES = _declare(
    "engine_tree_copy_d2h_bytes", COUNTER, _TAPS, ("engines.audit",), "device-to-host copies of the engine's processes"
)
ENGINE_TREE_COPY_H2D_BYTES = _declare(
    "engine_tree_copy_h2d_bytes", COUNTER, _TAPS, ("engines.audit",), "host-to-device copies of the engine's processes"
)

# --- the KV loss ledger (engines.losses): "+ tier:cause" ---------------------------------------------------------
KV_LOST_BYTES = _declare("kv_lost_bytes:", COUNTER, "engines.losses", ("publish",), "bytes lost, by tier and cause")
