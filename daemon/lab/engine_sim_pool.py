"""The simulated vLLM's KV cache: a prefix-cached GPU block pool, an offload CPU tier, and the
scheduler that runs requests through them — with the event semantics of vLLM 0.26.0.

What it reproduces, because kvwatch's counts and detectors depend on it:

* GPU pool (vLLM's ``BlockPool``): blocks held by running requests beside free blocks;
  a freed block keeps its hash and joins the tail of the free queue (still a prefix-cache
  hit); a new allocation takes an uncached free block, else evicts the head of the queue —
  one ``BlockRemoved`` per hash. Full blocks are announced when computed, prompt and
  generated alike, one ``BlockStored`` per call. A lookup hits at most ``tokens - 1``
  tokens (the last one is always computed). Preemption frees the blocks, still cached,
  with no event. ``reset`` is one ``AllBlocksCleared`` and only succeeds when nothing is
  held; queued events go out with the next step that has requests.
* CPU tier (vLLM's OffloadingConnector, blocks_per_chunk 1): prompt blocks computed on
  the GPU are stored one step later (the copy completes), announced as placeholders (one
  hash, no tokens, ``block_size`` 0); making room evicts least-recently-used blocks, one
  grouped ``BlockRemoved``. Lookups of what the GPU missed count as external queries and
  hits; the bytes copied each way are counted as vLLM's offload counters count them.
* Tenants: a request's ``cache_salt`` goes into its first block's hash and extra keys, a LoRA
  adapter's name into every block's (vLLM's ``generate_block_hash_extra_keys``); blocks of two
  salts never share a hash.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from kvwatch.daemon.lab.wire_encode import cleared, removed, stored

BLOCK = 16
_MASK = (1 << 64) - 1
Tenancy = tuple[str | None, str | None]  # a request's (cache_salt, LoRA adapter)


@dataclass(slots=True)
class PoolStats:
    queries: int = 0  # tokens looked up in the GPU prefix cache
    hits: int = 0
    ext_queries: int = 0  # tokens asked of the CPU tier (what the GPU missed)
    ext_hits: int = 0
    stored: int = 0  # GPU blocks announced
    removed: int = 0
    stored_cpu: int = 0
    removed_cpu: int = 0
    store_bytes: int = 0  # GPU -> CPU
    load_bytes: int = 0  # CPU -> GPU
    preemptions: int = 0
    cleared: int = 0
    generated: int = 0  # tokens decoded


def chain_hashes(
    tokens: list[int], seed: int, start: int = 0, parent: int | None = None, keys: Tenancy = (None, None)
) -> list[int]:
    """vLLM-style block hashes: each full block's hash covers its tokens, its parent's hash and
    its extra keys (``keys``: the request's salt, first block only, and LoRA adapter)."""
    out: list[int] = []
    h = seed if parent is None else parent
    salt, lora = keys
    for i in range(start, len(tokens) // BLOCK):
        h = hash((h, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), lora, salt if i == 0 else None)) & _MASK
        out.append(h)
    return out


def extra_keys(n: int, first: bool, keys: Tenancy) -> list[list[str] | None] | None:
    """The ``extra_keys`` of ``n`` blocks as vLLM 0.26 announces them: per block, the adapter's
    name, then the salt on a request's first block (``first``)."""
    salt, lora = keys
    if salt is None and lora is None:
        return None
    out: list[list[str] | None] = []
    for i in range(n):
        k = [x for x in (lora, salt if first and i == 0 else None) if x is not None]
        out.append(k or None)
    return out


class CpuTier:
    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.capacity = capacity
        self.block_bytes = block_bytes
        self.lru: OrderedDict[int, None] = OrderedDict()

    def lookup(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            self.lru.move_to_end(h)
            n += 1
        return n

    def store(self, hashes: list[int], stats: PoolStats) -> list[dict[str, Any]]:
        new = [h for h in dict.fromkeys(hashes) if h not in self.lru]
        for h in hashes:
            if h in self.lru:
                self.lru.move_to_end(h)
        events: list[dict[str, Any]] = []
        over = len(self.lru) + len(new) - self.capacity
        victims = [self.lru.popitem(last=False)[0] for _ in range(min(max(over, 0), len(self.lru)))]
        if victims:
            events.append(removed(victims, medium="CPU"))
            stats.removed_cpu += len(victims)
        for h in new[: self.capacity]:
            self.lru[h] = None
            events.append(stored([h], [], medium="CPU", block_size=0))
        stats.stored_cpu += min(len(new), self.capacity)
        stats.store_bytes += min(len(new), self.capacity) * self.block_bytes
        return events


@dataclass(slots=True)
class BlockPool:
    capacity: int
    free_cached: OrderedDict[int, None] = field(default_factory=OrderedDict)  # eviction order
    held: Counter[int] = field(default_factory=Counter)  # hash -> requests holding it
    held_blocks: int = 0  # every block held by a request, hashed or not
    ballast: int = 0  # blocks held by the scripted "running requests" (``set_active``)
    stats: PoolStats = field(default_factory=PoolStats)
    broken: bool = False  # lookups always miss: blocks are computed, stored and announced again

    @property
    def usage(self) -> float:
        return min(1.0, (self.held_blocks + self.ballast) / self.capacity)

    @property
    def free_uncached(self) -> int:
        return self.capacity - self.held_blocks - self.ballast - len(self.free_cached)

    def lookup(self, hashes: list[int]) -> int:
        if self.broken:
            return 0
        n = 0
        for h in hashes:
            if h not in self.free_cached and h not in self.held:
                break
            n += 1
        return n

    def take_hits(self, hashes: list[int]) -> None:
        for h in hashes:
            self.free_cached.pop(h, None)
            self.held[h] += 1
        self.held_blocks += len(hashes)

    def _evict(self, n: int, events: list[dict[str, Any]]) -> None:
        for _ in range(min(n, len(self.free_cached))):
            h, _ = self.free_cached.popitem(last=False)
            events.append(removed([h]))
            self.stats.removed += 1

    def allocate(self, n: int, events: list[dict[str, Any]]) -> bool:
        if n > self.free_uncached + len(self.free_cached):
            return False
        self._evict(n - max(self.free_uncached, 0), events)
        self.held_blocks += n
        return True

    def cache(
        self,
        hashes: list[int],
        tokens: list[int],
        parent: int | None,
        events: list[dict[str, Any]],
        keys: Tenancy = (None, None),
    ) -> None:
        """Blocks this request computed and now holds are full: their hashes join the cache."""
        if not hashes:
            return
        for h in hashes:
            self.held[h] += 1
        extra = extra_keys(len(hashes), parent is None, keys)
        events.append(stored(hashes, tokens, parent=parent, lora_name=keys[1], extra_keys=extra))
        self.stats.stored += len(hashes)

    def release(self, hashes: list[int], total_blocks: int) -> None:
        """A request ends or is preempted: its blocks are free, the hashed ones still cached
        (tail blocks first in the queue, as vLLM frees in reverse)."""
        for h in reversed(hashes):
            self.held[h] -= 1
            if self.held[h] <= 0:
                del self.held[h]
                self.free_cached[h] = None
        self.held_blocks -= total_blocks

    def set_ballast(self, blocks: int, events: list[dict[str, Any]]) -> None:
        self.ballast = max(0, min(blocks, self.capacity))
        self._evict(-self.free_uncached, events)

    def evict(self, n: int, events: list[dict[str, Any]]) -> None:
        self._evict(n, events)

    def reset(self, events: list[dict[str, Any]]) -> bool:
        if self.held_blocks:
            return False
        self.free_cached.clear()
        events.append(cleared())
        self.stats.cleared += 1
        return True


@dataclass(slots=True)
class SimRequest:
    prompt: list[int]
    max_tokens: int
    rid: int
    generated: int = 0
    hashes: list[int] = field(default_factory=list)  # hashed blocks held
    blocks: int = 0  # blocks held
    cached_tokens: int = 0
    preempted: int = 0
    finished: bool = False
    keys: Tenancy = (None, None)  # cache_salt, LoRA adapter

    @property
    def tokens(self) -> list[int]:
        return self.prompt + [(self.rid * 7919 + i) % 31997 + 3 for i in range(self.generated)]


class Scheduler:
    """Admits, decodes and preempts requests one step at a time (the caller holds the lock)."""

    def __init__(self, pool: BlockPool, cpu: CpuTier | None, max_num_seqs: int, seed: int | None = None) -> None:
        self.pool = pool
        self.cpu = cpu
        self.max_num_seqs = max_num_seqs
        self.seed = random.Random(seed).getrandbits(64)  # noqa: S311 - a hash seed (vLLM NONE_HASH), not a secret
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.queued: list[dict[str, Any]] = []  # events raised outside a step (reset)
        self._offload: list[int] = []
        self._rid = 0

    def new_request(self, prompt: list[int], max_tokens: int, keys: Tenancy = (None, None)) -> SimRequest:
        self._rid += 1
        return SimRequest(list(prompt), max(1, max_tokens), self._rid, keys=keys)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> tuple[list[dict[str, Any]], list[SimRequest]]:
        """One engine step: events to publish (GPU first, then the CPU tier's) and the
        requests that finished."""
        gpu: list[dict[str, Any]] = []
        done = self._decode(gpu)
        self._admit(gpu)
        cpu: list[dict[str, Any]] = []
        if self.cpu is not None and self._offload:
            cpu = self.cpu.store(self._offload, self.pool.stats)
            self._offload = []
        if not self.has_requests() and not done:
            return [], []
        events, self.queued = self.queued + gpu + cpu, []
        return events, done

    def run_now(self, prompt: list[int], keys: Tenancy = (None, None)) -> list[dict[str, Any]]:
        """The scripted engine: one request admitted and finished at once (prefill only)."""
        req = self.new_request(prompt, 1, keys)
        events: list[dict[str, Any]] = []
        if self._start(req, events):
            self._finish(req)
        cpu = self.cpu.store(self._offload, self.pool.stats) if self.cpu is not None and self._offload else []
        self._offload = []
        return events + cpu

    def _start(self, r: SimRequest, events: list[dict[str, Any]]) -> bool:
        st = self.pool.stats
        tokens = r.tokens
        hashes = chain_hashes(tokens, self.seed, keys=r.keys)
        cap = (len(tokens) - 1) // BLOCK
        hit = min(self.pool.lookup(hashes), cap)
        need = -(-len(tokens) // BLOCK) - hit
        if not r.preempted:  # vLLM exports the lookups of requests never preempted
            st.queries += len(tokens)
            st.hits += hit * BLOCK
        ext = 0
        if self.cpu is not None:
            ext = min(self.cpu.lookup(hashes[hit:]), cap - hit)
            if not r.preempted:
                st.ext_queries += len(tokens) - hit * BLOCK
                st.ext_hits += ext * BLOCK
        if not self.pool.allocate(need, events):
            return False
        st.load_bytes += ext * (self.cpu.block_bytes if self.cpu else 0)
        self.pool.take_hits(hashes[:hit])
        new = hashes[hit:]
        parent = hashes[hit - 1] if hit else None
        self.pool.cache(new, tokens[hit * BLOCK : len(hashes) * BLOCK], parent, events, r.keys)
        prompt_blocks = len(r.prompt) // BLOCK
        self._offload += new[: max(0, prompt_blocks - hit)]  # only prompt blocks are offloaded
        r.hashes, r.blocks = hashes, need + hit
        if not r.preempted:
            r.cached_tokens = (hit + ext) * BLOCK
        return True

    def _admit(self, events: list[dict[str, Any]]) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self._start(r, events):
                break
            self.waiting.popleft()
            self.running.append(r)

    def _decode(self, events: list[dict[str, Any]]) -> list[SimRequest]:
        done: list[SimRequest] = []
        for r in list(self.running):
            if r not in self.running:  # preempted to make room for an earlier one
                continue
            r.generated += 1
            self.pool.stats.generated += 1
            n = len(r.prompt) + r.generated
            if n % BLOCK == 0:  # a generated block filled up: cached and announced
                parent = r.hashes[-1] if r.hashes else None
                h = chain_hashes(r.tokens, self.seed, start=n // BLOCK - 1, parent=parent, keys=r.keys)
                self.pool.cache(h, r.tokens[-BLOCK:], parent, events, r.keys)
                r.hashes += h
            if r.generated >= r.max_tokens:
                self.running.remove(r)
                self._finish(r)
                done.append(r)
            elif n % BLOCK == 0 and not self._grow(r, events):
                continue
        return done

    def _grow(self, r: SimRequest, events: list[dict[str, Any]]) -> bool:
        """The next token needs a new block: preempt from the back until one is free."""
        while not self.pool.allocate(1, events):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        r.blocks += 1
        return True

    def _preempt(self, r: SimRequest) -> None:
        self.running.remove(r)
        self.pool.release(r.hashes, r.blocks)
        r.hashes, r.blocks = [], 0
        r.preempted += 1
        self.pool.stats.preemptions += 1
        self.waiting.appendleft(r)

    def _finish(self, r: SimRequest) -> None:
        self.pool.release(r.hashes, r.blocks)
        r.hashes, r.blocks = [], 0
        r.finished = True

    def abort_all(self) -> list[SimRequest]:
        out = list(self.running) + list(self.waiting)
        for r in self.running:
            self.pool.release(r.hashes, r.blocks)
            r.hashes, r.blocks = [], 0
        self.running.clear()
        self.waiting.clear()
        return out

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache(): the event waits for the next step with requests."""
        events: list[dict[str, Any]] = []
        ok = self.pool.reset(events)
        self.queued += events
        return ok
