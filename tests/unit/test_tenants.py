"""Tenants in the KV event stream: names (configured, keyed hash, adapter), the node key, the
per-tenant counts of a stream exact against an independent count of the same events
(``tests/support/tenant_reference.py``), and the top-K fold that keeps counters monotonic."""

from __future__ import annotations

import gc
import hashlib
import stat
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvwatch.daemon.config import EnginesConfig, TenantRule
from kvwatch.daemon.config.base import ConfigError, parse
from kvwatch.daemon.engines.stream_counts import StreamCounts
from kvwatch.daemon.engines.tenants import MAX_TENANTS, TenantBook, TenantFold, TenantNamer, load_key
from kvwatch.daemon.lab import wire_encode as we
from kvwatch.daemon.lab.engine_sim_pool import BlockPool, CpuTier, Scheduler
from tests.support.tenant_reference import FIELDS, TenantReference

KEY = b"k" * 32
RULES = [TenantRule(name="team-a", salt="salt-of-a"), TenantRule(name="team-b", salt="salt-of-b")]
NAMES = {("salt-of-a", None): "team-a", ("salt-of-b", None): "team-b"}


def test_names_configured_hashed_or_adapter_and_never_the_salt() -> None:
    sha = hashlib.sha256(b"hidden").hexdigest()
    namer = TenantNamer([*RULES, TenantRule(name="team-c", salt_sha256=sha), TenantRule(name="ft", lora="sql")], KEY)
    assert namer.name("salt-of-a", None) == "team-a"
    assert namer.name("hidden", None) == "team-c"  # named by the salt's SHA-256, the salt not in config
    assert namer.name(None, "sql") == "ft" and namer.name(None, "chat") == "lora:chat"
    assert namer.name(None, None) == "default"
    unknown = namer.name("a-secret-salt", None)
    assert unknown.startswith("salt-") and len(unknown) == 13 and "secret" not in unknown
    assert TenantNamer([], KEY).name("a-secret-salt", None) == unknown  # the same key, the same name
    assert TenantNamer([], b"x" * 32).name("a-secret-salt", None) != unknown  # another node's key


def test_rules_are_checked_all_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse(
            EnginesConfig,
            {"tenants": [{"name": "x"}, {"name": "y", "salt": "s", "lora": "l"}, {"name": "bad name!", "lora": "q"}]},
        )
    text = str(err.value)
    assert text.count("exactly one of salt, salt_sha256 or lora") == 2 and "tenants.2.name" in text
    with pytest.raises(ConfigError, match="a second rule for the same lora"):
        parse(EnginesConfig, {"tenants": [{"name": "x", "lora": "l"}, {"name": "y", "lora": "l"}]})


def test_the_node_key_is_made_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / "tenant.key"
    key, problem = load_key(path)
    assert problem == "" and len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(path) == (key, "")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    key2, problem2 = load_key(blocked / "tenant.key")
    assert len(key2) == 32 and "cannot" in problem2


def test_a_stream_interns_a_bounded_number_of_tenants() -> None:
    book = TenantBook(TenantNamer([], KEY))
    tags = {book.tag(f"s{i}", None) for i in range(MAX_TENANTS + 10)}
    assert len(book.names) == MAX_TENANTS and book.overflow == 13 and 2 in tags  # 3 reserved names


@contextmanager
def retained() -> Iterator[list[int]]:
    """Bytes still allocated at the end of the block that were not at its start."""
    out: list[int] = []
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        yield out
        gc.collect()
        out.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()


def _salted(i: int, salt: str, lora: str | None = None) -> bytes:
    """A request's first block, with its cache salt: a batch as vLLM 0.33 sends it."""
    ev = we.stored([i], list(range(16)), extra_keys=[[salt]], lora_name=lora)
    return we.encode_batch(we.Layout.V0_33, float(i), [ev], 0)


def test_a_flood_of_distinct_large_salts_keeps_none_of_them() -> None:
    """An API client chooses the salt (as long as a message): the stream keeps a digest of it."""
    counts = StreamCounts((4096, 4096), 5.0, TenantNamer((), KEY))
    counts.ingest(_salted(0, "warm-up"))  # the book, its first name, the decoder's shapes
    n = 32
    with retained() as grew:
        for i in range(1, n + 1):
            counts.ingest(_salted(i, f"{i:08d}" + "x" * (1 << 20)))  # 1 MiB each, each a new tenant
    assert len(counts.book.names) == 3 + 1 + n  # every salt named
    assert grew[0] < 256 << 10, f"{grew[0] / 2**20:.1f} MiB kept after {n} salts of 1 MiB"


def test_the_book_tells_every_salt_and_adapter_pair_apart() -> None:
    """Pairs are remembered by digest: no two pairs share one (a salt, an adapter, both, an
    empty string, the same characters split differently), and a pair seen again keeps its tag."""
    named: list[tuple[str | None, str | None]] = []

    class Counting(TenantNamer):
        def name(self, salt: str | None, lora: str | None) -> str:
            named.append((salt, lora))
            return super().name(salt, lora)

    book = TenantBook(Counting([], KEY))
    pairs = [("ab", "c"), ("a", "bc"), ("abc", None), (None, "abc"), ("", None), (None, ""), ("", "")]
    tags = [book.tag(s, lo) for s, lo in pairs]
    assert [book.names[t] for t in tags] == [TenantNamer([], KEY).name(s, lo) for s, lo in pairs]
    assert [book.tag(s, lo) for s, lo in pairs] == tags and named == pairs  # named once each


# --- per-tenant counts, exact against an independent count ------------------------------------------


def _noisy_neighbour(sched: Scheduler, steps: int) -> list[list[dict[str, Any]]]:
    """Tenant A reuses 12 hot prefixes; from step 20 tenant B floods unique prompts; an adapter's
    requests and unsalted ones run throughout. One batch of events per step."""
    batches = []
    n = 0
    for step in range(steps):
        events: list[dict[str, Any]] = []
        for i in range(3):
            events += sched.run_now(_prompt(100 + (step * 3 + i) % 12, 6), ("salt-of-a", None))
        if step >= 20:
            for _ in range(8):
                n += 1
                events += sched.run_now(_prompt(10_000 + n, 6), ("salt-of-b", None))
        events += sched.run_now(_prompt(7 + step % 2, 4), (None, "sql-adapter"))
        events += sched.run_now(_prompt(50 + step % 3, 3), (None, None))
        batches.append(events)
    return batches


def _prompt(seed: int, blocks: int) -> list[int]:
    return [3 + (seed * 7919 + i) % 31_000 for i in range(blocks * 16 + 1)]


def _two_groups(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same events as a hybrid model announces them: a full-attention group and a
    sliding-window group of the same blocks (the window group frees a block in each store)."""
    out = []
    for ev in events:
        if ev.get("medium") not in (None, "GPU"):
            out.append(ev)
            continue
        full = {**ev, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        window = {**ev, "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32}
        out += [full, window]
        if ev["type"] == "BlockStored" and len(ev["block_hashes"]) > 2:
            out.append(we.removed(ev["block_hashes"][:1], group_idx=1))
    return out


@pytest.mark.parametrize("hybrid", [False, True])
def test_per_tenant_counts_equal_an_independent_count(hybrid: bool) -> None:
    pool = BlockPool(160)
    sched = Scheduler(pool, CpuTier(120, 1 << 19), max_num_seqs=64, seed=5)
    batches = _noisy_neighbour(sched, 80)
    if hybrid:
        batches = [_two_groups(b) for b in batches]
    counts = StreamCounts((1_000_000, 524_288), 5.0, TenantNamer(RULES, KEY))
    ref = TenantReference(lambda salt, lora: NAMES.get((salt, lora)) or f"lora:{lora}", 5.0)
    enc = msgspec.msgpack.Encoder()
    for i, events in enumerate(batches):
        ts = 1000.0 + i * 0.5
        counts.ingest(we.encode_batch(we.Layout.V0_26, ts, events, 0, enc))
        ref.batch(ts, events)
    got = counts.tenants()
    for medium in ("GPU", "CPU"):
        mine = {name: {f: getattr(m, f) for f in FIELDS} for name, m in got[medium].items()}
        theirs = {t: c for (m, t), c in ref.counts.items() if m == medium}
        for name in theirs.keys() | mine.keys():
            zero = dict.fromkeys(FIELDS, 0)
            assert mine.get(name, zero) == theirs.get(name, zero), (medium, name)
        assert {n: m.resident for n, m in got[medium].items() if m.resident} == ref.resident(medium)
    gpu = got["GPU"]
    assert set(gpu) == {"default", "unknown", "team-a", "team-b", "lora:sql-adapter"}
    assert gpu["team-a"].regretted > 0 and gpu["team-b"].stored > gpu["team-a"].stored
    assert gpu["unknown"].stored == 0  # every parent was seen
    total = counts.media["GPU"].logical()
    assert sum(m.stored for m in gpu.values()) == total.stored  # the tenants add up to the pool
    assert sum(m.regretted for m in gpu.values()) == total.regretted
    assert sum(m.resident for m in gpu.values()) == total.resident


def test_a_block_after_a_parent_never_seen_is_unknown_and_tenants_start_with_the_first_salt() -> None:
    counts = StreamCounts((1000, 1000), 5.0, TenantNamer(RULES, KEY))
    enc = msgspec.msgpack.Encoder()

    def feed(ts: float, events: list[dict[str, Any]]) -> None:
        counts.ingest(we.encode_batch(we.Layout.V0_26, ts, events, 0, enc))

    feed(1.0, [we.stored([1, 2], list(range(32)))])
    assert counts.tenants() == {}  # nothing named a tenant: no per-tenant counts at all
    feed(2.0, [we.stored([3], list(range(16)), extra_keys=[["salt-of-a"]])])
    feed(3.0, [we.stored([4, 5], list(range(32)), parent=99), we.stored([6], list(range(16)), parent=3)])
    feed(4.0, [we.removed([1, 4, 6, 42])])
    t = counts.tenants()["GPU"]
    assert (t["default"].stored, t["unknown"].stored, t["team-a"].stored) == (2, 2, 2)
    assert (t["default"].removed, t["unknown"].removed, t["team-a"].removed) == (1, 2, 1)  # 42: never stored
    assert (t["default"].resident, t["unknown"].resident, t["team-a"].resident) == (1, 1, 1)


# --- the fold --------------------------------------------------------------------------------------------


def test_the_fold_keeps_k_labels_and_other_only_grows() -> None:
    fold = TenantFold(top_k=2)

    def counters(**stored: float) -> dict[str, dict[str, float]]:
        return {name: {"stored": v} for name, v in stored.items()}

    out = fold.fold(counters(a=10, b=5, c=1, default=3), {}, {"a": 10, "b": 5, "c": 1})
    assert out == {"a": {"stored": 10}, "b": {"stored": 5}, "other": {"stored": 1}, "default": {"stored": 3}}
    out = fold.fold(counters(a=11, b=6, c=50, d=2, default=3), {}, {"a": 11, "b": 6, "c": 50, "d": 2})
    assert out["a"] == {"stored": 11} and out["other"] == {"stored": 52}  # c stays folded: labels are kept
    assert fold.folded == {"c", "d"} and fold.labels == {"a", "b"}
    totals = [sum(v["stored"] for v in out.values())]
    assert totals == [11 + 6 + 50 + 2 + 3]


def test_the_node_key_is_read_only_for_an_unnamed_salt() -> None:
    calls: list[int] = []

    def key() -> bytes:
        calls.append(1)
        return KEY

    namer = TenantNamer(RULES, key)
    assert (namer.name("salt-of-a", None), namer.name(None, "x"), namer.name(None, None)) == (
        "team-a",
        "lora:x",
        "default",
    )
    assert calls == []  # a node that never sees an unnamed salt never writes a key
    assert namer.name("s1", None) == TenantNamer([], KEY).name("s1", None) and namer.name("s2", None)
    assert calls == [1]
