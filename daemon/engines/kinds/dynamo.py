"""NVIDIA Dynamo: its processes and its KV block manager's (KVBM) tiers.

* Processes: ``dynamo-run`` / ``python -m dynamo.*``.
* /metrics: KVBM 1.6.1 (its Rust exporter writes counters without ``_total``; prometheus-client's
  parser names their samples with it). Directions name the move: offload d2h device→host, h2d
  host→disk, d2d device→disk, d2o device→object; onboard h2d host→device, d2d disk→device, o2d
  object→device.
"""

from __future__ import annotations

from kvwatch.daemon.config import EngineRule
from kvwatch.daemon.engines.kind import PY_M, EngineKind, TierRule

KIND = EngineKind(
    name="dynamo",
    rules=(EngineRule(engine="dynamo", cmdline=r"^(\S*/)?dynamo-run\b|" + PY_M + r"dynamo\."),),
    tiers=(
        TierRule("kvbm", "cpu", "stored", "blocks", "kvbm_offload_blocks_d2h_total"),
        TierRule("kvbm", "cpu", "loaded", "blocks", "kvbm_onboard_blocks_h2d_total"),
        TierRule("kvbm", "cpu", "hit_ratio", "ratio", "kvbm_host_cache_hit_rate"),
        TierRule("kvbm", "disk", "stored", "blocks", "kvbm_offload_blocks_h2d_total"),
        TierRule("kvbm", "disk", "stored", "blocks", "kvbm_offload_blocks_d2d_total"),
        TierRule("kvbm", "disk", "loaded", "blocks", "kvbm_onboard_blocks_d2d_total"),
        TierRule("kvbm", "disk", "hit_ratio", "ratio", "kvbm_disk_cache_hit_rate"),
        TierRule("kvbm", "remote", "stored", "blocks", "kvbm_offload_blocks_d2o_total"),
        TierRule("kvbm", "remote", "loaded", "blocks", "kvbm_onboard_blocks_o2d_total"),
        TierRule("kvbm", "remote", "hit_ratio", "ratio", "kvbm_object_cache_hit_rate"),
    ),
)
