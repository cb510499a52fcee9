"""The configuration's schema: every key, its default and its bounds (pydantic).

How a file, the environment and flags are merged and checked is in ``config_load.py``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

DEFAULT_CONFIG_PATH = Path("/etc/kvwatch/kvwatch.toml")
ENV_PREFIX = "KVWATCH_"
DEFAULT_LISTEN = "127.0.0.1:9740"

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


DEFAULT_RUNBOOK = "https://github.com/kvwatch/kvwatch/blob/main/docs/runbook.md"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaemonConfig(_Section):
    listen: str = DEFAULT_LISTEN
    tick_seconds: Annotated[float, Field(ge=0.05, le=60)] = 1.0
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        parse_listen(v)
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> DaemonConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        return self


class EngineRule(_Section):
    """A discovery rule: a process matching any of the regexes is an inference process."""

    engine: Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_.-]+$")]
    comm: str | None = None
    cmdline: str | None = None
    role: str | None = None

    @model_validator(mode="after")
    def _needs_pattern(self) -> EngineRule:
        import re  # noqa: PLC0415 - only to validate

        if self.comm is None and self.cmdline is None:
            raise ValueError("a rule needs comm or cmdline")
        for name in ("comm", "cmdline"):
            pattern = getattr(self, name)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise ValueError(f"{name}: invalid regex {pattern!r}: {err}") from err
        return self


class DiscoveryConfig(_Section):
    interval_seconds: PositiveFloat = 5.0
    pids: list[Annotated[int, Field(gt=0)]] = []
    default_rules: bool = True
    rules: list[EngineRule] = []
    nvml: Literal["auto", "on", "off"] = "auto"
    follow_children: bool = True
    max_processes: Annotated[int, Field(ge=1, le=4096)] = 256
    exec_hints_per_tick: Annotated[int, Field(ge=0)] = 200
    proc_root: Path = Path("/proc")  # the procfs showing the watched processes: the host's (/host/proc in a pod)


class KVTierDir(_Section):
    path: Path
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    owner_pid: Annotated[int, Field(gt=0)] | None = None


class KVTiersConfig(_Section):
    dirs: list[KVTierDir] = []
    from_environment: bool = True
    rescan_seconds: PositiveFloat = 10.0
    max_files: Annotated[int, Field(ge=1)] = 65536


class ProbesConfig(_Section):
    memory: list[Literal["page_free", "pagecache", "reclaim", "oom", "lifecycle", "hints"]] = [
        "page_free",
        "pagecache",
        "reclaim",
        "oom",
        "lifecycle",
        "hints",
    ]
    ringbuf_pages: Annotated[int, Field(ge=1)] = 64
    max_evicted_pages_tracked: Annotated[int, Field(ge=1024)] = 131072
    max_reclaimers: Annotated[int, Field(ge=64)] = 4096  # (tier, reclaimer kind, cgroup) entries in the kernel
    cuda: bool = True
    cuda_driver_api: Literal["auto", "all", "off"] = "auto"
    cuda_rescan_seconds: PositiveFloat = 5.0
    cuda_max_ledger: Annotated[int, Field(ge=1024)] = 65536
    transfer: bool = True
    transfer_rescan_seconds: PositiveFloat = 5.0
    transfer_pending_timeout_seconds: PositiveFloat = 60.0

    @field_validator("ringbuf_pages")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two")
        return v


class SelfCostConfig(_Section):
    """What kvwatch's probes cost the watched processes, and the budget it keeps to."""

    bpf_stats: bool = False  # may kvwatch turn the kernel's BPF run-time statistics on while it runs
    calibrate: bool = True  # time a canary uprobe at start: the per-call cost of a probed call
    call_cost_ns: NonNegFloat = 0.0  # a fixed per-call cost instead of the canary's (0: measured)
    budget: Annotated[float, Field(ge=0, le=1)] = 0.01  # of a process's CPU time; 0: never shed
    floor_ms_per_second: NonNegFloat = 1.0  # a window costing less than this is within budget
    window_seconds: PositiveFloat = 5.0
    windows: Annotated[int, Field(ge=1)] = 3  # over budget this many windows in a row: shed
    backoff_seconds: PositiveFloat = 60.0  # shed this long, then attached again (doubling while it recurs)
    backoff_max_seconds: PositiveFloat = 960.0


class TransfersConfig(_Section):
    """The link KV transfers cross, to report bandwidth as a share of it."""

    link_bits_per_second: NonNegFloat = 0.0
    link_interface: str = ""


class EngineEndpoint(_Section):
    """Taps given by hand, for the watched process with this pid (or whose command line matches)."""

    pid: Annotated[int, Field(gt=0)] | None = None
    cmdline: str | None = None
    kv_events: str | None = None  # a connect address: tcp://10.0.0.5:5557
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    data_parallel_ranks: Annotated[int, Field(ge=1, le=256)] = 1  # streams on kv_events port + 0..N-1
    metrics_url: str | None = None
    engine: Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_.-]+$")] = "unknown"  # label

    @model_validator(mode="after")
    def _complete(self) -> EngineEndpoint:
        import re  # noqa: PLC0415 - only to validate

        if (self.pid is None) == (self.cmdline is None):
            raise ValueError("give exactly one of pid or cmdline")
        if self.cmdline is not None:
            try:
                re.compile(self.cmdline)
            except re.error as err:
                raise ValueError(f"cmdline: invalid regex {self.cmdline!r}: {err}") from err
        if self.kv_events is None and self.metrics_url is None:
            raise ValueError("give kv_events, metrics_url or both")
        for name in ("kv_events", "kv_events_replay"):
            v = getattr(self, name)
            if v is not None and not v.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name}: expected tcp://HOST:PORT or ipc://PATH, got {v!r}")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"metrics_url: expected http(s)://..., got {self.metrics_url!r}")
        return self


class TenantRule(_Section):
    """A tenant's name for requests with a cache salt or a LoRA adapter (exactly one of the three
    keys). ``salt_sha256`` (hex of the salt's SHA-256) names a salt without writing it here."""

    name: Annotated[str, Field(min_length=1, max_length=48, pattern=r"^[A-Za-z0-9_.:-]+$")]
    salt: str | None = None
    salt_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    lora: str | None = None

    @model_validator(mode="after")
    def _one(self) -> TenantRule:
        if sum(v is not None for v in (self.salt, self.salt_sha256, self.lora)) != 1:
            raise ValueError("give exactly one of salt, salt_sha256 or lora")
        return self


class EnginesConfig(_Section):
    """Engine taps: vLLM's KV event stream and engines' own /metrics."""

    kv_events: bool = True
    kv_events_replay: bool = True
    metrics: bool = True
    from_cmdline: bool = True
    scrape_interval_seconds: Annotated[float, Field(ge=0.5)] = 2.0  # KVEvictionBurst's hit ratio lags by this
    scrape_timeout_seconds: PositiveFloat = 2.0
    replay_timeout_seconds: PositiveFloat = 2.0
    thrash_seconds: PositiveFloat = 10.0
    # Store times remembered per stream, medium and KV cache group, to see young removals; about
    # 24 bytes each when full (40 at worst), the oldest forgotten first (counted).
    max_tracked_blocks: Annotated[int, Field(ge=1024, le=1 << 26)] = 1_000_000
    # Removed block hashes remembered per stream, medium and group to see them stored again
    # (regretted evictions); as many bytes each. 0: off.
    regret_memory_blocks: Annotated[int, Field(ge=0, le=1 << 26)] = 524_288
    # What every stream's hash memories together may hold on this node (the streams share it, each
    # medium and group within its bounds above: docs/architecture.md, "What the accounting keeps").
    kv_memory_bytes: Annotated[int, Field(ge=16 << 20, le=16 << 30)] = 256 << 20
    # Bytes of one KV block, to price the loss ledger; 0: learnt from the engine's offload
    # counter (bytes copied to its CPU tier over CPU blocks announced), else blocks only.
    kv_block_bytes: Annotated[int, Field(ge=0)] = 0
    # How long a gone process's loss ledger stays on /metrics (its last losses: an OOM kill).
    loss_linger_seconds: NonNegFloat = 300.0
    endpoints: list[EngineEndpoint] = []
    # Tenants (cache salts, LoRA adapters) named by hand; an unnamed salt is exported as a keyed
    # hash ("salt-" + 8 hex), the key kept in tenant_key_file so that names survive restarts.
    tenants: list[TenantRule] = []
    tenant_top_k: Annotated[int, Field(ge=1, le=256)] = 8  # per engine; the rest count as "other"
    tenant_key_file: Path = Path("/var/lib/kvwatch/tenant.key")

    @model_validator(mode="after")
    def _tenants_unique(self) -> EnginesConfig:
        seen: set[tuple[str, str]] = set()
        for i, t in enumerate(self.tenants):
            key = next((k, str(v)) for k in ("salt", "salt_sha256", "lora") if (v := getattr(t, k)) is not None)
            if key in seen:
                raise ValueError(f"tenants[{i}]: a second rule for the same {key[0]}")
            seen.add(key)
        return self


class DetectorCommon(_Section):
    enabled: bool = True
    warmup_seconds: NonNegFloat = 120.0
    baseline_half_life_seconds: PositiveFloat = 1800.0
    confirm_windows: Annotated[int, Field(ge=1)] = 2
    clear_windows: Annotated[int, Field(ge=1)] = 5


class HostTierEvictionConfig(DetectorCommon):
    window_seconds: PositiveFloat = 2.0
    factor: Annotated[float, Field(ge=1)] = 5.0
    floor_bytes_per_second: NonNegFloat = 64 * 1024 * 1024
    refault_ratio: Annotated[float, Field(ge=0, le=1)] = 0.25
    reclaim_stall_ms_per_second: NonNegFloat = 50.0
    psi_some_avg10: NonNegFloat = 10.0


class ReuseCollapseConfig(DetectorCommon):
    window_seconds: PositiveFloat = 2.0
    factor: Annotated[float, Field(ge=1)] = 10.0
    floor_calls_per_second: NonNegFloat = 20.0
    churn_tolerance: Annotated[float, Field(ge=0, le=1)] = 0.05
    require_kv_pool: bool = True
    kv_pool_fraction: Annotated[float, Field(gt=0, le=1)] = 0.10
    baseline_min_seconds: NonNegFloat = 30.0
    quiet_after_sleep_seconds: NonNegFloat = 30.0  # engine sleep mode: the wake-up remap is not learnt


class TransferCollapseConfig(DetectorCommon):
    window_seconds: PositiveFloat = 5.0
    fraction: Annotated[float, Field(gt=0, lt=1)] = 0.3
    demand_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    min_transfers: Annotated[int, Field(ge=1)] = 20
    min_stalled_transfers: Annotated[int, Field(ge=1)] = 3  # a stall: few transfers, min_transfers' worth of time
    peer_grace_seconds: NonNegFloat = 10.0
    baseline_min_seconds: NonNegFloat = 30.0


class EvictionBurstConfig(DetectorCommon):
    window_seconds: PositiveFloat = 10.0
    factor: Annotated[float, Field(ge=1)] = 5.0
    floor_blocks_per_second: NonNegFloat = 20.0
    floor_tokens_per_second: NonNegFloat = 320.0  # engines that count evicted tokens (SGLang)
    floor_copy_bytes_per_second: NonNegFloat = 64 * 1024 * 1024  # OS-side: host<->device copies, each way
    hit_drop: Annotated[float, Field(gt=0, le=1)] = 0.30  # prefix-hit ratio points below baseline
    min_queried_tokens: NonNegFloat = 2000.0  # in the window, to judge the hit ratio at all
    usage_pressure: Annotated[float, Field(gt=0, le=1)] = 0.9
    thrash_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5  # of removals, blocks stored < thrash_seconds ago
    thrash_preemptions_per_second: NonNegFloat = 1.0
    quiet_after_reset_seconds: NonNegFloat = 60.0  # prefix-cache reset / sleep: intentional, re-learn
    baseline_min_seconds: NonNegFloat = 30.0


class PrefixCacheIneffectiveConfig(DetectorCommon):
    window_seconds: PositiveFloat = 60.0
    min_queried_tokens: NonNegFloat = 20_000.0  # prompt tokens looked up in the window, to judge at all
    max_hit_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.02  # hot at or below; cool above twice this
    min_stored_blocks: NonNegFloat = 100.0  # GPU blocks stored in the window (the KV event stream)
    recur_fraction: Annotated[float, Field(gt=0, le=1)] = 0.05  # of those, stored while held: cause not_hit


class PreemptionLivelockConfig(DetectorCommon):
    window_seconds: PositiveFloat = 10.0
    min_preemptions_per_second: PositiveFloat = 0.5
    collapse_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2  # of the learnt tokens/s: hot at or below
    recover_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5  # cool at or above
    floor_tokens_per_second: NonNegFloat = 10.0  # a learnt rate below this is not judged
    baseline_min_seconds: NonNegFloat = 30.0


class TenantThrashConfig(DetectorCommon):
    window_seconds: PositiveFloat = 10.0
    factor: Annotated[float, Field(ge=1)] = 5.0  # the victim's regrets/s over its own baseline
    floor_regretted_per_second: NonNegFloat = 5.0  # GPU blocks; below this no tenant is a victim
    aggressor_store_share: Annotated[float, Field(gt=0, le=1)] = 0.5  # of the pool's stores in the window
    min_stored_blocks: NonNegFloat = 50.0  # the pool's stores in the window, to judge at all
    baseline_min_seconds: NonNegFloat = 30.0


class MetricDivergenceConfig(_Section):
    """The KV metric-truth audit (engines/audit.py) and its alert."""

    enabled: bool = True
    window_seconds: Annotated[float, Field(ge=1)] = 30.0  # one audit window; several engine scrapes
    tolerance: Annotated[float, Field(gt=0, lt=1)] = 0.10  # of the larger of the two numbers
    floor_bytes: NonNegFloat = 64 * 1024 * 1024  # a window moving less is not judged
    confirm_windows: Annotated[int, Field(ge=1)] = 3
    clear_windows: Annotated[int, Field(ge=1)] = 2
    severity: Literal["info", "warning", "critical"] = "info"


class OOMConfig(_Section):
    enabled: bool = True
    include_cgroup_siblings: bool = True
    active_seconds: PositiveFloat = 300.0


class DetectorsConfig(_Section):
    host_tier_eviction: HostTierEvictionConfig = HostTierEvictionConfig()
    reuse_collapse: ReuseCollapseConfig = ReuseCollapseConfig()
    transfer_collapse: TransferCollapseConfig = TransferCollapseConfig()
    eviction_burst: EvictionBurstConfig = EvictionBurstConfig()
    prefix_cache_ineffective: PrefixCacheIneffectiveConfig = PrefixCacheIneffectiveConfig()
    preemption_livelock: PreemptionLivelockConfig = PreemptionLivelockConfig()
    tenant_thrash: TenantThrashConfig = TenantThrashConfig()
    engine_metric_divergence: MetricDivergenceConfig = MetricDivergenceConfig()
    oom: OOMConfig = OOMConfig()


class AlertmanagerConfig(_Section):
    """Post alerts straight to Alertmanager's v2 API (for sites without Prometheus rules)."""

    url: str = ""  # e.g. http://alertmanager:9093; empty: off
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 5.0
    resend_seconds: Annotated[float, Field(gt=0, le=3600)] = 60.0  # Alertmanager resolves what it stops hearing
    max_backoff_seconds: Annotated[float, Field(gt=0, le=3600)] = 60.0
    max_pending: Annotated[int, Field(ge=1, le=100_000)] = 1000
    labels: dict[str, str] = {}  # added to every alert (cluster, region, ...)
    runbook_base_url: str = DEFAULT_RUNBOOK

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class AlertsConfig(_Section):
    log: bool = True
    alertmanager: AlertmanagerConfig = AlertmanagerConfig()


class Config(_Section):
    daemon: DaemonConfig = DaemonConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    kv_tiers: KVTiersConfig = KVTiersConfig()
    probes: ProbesConfig = ProbesConfig()
    transfers: TransfersConfig = TransfersConfig()
    self_cost: SelfCostConfig = SelfCostConfig()
    engines: EnginesConfig = EnginesConfig()
    detectors: DetectorsConfig = DetectorsConfig()
    alerts: AlertsConfig = AlertsConfig()


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
