"""The KV loss ledger: per engine, what each tier lost, in blocks and bytes, and why.

Every cause is backed by evidence kvwatch holds itself (docs/architecture.md, "KV loss
ledger"):

* ``evicted``: the engine removed blocks (KV event stream, per medium) while it was not
  preempting; for a disk tier, the engine deleted or truncated its files (page cache of
  those files dropped by policy, kernel tracepoint).
* ``preempted``: GPU blocks the engine removed while its preemption counter was rising
  (engine /metrics, within ``preempt_window`` seconds): the pool evicting to make room for
  requests it had to preempt.
* ``offload_dropped`` (tier ``cpu``): GPU blocks removed that never reached the stream's
  lower tier although the engine was offloading (that tier had stored blocks).
* ``reclaim`` (tier ``disk``): the kernel reclaimed page cache of a KV-tier file.
* ``cleared``: blocks resident when the engine announced AllBlocksCleared (reset, sleep).
* ``oom``: blocks resident in each medium when the kernel OOM-killed a process of the engine.

Where the stream tells tenants apart (``tenants.py``), each GPU and CPU row is also kept per
tenant: the blocks of each tenant's that the row lost, by the same rules.

Bytes need a block's size. It comes from config (``engines.kv_block_bytes``) or is learnt
from the engine: the bytes it says it copied to its CPU tier, against the CPU blocks the
stream announced (``BlockBytes``). Until it is known, blocks are kept unpriced and priced
once it is (so the byte counter only grows); a disk tier's losses are bytes from the start.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvwatch.daemon.model.engines import EngineSample, GroupTotals, LossTotal, MediumTotals, StreamStats

GPU = "GPU"
LOWER_TIER = "cpu"  # where a GPU block that was never offloaded should have gone
STABLE_SCRAPES = 5  # changes of the offload counter that left its common divisor alone
MIN_DIVISOR = 1024  # a smaller common divisor is no block size
FALLBACK_SCRAPES = 20  # scrapes without a believed divisor before the ratio is used
MIN_LEARN_BLOCKS = 64  # CPU blocks announced, for the ratio
K_TOLERANCE = 0.02  # how near an integer the stream's blocks per divisor must be


MAX_COUNT = float(2**63)  # the largest count the ledger takes, as at the /metrics parse (engines/exposition.py)


def tier_of(medium: str) -> str:
    return medium.lower()


def _count(value: float | None) -> float | None:
    """A cumulative count the ledger can take: finite, not negative, an int64's at most. The
    /metrics parse drops any other already; the ledger holds on its own, so that one engine's
    bad number never raises in the tick's loop over every engine's ledger."""
    if value is None or not (0.0 <= value <= MAX_COUNT):  # NaN fails the comparison too
        return None
    return value


class BlockBytes:
    """One engine's bytes per KV block: configured, or learnt from its offload counter.

    The engine copies whole blocks, so its cumulative offload bytes are always a multiple of
    the block size, and their greatest common divisor over the scrapes falls to the block size
    as soon as two of the counts are coprime. It does not when every transfer is a multiple of
    k blocks (prompts of one length, as a fixed-length benchmark sends: 56 blocks each): the
    divisor is then k blocks. The CPU blocks the stream announced tell k: the bytes over the
    divisor count transfers, the stream counts blocks, and their ratio settles on the integer k
    as the totals grow (the counter counts copies finished, the stream blocks scheduled: early
    on, and through a pressure phase, the stream runs ahead, up to 4 x on the real vLLM run,
    and the ratio is no integer). A divisor is believed once its k has been the same integer,
    within K_TOLERANCE, for ``STABLE_SCRAPES`` changes of the counter (k 1 the common case);
    what is believed stays. Without a usable divisor (under ``MIN_DIVISOR``) the ratio of bytes
    to CPU blocks is the fallback, after ``FALLBACK_SCRAPES`` scrapes.
    """

    def __init__(self, configured: int = 0) -> None:
        self.value: int | None = configured or None
        self.source = "config" if configured else ""
        self._origin: tuple[float, int] | None = None
        self._at = -1.0
        self._last_bytes = -1.0
        self._gcd = 0
        self._candidate = 0
        self._stable = 0
        self._scrapes = 0

    def observe(self, at: float, offload_store_bytes: float | None, cpu_blocks_stored: int) -> None:
        offload_store_bytes = _count(offload_store_bytes)
        if self.source in ("config", "offload") or offload_store_bytes is None or at <= self._at:
            return
        self._at = at
        self._scrapes += 1
        if self._origin is None:
            self._origin = (offload_store_bytes, cpu_blocks_stored)
        nbytes, blocks = offload_store_bytes - self._origin[0], cpu_blocks_stored - self._origin[1]
        clear = 0
        if offload_store_bytes != self._last_bytes:
            self._last_bytes = offload_store_bytes
            g = math.gcd(self._gcd, int(offload_store_bytes))
            clear = self._per_block(g, nbytes, blocks)
            if g != self._gcd or (clear and clear != self._candidate):
                self._gcd, self._candidate, self._stable = g, clear, 0
            else:  # the divisor unchanged, and no other size named (unclear contradicts nothing)
                self._stable += 1
        if clear and clear == self._candidate and self._stable >= STABLE_SCRAPES:
            self.value, self.source = self._candidate, "offload"
            return
        if self._gcd < MIN_DIVISOR and self._scrapes >= FALLBACK_SCRAPES and blocks >= MIN_LEARN_BLOCKS and nbytes > 0:
            self.value, self.source = round(nbytes / blocks), "offload_ratio"

    @staticmethod
    def _per_block(g: int, nbytes: float, blocks: int) -> int:
        """The divisor over the k the stream says it spans; 0 while that is unclear."""
        if g < MIN_DIVISOR:
            return 0
        if blocks < MIN_LEARN_BLOCKS or nbytes <= 0:
            return g
        est = blocks * g / nbytes
        k = max(round(est), 1)
        if k == 1:
            return g  # one block per divisor, the stream maybe running ahead of the copies
        if abs(est / k - 1) > K_TOLERANCE:
            return 0  # the stream far ahead, or not settled on a whole k yet
        return g // k if g % k == 0 and g // k >= MIN_DIVISOR else 0


@dataclass(slots=True)
class _Row:
    blocks: int = 0
    bytes: float = 0.0
    unpriced: int = 0  # blocks lost before their size was known


class EngineLedger:
    """One engine process's losses, from cumulative evidence turned into deltas each tick."""

    def __init__(self, configured_block_bytes: int = 0) -> None:
        self.block_bytes = BlockBytes(configured_block_bytes)
        self.rows: dict[tuple[str, str], _Row] = {}
        self.tenant_rows: dict[tuple[str, str, str], _Row] = {}  # (tenant, tier, cause): a share of rows
        self._seen: dict[tuple[object, ...], float] = {}  # (source, part..., field) -> last value

    def _delta(self, key: tuple[object, ...], value: float) -> float:
        """What a cumulative count grew by since it was last seen; a value that is no count
        (``_count``) is skipped, the last good one kept."""
        checked = _count(value)
        if checked is None:
            return 0.0
        last = self._seen.get(key)
        self._seen[key] = checked
        return max(checked - last, 0.0) if last is not None else checked

    def add_blocks(self, tier: str, cause: str, blocks: int, tenant: str | None = None) -> None:
        """``tenant``: the share of a row that is one tenant's (the row itself counted apart)."""
        if blocks <= 0:
            return
        row = self.rows.setdefault((tier, cause), _Row()) if tenant is None else self._tenant_row(tenant, tier, cause)
        row.blocks += blocks
        if self.block_bytes.value is None:
            row.unpriced += blocks
        else:
            row.bytes += blocks * self.block_bytes.value

    def _tenant_row(self, tenant: str, tier: str, cause: str) -> _Row:
        return self.tenant_rows.setdefault((tenant, tier, cause), _Row())

    def add_bytes(self, tier: str, cause: str, nbytes: float) -> None:
        if nbytes > 0:
            self.rows.setdefault((tier, cause), _Row()).bytes += nbytes

    def streams(self, streams: Sequence[StreamStats], sample: EngineSample | None, preempting: bool) -> None:
        """The streams' blocks removed, dropped and cleared since the last tick: physical blocks,
        every KV cache group's (a hybrid model's sliding-window blocks are memory too)."""
        cpu_stored = sum(g.totals.stored for s in streams for g in s.groups if tier_of(g.medium) == LOWER_TIER)
        if sample is not None:
            self.block_bytes.observe(sample.at, sample.offload_store_bytes, cpu_stored)
        self._price()
        for s in streams:
            for g in s.groups:
                tier, m, key = tier_of(g.medium), g.totals, (s.spec, g.medium, g.group)
                cause = "preempted" if preempting and g.medium == GPU else "evicted"
                self._removals(key, tier, cause, m)
                for name, t in g.tenants.items():
                    self._removals((*key, name), tier, cause, t, name)

    def _removals(
        self, key: tuple[object, ...], tier: str, cause: str, m: MediumTotals, tenant: str | None = None
    ) -> None:
        """What a group (or one tenant's share of it) lost since the last tick."""
        self.add_blocks(tier, cause, int(self._delta((*key, "removed"), m.removed)), tenant)
        self.add_blocks(LOWER_TIER, "offload_dropped", int(self._delta((*key, "dropped"), m.dropped)), tenant)
        self.add_blocks(tier, "cleared", int(self._delta((*key, "cleared"), m.cleared)), tenant)

    def tier(self, tier_id: int, reclaim_bytes: float, policy_bytes: float) -> None:
        """A disk tier's page cache, dropped by reclaim or by the engine deleting files."""
        self.add_bytes("disk", "reclaim", self._delta((tier_id, "disk", "reclaim"), reclaim_bytes))
        self.add_bytes("disk", "evicted", self._delta((tier_id, "disk", "policy"), policy_bytes))

    def oom(self, groups: Iterable[GroupTotals]) -> None:
        """Every group's resident blocks (summed over the engine's streams by the caller or not)."""
        for g in groups:
            self.add_blocks(tier_of(g.medium), "oom", g.totals.resident)
            for name, t in g.tenants.items():
                self.add_blocks(tier_of(g.medium), "oom", t.resident, name)

    def _price(self) -> None:
        size = self.block_bytes.value
        if size is None:
            return
        for row in (*self.rows.values(), *self.tenant_rows.values()):
            if row.unpriced:
                row.bytes += row.unpriced * size
                row.unpriced = 0

    def totals(self) -> dict[tuple[str, str], LossTotal]:
        return {k: self._total(r) for k, r in sorted(self.rows.items())}

    def tenant_totals(self) -> dict[tuple[str, str, str], LossTotal]:
        """By (tenant, tier, cause): the GPU and CPU rows' shares, where the stream has tenants."""
        return {k: self._total(r) for k, r in sorted(self.tenant_rows.items())}

    def _total(self, r: _Row) -> LossTotal:
        priced = self.block_bytes.value is not None
        return LossTotal(blocks=r.blocks, bytes=r.bytes if priced or not r.unpriced else None)


class LossLedger:
    """Every engine's ledger, by the owning process's key. A process that is gone keeps its
    ledger for ``linger_seconds`` (with its last labels), so that the losses of its end (an OOM
    kill) stay on /metrics long enough for a scrape to see them."""

    def __init__(self, configured_block_bytes: int = 0, linger_seconds: float = 300.0) -> None:
        self.configured = configured_block_bytes
        self.linger = linger_seconds
        self.engines: dict[str, EngineLedger] = {}
        self.departed: dict[str, tuple[float, Mapping[str, str], EngineLedger]] = {}

    def of(self, key: str) -> EngineLedger:
        led = self.engines.get(key)
        if led is None:
            led = self.engines[key] = EngineLedger(self.configured)
        return led

    def depart(self, key: str, labels: Mapping[str, str], now: float) -> None:
        led = self.engines.pop(key, None)
        if led is not None and led.rows:
            self.departed[key] = (now, dict(labels), led)

    def rows(self, key: str) -> dict[tuple[str, str], LossTotal]:
        led = self.engines.get(key)
        return led.totals() if led is not None else {}

    def tenant_rows(self, key: str) -> dict[tuple[str, str, str], LossTotal]:
        led = self.engines.get(key)
        return led.tenant_totals() if led is not None else {}

    def block_bytes(self, key: str) -> tuple[int, str] | None:
        """The engine's block size and where it came from (config / offload / offload_ratio)."""
        led = self.engines.get(key)
        if led is None or led.block_bytes.value is None:
            return None
        return led.block_bytes.value, led.block_bytes.source

    def exact_block_bytes(self, key: str) -> float:
        """The block size, when configured or learnt from a divisor (0 otherwise): what may price
        the audit's blocks (a size from the ratio of bytes to blocks is no evidence)."""
        size = self.block_bytes(key)
        return float(size[0]) if size is not None and size[1] in ("config", "offload") else 0.0

    def departed_rows(self) -> tuple[tuple[Mapping[str, str], dict[tuple[str, str], LossTotal]], ...]:
        return tuple((labels, led.totals()) for _, labels, led in self.departed.values())

    def expire(self, now: float) -> None:
        for key in [k for k, (at, _, _) in self.departed.items() if now - at >= self.linger]:
            del self.departed[key]
