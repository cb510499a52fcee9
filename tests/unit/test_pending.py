"""The GPU removals waiting for their offload (daemon/engines/pending.py), against a plain list of
batches: the same batches come out, in order, with their tags, however adds and takes interleave,
and the packed arrays are cut down as batches settle."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines.pending import COMPACT_BATCHES, PendingRemovals


def taken(p: PendingRemovals, before: float) -> list[tuple[list[int], list[int] | None]]:
    return [(list(fps), None if tags is None else list(tags)) for fps, tags in p.take(before)]


def test_batches_settle_oldest_first_with_their_tags() -> None:
    p = PendingRemovals()
    p.add(1.0, [11, 12], None)
    p.add(2.0, [21], [0])
    p.add(3.0, [31, 32, 33], [7, 0, 9])
    assert p.n == 6
    assert taken(p, 0.5) == []
    assert taken(p, 2.0) == [([11, 12], None), ([21], None)]  # all-zero tags: untagged
    assert p.n == 3
    assert taken(p, 10.0) == [([31, 32, 33], [7, 0, 9])]
    assert p.n == 0 and taken(p, 100.0) == []


def test_one_batch_at_a_time() -> None:
    """A backlog is handed out batch by batch: what is yielded waits no more, the rest still waits."""
    p = PendingRemovals()
    for i in range(23):
        p.add(float(i), [i, i + 100], [0, i % 3])
    it = p.take(1e9)
    fps, tags = next(it)
    assert list(fps) == [0, 100] and tags is None
    assert p.n == 44
    fps, tags = next(it)
    assert list(fps) == [1, 101] and tags is not None and list(tags) == [0, 1]
    assert p.n == 42
    assert len(list(it)) == 21 and p.n == 0


def test_settled_batches_are_cut_from_the_front() -> None:
    p = PendingRemovals()
    for i in range(2 * COMPACT_BATCHES + 3):
        p.add(float(i), [i], None)
    got = taken(p, float(COMPACT_BATCHES + 1))
    assert [fps[0] for fps, _ in got] == list(range(COMPACT_BATCHES + 2))
    assert p.batch0 == 0 and p.key0 == 0  # compacted: what waits starts at the front again
    assert [fps for fps, _ in taken(p, 1e9)] == [[i] for i in range(COMPACT_BATCHES + 2, 2 * COMPACT_BATCHES + 3)]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4), st.booleans()),
        st.tuples(st.just("take"), st.floats(0, 50), st.just(False)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_same_as_a_list_of_batches(script: list[tuple[str, object, bool]]) -> None:
    p, model, clock = PendingRemovals(), [], 0.0
    for op, arg, tagged in script:
        if op == "add":
            assert isinstance(arg, list)
            clock += 1.0
            tags = [(fp % 5) for fp in arg] if tagged else None
            p.add(clock, arg, tags)
            model.append((clock, arg, tags if tags and any(tags) else None))
        else:
            assert isinstance(arg, float)
            want = [(fps, tags) for ts, fps, tags in model if ts <= arg]
            model = [b for b in model if b[0] > arg] if want else model
            assert taken(p, arg) == want
        assert p.n == sum(len(fps) for _, fps, _ in model)
