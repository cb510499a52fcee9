"""Hugging Face Text Generation Inference: its launcher, router and shards (found and labelled;
no KV taps)."""

from __future__ import annotations

from kvwatch.daemon.config import EngineRule
from kvwatch.daemon.engines.kind import SCRIPT, EngineKind

KIND = EngineKind(
    name="tgi",
    rules=(
        EngineRule(engine="tgi", comm=r"^text-generation"),
        EngineRule(engine="tgi", cmdline=SCRIPT + r"text-generation-(router|server|launcher)\b"),
    ),
    components=(
        (r"text-generation-router", "router"),
        (r"text-generation-server", "shard"),
        (r"text-generation-launcher", "launcher"),
    ),
)
