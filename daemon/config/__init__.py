"""The configuration's schema: every key, its default and its bounds (msgspec Structs, ``base.py``).

How a file, the environment and flags are merged and checked is in ``load.py``; the detectors'
sections are in ``detectors.py``.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta, field
from msgspec.structs import force_setattr

from kvwatch.daemon.config.base import UNECHOED_KEYS, Check, NonNegFloat, PositiveFloat, Section
from kvwatch.daemon.config.detectors import (
    DetectorCommon,
    DetectorsConfig,
    EvictionBurstConfig,
    HostTierEvictionConfig,
    MetricDivergenceConfig,
    OOMConfig,
    PreemptionLivelockConfig,
    PrefixCacheIneffectiveConfig,
    ReuseCollapseConfig,
    TenantThrashConfig,
    TransferCollapseConfig,
)

DEFAULT_CONFIG_PATH = Path("/etc/kvwatch/kvwatch.toml")
ENV_PREFIX = "KVWATCH_"
DEFAULT_LISTEN = "127.0.0.1:9740"
DEFAULT_RUNBOOK = "https://github.com/kvwatch/kvwatch/blob/main/docs/runbook.md"

__all__ = [  # only what this module re-exports: the detectors' sections, from detectors.py, and base's
    "UNECHOED_KEYS",
    "DetectorCommon",
    "DetectorsConfig",
    "EvictionBurstConfig",
    "HostTierEvictionConfig",
    "MetricDivergenceConfig",
    "OOMConfig",
    "PreemptionLivelockConfig",
    "PrefixCacheIneffectiveConfig",
    "ReuseCollapseConfig",
    "TenantThrashConfig",
    "TransferCollapseConfig",
]

# Tenant names kvwatch gives itself (engines/tenants.py): a rule taking one would merge its
# tenant into requests without a salt or adapter, untold ones, the folded rest, or a hashed salt.
RESERVED_TENANT_NAMES = ("default", "unknown", "other")
RESERVED_TENANT_PREFIXES = ("salt-", "lora:")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port_s = value.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]")
    if host not in ("", "localhost"):
        try:
            ipaddress.ip_address(host)
        except ValueError as err:
            raise ValueError(f"host {host!r} is not an IP address") from err
    return host or "0.0.0.0", int(port_s)  # noqa: S104 - an explicit empty host asks for all


def _regex(pattern: str | None) -> None:
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ValueError(f"invalid regex {pattern!r}: {err}") from err


def _power_of_two(v: int) -> None:
    if v & (v - 1):
        raise ValueError("must be a power of two")


def _http_url(v: str) -> None:
    if v and not v.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")


def _tenant_name(v: str) -> None:
    if v in RESERVED_TENANT_NAMES or v.startswith(RESERVED_TENANT_PREFIXES):
        reserved = ", ".join([*RESERVED_TENANT_NAMES, *(p + "..." for p in RESERVED_TENANT_PREFIXES)])
        raise ValueError(f"reserved by kvwatch ({reserved})")


Regex = Annotated[str | None, Check(_regex)]
EngineLabel = Annotated[str, Meta(min_length=1, max_length=32, pattern=r"^[a-z0-9_.-]+$")]


class DaemonConfig(Section, frozen=True):
    listen: Annotated[str, Check(parse_listen)] = DEFAULT_LISTEN
    tick_seconds: Annotated[float, Meta(ge=0.05, le=60)] = 1.0
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # HTTP connections held at once (a thread each); past it the oldest one still sending its
    # request makes room, or, every one being answered, the new one is refused
    max_connections: Annotated[int, Meta(ge=1, le=1024)] = 64
    # a client's time to send its request head (TLS handshake included), and each read or write
    http_timeout_seconds: Annotated[float, Meta(ge=1, le=300)] = 10.0

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")


class EngineRule(Section, frozen=True):
    """A discovery rule: a process matching any of the regexes is an inference process."""

    engine: EngineLabel
    comm: Regex = None
    cmdline: Regex = None
    role: str | None = None

    def __post_init__(self) -> None:
        if self.comm is None and self.cmdline is None:
            raise ValueError("a rule needs comm or cmdline")


class DiscoveryConfig(Section, frozen=True):
    interval_seconds: PositiveFloat = 5.0
    # as many as max_processes
    pids: Annotated[list[Annotated[int, Meta(gt=0)]], Meta(max_length=4096)] = field(default_factory=list)
    default_rules: bool = True
    # each matched against every new process
    rules: Annotated[list[EngineRule], Meta(max_length=256)] = field(default_factory=list)
    nvml: Literal["auto", "on", "off"] = "auto"
    follow_children: bool = True
    max_processes: Annotated[int, Meta(ge=1, le=4096)] = 256
    exec_hints_per_tick: Annotated[int, Meta(ge=0, le=10_000)] = 200  # four ticks' worth are queued

    proc_root: Path = Path("/proc")  # the procfs showing the watched processes: the host's (/host/proc in a pod)

    def __post_init__(self) -> None:
        force_setattr(self, "pids", sorted(set(self.pids)))


class KVTierDir(Section, frozen=True):
    path: Path
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    owner_pid: Annotated[int, Meta(gt=0)] | None = None


class KVTiersConfig(Section, frozen=True):
    dirs: Annotated[list[KVTierDir], Meta(max_length=64)] = field(default_factory=list)  # the BPF program's MAX_TIERS
    from_environment: bool = True
    rescan_seconds: PositiveFloat = 10.0
    max_files: Annotated[int, Meta(ge=1, le=1 << 21)] = 65536  # a BPF map entry each


class ProbesConfig(Section, frozen=True):
    memory: list[Literal["page_free", "pagecache", "reclaim", "oom", "lifecycle", "hints"]] = field(
        default_factory=lambda: ["page_free", "pagecache", "reclaim", "oom", "lifecycle", "hints"]
    )
    # Each bounds kernel memory kvwatch allocates: a ring buffer, or a BPF map of roughly 100 bytes
    # an entry (most preallocated); the maxima, 16 to 64 times the defaults, keep a typo (1e14) from
    # asking the kernel for terabytes, while leaving room far past any node measured.
    ringbuf_pages: Annotated[int, Meta(ge=1, le=4096), Check(_power_of_two)] = 64  # 4 KiB pages: 16 MiB at most
    max_evicted_pages_tracked: Annotated[int, Meta(ge=1024, le=1 << 22)] = 131072  # 16-page granules: 256 GiB
    max_reclaimers: Annotated[int, Meta(ge=64, le=1 << 16)] = 4096  # (tier, reclaimer kind, cgroup) entries
    cuda: bool = True
    cuda_driver_api: Literal["auto", "all", "off"] = "auto"
    cuda_rescan_seconds: PositiveFloat = 5.0
    cuda_max_ledger: Annotated[int, Meta(ge=1024, le=1 << 20)] = 65536  # live allocations, node-wide
    transfer: bool = True
    transfer_rescan_seconds: PositiveFloat = 5.0
    transfer_pending_timeout_seconds: PositiveFloat = 60.0


class SelfCostConfig(Section, frozen=True):
    """What kvwatch's probes cost the watched processes, and the budget it keeps to."""

    bpf_stats: bool = False  # may kvwatch turn the kernel's BPF run-time statistics on while it runs
    calibrate: bool = True  # time a canary uprobe at start: the per-call cost of a probed call
    call_cost_ns: NonNegFloat = 0.0  # a fixed per-call cost instead of the canary's (0: measured)
    budget: Annotated[float, Meta(ge=0, le=1)] = 0.01  # of a process's CPU time; 0: never shed
    floor_ms_per_second: NonNegFloat = 1.0  # a window costing less than this is within budget
    window_seconds: PositiveFloat = 5.0
    windows: Annotated[int, Meta(ge=1)] = 3  # over budget this many windows in a row: shed
    backoff_seconds: PositiveFloat = 60.0  # shed this long, then attached again (doubling while it recurs)
    backoff_max_seconds: PositiveFloat = 960.0


class TransfersConfig(Section, frozen=True):
    """The link KV transfers cross, to report bandwidth as a share of it."""

    link_bits_per_second: NonNegFloat = 0.0
    link_interface: str = ""


class EngineEndpoint(Section, frozen=True):
    """Taps given by hand, for the watched process with this pid (or whose command line matches)."""

    pid: Annotated[int, Meta(gt=0)] | None = None
    cmdline: Regex = None
    kv_events: str | None = None  # a connect address: tcp://10.0.0.5:5557
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    data_parallel_ranks: Annotated[int, Meta(ge=1, le=256)] = 1  # streams on kv_events port + 0..N-1
    metrics_url: str | None = None
    engine: EngineLabel = "unknown"  # label

    def __post_init__(self) -> None:
        if (self.pid is None) == (self.cmdline is None):
            raise ValueError("give exactly one of pid or cmdline")
        if self.kv_events is None and self.metrics_url is None:
            raise ValueError("give kv_events, metrics_url or both")
        for name in ("kv_events", "kv_events_replay"):  # not the value: an address may carry credentials
            v = getattr(self, name)
            if v is not None and not v.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name}: expected tcp://HOST:PORT or ipc://PATH")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise ValueError("metrics_url: expected http(s)://...")


class TenantRule(Section, frozen=True):
    """A tenant's name for requests with a cache salt or a LoRA adapter (exactly one of the three
    keys). ``salt_sha256`` (hex of the salt's SHA-256) names a salt without writing it here."""

    name: Annotated[str, Meta(min_length=1, max_length=48, pattern=r"^[A-Za-z0-9_.:-]+$"), Check(_tenant_name)]
    salt: str | None = None
    salt_sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")] | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.salt, self.salt_sha256, self.lora)) != 1:
            raise ValueError("give exactly one of salt, salt_sha256 or lora")


class EnginesConfig(Section, frozen=True):
    """Engine taps: vLLM's KV event stream and engines' own /metrics."""

    kv_events: bool = True
    kv_events_replay: bool = True
    metrics: bool = True
    from_cmdline: bool = True
    scrape_interval_seconds: Annotated[float, Meta(ge=0.5)] = 2.0  # KVEvictionBurst's hit ratio lags by this
    scrape_timeout_seconds: PositiveFloat = 2.0
    replay_timeout_seconds: PositiveFloat = 2.0
    thrash_seconds: PositiveFloat = 10.0
    # Store times remembered per stream, medium and KV cache group, to see young removals; about
    # 24 bytes each when full (40 at worst), the oldest forgotten first (counted).
    max_tracked_blocks: Annotated[int, Meta(ge=1024, le=1 << 26)] = 1_000_000
    # Removals remembered per stream, medium and group to see their blocks stored again (regretted
    # evictions): at least this many seconds of removals at this rate (blocks/s), about 7 bytes
    # each (11 at worst): 10 minutes of a 20,000 blocks/s flood by default. 0 seconds: off.
    regret_memory_seconds: Annotated[float, Meta(ge=0, le=86_400)] = 600.0
    regret_memory_rate: Annotated[int, Meta(ge=1, le=1_000_000)] = 20_000
    # What every stream's hash memories together may hold on this node (the streams share it, each
    # medium and group within its bounds above: docs/architecture.md, "What the accounting keeps").
    kv_memory_bytes: Annotated[int, Meta(ge=16 << 20, le=16 << 30)] = 384 << 20
    # Bytes of one KV block, to price the loss ledger; 0: learnt from the engine's offload
    # counter (bytes copied to its CPU tier over CPU blocks announced), else blocks only.
    kv_block_bytes: Annotated[int, Meta(ge=0, le=1 << 32)] = 0
    # How long a gone process's loss ledger stays on /metrics (its last losses: an OOM kill).
    loss_linger_seconds: NonNegFloat = 300.0
    endpoints: Annotated[list[EngineEndpoint], Meta(max_length=256)] = field(default_factory=list)
    # Tenants (cache salts, LoRA adapters) named by hand; an unnamed salt is exported as a keyed
    # hash ("salt-" + 8 hex), the key kept in tenant_key_file so that names survive restarts.
    tenants: Annotated[list[TenantRule], Meta(max_length=1024)] = field(default_factory=list)
    tenant_top_k: Annotated[int, Meta(ge=1, le=256)] = 8  # per engine process, metrics and alerts alike; rest: "other"
    tenant_key_file: Path = Path("/var/lib/kvwatch/tenant.key")

    @property
    def regret_blocks(self) -> int:
        """Removals a regret memory holds (per stream, medium and group): seconds x rate."""
        return min(int(self.regret_memory_seconds * self.regret_memory_rate), 1 << 26)

    def __post_init__(self) -> None:
        seen: set[tuple[str, str]] = set()
        for i, t in enumerate(self.tenants):
            key = next((k, str(v)) for k in ("salt", "salt_sha256", "lora") if (v := getattr(t, k)) is not None)
            if key in seen:
                raise ValueError(f"tenants[{i}]: a second rule for the same {key[0]}")
            seen.add(key)


class AlertmanagerConfig(Section, frozen=True):
    """Post alerts straight to Alertmanager's v2 API (for sites without Prometheus rules)."""

    url: Annotated[str, Check(_http_url)] = ""  # e.g. http://alertmanager:9093; empty: off
    timeout_seconds: Annotated[float, Meta(gt=0, le=60)] = 5.0
    resend_seconds: Annotated[float, Meta(gt=0, le=3600)] = 60.0  # Alertmanager resolves what it stops hearing
    max_backoff_seconds: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    max_pending: Annotated[int, Meta(ge=1, le=100_000)] = 1000
    # added to every alert (cluster, region, ...)
    labels: Annotated[dict[str, str], Meta(max_length=64)] = field(default_factory=dict)
    runbook_base_url: str = DEFAULT_RUNBOOK

    def __post_init__(self) -> None:
        force_setattr(self, "url", self.url.rstrip("/"))


class AlertsConfig(Section, frozen=True):
    log: bool = True
    alertmanager: AlertmanagerConfig = AlertmanagerConfig()


class Config(Section, frozen=True):
    daemon: DaemonConfig = DaemonConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    kv_tiers: KVTiersConfig = KVTiersConfig()
    probes: ProbesConfig = ProbesConfig()
    transfers: TransfersConfig = TransfersConfig()
    self_cost: SelfCostConfig = SelfCostConfig()
    engines: EnginesConfig = EnginesConfig()
    detectors: DetectorsConfig = DetectorsConfig()
    alerts: AlertsConfig = AlertsConfig()
