"""daemon/engines/hashmem.py and hashmem_sealed.py: calls with a few fingerprints go one by one
behind the sealed entries' bit filter; they must answer exactly as the vectorised path does."""

from __future__ import annotations

import random

import pytest

from kvwatch.daemon.engines import hashmem_sealed
from kvwatch.daemon.engines.hashmem import HashMemory


def _ops(seed: int, n: int = 4000) -> list[tuple[str, list[int], int]]:
    """Puts, takes and counts of 1-20 fingerprints from a small universe (so that takes hit,
    puts repeat and a call may name one hash twice), with tags."""
    rng = random.Random(seed)
    universe = [rng.getrandbits(64) for _ in range(3000)]
    out = []
    for _ in range(n):
        op = rng.choice(("put", "put", "take", "take", "count"))
        k = rng.choice((1, 1, 1, 2, 3, 8, 9, 20))
        out.append((op, [rng.choice(universe) for _ in range(k)], rng.choice((0, 0, 0, 1, 2))))
    return out


def _run(ops: list[tuple[str, list[int], int]]) -> list[object]:
    mem, got = HashMemory(800), []  # seals every 50 entries, forgets past 800
    for t, (op, fps, tag) in enumerate(ops):
        if op == "put":
            mem.put_keys(fps, float(t), tag)
        elif op == "take":
            tags: list[int] = []
            keys, times = mem.take_keys(fps, tags)
            got.append(sorted(zip(keys, times, tags, strict=True)))
        else:
            got.append(mem.count(fps))
    got.append((len(mem), mem.forgotten, sorted(mem.live_by_tag.items())))
    return got


@pytest.mark.parametrize("seed", range(12))
def test_few_fingerprints_one_by_one_answer_as_the_vectorised_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _ops(seed)
    one_by_one = _run(ops)
    monkeypatch.setattr(hashmem_sealed, "FEW", 0)
    assert _run(ops) == one_by_one


def test_the_filter_holds_every_live_sealed_fingerprint() -> None:
    rng = random.Random(7)
    mem = HashMemory(160_000)  # seals every 10,000
    fps = [rng.getrandbits(64) for _ in range(50_000)]
    mem.put_keys(fps, 1.0)
    sealed = mem._sealed
    assert sealed is not None and sealed.live == 50_000
    assert all(sealed._might_hold(fp) for fp in fps)
    others = [rng.getrandbits(64) for _ in range(20_000)]
    assert sum(sealed._might_hold(fp) for fp in others) < 0.06 * len(others)  # ~3 % expected


def test_a_shrink_holds_the_new_capacity_at_once_and_counts_what_it_drops() -> None:
    """The node's budget shrinks a memory when another stream needs its part: what it held
    beyond the new capacity goes at once (even entries still in the open dict), each counted."""
    mem = HashMemory(1_000_000)
    mem.put_keys(list(range(1, 10_001)), 1.0)  # all in the open dict (it seals at 16,384)
    mem.resize(1024)
    assert len(mem) <= 1024 and mem.forgotten == 10_000 - len(mem)
