"""What one KV event stream's batches say, counted: the decoding and the block accounting of a
stream, apart from its sockets (``kv_events.py`` owns those and the sequence).

Per medium and KV cache group (``groups.py``): blocks stored, removed, removed young, regretted,
stored again while held, announced, dropped on the way to the tier below (``blocks.py``). Per
stream: batches, events, resets, blocks stored with extra keys, and every malformed message or
event counted by kind. Offline users (the replay tools, the benchmarks) feed payloads straight in.

A BlockStored of the GPU pool without a parent whose last block the group still holds is not a
store: it is vLLM announcing the blocks of a prefix-cache hit (a request asked for
``kv_cache_report_mode="full"``; ``emit_cached_block_events``), counted as ``announced`` and
changing nothing. Its blocks are the request's prefix from the first one on (a sliding-window
group's include blocks it no longer holds), and a group can only have served the hit if it holds
the prefix's last block: a real first store (no hit) of a block already held would need a
request that missed what the group holds.

A store's tenant (``tenants.py``): a request's first block names it (its salt, its adapter); a
block after a parent is its parent's tenant, looked up where the parent is held (the medium's
reference group); a tier's copy of a GPU block is that block's tenant. Until a stream names a
tenant, every block is the default tenant's and nothing is looked up.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.engines.groups import MediumGroups, group_key
from kvwatch.daemon.engines.hashmem import fingerprint
from kvwatch.daemon.engines.memory_budget import MemoryBudget, StreamPlan
from kvwatch.daemon.engines.tenants import DEFAULT, UNKNOWN, TenantBook, TenantNamer
from kvwatch.daemon.engines.wire import CLEARED, REMOVED, STORED, Batch, Decoder, Event, Stored, WireError
from kvwatch.daemon.model.engines import MediumTotals, StreamSpec, StreamStats

BLOCK_EVENTS = (*STORED, *REMOVED)
LEARN_BATCHES = 64
DEFAULT_MEDIUM = "GPU"  # events without a medium (vLLM ≤ 0.10) came from the GPU block pool
MAX_MEDIA = 8  # named media; the rest, and names too long or not printable, count as "other"
MAX_MEDIUM_CHARS = 32


class StreamCounts:
    """``budget``: the node's, which the hub's streams share (``memory_budget.py``); a stream
    counted on its own has one to itself."""

    def __init__(
        self,
        bounds: tuple[int, int],
        thrash_seconds: float,
        namer: TenantNamer | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.bounds = bounds  # per medium and group: store times, removals remembered
        self.thrash_seconds = thrash_seconds
        self.decoder = Decoder()
        self.book = TenantBook(namer or TenantNamer((), b""))
        self.media: dict[str, MediumGroups] = {}
        self.extras: dict[str, int] = {}  # blocks stored with extra keys, by key: lora, cache_salt, ...
        self.batches = self.events = self.cleared = 0
        self.errors: dict[str, int] = {}
        self.last_ts = 0.0
        self._lowers: dict[int, list[MediumBlocks]] = {}  # per GPU group, within one batch
        self._learning = LEARN_BATCHES  # batches left in which the groups a batch names are read first
        self._named = 0  # media and groups known when learning last stopped
        self.plan = StreamPlan(bounds, budget or MemoryBudget(), self.media)

    def error(self, kind: str, n: int = 1) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + n

    def close(self) -> None:
        """The stream is gone: its share of the node's budget goes back to the others."""
        self.plan.close()

    def restart(self) -> None:
        """A new publisher (the engine restarted): its hashes need not mean what they meant."""
        for m in self.media.values():
            m.clear()

    def stats(self, spec: StreamSpec, **stream: object) -> StreamStats:
        names = self.book.names if self.book.active else None
        return StreamStats(
            spec=spec,
            batches=self.batches,
            events=self.events,
            media={k: m.logical() for k, m in self.media.items()},
            groups=tuple(g for k, m in self.media.items() for g in m.totals(k, names)),
            tenants=self.tenants(),
            tenants_overflow=self.book.overflow,
            localities={k: m.locality for k, m in self.media.items() if m.locality},
            cleared=self.cleared,
            decode_errors=dict(self.errors),
            last_batch_ts=self.last_ts,
            tracked_blocks=sum(m.remembered for m in self.media.values()),
            regret_horizon={k: m.regret_horizon(self.last_ts) for k, m in self.media.items()} if self.bounds[1] else {},
            extras=dict(self.extras),
            **stream,  # type: ignore[arg-type]
        )

    def tenants(self) -> dict[str, dict[str, MediumTotals]]:
        """Per medium and tenant name, the logical counts; none until the stream names a tenant."""
        if not self.book.active:
            return {}
        names = self.book.names
        return {k: {names[t]: m for t, m in mg.logical_tenants().items()} for k, mg in self.media.items()}

    def ingest(self, payload: bytes | memoryview, *, newest: bool = True) -> None:
        """Count one batch, or the reason it counts for nothing. ``newest``: the stream's latest
        batch, whose time becomes the last batch time (a replayed batch is older; and the last
        batch's, not the greatest seen, so that one batch from the far future pins nothing)."""
        try:
            batch = self.decoder.decode(payload)
        except WireError as err:
            self.error(err.kind)
            return
        if batch.skipped:
            self.error("event", batch.skipped)
        if batch.undescribed:
            self.error("field", batch.undescribed)
        self._apply(batch)
        self.batches += 1
        self.events += len(batch.events)
        if newest:
            self.last_ts = batch.ts

    def _apply(self, batch: Batch) -> None:
        ts = batch.ts
        young_before = ts - self.thrash_seconds
        if self._learning:
            self._learn(batch.events)
        self._lowers.clear()  # a tier's first store of the batch before makes it a target
        for ev in batch.events:
            if isinstance(ev, STORED):
                self._store(ev, ts)
            elif isinstance(ev, REMOVED):
                mg = self._medium(ev.medium)
                idx = ev.group_idx
                mg.group(idx).remove(ev.block_hashes, ts, young_before, self._lower(ev.medium, mg, idx))
            elif isinstance(ev, CLEARED):
                self.cleared += 1
                self._settle(float("inf"))  # what waits is judged before the memories go
                for m in self.media.values():
                    m.drop_all()
        self._settle(ts)
        if not self._learning and self._count_named() != self._named:
            self._learning = LEARN_BATCHES  # a group (or medium) showed up late
        self.plan.check()  # nearing its part of the node's memory budget: ask again

    def _count_named(self) -> int:
        """Media and groups known: a change means the engine named one more."""
        return len(self.media) + sum(len(m.groups) for m in self.media.values())

    def _learn(self, events: Sequence[Event]) -> None:
        """The groups a batch names, known before any of its blocks count (their reference settled
        first); the tiers below the pool take its groups' kinds. An engine names its groups in
        its first batches (every request is cached in every group): once LEARN_BATCHES batches in
        a row taught nothing, batches are no longer read twice, until a group or kind shows up."""
        learnt = False
        groups = self._count_named()
        for ev in events:
            if isinstance(ev, BLOCK_EVENTS) and ev.group_idx is not None:
                mg = self._medium(ev.medium)
                mg.group(ev.group_idx)
                if isinstance(ev, STORED) and ev.kv_cache_spec_kind is not None:
                    window = ev.kv_cache_spec_sliding_window
                    learnt |= mg.learn(ev.group_idx, ev.kv_cache_spec_kind, window, ev.locality)
        if learnt:
            for m in self.media.values():
                m.choose()
        named = self._count_named()
        self._learning = LEARN_BATCHES if learnt or named != groups else self._learning - 1
        self._named = named

    def _store(self, ev: Stored, ts: float) -> None:
        mg = self._medium(ev.medium)
        blocks = mg.group(ev.group_idx)
        kind = ev.kv_cache_spec_kind
        late = kind is not None and not self._learning and mg.kinds.get(ev.group_idx or 0) != kind
        if (ev.locality is not None or late) and mg.learn(
            ev.group_idx, kind, ev.kv_cache_spec_sliding_window, ev.locality
        ):
            self._learning = LEARN_BATCHES  # a kind told late (or changed): read batches first again
        hashes = ev.block_hashes
        nil = not ev.has_parent
        if nil and hashes and (ev.medium or DEFAULT_MEDIUM) == DEFAULT_MEDIUM and blocks.holds(hashes[-1]):
            blocks.announce(len(hashes), ev.block_size)  # a prefix-cache hit announced again, not a store
            return
        tag = DEFAULT
        described = ev.lora_name is not None or ev.keys is not None
        if self.book.active or described:
            tag = self._tenant_of(ev, mg, nil)
        blocks.store(hashes, ts, ev.block_size, len(hashes) == 1 and not nil, tag)
        if described and blocks is mg.groups.get(mg.reference):
            self._extras(ev)

    def _tenant_of(self, ev: Stored, mg: MediumGroups, nil: bool) -> int:
        lora = ev.lora_name
        gpu = (ev.medium or DEFAULT_MEDIUM) == DEFAULT_MEDIUM
        if gpu and nil:  # a request's first block
            salt = ev.keys.first.salt if ev.keys is not None else None
            return self.book.tag(salt, lora) if salt is not None or lora is not None else DEFAULT
        if not self.book.active and lora is None:
            return DEFAULT
        tag = None
        if not gpu:  # a tier's copy of a GPU block: that block's tenant
            pool = self.media.get(DEFAULT_MEDIUM)
            if pool is not None and ev.block_hashes:
                tag = pool.group(pool.reference).peek_tag(fingerprint(ev.block_hashes[0]))
        if tag is None and ev.parent is not None:
            tag = mg.group(mg.reference).peek_tag(fingerprint(ev.parent))
        if tag is not None:
            return tag
        return self.book.tag(None, lora) if lora is not None else UNKNOWN

    def _extras(self, ev: Stored) -> None:
        """Blocks stored with a LoRA adapter, a cache salt (a request's first block), multimodal
        inputs or prompt embeddings, on the medium's reference group (once per block range)."""
        n = self.extras
        if ev.lora_name is not None:
            n["lora"] = n.get("lora", 0) + len(ev.block_hashes)
        k = ev.keys
        if k is not None:
            for key, blocks in (("cache_salt", k.salted), ("multimodal", k.multimodal), ("prompt_embeds", k.embeds)):
                if blocks:
                    n[key] = n.get(key, 0) + blocks

    def _settle(self, ts: float) -> None:
        gpu = self.media.get(DEFAULT_MEDIUM)
        if gpu is not None:
            for idx, g in gpu.groups.items():
                g.settle(ts, self._lower(DEFAULT_MEDIUM, gpu, idx))

    def _lower(self, name: str | None, mg: MediumGroups, idx: int | None) -> list[MediumBlocks]:
        """For a GPU removal in a group that holds whole prefixes: the same group of the stream's
        other tiers, where they have stored blocks (the offload targets the block should have
        reached). A window-bounded group's blocks are offloaded by window, if at all: not judged."""
        if (name or DEFAULT_MEDIUM) != DEFAULT_MEDIUM:
            return []
        key = group_key(idx)
        out = self._lowers.get(key)
        if out is None:
            out = self._lowers[key] = self._targets(mg, key)
        return out

    def _targets(self, mg: MediumGroups, key: int) -> list[MediumBlocks]:
        if not mg.is_full(key):
            return []
        out = []
        for k, m in self.media.items():
            g = m.groups.get(key) if k != DEFAULT_MEDIUM else None
            if g is not None and g.stored:
                out.append(g)
        return out

    def _medium(self, name: str | None) -> MediumGroups:
        key = name or DEFAULT_MEDIUM
        m = self.media.get(key)
        if m is None:
            if len(self.media) >= MAX_MEDIA or len(key) > MAX_MEDIUM_CHARS or not key.isprintable():
                key = "other"
            m = self.media.get(key)
            if m is None:
                like = self.media.get(DEFAULT_MEDIUM) if key != DEFAULT_MEDIUM else None
                m = self.media[key] = MediumGroups(self.bounds, like, self.plan)
                self.plan.apply()  # the stream's share split again, this medium included
        return m
