"""The regret memory (``engines/removals.py``, ``removal_segments.py``): what it answers is what a
plain dict of every removal would answer, while nothing is forgotten; past its capacity it
forgets the oldest first, counts them, and its horizon says how far back it still remembers;
its cost per removal is what the docs state."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwatch.daemon.config import EnginesConfig
from kvwatch.daemon.engines import removals
from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.engines.removals import RemovalMemory

TICK = 1 / 1024  # removal times on this grid, within a segment's span of 16 s, are kept exactly

# one operation: (kind, fingerprints by index into a pool, time step, tag, marked)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "take", "count", "peek"]),
        st.lists(st.integers(0, 299), min_size=1, max_size=40),
        st.integers(0, 3),
        st.sampled_from([0, 0, 1, 2, 700]),
        st.booleans(),
    ),
    min_size=20,
    max_size=150,
)


class Model:
    """Every removal, in a dict."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[float, int]] = {}

    def by_tag(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for _, tag in self.held.values():
            if tag:
                out[tag] = out.get(tag, 0) + 1
        return out


def _apply(
    m: RemovalMemory, model: Model, op: tuple[str, list[int], int, int, bool], pool: list[int], t: float
) -> None:
    kind, idx, _, tag, marked = op
    fps = [pool[i] for i in idx]
    if kind == "put":
        m.take_keys(fps)  # callers take a hash before they put it again
        for fp in fps:
            model.held.pop(fp, None)
        at = -t if marked else t
        m.put_keys(fps, at, tag)
        for fp in fps:
            model.held[fp] = (at, tag)
    elif kind == "take":
        tags: list[int] = []
        keys, times = m.take_keys(fps, tags)
        want = {fp: model.held.pop(fp) for fp in dict.fromkeys(fps) if fp in model.held}
        assert dict(zip(keys, zip(times, tags, strict=True), strict=True)) == want
    elif kind == "count":
        assert m.count(fps) == sum(1 for fp in fps if fp in model.held)
    else:
        held = model.held.get(fps[0])
        assert m.peek_tag(fps[0]) == (held[1] if held else None)


@pytest.fixture(params=[False, True], ids=["sealed", "merged"])
def merging(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Merged: two segments at a time, of any size."""
    if request.param:
        monkeypatch.setattr(removals, "FANOUT", 2)
        monkeypatch.setattr(removals, "TOP_PART", 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_it_answers_as_a_dict_of_every_removal_would(
    ops: list[tuple[str, list[int], int, int, bool]], seed: int, merging: None
) -> None:
    """Sealed into segments (every 16 removals here), merged or not: the same hashes, times,
    marks and tags as the dict."""
    rnd = random.Random(seed)
    pool = [rnd.getrandbits(64) for _ in range(300)] + [0, 1, 2]  # small ints too: test hashes
    m, model = RemovalMemory(100_000), Model()
    m.open_limit = 16
    t = 1000.0
    for op in ops:
        t += op[2] * TICK
        _apply(m, model, op, pool, t)
        assert len(m) == len(model.held)
        assert m.live_by_tag == model.by_tag()
    assert m.forgotten == 0


def test_past_its_capacity_it_forgets_the_oldest_and_its_horizon_says_since_when() -> None:
    m = RemovalMemory(4096)
    rnd = random.Random(23)
    puts: list[tuple[int, float]] = []
    for i in range(23 * 1000):
        fp = rnd.getrandbits(64)
        ts = 100.0 + i * 0.01
        m.put_keys([fp], ts, tag=1 + i % 3)
        puts.append((fp, ts))
    end = puts[-1][1]
    assert len(m) <= 4096 and m.forgotten == len(puts) - len(m)
    assert sum(m.live_by_tag.values()) == len(m)
    horizon = m.horizon(end)
    assert 0 < horizon < 4096 * 0.01
    kept = [fp for fp, ts in puts if ts > end - horizon]
    assert m.count(kept) == len(kept)  # every removal within the horizon is remembered
    assert m.count([fp for fp, ts in puts if ts <= end - horizon]) == 0  # and none before it
    m.clear()
    assert (len(m), m.horizon(end), m.live_by_tag) == (0, 0.0, {})


def test_the_default_remembers_ten_minutes_of_a_flood_at_a_few_bytes_a_removal() -> None:
    """The default holds 600 s x 20,000 blocks/s; a million removals (a bucketed segment of them)
    cost under 9 bytes each, and a million lookups of hashes never removed find none (48-bit
    keys: 0.004 expected)."""
    cfg = EnginesConfig()
    assert cfg.regret_blocks == 600 * 20_000
    m = RemovalMemory(cfg.regret_blocks)
    rnd = random.Random(29)
    n = 1 << 20
    fps = [rnd.getrandbits(64) for _ in range(n)]
    for i in range(0, n, 1024):
        m.put_keys(fps[i : i + 1024], 1.0 + i / 20_000)
    assert len(m) == n and m.forgotten == 0
    assert any(s.bucketed for s in m._segments)
    assert m.nbytes / n < 9.0, m.nbytes / n
    assert m.count([rnd.getrandbits(64) for _ in range(1 << 20)]) == 0
    sample = rnd.sample(fps, 4099)
    keys, times = m.take_keys(sample)
    assert sorted(keys) == sorted(sample)
    want = {fp: 1.0 + (i - i % 1024) / 20_000 for i, fp in enumerate(fps)}
    assert all(abs(t - want[k]) <= 0.064 for k, t in zip(keys, times, strict=True))  # the time unit's bound


def test_a_hot_set_evicted_at_a_floods_start_is_regretted_at_its_end() -> None:
    """The flood the default memory was sized for, scaled: 60 s at 20,000 blocks/s through a
    pool of 65,536 blocks, the hot set evicted in its first seconds and stored again at its end:
    every one of its blocks counted as regretted; a memory by count (the old default, 524,288)
    forgot them all."""
    rnd = random.Random(31)
    hot = [rnd.getrandbits(64) for _ in range(2003)]

    def flood(removals_kept: int) -> int:
        m = MediumBlocks(1_000_000, removals_kept)
        m.store(hot, 0.0, 16)
        pool: list[list[int]] = [hot]
        resident = len(hot)
        for i in range(60 * 20_000 // 64):
            ts = 1.0 + i * 64 / 20_000
            new = [rnd.getrandbits(64) for _ in range(64)]
            m.store(new, ts, 16)
            pool.append(new)
            resident += 64
            while resident > 65_536:
                old = pool.pop(0)
                m.remove(old, ts, ts - 10.0)
                resident -= len(old)
        m.store(hot, 62.0, 16)
        return m.totals().regretted

    assert flood(EnginesConfig().regret_blocks) == len(hot)
    assert flood(524_288) == 0
