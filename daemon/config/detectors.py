"""The detectors' sections of the configuration (``[detectors.*]``): thresholds, windows, warm-up."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from kvwatch.daemon.config.base import NonNegFloat, PositiveFloat
from kvwatch.daemon.config.base import Section as _Section


class DetectorCommon(_Section, frozen=True):
    enabled: bool = True
    warmup_seconds: NonNegFloat = 120.0
    baseline_half_life_seconds: PositiveFloat = 1800.0
    confirm_windows: Annotated[int, Meta(ge=1)] = 2
    clear_windows: Annotated[int, Meta(ge=1)] = 5


class HostTierEvictionConfig(DetectorCommon, frozen=True):
    window_seconds: PositiveFloat = 2.0
    factor: Annotated[float, Meta(ge=1)] = 5.0
    floor_bytes_per_second: NonNegFloat = 64 * 1024 * 1024
    refault_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.25
    reclaim_stall_ms_per_second: NonNegFloat = 50.0
    psi_some_avg10: NonNegFloat = 10.0


class ReuseCollapseConfig(DetectorCommon, frozen=True):
    window_seconds: PositiveFloat = 2.0
    factor: Annotated[float, Meta(ge=1)] = 10.0
    floor_calls_per_second: NonNegFloat = 20.0
    churn_tolerance: Annotated[float, Meta(ge=0, le=1)] = 0.05
    require_kv_pool: bool = True
    kv_pool_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.10
    baseline_min_seconds: NonNegFloat = 30.0
    quiet_after_sleep_seconds: NonNegFloat = 30.0  # engine sleep mode: the wake-up remap is not learnt


class TransferCollapseConfig(DetectorCommon, frozen=True):
    window_seconds: PositiveFloat = 5.0
    fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.3
    demand_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5
    min_transfers: Annotated[int, Meta(ge=1)] = 20
    min_stalled_transfers: Annotated[int, Meta(ge=1)] = 3  # a stall: few transfers, min_transfers' worth of time
    peer_grace_seconds: NonNegFloat = 10.0
    baseline_min_seconds: NonNegFloat = 30.0


class EvictionBurstConfig(DetectorCommon, frozen=True):
    window_seconds: PositiveFloat = 10.0
    factor: Annotated[float, Meta(ge=1)] = 5.0
    floor_blocks_per_second: NonNegFloat = 20.0
    floor_tokens_per_second: NonNegFloat = 320.0  # engines that count evicted tokens (SGLang)
    floor_copy_bytes_per_second: NonNegFloat = 64 * 1024 * 1024  # OS-side: host<->device copies, each way
    hit_drop: Annotated[float, Meta(gt=0, le=1)] = 0.30  # prefix-hit ratio points below baseline
    min_queried_tokens: NonNegFloat = 2000.0  # in the window, to judge the hit ratio at all
    usage_pressure: Annotated[float, Meta(gt=0, le=1)] = 0.9
    thrash_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5  # of removals, blocks stored < thrash_seconds ago
    thrash_preemptions_per_second: NonNegFloat = 1.0
    quiet_after_reset_seconds: NonNegFloat = 60.0  # prefix-cache reset / sleep: intentional, re-learn
    baseline_min_seconds: NonNegFloat = 30.0


class PrefixCacheIneffectiveConfig(DetectorCommon, frozen=True):
    window_seconds: PositiveFloat = 60.0
    min_queried_tokens: NonNegFloat = 20_000.0  # prompt tokens looked up in the window, to judge at all
    max_hit_ratio: Annotated[float, Meta(ge=0, lt=1)] = 0.02  # hot at or below; cool above twice this
    min_stored_blocks: NonNegFloat = 100.0  # GPU blocks stored in the window (the KV event stream)
    recur_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.05  # of those, stored while held: cause not_hit


class PreemptionLivelockConfig(DetectorCommon, frozen=True):
    window_seconds: PositiveFloat = 10.0
    min_preemptions_per_second: PositiveFloat = 0.5
    collapse_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.2  # of the learnt tokens/s: hot at or below
    recover_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5  # cool at or above
    floor_tokens_per_second: NonNegFloat = 10.0  # a learnt rate below this is not judged
    baseline_min_seconds: NonNegFloat = 30.0


class TenantThrashConfig(DetectorCommon, frozen=True):
    # An engine's start holds no tenant's regrets; each victim's baseline_min_seconds is its warm-up.
    warmup_seconds: NonNegFloat = 0.0
    window_seconds: PositiveFloat = 10.0
    factor: Annotated[float, Meta(ge=1)] = 5.0  # the victim's regrets/s over its own baseline
    floor_regretted_per_second: NonNegFloat = 5.0  # GPU blocks; below this no tenant is a victim
    aggressor_store_share: Annotated[float, Meta(gt=0, le=1)] = 0.5  # of the pool's stores in the window
    min_stored_blocks: NonNegFloat = 50.0  # the pool's stores in the window, to judge at all
    baseline_min_seconds: NonNegFloat = 30.0


class MetricDivergenceConfig(_Section, frozen=True):
    """The KV metric-truth audit (engines/audit.py) and its alert."""

    enabled: bool = True
    window_seconds: Annotated[float, Meta(ge=1)] = 30.0  # one audit window; several engine scrapes
    tolerance: Annotated[float, Meta(gt=0, lt=1)] = 0.10  # of the larger of the two numbers
    floor_bytes: NonNegFloat = 64 * 1024 * 1024  # a window moving less is not judged
    confirm_windows: Annotated[int, Meta(ge=1)] = 3
    clear_windows: Annotated[int, Meta(ge=1)] = 2
    severity: Literal["info", "warning", "critical"] = "info"


class OOMConfig(_Section, frozen=True):
    enabled: bool = True
    include_cgroup_siblings: bool = True
    active_seconds: PositiveFloat = 300.0


class DetectorsConfig(_Section, frozen=True):
    host_tier_eviction: HostTierEvictionConfig = HostTierEvictionConfig()
    reuse_collapse: ReuseCollapseConfig = ReuseCollapseConfig()
    transfer_collapse: TransferCollapseConfig = TransferCollapseConfig()
    eviction_burst: EvictionBurstConfig = EvictionBurstConfig()
    prefix_cache_ineffective: PrefixCacheIneffectiveConfig = PrefixCacheIneffectiveConfig()
    preemption_livelock: PreemptionLivelockConfig = PreemptionLivelockConfig()
    tenant_thrash: TenantThrashConfig = TenantThrashConfig()
    engine_metric_divergence: MetricDivergenceConfig = MetricDivergenceConfig()
    oom: OOMConfig = OOMConfig()
