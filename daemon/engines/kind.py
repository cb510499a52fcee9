"""What kvwatch knows of one inference engine, declared in one place: its module under
``kinds/`` (one per engine) fills an ``EngineKind``, and the mechanisms read every engine's from
``kinds.KINDS``: discovery (which processes, which component, the disaggregation role, the
environment kept), the command-line plan (``cmdline.py``), the metric names of its /metrics
(``exposition.py``), its tier counters (``tiers.py``) and latency histograms (``latency.py``),
and the directories of its disk KV tier (``families/kv_files.py``).

Adding an engine is adding its module and its line in ``kinds/__init__.py`` (and its page in
docs/engines.md); nothing else names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvwatch.daemon.config import EngineRule, EnginesConfig
from kvwatch.daemon.engines.planning import Planning
from kvwatch.daemon.model.engines import EnginePlan

# Command-line rules are anchored at the program (argv[0], or python -m MODULE): a shell whose
# arguments merely mention "vllm serve" is not an engine.
PY_M = r"^(\S*/)?python[0-9.]*(\s+-\S+)*\s+-m\s+"
# A console script (pip's ``vllm``, ``sglang``) runs through its shebang: the kernel makes the
# command line "/venv/bin/python3 /venv/bin/vllm serve ...", the interpreter first.
SCRIPT = r"^((\S*/)?python[0-9.]*(\s+-\S+)*\s+)?(\S*/)?"

SUM, RANK0 = "sum", "rank0"  # every rank counts its own share / every rank reports the same number

# A command-line plan: the process's flags, the taps configuration -> its plan (None: nothing to tap).
Plan = Callable[[Planning, Mapping[str, str], EnginesConfig], EnginePlan | None]
# The directories of a disk KV tier, from the process's environment, command line, and a reader
# of files inside its root (None where unreadable).
KVDirs = Callable[[Mapping[str, str], str, Callable[[str], str | None]], list[str]]


@dataclass(frozen=True, slots=True)
class TierRule:
    """One engine counter read as a (source, tier, quantity, unit) reading (``tiers.py``)."""

    source: str
    tier: str
    quantity: str
    unit: str
    name: str
    match: tuple[tuple[str, str], ...] = ()  # label filters
    ranks: str = SUM
    over: str = ""  # a ratio: divided by this sample (same filters)
    when: tuple[str, ...] = ()  # read only when one of these samples is present too
    unless: tuple[str, ...] = ()  # ... when none is (a newer name of the same number)


@dataclass(frozen=True, slots=True)
class LatencyRule:
    """One engine latency histogram read as a reading (``latency.py``)."""

    name: str  # the reading's name, one of LATENCY_NAMES
    histogram: str  # the engine's histogram; its samples are <histogram>_sum and <histogram>_count


@dataclass(frozen=True, slots=True)
class SampleNames:
    """The engine's sample names for each plain field of ``EngineSample``, in order of preference
    (counters as exposed, with ``_total``); gauges are read as the maximum over ranks, counters summed."""

    usage: tuple[str, ...] = ()  # KV pool in use, 0..1
    prefix_queries: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    generation_tokens: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    evicted_tokens: tuple[str, ...] = ()
    external_queries: tuple[str, ...] = ()
    external_hits: tuple[str, ...] = ()
    offload_store_bytes: tuple[str, ...] = ()
    offload_load_bytes: tuple[str, ...] = ()
    lmcache_evicted_keys: tuple[str, ...] = ()
    lmcache_hit_tokens: tuple[str, ...] = ()
    lmcache_requested_tokens: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: str  # the ``engine`` label
    rules: tuple[EngineRule, ...] = ()  # discovery: a process matching one is this engine's
    components: tuple[tuple[str, str], ...] = ()  # (regex on title or command line, component)
    late_components: tuple[tuple[str, str], ...] = ()  # ... tried after every engine's components
    roles: tuple[tuple[str, Mapping[str, str]], ...] = ()  # (regex with one group, group -> role)
    environ: tuple[str, ...] = ()  # environment keys read from its processes (nothing else is kept)
    plans: Mapping[str, Plan] = field(default_factory=dict)  # component -> its command-line plan
    any_process_plan: Plan | None = None  # a plan for any watched process whose flags are this engine's
    samples: SampleNames = SampleNames()
    tiers: tuple[TierRule, ...] = ()
    latencies: tuple[LatencyRule, ...] = ()
    kv_tier: tuple[str, KVDirs] | None = None  # (tier source, its directories)
