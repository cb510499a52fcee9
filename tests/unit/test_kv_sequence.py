"""A KV event stream's sequence numbers (``engines/kv_sequence.py``), with no sockets: the
numbers awaiting replay as bounded ranges, and which numbers are believed.

On real sockets: ``tests/integration/test_kv_events.py`` and ``test_kv_events_hostile.py``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.daemon.engines.kv_sequence import Missing, StreamSequence

FUZZ = settings(max_examples=300, deadline=None)


@st.composite
def missing_ops(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    ops: list[tuple[str, int, int]] = []
    top = 0
    for _ in range(draw(st.integers(1, 30))):
        op = draw(st.sampled_from(["add", "discard", "take"]))
        if op == "add":
            lo = top + draw(st.integers(0, 5))
            top = lo + draw(st.integers(0, 12))
            ops.append((op, lo, top))
        else:
            a = draw(st.integers(0, max(top, 1)))
            ops.append((op, a, a + draw(st.integers(1, 15))))
    return ops


@FUZZ
@given(st.integers(1, 40), missing_ops())
def test_fuzz_missing_ranges_behave_as_a_bounded_set(limit: int, ops: list[tuple[str, int, int]]) -> None:
    """Against a plain list of the numbers: the oldest go first past the limit."""
    m, model = Missing(limit), []
    for op, a, b in ops:
        if op == "add":
            lo = max(a, model[-1] + 1) if model else a
            model += range(lo, b)
            given_up = max(len(model) - limit, 0)
            assert m.add(a, b) == given_up
            model = model[given_up:]
        elif op == "discard":
            assert m.discard(a) == (a in model)
            model = [x for x in model if x != a]
        else:
            covered = ((a, b), (b + 3, b + 9))
            gone = [x for x in model if a <= x < b or b + 3 <= x < b + 9]
            assert m.take(covered) == len(gone)
            model = [x for x in model if x not in gone]
        assert [x for lo, hi in m.snapshot() for x in range(lo, hi)] == model
        assert len(m) == len(model) <= limit


def test_jumps_of_the_replay_bound_keep_the_missing_numbers_bounded() -> None:
    """A publisher stepping by 10,000 with a replay endpoint that never answers: 10,000 numbers
    await replay at most, the older ones lost and counted abandoned."""
    q: StreamSequence[int] = StreamSequence(True, 10_000)
    for i in range(1_000):
        q.live(i * 10_000, i)
    assert len(q.missing) == 10_000
    assert q.missed == 999 * 9_999
    assert q.lost == q.abandoned == q.missed - len(q.missing)
    assert len(q.missing.snapshot()) <= 2


@FUZZ
@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 40), max_size=40), st.booleans())
def test_fuzz_every_number_is_counted_held_or_a_stray_and_the_books_balance(seqs: list[int], replay: bool) -> None:
    q: StreamSequence[int] = StreamSequence(replay, 16, max_jump=64)
    counted = strays = 0
    for i, n in enumerate(seqs):
        v = q.live(n, i)
        counted += len(v.payloads)
        strays += v.strays
        assert q.missed == q.replayed + q.lost + len(q.missing)
        assert len(q.missing) <= 16
        assert q.lost <= q.missed  # a lost batch was first missed: never more than the jumps believed
    held = len(seqs) - counted - strays
    assert held in (0, 1)
    assert q.missed <= 64 * len(seqs)


def test_a_restart_from_zero_counts_both_of_its_first_batches() -> None:
    q: StreamSequence[str] = StreamSequence(False, 16)
    for n in range(100):
        q.live(n, "old")
    assert q.live(0, "new0").payloads == []  # held: a stray or a restart
    v = q.live(1, "new1")
    assert (v.restart, v.payloads, v.strays, q.restarts, q.gaps) == (True, ["new0", "new1"], 0, 1, 0)


def test_a_stray_back_then_the_old_sequence_goes_on() -> None:
    q: StreamSequence[str] = StreamSequence(False, 16)
    for n in range(10):
        q.live(n, "x")
    q.live(9, "again")  # a duplicate of the last
    v = q.live(10, "next")
    assert (v.restart, v.payloads, v.strays, q.restarts, q.lost) == (False, ["next"], 1, 0, 0)
