"""The KV metric-truth audit: an engine's own KV counters against evidence kvwatch holds itself.

Engines have shipped KV counters that were wrong (a hit rate stuck at 1, recomputed tokens
counted as hits, an onboard counter stuck at 0), and nothing on the engine's side can tell.
Where kvwatch derives the same quantity independently, each pair below is compared over
disjoint windows of ``window_seconds`` (docs/architecture.md, "KV metric-truth audit"):

* ``offload_store_copies``: bytes the engine says it offloaded to its CPU tier (vLLM
  ``kv_offload_store_bytes``) against the device-to-host bytes kvwatch's copy probes saw in
  the engine's processes (the offload worker copies through ``cuMemcpyBatchAsync``). Equal
  within the tolerance; the probes also see the engine's other copies, which are small beside
  an offload stream, and a one-off (sleep mode moving the weights) lasts one window.
* ``offload_load_copies``: the same for loads back to the GPU, judged one way only: an engine
  may load through a GPU kernel reading pinned memory, which no copy probe sees, so the probes
  seeing fewer bytes is no divergence; the probes seeing more is (an engine reporting no loads
  while it loads).
* ``offload_store_blocks``: the engine's offload bytes against the CPU-tier blocks its own KV
  event stream announced, times the block size (configured, or the greatest common divisor of
  those bytes: a count missing whole blocks leaves the divisor alone). Equal.
* ``resident_blocks``: blocks the stream holds resident on the GPU against the pool the engine
  says it has (vLLM ``cache_config_info`` ``num_gpu_blocks``): every cached block takes a slot,
  so the stream can never hold more. A bound, not an equality: the engine's KV usage counts
  blocks held by running requests, partial ones included, and not the free blocks kept for
  their prefix, so usage x pool and the stream's resident blocks differ by design.

Not derivable, so not audited: prefix-cache hits (a lookup announces nothing on the stream)
and preemptions (a preempted request's blocks are freed, not removed, and nothing is
announced). A window in which kvwatch's own evidence was incomplete (stream batches lost,
copy probes not attached or shed) is not judged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvwatch.daemon.config import MetricDivergenceConfig
from kvwatch.daemon.engines.kinds import vllm
from kvwatch.daemon.model.cuda import TREE, CopyCounts
from kvwatch.daemon.model.engine_scrape import EngineState
from kvwatch.daemon.model.engines import AuditRow, EngineSample
from kvwatch.daemon.model.history import History
from kvwatch.daemon.model.kv_counts import STREAM, KVState, MediumCounts, StreamEvents

# the engine's side, as the rows name it: vLLM's metrics (engines/kinds/vllm.py)
STORE_BYTES, LOAD_BYTES = vllm.OFFLOAD_STORE.removesuffix("_total"), vllm.OFFLOAD_LOAD.removesuffix("_total")
POOL = f"{vllm.CACHE_CONFIG} num_gpu_blocks"
EQUAL, AT_MOST = "equal", "kvwatch_at_most"  # kvwatch_at_most: only kvwatch exceeding the engine diverges
COPY_PROBES = "copy_probes"  # evidence: the engine's processes have their copy probes attached
BLOCK_BYTES = "block_bytes"  # evidence: bytes of one block, where configured or learnt from a divisor


@dataclass(frozen=True, slots=True)
class AuditInputs:
    """One engine process's readings this tick: kvwatch's evidence and the engine's last scrape."""

    copies: History[CopyCounts]  # the engine tree's copies, summed under TREE
    kv: History[MediumCounts]  # its KV event streams, by medium
    kv_events: History[StreamEvents]
    kv_state: KVState
    engine: EngineState

    def lost(self) -> float:
        return self.kv_events.last(STREAM).batches_lost


Reading = Callable[[AuditInputs, float], float | None]  # kvwatch's cumulative count at a time (None: unknown)


def _copies(get: Callable[[CopyCounts], float]) -> Reading:
    def read(x: AuditInputs, t: float) -> float | None:
        c = x.copies.at(TREE, t)
        return get(c) if c is not None else None

    return read


def _cpu_stored(x: AuditInputs, t: float) -> float | None:
    c = x.kv.at("CPU", t)
    return c.physical_stored if c is not None else None


def _resident_gpu(x: AuditInputs, _t: float) -> float | None:
    return x.kv_state.resident_gpu if x.kv else None


@dataclass(frozen=True, slots=True)
class Pair:
    name: str
    unit: str
    relation: str
    engine: Callable[[EngineSample], float | None]  # the engine's counter (a gauge pair: read fresh only)
    engine_source: str
    kvwatch: Reading
    kvwatch_source: str
    requires: tuple[str, ...] = ()  # evidence that must be > 0 through the window (``Evidence``)
    scale: str = ""  # evidence multiplying kvwatch's count (a block count into bytes)
    stream: bool = False  # kvwatch's side is the KV event stream: no batch lost in the window
    gauge: bool = False


PAIRS = (
    Pair(
        "offload_store_copies",
        "bytes",
        EQUAL,
        lambda x: x.offload_store_bytes,
        STORE_BYTES,
        _copies(lambda c: c.d2h_bytes),
        "device-to-host copy probes",
        requires=(COPY_PROBES,),
    ),
    Pair(
        "offload_load_copies",
        "bytes",
        AT_MOST,
        lambda x: x.offload_load_bytes,
        LOAD_BYTES,
        _copies(lambda c: c.h2d_bytes),
        "host-to-device copy probes",
        requires=(COPY_PROBES,),
    ),
    Pair(
        "offload_store_blocks",
        "bytes",
        EQUAL,
        lambda x: x.offload_store_bytes,
        STORE_BYTES,
        _cpu_stored,
        "KV event stream CPU blocks stored (every KV cache group) x block size",
        requires=(BLOCK_BYTES,),
        scale=BLOCK_BYTES,
        stream=True,
    ),
    Pair(
        "resident_blocks",
        "blocks",
        AT_MOST,
        lambda x: x.pool_blocks,
        POOL,
        _resident_gpu,
        "KV event stream GPU blocks resident (every KV cache group)",
        stream=True,
        gauge=True,
    ),
)


@dataclass(frozen=True, slots=True)
class AuditSettings:
    window_seconds: float = 30.0
    tolerance: float = 0.10
    floor_bytes: float = 64 * 1024 * 1024


def audit_settings(c: MetricDivergenceConfig) -> AuditSettings:
    return AuditSettings(c.window_seconds, c.tolerance, c.floor_bytes)


def divergence(engine: float, kvwatch: float) -> float:
    top = max(engine, kvwatch)
    return (engine - kvwatch) / top if top > 0 else 0.0


def diverges(relation: str, engine: float, kvwatch: float, tolerance: float) -> bool:
    d = divergence(engine, kvwatch)
    return -d > tolerance if relation == AT_MOST else abs(d) > tolerance


@dataclass(slots=True)
class _Open:
    """A window being measured: where it began on each side."""

    t0: float
    engine0: float
    kvwatch0: float
    lost0: float
    scale: float


@dataclass(slots=True)
class _PairState:
    open: _Open | None = None
    windows: int = 0
    diverged: int = 0
    row: AuditRow | None = None


@dataclass(frozen=True, slots=True)
class Evidence:
    """What other steps of the tick hand the audit for one engine process, as values."""

    copy_probes: float = 0.0  # 1 while every process of the engine has its copy probes attached
    block_bytes: float = 0.0  # the ledger's block size, when configured or learnt from a divisor

    def get(self, name: str) -> float:
        return float(getattr(self, name))


class ProcessAudit:
    """One engine process's pairs: each new window judged once, its row kept until the next."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self._pairs: dict[str, _PairState] = {p.name: _PairState() for p in PAIRS}

    def update(self, x: AuditInputs, evidence: Evidence, now: float) -> tuple[AuditRow, ...]:
        engine = x.engine
        for pair in PAIRS:
            st = self._pairs[pair.name]
            if not all(evidence.get(e) > 0 for e in pair.requires):
                st.open = None  # evidence absent: the next window starts when it is back
                continue
            if engine.scrape is None:
                continue
            if pair.gauge:
                self._gauge_pair(pair, st, x, now)
            else:
                self._counter_pair(pair, st, x, engine.scrape, evidence.get(pair.scale) if pair.scale else 1.0)
        return tuple(st.row for st in self._pairs.values() if st.row is not None)

    def _counter_pair(self, pair: Pair, st: _PairState, x: AuditInputs, sample: EngineSample, scale: float) -> None:
        e1 = pair.engine(sample)
        if e1 is None:
            return
        t1 = sample.at  # the engine's newest scrape; kvwatch's side read at its time
        k1 = pair.kvwatch(x, t1)
        if k1 is None:
            return
        lost = x.lost() if pair.stream else 0.0
        o = st.open
        if o is None or e1 < o.engine0 or k1 < o.kvwatch0 or scale != o.scale or lost != o.lost0:
            st.open = _Open(t1, e1, k1, lost, scale)  # first sight, a restart, or evidence lost
            return
        if t1 - o.t0 < self.settings.window_seconds:
            return
        self._judge(pair, st, e1 - o.engine0, (k1 - o.kvwatch0) * scale, t1 - o.t0)
        st.open = _Open(t1, e1, k1, lost, scale)

    def _gauge_pair(self, pair: Pair, st: _PairState, x: AuditInputs, now: float) -> None:
        state = x.engine
        engine = pair.engine(state.scrape) if state.scrape is not None and state.fresh else None
        kvwatch = pair.kvwatch(x, now)
        if engine is None or kvwatch is None or engine <= 0:
            return
        lost = x.lost()
        o = st.open
        if o is None or lost != o.lost0:
            st.open = _Open(now, 0.0, 0.0, lost, 1.0)
            return
        if now - o.t0 < self.settings.window_seconds:
            return
        self._judge(pair, st, engine, kvwatch, now - o.t0)
        st.open = _Open(now, 0.0, 0.0, lost, 1.0)

    def _judge(self, pair: Pair, st: _PairState, engine: float, kvwatch: float, seconds: float) -> None:
        s = self.settings
        if not pair.gauge and max(engine, kvwatch) < s.floor_bytes:
            return  # too little moved to judge a ratio (every counter pair is in bytes)
        bad = diverges(pair.relation, engine, kvwatch, s.tolerance)
        st.windows += 1
        st.diverged += bad
        st.row = AuditRow(
            pair=pair.name,
            unit=pair.unit,
            engine_source=pair.engine_source,
            kvwatch_source=pair.kvwatch_source,
            engine=engine,
            kvwatch=kvwatch,
            divergence=divergence(engine, kvwatch),
            diverged=bad,
            window=st.windows,
            windows_diverged=st.diverged,
            window_seconds=seconds,
        )


class MetricAudit:
    """Every tapped engine process's audit, by process key; a gone process's is dropped."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self._procs: dict[str, ProcessAudit] = {}
        self.rows: dict[str, tuple[AuditRow, ...]] = {}

    def update(
        self, processes: Iterable[tuple[str, AuditInputs, Evidence]], now: float
    ) -> Mapping[str, tuple[AuditRow, ...]]:
        seen = set()
        for key, inputs, evidence in processes:
            seen.add(key)
            audit = self._procs.get(key)
            if audit is None:
                audit = self._procs[key] = ProcessAudit(self.settings)
            self.rows[key] = audit.update(inputs, evidence, now)
        for key in list(self._procs):
            if key not in seen:
                del self._procs[key]
                self.rows.pop(key, None)
        return self.rows
